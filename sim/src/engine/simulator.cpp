#include "ferry/sim/engine/simulator.hpp"

#include <algorithm>
#include <span>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "simulator_state.hpp"

namespace ferry::sim {

// Each API call is one function here, from begin_call (the host pays the launch overhead and
// the call takes effect) to end_host_call or submit (what the device will run).

Simulator::Simulator(std::vector<DeviceSpec> devices, std::vector<ProgramLink> links,
                     SimOptions options, SimFaults faults)
    : state_(std::make_unique<State>(std::move(devices), std::move(links), options, faults)) {}
Simulator::~Simulator() = default;
Simulator::Simulator(Simulator&&) noexcept = default;
Simulator& Simulator::operator=(Simulator&&) noexcept = default;

StreamId Simulator::add_stream(DeviceId device, std::string name) {
  State& s = *state_;
  s.device(device);
  return s.streams.add(std::move(name), device, s.checker.add_thread());
}

// Note [Processes]
// With SimOptions::process_per_device each device is driven by a process of its own, as the
// ranks of FSDP or DDP are: set_host names the process whose host thread makes the calls that
// follow. Each process has its own host thread in the checker, ordered with the others' only
// through what its streams wait for, and its own pinned pool: the device profile's pinned
// capacity at addresses of its own within the node's host memory, so two ranks' pinned
// buffers never share bytes unless the pools are planted on the same addresses. One host
// clock serves every process (calls interleave in the order they are made), so the timings of
// such a run are not a prediction: it is a check of what the processes share.

void Simulator::set_host(DeviceId device) {
  State& s = *state_;
  s.device(device);
  FERRY_CHECK(s.options.process_per_device || device.value() == 0,
              "set_host needs a process per device (SimOptions::process_per_device)");
  s.caller = device.value();
  s.checker.set_host(s.host_thread());
}

void Simulator::reserve(std::size_t calls, std::size_t buffers) {
  State& s = *state_;
  s.ops.reserve(calls);
  s.exec.reserve(calls);
  s.buffers.reserve(buffers);
  s.device_blocks.reserve(buffers);
  s.host_blocks.reserve(buffers);
}

void Simulator::observe(SimObserver& observer) { state_->attach(observer); }

EventId Simulator::add_event() {
  State& s = *state_;
  s.events.emplace_back();
  return EventId(static_cast<std::uint32_t>(s.events.size() - 1));
}

Result<BufferId> Simulator::alloc(MemoryKind kind, DeviceId device, Bytes bytes, StreamId stream,
                                  PinnedPool pool, std::string_view label, std::string_view name) {
  State& s = *state_;
  FERRY_CHECK(bytes.count() >= 0, "negative allocation size");
  const OpId op =
      s.begin_call(OpKind::Alloc, s.overheads(device.valid() ? device : DeviceId(0)).malloc, label);
  OpRecord& rec = s.ops[op.value()];
  rec.bytes = bytes;
  BufferInfo info{.kind = kind,
                  .device = DeviceId(),
                  .address = Bytes(),
                  .bytes = bytes,
                  .label = name.empty() || !s.options.timeline ? rec.label : s.labels.intern(name),
                  .live = true,
                  .allocated_by = op,
                  .freed_by = OpId()};
  BlockId block;
  HostBlockId host_block;
  if (kind == MemoryKind::Device) {
    CachingAllocator& allocator = s.device(device).allocator;
    FERRY_CHECK(
        stream.valid() && stream.value() < s.streams.size() && s.streams.device(stream) == device,
        "a device allocation needs a stream of its device");
    rec.stream = stream;
    info.device = device;
    const std::int64_t frees = allocator.stats().segment_frees;
    auto got =
        allocator.malloc(stream, bytes, s, BufferId(static_cast<std::uint32_t>(s.buffers.size())));
    s.after_segment_frees(op, device, frees);
    if (!got) {
      s.end_host_call(op);
      return got.error();
    }
    info.address = got.value().address;
    block = got.value().block;
  } else if (kind == MemoryKind::Pinned) {
    PinnedHostAllocator& pinned = s.pinned_of(s.caller);
    const std::int64_t pins = pinned.stats().host_allocs;
    auto got = pinned.malloc(bytes, pool, s);
    if (pinned.stats().host_allocs != pins) {
      // No cached block of the size: the host pins a new one (cudaHostAlloc) before it goes on.
      s.host_time += s.overheads(DeviceId(0)).host_alloc;
      s.advance_to(s.host_time);
    }
    if (!got) {
      s.end_host_call(op);
      return got.error();
    }
    info.address = got.value().address;
    host_block = got.value().block;
  } else {
    info.address = s.pageable_next;
    s.pageable_next += Bytes((std::max<std::int64_t>(bytes.count(), 1) + 511) / 512 * 512);
  }
  const BufferId id(static_cast<std::uint32_t>(s.buffers.size()));
  s.ops[op.value()].buffer = id;
  s.buffers.push_back(info);
  s.device_blocks.push_back(block);
  s.host_blocks.push_back(State::HostBlock{host_block, s.caller});
  // Checker: bytes a deferred free returned are ordered after its markers (Note [Latent reuse]).
  if (s.options.check_hazards && kind != MemoryKind::Pageable) {
    s.checker.allocated(id, s.space_of(info), info.address, info.address + bytes);
  }
  if (kind != MemoryKind::Pageable) s.sample(info.device);
  s.end_host_call(op);
  return id;
}

void Simulator::free(BufferId buffer, std::string_view label) {
  State& s = *state_;
  const BufferInfo& b = s.buffer(buffer);
  const DeviceId device = b.kind == MemoryKind::Device ? b.device : DeviceId(0);
  const OpId op = s.begin_call(OpKind::Free, s.overheads(device).free, label);
  s.ops[op.value()].buffer = buffer;
  BufferInfo& info = s.buffers[buffer.value()];
  if (!info.live) {
    s.checker.report(Hazard{HazardKind::DoubleFree, Conflict::None, info.freed_by, op, buffer,
                            buffer, s.space_of(info), info.address, info.address + info.bytes});
    s.end_host_call(op);
    return;
  }
  info.live = false;
  info.freed_by = op;
  // Checker: judge the free for latent reuse before the allocator forgets the block's
  // record_stream streams (Note [Latent reuse]).
  if (s.options.check_hazards && info.kind != MemoryKind::Pageable) {
    const bool on_device = info.kind == MemoryKind::Device;
    const std::span<const StreamId> deferring =
        on_device
            ? s.devices[device.value()].allocator.deferring_streams(s.device_blocks[buffer.value()])
            : s.pinned_pool(buffer).deferring_streams(s.host_blocks[buffer.value()].block);
    std::vector<ThreadIndex>& deferred = s.free_threads;
    deferred.clear();
    for (const StreamId d : deferring) deferred.push_back(s.streams.thread(d));
    const ThreadIndex alloc_thread =
        on_device ? s.streams.thread(s.ops[info.allocated_by.value()].stream) : s.host_thread();
    s.checker.release(op, buffer, s.space_of(info), info.address, info.address + info.bytes,
                      std::span<const ThreadIndex>(&alloc_thread, on_device ? 1 : 0), deferred);
  }
  if (info.kind == MemoryKind::Device) {
    s.devices[device.value()].allocator.free(s.device_blocks[buffer.value()], s);
    s.sample(info.device);
  } else if (info.kind == MemoryKind::Pinned) {
    s.pinned_pool(buffer).free(s.host_blocks[buffer.value()].block, s);
    s.sample(DeviceId());
  }
  s.end_host_call(op);
}

void Simulator::record_stream(BufferId buffer, StreamId stream, std::string_view label) {
  State& s = *state_;
  const OpId op = s.begin_call(OpKind::RecordStream, SimTime(0), label);
  s.ops[op.value()].buffer = buffer;
  s.ops[op.value()].stream = stream;
  const BufferInfo& b = s.buffer(buffer);
  if (!b.live) {
    s.checker.report(Hazard{HazardKind::UseAfterFree, Conflict::None, b.freed_by, op, buffer,
                            buffer, s.space_of(b), b.address, b.address + b.bytes});
  } else if (b.kind == MemoryKind::Device) {
    s.devices[b.device.value()].allocator.record_stream(s.device_blocks[buffer.value()], stream);
  } else if (b.kind == MemoryKind::Pinned) {
    s.pinned_pool(buffer).record_stream(s.host_blocks[buffer.value()].block, stream);
  }
  s.end_host_call(op);
}

OpId Simulator::kernel(StreamId stream, SimTime duration, std::span<const Region> reads,
                       std::span<const Region> writes, std::string_view label,
                       std::span<const std::uint64_t> values) {
  return state_->launch(engine_detail::ExecKind::Kernel, stream, duration, reads, writes, label,
                        values);
}

// Note [Collectives]
// A collective (an NCCL all-gather, reduce-scatter or all-reduce) is a kernel to the stream
// scheduler and the checker: it reads and writes device ranges in stream order. It does not
// run on the compute engine: NCCL's kernels run beside compute kernels, so each device has
// engines of the same kind for its collectives, one per lane (CollectiveLane), each running
// one collective at a time. A lane is a process group: NCCL gives each communicator a stream
// of its own, so a tensor-parallel all-gather on the critical path does not queue behind the
// data-parallel group's prefetched all-gather. Two collectives of one lane that overlap in
// reality share the link, and finish together about when the two run back to back would; two
// of different lanes overlap without sharing bandwidth, which is optimistic where both groups
// use the same link. The duration is the caller's, from the link model (collective_cost.hpp,
// docs/fsdp.md); the SMs a collective takes from compute kernels are not modelled.
OpId Simulator::collective(StreamId stream, SimTime duration, std::span<const Region> reads,
                           std::span<const Region> writes, std::string_view label,
                           std::span<const std::uint64_t> values, CollectiveLane lane) {
  return state_->launch(engine_detail::ExecKind::Collective, stream, duration, reads, writes, label,
                        values, static_cast<std::uint8_t>(lane));
}

OpId Simulator::State::launch(engine_detail::ExecKind kind, StreamId stream, SimTime duration,
                              std::span<const Region> reads, std::span<const Region> writes,
                              std::string_view label, std::span<const std::uint64_t> values,
                              std::uint8_t lane) {
  State& s = *this;
  s.streams.check(stream);
  FERRY_CHECK(duration.ns() >= 0, "negative kernel duration");
  const OpId op = s.begin_call(OpKind::Kernel, s.overheads(s.streams.device(stream)).kernel, label);
  s.ops[op.value()].stream = stream;
  s.ops[op.value()].collective = kind == engine_detail::ExecKind::Collective;
  State::Exec& e = s.exec[op.value()];
  e.kind = kind;
  e.lane = lane;
  e.duration = duration;
  const ThreadIndex thread = s.streams.thread(stream);
  if (s.options.check_hazards) s.checker.begin_op(thread);
  for (const Region& r : reads) s.touch(op, thread, AccessOrigin::Kernel, r, false);
  e.first_write = static_cast<std::uint32_t>(s.write_ranges.size());
  FERRY_CHECK(writes.size() < 0xffffffffU, "a kernel writes {} ranges", writes.size());
  FERRY_CHECK(values.empty() || values.size() == writes.size(), "{} content values for {} writes",
              values.size(), writes.size());
  for (std::uint32_t i = 0; i < writes.size(); ++i) {
    const Region& r = writes[i];
    // What the kernel writes is kept for the content shadow alone (apply_content).
    if (!s.touch(op, thread, AccessOrigin::Kernel, r, true) || !s.options.track_content) continue;
    const BufferInfo& b = s.buffer(r.buffer);
    const Bytes lo = b.address + r.offset;
    s.write_ranges.push_back(engine_detail::WriteRange{
        s.space_of(b), lo, lo + r.bytes, values.empty() ? written_content(op, i) : values[i]});
  }
  e.write_count = static_cast<std::uint32_t>(s.write_ranges.size()) - e.first_write;
  if (!s.pending_expectations.empty()) {
    s.expectations.emplace(op, std::move(s.pending_expectations));
    s.pending_expectations.clear();
  }
  s.submit(op);
  return op;
}

OpId Simulator::copy(StreamId stream, Region src, Region dst, std::string_view label) {
  State& s = *state_;
  s.streams.check(stream);
  FERRY_CHECK(src.bytes == dst.bytes, "copy of {} bytes into {} bytes", src.bytes.count(),
              dst.bytes.count());
  s.check_region(src);
  s.check_region(dst);
  const BufferInfo& from = s.buffer(src.buffer);
  const BufferInfo& to = s.buffer(dst.buffer);
  FERRY_CHECK(from.kind == MemoryKind::Device || to.kind == MemoryKind::Device,
              "a copy needs at least one device buffer");
  const OpId op = s.begin_call(OpKind::Copy, s.overheads(s.streams.device(stream)).copy, label);
  OpRecord& rec = s.ops[op.value()];
  rec.stream = stream;
  rec.bytes = src.bytes;
  State::Exec& e = s.exec[op.value()];
  e.kind = engine_detail::ExecKind::Copy;
  rec.engine = s.copy_engine(rec, e, from, to);
  FERRY_CHECK(e.rate > Bandwidth(0), "copy path with zero bandwidth");
  const ThreadIndex thread = s.streams.thread(stream);
  if (s.options.check_hazards) s.checker.begin_op(thread);
  const bool src_ok = s.touch(op, thread, AccessOrigin::Copy, src, false);
  const bool dst_ok = s.touch(op, thread, AccessOrigin::Copy, dst, true);
  if (src_ok && dst_ok) {
    e.src_space = s.space_of(from);
    e.dst_space = s.space_of(to);
    e.src_addr = from.address + src.offset;
    e.dst_addr = to.address + dst.offset;
  } else {
    rec.bytes = Bytes(0);  // nothing sensible moves through freed memory
  }
  s.submit(op);
  if (from.kind == MemoryKind::Pageable || to.kind == MemoryKind::Pageable) {
    // A pageable copy returns to the host only once it has completed.
    s.wait_for(s.streams.submitted(stream));
    if (s.options.check_hazards) s.checker.host_joins(thread);
  }
  return op;
}

void Simulator::record(EventId event, StreamId stream, std::string_view label) {
  State& s = *state_;
  State::EventState& ev = s.event(event);
  s.streams.check(stream);
  const OpId op =
      s.begin_call(OpKind::Record, s.overheads(s.streams.device(stream)).event_record, label);
  s.ops[op.value()].stream = stream;
  ev.recorded = s.streams.submitted(stream);
  if (s.options.check_hazards) ev.snapshot = s.checker.capture(s.streams.thread(stream));
  s.end_host_call(op);
}

void Simulator::wait(StreamId stream, EventId event, std::string_view label) {
  State& s = *state_;
  const State::EventState& ev = s.event(event);
  s.streams.check(stream);
  const OpId op =
      s.begin_call(OpKind::Wait, s.overheads(s.streams.device(stream)).stream_wait, label);
  s.ops[op.value()].stream = stream;
  if (!ev.recorded) {  // CUDA: waiting on a never-recorded event does nothing
    s.end_host_call(op);
    return;
  }
  if (s.options.check_hazards) s.checker.wait(s.streams.thread(stream), ev.snapshot);
  s.submit(op, ev.recorded);
}

void Simulator::sync_stream(StreamId stream, std::string_view label) {
  State& s = *state_;
  s.streams.check(stream);
  const OpId op =
      s.begin_call(OpKind::SyncStream, s.overheads(s.streams.device(stream)).synchronize, label);
  s.ops[op.value()].stream = stream;
  s.wait_for(s.streams.submitted(stream));
  if (s.options.check_hazards) s.checker.host_joins(s.streams.thread(stream));
  s.end_host_call(op);
}

void Simulator::sync_event(EventId event, std::string_view label) {
  State& s = *state_;
  const State::EventState ev = s.event(event);
  const OpId op = s.begin_call(OpKind::SyncEvent, s.overheads(DeviceId(0)).synchronize, label);
  if (ev.recorded) {
    s.wait_for(*ev.recorded);
    if (s.options.check_hazards) s.checker.host_observes(ev.snapshot);
  }
  s.end_host_call(op);
}

void Simulator::sync_device(DeviceId device, std::string_view label) {
  State& s = *state_;
  s.device(device);
  const OpId op = s.begin_call(OpKind::SyncDevice, s.overheads(device).synchronize, label);
  s.synchronize_device(device);
  s.end_host_call(op);
}

bool Simulator::query(EventId event, std::string_view label) {
  State& s = *state_;
  const State::EventState& ev = s.event(event);
  const OpId op = s.begin_call(OpKind::Query, s.overheads(DeviceId(0)).event_query, label);
  s.end_host_call(op);
  if (!ev.recorded) return true;
  if (!s.streams.reached(*ev.recorded)) return false;
  if (s.options.check_hazards) s.checker.host_observes(ev.snapshot);
  return true;
}

void Simulator::host_read(std::span<const Region> regions, std::string_view label) {
  State& s = *state_;
  const OpId op = s.begin_call(OpKind::HostRead, s.overheads(DeviceId(0)).host_access, label);
  if (s.options.check_hazards) s.checker.begin_op(s.host_thread());
  for (const Region& r : regions) {
    FERRY_CHECK(s.buffer(r.buffer).kind != MemoryKind::Device,
                "the host cannot read device memory directly");
    s.touch(op, s.host_thread(), AccessOrigin::Host, r, false);
  }
  s.end_host_call(op);
}

void Simulator::host_write(std::span<const Region> regions, std::string_view label) {
  State& s = *state_;
  const OpId op = s.begin_call(OpKind::HostWrite, s.overheads(DeviceId(0)).host_access, label);
  if (s.options.check_hazards) s.checker.begin_op(s.host_thread());
  FERRY_CHECK(regions.size() < 0xffffffffU, "a host write covers {} ranges", regions.size());
  for (std::uint32_t i = 0; i < regions.size(); ++i) {
    const Region& r = regions[i];
    const BufferInfo& b = s.buffer(r.buffer);
    FERRY_CHECK(b.kind != MemoryKind::Device, "the host cannot write device memory directly");
    if (!s.touch(op, s.host_thread(), AccessOrigin::Host, r, true)) continue;
    if (s.options.track_content) {
      const Bytes lo = b.address + r.offset;
      s.content[s.host_space()].write(lo, lo + r.bytes, written_content(op, i), Bytes(0));
    }
  }
  s.end_host_call(op);
}

void Simulator::empty_cache(DeviceId device, std::string_view label) {
  State& s = *state_;
  CachingAllocator& allocator = s.device(device).allocator;
  const OpId op = s.begin_call(OpKind::EmptyCache, s.overheads(device).free, label);
  const std::int64_t frees = allocator.stats().segment_frees;
  allocator.empty_cache(s);
  s.after_segment_frees(op, device, frees);
  s.sample(device);
  s.end_host_call(op);
}

void Simulator::expect_content_at_next_kernel(Region region,
                                              std::span<const ContentPiece> expected) {
  State& s = *state_;
  if (!s.options.track_content) return;
  s.check_region(region);
  const BufferInfo& b = s.buffer(region.buffer);
  State::Expectation& e = s.pending_expectations.emplace_back(
      State::Expectation{s.space_of(b), b.address + region.offset, region, {}});
  e.expected.append(expected.begin(), expected.end());
}

OpId Simulator::report_misuse(HazardKind kind, OpKind op_kind, std::string_view label) {
  State& s = *state_;
  const OpId op = s.begin_call(op_kind, SimTime(0), label);
  s.checker.report(
      Hazard{kind, Conflict::None, OpId(), op, BufferId(), BufferId(), 0, Bytes(0), Bytes(0)});
  s.end_host_call(op);
  return op;
}

void Simulator::finish() {
  State& s = *state_;
  while (!s.queue.empty()) s.process(s.queue.pop());
}

void Simulator::replay(SimObserver& observer) const {
  const State& s = *state_;
  const auto& engines = s.copies.info();
  for (std::uint32_t e = 0; e < engines.size(); ++e) observer.engine_added(EngineId(e), engines[e]);
  for (std::uint32_t op = 0; op < s.ops.size(); ++op) observer.op_finished(OpId(op), s.ops[op]);
  for (const MemorySample& m : s.memory.samples()) observer.memory_sampled(m);
}

SimTime Simulator::host_time() const { return state_->host_time; }

SimTime Simulator::makespan() const { return std::max(state_->host_time, state_->latest_end); }

const std::vector<Hazard>& Simulator::hazards() const { return state_->checker.hazards(); }
const std::vector<ContentMismatch>& Simulator::content_mismatches() const {
  return state_->mismatches;
}
const std::vector<OpRecord>& Simulator::ops() const { return state_->ops; }
const std::vector<BufferInfo>& Simulator::buffers() const { return state_->buffers; }
const std::vector<EngineInfo>& Simulator::engines() const { return state_->copies.info(); }
const std::vector<MemorySample>& Simulator::memory_samples() const {
  return state_->memory.samples();
}
std::string_view Simulator::label(std::uint32_t index) const { return state_->labels[index]; }
std::size_t Simulator::device_count() const { return state_->devices.size(); }
const std::string& Simulator::device_name(DeviceId device) const {
  return state_->devices.at(device.value()).name;
}
const DeviceProfile& Simulator::device_profile(DeviceId device) const {
  return state_->devices.at(device.value()).profile;
}
std::size_t Simulator::stream_count() const { return state_->streams.size(); }
const std::string& Simulator::stream_name(StreamId stream) const {
  state_->streams.check(stream);
  return state_->streams.name(stream);
}
DeviceId Simulator::stream_device(StreamId stream) const {
  state_->streams.check(stream);
  return state_->streams.device(stream);
}
const CachingAllocator& Simulator::device_allocator(DeviceId device) const {
  return state_->devices.at(device.value()).allocator;
}
const PinnedHostAllocator& Simulator::pinned_allocator() const { return state_->pinned; }

const PinnedHostAllocator& Simulator::pinned_allocator(DeviceId device) const {
  State& s = *state_;
  FERRY_CHECK(device.valid() && device.value() < s.devices.size(), "unknown device");
  return s.pinned_of(s.options.process_per_device ? device.value() : 0);
}
const AllocatorLog* Simulator::allocator_log() const { return state_->allocator_log.get(); }
CopyTotals Simulator::copied() const { return state_->totals; }

std::vector<ContentPiece> Simulator::content(Region region) const {
  const State& s = *state_;
  s.check_region(region);
  const BufferInfo& b = s.buffer(region.buffer);
  const Bytes lo = b.address + region.offset;
  return s.content[s.space_of(b)].read(lo, lo + region.bytes);
}

SpaceIndex Simulator::space_of(BufferId buffer) const {
  return state_->space_of(state_->buffer(buffer));
}

}  // namespace ferry::sim
