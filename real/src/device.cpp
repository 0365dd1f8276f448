#include "ferry/real/device.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "ferry/check.hpp"

namespace ferry::real {

DeviceBase::DeviceBase(std::unique_ptr<Recorder> recorder) : recorder_(std::move(recorder)) {
  new_stream("compute");
}

std::uint32_t DeviceBase::new_stream(std::string_view name) {
  if (recorder_) recorder_->add_stream(name);
  return streams_++;
}

BufferHandle DeviceBase::make_entry(at::Storage storage, Place place, Bytes bytes,
                                    std::int64_t stream) {
  auto entry = std::make_shared<BufferEntry>();
  entry->storage = std::move(storage);
  entry->place = place;
  entry->bytes = bytes;
  entry->stream = static_cast<std::uint32_t>(std::max<std::int64_t>(stream, 0));
  if (recorder_) {
    entry->slot = recorder_->add_buffer(place, bytes);
    recorder_->alloc(entry->slot, place == Place::Device ? stream : -1);
  }
  return entry;
}

// Read with C stdio, not iostreams: the locale state an istream's number parsing consults is
// not safe in a module whose libstdc++ is another copy than the process's.
std::optional<std::int64_t> host_available_bytes() {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> meminfo(std::fopen("/proc/meminfo", "r"),
                                                          &std::fclose);
  if (!meminfo) return std::nullopt;
  std::array<char, 256> line{};
  constexpr std::string_view key = "MemAvailable:";
  while (std::fgets(line.data(), static_cast<int>(line.size()), meminfo.get()) != nullptr) {
    if (std::string_view(line.data()).substr(0, key.size()) != key) continue;
    char* end = nullptr;
    const long long kib = std::strtoll(line.data() + key.size(), &end, 10);
    if (end == line.data() + key.size() || kib < 0) return std::nullopt;
    return static_cast<std::int64_t>(kib) * 1024;
  }
  return std::nullopt;
}

bool DeviceBase::host_room(Bytes bytes) {
  if (host_reserve_.count() <= 0) return true;
  const auto available = host_available_bytes();
  if (!available || *available - bytes.count() >= host_reserve_.count()) return true;
  ++host_refusals_;
  return false;
}

void DeviceBase::hold(const BufferHandle& buffer) {
  FERRY_CHECK(buffer && buffer->storage, "hold of a freed buffer");
  if (buffer->holds++ == 0) ++(buffer->place == Place::Device ? live_device_ : live_host_);
}

void DeviceBase::drop(const BufferHandle& buffer) {
  FERRY_CHECK(buffer && buffer->holds > 0, "drop of a buffer with no references");
  if (--buffer->holds > 0) return;
  --(buffer->place == Place::Device ? live_device_ : live_host_);
  free_storage(*buffer);
  if (recorder_) recorder_->free(buffer->slot);
}

long DeviceBase::use_count(const BufferHandle& buffer) const {
  if (!buffer || !buffer->storage) return 0;
  return static_cast<long>(buffer->storage.use_count());
}

BufferHandle DeviceBase::adopt(const at::Tensor& tensor) {
  at::Storage storage = tensor.storage();
  const Bytes bytes(static_cast<std::int64_t>(storage.nbytes()));
  const std::uint32_t stream = current_index();
  BufferHandle entry = make_entry(std::move(storage), Place::Device, bytes, stream);
  if (recorder_) recorder_->produce(stream, entry->slot, Bytes(0), bytes);
  produced(entry);
  return entry;
}

at::Tensor DeviceBase::view(const BufferHandle& buffer, Bytes offset, at::IntArrayRef sizes,
                            at::IntArrayRef strides, at::ScalarType dtype) {
  const std::int64_t item = static_cast<std::int64_t>(c10::elementSize(dtype));
  FERRY_CHECK(offset.count() % item == 0, "a view offset that is not a whole element");
  at::Tensor out =
      at::empty({0}, at::TensorOptions().dtype(dtype).device(buffer->storage.device()));
  out.set_(buffer->storage, offset.count() / item, sizes, strides);
  return out;
}

void DeviceBase::consume(const BufferHandle& buffer, Bytes offset, Bytes bytes) {
  if (recorder_) recorder_->consume(current_index(), buffer->slot, offset, bytes);
  consumed(buffer);
}

BufferHandle DeviceBase::allocated(at::Storage storage, Place place, Bytes bytes,
                                   std::uint32_t stream) {
  BufferHandle entry = make_entry(std::move(storage), place, bytes, stream);
  hold(entry);
  return entry;
}

void DeviceBase::check_copy(const BufferHandle& src, Bytes src_offset, const BufferHandle& dst,
                            Bytes dst_offset, Bytes bytes) {
  const auto size = [](const BufferHandle& b) {
    return Bytes(static_cast<std::int64_t>(b->storage.nbytes()));
  };
  FERRY_CHECK(src && src->storage && dst && dst->storage, "copy of a freed buffer");
  FERRY_CHECK(src_offset + bytes <= size(src) && dst_offset + bytes <= size(dst),
              "copy out of bounds");
}

std::uint8_t* DeviceBase::bytes_of(const BufferHandle& buffer) {
  return static_cast<std::uint8_t*>(buffer->storage.mutable_data());
}

// --- loopback ------------------------------------------------------------------------------

LoopbackDevice::LoopbackDevice(std::unique_ptr<Recorder> recorder, const LoopbackConfig& streams)
    : DeviceBase(std::move(recorder)), streams_impl_(make_loopback_streams(streams)) {
  streams_impl_->add_stream(0, /*compute=*/true, "compute");
}

// The workers finish what was queued before the buffers the scheduler still holds go.
LoopbackDevice::~LoopbackDevice() = default;

LoopbackDevice::Stream LoopbackDevice::make_stream(std::string_view name) {
  const Stream s{new_stream(name)};
  streams_impl_->add_stream(s.index, /*compute=*/false, name);
  return s;
}

void LoopbackDevice::set_current_stream(std::string_view name) {
  const std::uint32_t before = current_;
  const auto known = std::find_if(compute_streams_.begin(), compute_streams_.end(),
                                  [&](const auto& s) { return s.first == name; });
  if (known != compute_streams_.end()) {
    current_ = known->second;
  } else {
    current_ = new_stream(name);
    compute_streams_.emplace_back(std::string(name), current_);
    streams_impl_->add_stream(current_, /*compute=*/true, name);
  }
  // The work on the new stream follows what was issued before (what a caller of
  // `torch.cuda.stream(s)` does with `s.wait_stream(torch.cuda.current_stream())`).
  if (current_ != before) {
    const Event e = make_event();
    record(e, Stream{before});
    wait(Stream{current_}, e);
    streams_impl_->set_current(current_);
  }
}

LoopbackDevice::Event LoopbackDevice::make_event() {
  return Event{recorder_ ? recorder_->add_event() : 0, std::make_shared<LoopbackStreams::Token>()};
}

LoopbackStreams::Block LoopbackDevice::block_of(const BufferHandle& buffer) {
  return LoopbackStreams::Block{buffer->storage.unsafeGetStorageImpl(), bytes_of(buffer),
                                buffer->storage.nbytes(), buffer};
}

std::optional<LoopbackDevice::Buffer> LoopbackDevice::allocate(Place place, Bytes bytes,
                                                               Stream stream, std::string_view) {
  if (place != Place::Device && !host_room(bytes)) return std::nullopt;
  at::Tensor t = at::empty({std::max<std::int64_t>(bytes.count(), 0)}, at::kByte);
  Buffer buffer = allocated(t.storage(), place, bytes, stream.index);
  streams_impl_->allocated(block_of(buffer));
  return buffer;
}

void LoopbackDevice::copy(Stream stream, const Buffer& src, Bytes src_offset, const Buffer& dst,
                          Bytes dst_offset, Bytes bytes, std::string_view) {
  check_copy(src, src_offset, dst, dst_offset, bytes);
  streams_impl_->copy(stream.index, block_of(src), static_cast<std::size_t>(src_offset.count()),
                      block_of(dst), static_cast<std::size_t>(dst_offset.count()),
                      static_cast<std::size_t>(bytes.count()));
  if (recorder_) recorder_->copy(stream.index, src->slot, src_offset, dst->slot, dst_offset, bytes);
}

void LoopbackDevice::record(Event event, Stream stream) {
  if (recorder_) recorder_->record(event.index, stream.index);
  if (event.last) *event.last = streams_impl_->record(stream.index);
}

void LoopbackDevice::wait(Stream stream, Event event) {
  if (recorder_) recorder_->wait(stream.index, event.index);
  if (event.last) streams_impl_->wait(stream.index, *event.last);
}

void LoopbackDevice::synchronize(Stream stream) {
  if (recorder_) recorder_->synchronize(stream.index);
  streams_impl_->synchronize(stream.index);
}

void LoopbackDevice::record_stream(const Buffer& buffer, Stream stream) {
  if (recorder_) recorder_->record_stream(buffer->slot, stream.index);
  auto& recorded = buffer->recorded;
  if (std::find(recorded.begin(), recorded.end(), stream.index) == recorded.end()) {
    recorded.push_back(stream.index);
  }
}

void LoopbackDevice::produced(const BufferHandle& buffer) {
  streams_impl_->produced(block_of(buffer));
}

void LoopbackDevice::consumed(const BufferHandle& buffer) {
  streams_impl_->consumed(block_of(buffer));
}

void LoopbackDevice::free_storage(BufferEntry& buffer) {
  // Stream-ordered, as the caching allocator frees: the block is reused once its allocation
  // stream and every stream recorded for it reach this point (inline streams: at once).
  std::vector<std::uint32_t> streams{buffer.stream};
  for (const std::uint32_t s : buffer.recorded) {
    if (s != buffer.stream) streams.push_back(s);
  }
  LoopbackStreams::Block block{buffer.storage.unsafeGetStorageImpl(),
                               static_cast<std::uint8_t*>(buffer.storage.mutable_data()),
                               buffer.storage.nbytes(), nullptr};
  auto held = std::make_shared<at::Storage>(std::move(buffer.storage));
  buffer.storage = at::Storage();
  streams_impl_->release(block, streams,
                         LoopbackStreams::Release{[held] { return held->use_count() == 1; },
                                                  [held] { *held = at::Storage(); }});
}

}  // namespace ferry::real
