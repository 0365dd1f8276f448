#include "ferry/real/cuda_device.hpp"

#include <ATen/cuda/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <stdexcept>

#include "ferry/check.hpp"

namespace ferry::real {

namespace {
void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("ferry: ") + what + ": " + cudaGetErrorString(status));
  }
}

void free_host(void* ptr) { cudaFreeHost(ptr); }
}  // namespace

bool cuda_available() { return c10::cuda::device_count() > 0; }

CudaDevice::CudaDevice(std::unique_ptr<Recorder> recorder)
    : DeviceBase(std::move(recorder)), device_(c10::cuda::current_device()) {
  streams_.push_back(c10::cuda::getCurrentCUDAStream(device_));
}

std::uint32_t CudaDevice::current_index() {
  const c10::cuda::CUDAStream live = c10::cuda::getCurrentCUDAStream(device_);
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    if (streams_[i] == live) return static_cast<std::uint32_t>(i);
  }
  streams_.push_back(live);
  return new_stream("compute " + std::to_string(live.id()));
}

DeviceBase::Stream CudaDevice::make_stream(std::string_view name) {
  streams_.push_back(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_));
  return Stream{new_stream(name)};
}

CudaDevice::Event CudaDevice::make_event() {
  return Event{std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming),
               recorder_ ? recorder_->add_event() : 0};
}

std::optional<CudaDevice::Buffer> CudaDevice::allocate(Place place, Bytes bytes, Stream stream,
                                                       std::string_view) {
  if (place != Place::Device && !host_room(bytes)) return std::nullopt;
  const std::int64_t n = std::max<std::int64_t>(bytes.count(), 0);
  at::Storage storage;
  try {
    switch (place) {
      case Place::Device: {
        // The block belongs to the pool of `stream`: the caching allocator keys blocks by the
        // stream current at allocation.
        c10::cuda::CUDAStreamGuard guard(streams_.at(stream.index));
        storage = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_))
                      .storage();
        break;
      }
      case Place::PinnedHost: {
        // Exact size, pinned once; the core's pool reuses it.
        void* ptr = nullptr;
        if (cudaHostAlloc(&ptr, static_cast<std::size_t>(std::max<std::int64_t>(n, 1)),
                          cudaHostAllocDefault) != cudaSuccess) {
          (void)cudaGetLastError();
          return std::nullopt;
        }
        storage =
            at::from_blob(ptr, {n}, free_host, at::TensorOptions().dtype(at::kByte)).storage();
        break;
      }
      case Place::PinnedHostCaching:
        storage =
            at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)).storage();
        break;
    }
  } catch (const c10::OutOfMemoryError&) {
    return std::nullopt;
  }
  return allocated(std::move(storage), place, bytes, stream.index);
}

void CudaDevice::copy(Stream stream, const Buffer& src, Bytes src_offset, const Buffer& dst,
                      Bytes dst_offset, Bytes bytes, std::string_view) {
  check_copy(src, src_offset, dst, dst_offset, bytes);
  const c10::cuda::CUDAStream s = streams_.at(stream.index);
  if (bytes.count() > 0) {
    check_cuda(
        cudaMemcpyAsync(bytes_of(dst) + dst_offset.count(), bytes_of(src) + src_offset.count(),
                        static_cast<std::size_t>(bytes.count()), cudaMemcpyDefault, s.stream()),
        "cudaMemcpyAsync");
    // Blocks of the caching host allocator are reused only after the copies that use them.
    for (const Buffer* b : {&src, &dst}) {
      if ((*b)->place == Place::PinnedHostCaching) {
        at::getHostAllocator(at::kCUDA)->record_event(
            (*b)->storage.mutable_data(), (*b)->storage.data_ptr().get_context(), s.unwrap());
      }
    }
  }
  if (recorder_) recorder_->copy(stream.index, src->slot, src_offset, dst->slot, dst_offset, bytes);
}

void CudaDevice::record(Event event, Stream stream) {
  event.event->record(streams_.at(stream.index));
  if (recorder_) recorder_->record(event.index, stream.index);
}

void CudaDevice::wait(Stream stream, Event event) {
  event.event->block(streams_.at(stream.index));
  if (recorder_) recorder_->wait(stream.index, event.index);
}

void CudaDevice::synchronize(Stream stream) {
  streams_.at(stream.index).synchronize();
  if (recorder_) recorder_->synchronize(stream.index);
}

void CudaDevice::record_stream(const Buffer& buffer, Stream stream) {
  if (buffer->storage && buffer->place == Place::Device) {
    c10::cuda::CUDACachingAllocator::recordStream(buffer->storage.data_ptr(),
                                                  streams_.at(stream.index));
  } else if (buffer->storage && buffer->place == Place::PinnedHostCaching) {
    at::getHostAllocator(at::kCUDA)->record_event(buffer->storage.mutable_data(),
                                                  buffer->storage.data_ptr().get_context(),
                                                  streams_.at(stream.index).unwrap());
  }
  if (recorder_) recorder_->record_stream(buffer->slot, stream.index);
}

}  // namespace ferry::real
