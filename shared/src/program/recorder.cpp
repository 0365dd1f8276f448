#include "ferry/program/recorder.hpp"

#include <fmt/format.h>

#include "ferry/check.hpp"
#include "ferry/program/program_json.hpp"

namespace ferry {

namespace {
// The device every recorded stream and device buffer is on.
constexpr DeviceId kDevice(0);
// A stand-in kernel's duration: the real one ran inside the framework, its time unknown.
constexpr SimTime kStandInKernel(1000);
}  // namespace

Recorder::Recorder(std::string profile) {
  program_.description = "stream operations recorded from a ferry run";
  ProgramDevice device;
  device.name = "gpu0";
  device.profile_name = std::move(profile);
  device.profile.name = device.profile_name;
  program_.devices.push_back(std::move(device));
}

std::uint32_t Recorder::add_stream(std::string_view name) {
  const auto index = static_cast<std::uint32_t>(program_.streams.size());
  program_.streams.push_back(ProgramStream{fmt::format("s{}_{}", index, name), kDevice});
  return index;
}

std::uint32_t Recorder::add_event() {
  const auto index = static_cast<std::uint32_t>(program_.events.size());
  program_.events.push_back(ProgramEvent{fmt::format("e{}", index)});
  return index;
}

std::uint32_t Recorder::add_buffer(Place place, Bytes bytes) {
  const auto index = static_cast<std::uint32_t>(program_.buffers.size());
  ProgramBuffer buffer;
  buffer.name = fmt::format("b{}", index);
  buffer.bytes = bytes.count() > 0 ? bytes : Bytes(1);
  if (place == Place::Device) {
    buffer.kind = MemoryKind::Device;
    buffer.device = kDevice;
  } else {
    buffer.kind = MemoryKind::Pinned;
    buffer.pool = place == Place::PinnedHost ? PinnedPool::Exact : PinnedPool::Caching;
  }
  program_.buffers.push_back(std::move(buffer));
  return index;
}

void Recorder::alloc(std::uint32_t buffer, std::int64_t stream) {
  add(OpKind::Alloc, stream >= 0 ? StreamId(static_cast<std::uint32_t>(stream)) : StreamId(),
      EventId(), SlotId(buffer));
}

void Recorder::free(std::uint32_t buffer) {
  add(OpKind::Free, StreamId(), EventId(), SlotId(buffer));
}

void Recorder::produce(std::uint32_t stream, std::uint32_t buffer, Bytes offset, Bytes bytes) {
  if (bytes.count() <= 0) return;
  kernel("producer", stream, range(buffer, offset, bytes), true);
}

void Recorder::consume(std::uint32_t stream, std::uint32_t buffer, Bytes offset, Bytes bytes) {
  if (bytes.count() <= 0) return;
  kernel("consumer", stream, range(buffer, offset, bytes), false);
}

void Recorder::copy(std::uint32_t stream, std::uint32_t src, Bytes src_offset, std::uint32_t dst,
                    Bytes dst_offset, Bytes bytes) {
  ProgramOp op;
  op.kind = OpKind::Copy;
  op.stream = StreamId(stream);
  op.src = range(src, src_offset, bytes);
  op.dst = range(dst, dst_offset, bytes);
  program_.ops.push_back(std::move(op));
}

void Recorder::record(std::uint32_t event, std::uint32_t stream) {
  add(OpKind::Record, StreamId(stream), EventId(event), SlotId());
}

void Recorder::wait(std::uint32_t stream, std::uint32_t event) {
  add(OpKind::Wait, StreamId(stream), EventId(event), SlotId());
}

void Recorder::record_stream(std::uint32_t buffer, std::uint32_t stream) {
  add(OpKind::RecordStream, StreamId(stream), EventId(), SlotId(buffer));
}

void Recorder::synchronize(std::uint32_t stream) {
  add(OpKind::SyncStream, StreamId(stream), EventId(), SlotId());
}

std::string Recorder::json() const { return program_to_json(program_); }

void Recorder::add(OpKind kind, StreamId stream, EventId event, SlotId slot) {
  ProgramOp op;
  op.kind = kind;
  op.stream = stream;
  op.event = event;
  op.slot = slot;
  program_.ops.push_back(std::move(op));
}

void Recorder::kernel(const char* label, std::uint32_t stream, SlotRange range, bool writes) {
  ProgramOp op;
  op.kind = OpKind::Kernel;
  op.label = label;
  op.stream = StreamId(stream);
  op.duration = kStandInKernel;
  (writes ? op.writes : op.reads).push_back(range);
  program_.ops.push_back(std::move(op));
}

SlotRange Recorder::range(std::uint32_t buffer, Bytes offset, Bytes bytes) const {
  FERRY_CHECK(buffer < program_.buffers.size(), "recorder: buffer {} was never added", buffer);
  return SlotRange{SlotId(buffer), offset, bytes};
}

}  // namespace ferry
