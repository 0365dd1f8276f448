#include "ferry/sim/device/device.hpp"

#include "ferry/check.hpp"
#include "ferry/sim/support/by_id.hpp"

namespace ferry::sim {

Device::Device(Simulator& sim, DeviceId device, StreamId compute)
    : sim_(sim), device_(device), current_(compute) {}

void Device::set_current_stream(Stream stream) {
  FERRY_CHECK(stream.id.valid() && stream.id.value() < sim_.stream_count() &&
                  sim_.stream_device(stream.id) == device_,
              "current stream {} is not a stream of this device", stream.id.value());
  current_ = stream.id;
}

Device::Stream Device::make_stream(std::string_view name) {
  return Stream{sim_.add_stream(device_, std::string(name))};
}

Device::Event Device::make_event() { return Event{sim_.add_event()}; }

std::optional<Device::Buffer> Device::allocate(Place place, Bytes bytes, Stream stream,
                                               std::string_view name) {
  auto got = try_allocate(place, bytes, stream, name);
  if (!got) return std::nullopt;
  return got.value();
}

Result<Device::Buffer> Device::try_allocate(Place place, Bytes bytes, Stream stream,
                                            std::string_view name) {
  const MemoryKind kind = place == Place::Device ? MemoryKind::Device : MemoryKind::Pinned;
  const PinnedPool pool =
      place == Place::PinnedHostCaching ? PinnedPool::Caching : PinnedPool::Exact;
  auto got =
      sim_.alloc(kind, device_, bytes, place == Place::Device ? stream.id : StreamId(), pool, name);
  if (!got) return got.error();
  const BufferId id = got.value();
  cover(refs_, id.value());
  refs_[id.value()] = 1;
  return Buffer{id};
}

void Device::copy(Stream stream, Buffer src, Bytes src_offset, Buffer dst, Bytes dst_offset,
                  Bytes bytes, std::string_view name) {
  sim_.copy(stream.id, Region{src.id, src_offset, bytes}, Region{dst.id, dst_offset, bytes}, name);
}

void Device::record(Event event, Stream stream) { sim_.record(event.id, stream.id); }

void Device::wait(Stream stream, Event event) { sim_.wait(stream.id, event.id); }

void Device::hold(Buffer buffer) {
  FERRY_CHECK(buffer.id.valid() && buffer.id.value() < refs_.size() && refs_[buffer.id.value()] > 0,
              "hold of a storage that is not live");
  ++refs_[buffer.id.value()];
}

void Device::drop(Buffer buffer) {
  FERRY_CHECK(buffer.id.valid() && buffer.id.value() < refs_.size() && refs_[buffer.id.value()] > 0,
              "drop of a storage that is not live");
  if (--refs_[buffer.id.value()] == 0) sim_.free(buffer.id);
}

long Device::use_count(Buffer buffer) const {
  return buffer.id.valid() && buffer.id.value() < refs_.size() ? refs_[buffer.id.value()] : 0;
}

void Device::synchronize(Stream stream) { sim_.sync_stream(stream.id); }

void Device::record_stream(Buffer buffer, Stream stream) {
  sim_.record_stream(buffer.id, stream.id);
}

}  // namespace ferry::sim
