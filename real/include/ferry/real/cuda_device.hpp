#pragma once
/// The CUDA device: c10::cuda streams, at::cuda::CUDAEvent, the caching allocator for device
/// memory, and exact-size page-locked host buffers (cudaHostAlloc) for ferry's host pool.

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <vector>

#include "ferry/real/device.hpp"

namespace ferry::real {

class CudaDevice : public DeviceBase {
 public:
  struct Event {
    std::shared_ptr<at::cuda::CUDAEvent> event;
    std::uint32_t index = 0;
  };
  using Buffer = BufferHandle;

  /// Drives the current device; the compute stream is the CUDA stream current at each call
  /// (Note [The compute stream is the current one]), each registered on first sight.
  explicit CudaDevice(std::unique_ptr<Recorder> recorder = nullptr);

  Stream make_stream(std::string_view name);
  Event make_event();
  std::optional<Buffer> allocate(Place place, Bytes bytes, Stream stream, std::string_view name);
  void copy(Stream stream, const Buffer& src, Bytes src_offset, const Buffer& dst, Bytes dst_offset,
            Bytes bytes, std::string_view name);
  void record(Event event, Stream stream);
  void wait(Stream stream, Event event);
  void record_stream(const Buffer& buffer, Stream stream);
  void synchronize(Stream stream);
  [[nodiscard]] bool is_device_tensor(const at::Tensor& t) const {
    return t.is_cuda() && t.get_device() == device_;
  }

 private:
  std::uint32_t current_index() override;

  c10::DeviceIndex device_;
  std::vector<c10::cuda::CUDAStream> streams_;
};

static_assert(Backend<CudaDevice>);

/// Whether a CUDA device can be used by this process.
bool cuda_available();

}  // namespace ferry::real
