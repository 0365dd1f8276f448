#include "simulator_state.hpp"

#include <algorithm>
#include <utility>

namespace ferry::sim {

// Note [Simulated time]
// Time is an integer count of nanoseconds. The host thread has its own clock, host_time; the
// devices advance through a queue of completion events ordered by (time, sequence number), so
// events at equal times run in the order they were scheduled, never by address. Before the
// host acts at host_time, every device event at or before host_time has run: a host call
// sees exactly the device state a real host would see then. Work a call submits may start no
// earlier than the call's issue time. Blocking calls run the queue until their condition
// holds and move host_time to that moment.
//
// What happens is kept apart from how long it takes: the stream scheduler decides when an op
// may start (stream order, waits); the compute engines and the copy engines (Note [Fluid copy
// engines]) decide when it ends, and report back through the event queue.

namespace {

constexpr Bytes kDeviceBase{0x1'0000'0000};       // first device address
constexpr Bytes kPinnedBase{0x2000'0000'0000};    // pinned host memory
constexpr Bytes kPageableBase{0x3000'0000'0000};  // pageable host memory

Bytes pinned_capacity(const std::vector<DeviceSpec>& specs) {
  Bytes cap;
  for (const auto& s : specs) cap = std::max(cap, s.profile.pinned_host_capacity);
  return cap;
}

// Bytes a process's pinned pool spans (its cap, 512 B aligned), with process_per_device.
Bytes pool_span(Bytes capacity) { return Bytes((capacity.count() + 511) / 512 * 512); }

}  // namespace

// Note [Recycled records] in simulator_state.hpp.
Simulator::State::~State() {
  engine_detail::recycle_records(buffers);
  engine_detail::recycle_records(ops);
  engine_detail::recycle_records(exec);
  engine_detail::recycle_records(write_ranges);
}

Simulator::State::State(std::vector<DeviceSpec> specs, std::vector<ProgramLink> link_list,
                        SimOptions opts, SimFaults planted)
    : options(opts),
      faults(planted),
      buffers(engine_detail::take_records<BufferInfo>()),
      ops(engine_detail::take_records<OpRecord>()),
      exec(engine_detail::take_records<Exec>()),
      write_ranges(engine_detail::take_records<engine_detail::WriteRange>()),
      pinned(opts.process_per_device && !specs.empty() ? specs.front().profile.pinned_host_capacity
                                                       : pinned_capacity(specs),
             kPinnedBase),
      pageable_next(kPageableBase),
      checker(planted.checker),
      streams(planted.timing_ignores_waits),
      compute(specs.size()),
      collectives(specs.size(), kCollectiveLanes, DeviceEvent::Kind::CollectiveDone),
      copies(queue) {
  FERRY_CHECK(!specs.empty(), "a simulation needs at least one device");
  for (const ProgramLink& l : link_list) links.insert_or_assign({l.from, l.to}, l);
  for (auto& spec : specs) {
    const Bytes capacity = spec.profile.memory;
    devices.push_back(
        DeviceState{.name = std::move(spec.name),
                    .profile = std::move(spec.profile),
                    .allocator = CachingAllocator(capacity, kDeviceBase, opts.allocator)});
  }
  for (std::uint32_t d = 0; d < devices.size(); ++d) {
    DeviceState& dev = devices[d];
    const DeviceId id(d);
    dev.h2d = copies.add(EngineInfo{dev.name + " H2D", id}, dev.profile.h2d.bidirectional_permille);
    dev.d2h = copies.add(EngineInfo{dev.name + " D2H", id}, dev.profile.d2h.bidirectional_permille);
    dev.d2d = copies.add(EngineInfo{dev.name + " D2D", id}, 1000);
    copies.pair(dev.h2d, dev.d2h);
  }
  if (options.record_allocator) {
    allocator_log = std::make_unique<AllocatorLog>(devices.size());
    attach(*allocator_log);
  }
  content.resize(devices.size() + 1);
  hosts.push_back(kHostThread);
  if (options.process_per_device) {
    // Each process's pool at addresses after the earlier ones' (or all at the same ones, a
    // planted fault). Note [Processes].
    Bytes base = kPinnedBase;
    for (std::size_t p = 1; p < devices.size(); ++p) {
      if (!planted.shared_pinned_pool)
        base += pool_span(devices[p - 1].profile.pinned_host_capacity);
      hosts.push_back(checker.add_thread());
      other_pinned.emplace_back(devices[p].profile.pinned_host_capacity, base);
    }
  }
}

// --- the host side ------------------------------------------------------------------------

// Waits for every stream of `device` (a device synchronize) and orders the host after it.
void Simulator::State::synchronize_device(DeviceId device) {
  for (std::uint32_t s = 0; s < streams.size(); ++s) {
    const StreamId stream(s);
    if (streams.device(stream) != device) continue;
    wait_for(streams.submitted(stream));
    if (options.check_hazards) checker.host_joins(streams.thread(stream));
  }
}

// Note [cudaFree synchronizes]
// Returning a segment to the device (cudaFree, in empty_cache or in an out-of-memory retry)
// synchronizes the whole device. Calls that may do so compare the allocator's segment-free
// count before and after, and when it moved, the host waits for the device and is ordered
// after all of its work, in time and in happens-before.
void Simulator::State::after_segment_frees(OpId op, DeviceId device, std::int64_t frees_before) {
  if (devices[device.value()].allocator.stats().segment_frees == frees_before) return;
  synchronize_device(device);
  ops[op.value()].device_synchronized = true;
}

void Simulator::State::sample(DeviceId device) {
  if (!options.timeline && observers.empty()) return;
  if (device.valid()) {
    memory.device(host_time, device, devices[device.value()].allocator, observers);
  } else {
    memory.pinned(host_time, pinned_of(caller), observers);
  }
}

// --- the device side ------------------------------------------------------------------------

void Simulator::State::process(const DeviceEventQueue::Entry& ev) {
  now = ev.time;
  if (ev.payload.kind != DeviceEvent::Kind::CopyPhaseDone) {
    const DeviceId device = ev.payload.device;
    ComputeEngines& engines =
        ev.payload.kind == DeviceEvent::Kind::KernelDone ? compute : collectives;
    const std::optional<OpId> done = engines.finish(device, ev.payload.lane, ev.payload.generation);
    if (!done) return;  // superseded by a change of rate
    complete(*done);
    start_kernel(engines, device, ev.payload.lane);
    return;
  }
  const EngineId engine = ev.payload.engine;
  const std::optional<OpId> done = copies.phase_done(engine, ev.payload.generation, now);
  if (!done) return;
  const OpRecord& rec = ops[done->value()];
  Bytes& total = rec.direction == CopyDirection::HostToDevice   ? totals.h2d
                 : rec.direction == CopyDirection::DeviceToHost ? totals.d2h
                 : rec.direction == CopyDirection::Peer         ? totals.peer
                                                                : totals.d2d;
  total += rec.bytes;
  complete(*done);
  start_copy(engine);
}

// The scheduler started `op`: a wait is done; a kernel or copy goes to its engine. Engines
// only schedule events here, never call back into the scheduler.
void Simulator::State::start_op(OpId op, bool wait_done) {
  OpRecord& rec = ops[op.value()];
  if (wait_done) {
    rec.start = rec.end = now;
    latest_end = std::max(latest_end, now);
    if (!observers.empty()) observers.op_finished(op, rec);
    return;
  }
  const Exec& e = exec[op.value()];
  if (e.kind == engine_detail::ExecKind::Kernel || e.kind == engine_detail::ExecKind::Collective) {
    ComputeEngines& engines = e.kind == engine_detail::ExecKind::Kernel ? compute : collectives;
    const DeviceId device = streams.device(rec.stream);
    engines.enqueue(device, e.lane, op, e.duration);
    start_kernel(engines, device, e.lane);
  } else {
    copies.enqueue(rec.engine, CopyJob{op, rec.bytes, e.rate, e.latency});
    start_copy(rec.engine);
  }
}

void Simulator::State::start_kernel(ComputeEngines& engines, DeviceId device, std::uint8_t lane) {
  const std::optional<OpId> op = engines.try_start(device, lane, now, queue);
  // A collective lane that started a kernel, or went idle, changes what compute runs beside.
  if (&engines == &collectives) contend(device);
  if (!op) return;
  ops[op->value()].start = now;
  if (!expectations.empty()) check_expectations(*op);
}

// Note [Contended compute]
// NCCL's collectives run as kernels on the GPU's SMs, so the compute kernels that overlap them
// have fewer SMs and less memory bandwidth: matmuls overlapped by FSDP's collectives on H100s
// run 30-40 % slower (pytorch/pytorch PR #179937, Llama 3 8B on 8 H100s over NVLink). A profile
// that gives `collective_overlap_permille` runs the device's compute kernels at that fraction of
// their rate while any of its collective lanes runs a kernel; a kernel keeps the work it has
// done when the rate changes (as the fluid copy engines do). Without the figure nothing slows.
void Simulator::State::contend(DeviceId device) {
  const std::int32_t slowed = devices[device.value()].profile.kernels.collective_overlap_permille;
  if (slowed <= 0) return;
  compute.set_rate(device, 0, collectives.busy(device) ? slowed : 1000, now, queue);
}

void Simulator::State::start_copy(EngineId engine) {
  if (const std::optional<OpId> op = copies.try_start(engine, now)) ops[op->value()].start = now;
}

void Simulator::State::complete(OpId op) {
  OpRecord& rec = ops[op.value()];
  rec.end = now;
  latest_end = std::max(latest_end, now);
  if (options.track_content) apply_content(op);
  if (!observers.empty()) observers.op_finished(op, rec);
  streams.complete(rec.stream,
                   [this](OpId started, bool wait_done) { start_op(started, wait_done); });
}

// Picks the engine of a copy between `from` and `to` and its uncontended rate and latency.
EngineId Simulator::State::copy_engine(OpRecord& rec, Exec& e, const BufferInfo& from,
                                       const BufferInfo& to) {
  const bool pageable = from.kind == MemoryKind::Pageable || to.kind == MemoryKind::Pageable;
  if (from.kind == MemoryKind::Device && to.kind == MemoryKind::Device) {
    const DeviceState& dev = devices[from.device.value()];
    if (from.device == to.device) {
      rec.direction = CopyDirection::DeviceToDevice;
      e.rate = dev.profile.d2d.bandwidth;
      e.latency = dev.profile.d2d.latency;
      return dev.d2d;
    }
    rec.direction = CopyDirection::Peer;
    e.rate = dev.profile.peer.bandwidth;
    e.latency = dev.profile.peer.latency;
    if (auto l = links.find({from.device, to.device}); l != links.end()) {
      e.rate = l->second.bandwidth;
      e.latency = l->second.latency;
    }
    if (auto engine = copies.peer(from.device, to.device)) return *engine;
    const EngineInfo info{dev.name + "->" + devices[to.device.value()].name, from.device};
    const EngineId engine = copies.add_peer(from.device, to.device, info);
    if (!observers.empty()) observers.engine_added(engine, info);
    return engine;
  }
  if (to.kind == MemoryKind::Device) {
    const DeviceState& dev = devices[to.device.value()];
    rec.direction = CopyDirection::HostToDevice;
    e.rate = pageable ? dev.profile.pageable_h2d : dev.profile.h2d.bandwidth;
    e.latency = dev.profile.h2d.latency;
    return dev.h2d;
  }
  const DeviceState& dev = devices[from.device.value()];
  rec.direction = CopyDirection::DeviceToHost;
  e.rate = pageable ? dev.profile.pageable_d2h : dev.profile.d2h.bandwidth;
  e.latency = dev.profile.d2h.latency;
  return dev.d2h;
}

// --- accesses, checking and content -----------------------------------------------------------

void Simulator::State::check_expectations(OpId op) {
  auto it = expectations.find(op);
  if (it == expectations.end()) return;
  for (Expectation& e : it->second) {
    const ContentShadow& shadow = content[e.space];
    const Bytes hi = e.address + e.region.bytes;
    if (!shadow.holds(e.address, hi, e.expected)) {
      mismatches.push_back(ContentMismatch{
          op, e.region, std::vector<ContentPiece>(e.expected.begin(), e.expected.end()),
          shadow.read(e.address, hi)});
    }
  }
  expectations.erase(it);
}

void Simulator::State::apply_content(OpId op) {
  const Exec& e = exec[op.value()];
  if (e.kind == engine_detail::ExecKind::Copy) {
    content[e.dst_space].copy_from(content[e.src_space], e.src_addr, e.dst_addr,
                                   ops[op.value()].bytes);
  } else {
    for (std::uint32_t i = 0; i < e.write_count; ++i) {
      const engine_detail::WriteRange& w = write_ranges[e.first_write + i];
      content[w.space].write(w.lo, w.hi, w.content, Bytes(0));
    }
  }
}

void Simulator::State::attach(SimObserver& observer) {
  if (observers.empty()) {
    for (std::uint32_t d = 0; d < devices.size(); ++d) {
      allocator_trackers.push_back(std::make_unique<AllocatorForwarder>(*this, DeviceId(d)));
      devices[d].allocator.set_tracker(allocator_trackers.back().get());
    }
  }
  observers.attach(observer);
  const auto& engines = copies.info();
  for (std::uint32_t e = 0; e < engines.size(); ++e) observer.engine_added(EngineId(e), engines[e]);
}

void Simulator::State::AllocatorForwarder::allocator_action(const AllocatorEvent& event) {
  AllocatorEvent stamped = event;
  stamped.time = state_->host_time;
  stamped.op = OpId(static_cast<std::uint32_t>(state_->ops.size() - 1));
  state_->observers.allocator_action(device_, stamped);
}

// --- StreamMarkers ----------------------------------------------------------------------------

MarkerId Simulator::State::record(StreamId stream) {
  const std::uint32_t snapshot =
      options.check_hazards ? checker.capture(streams.thread(stream)) : 0;
  markers.push_back(engine_detail::Marker{streams.submitted(stream), snapshot});
  return MarkerId(static_cast<std::uint32_t>(markers.size() - 1));
}

bool Simulator::State::query(MarkerId id) {
  // A poll's answer depends on timing: it orders only the bytes' next owner (the checker's
  // allocated()), not the host. See Note [Latent reuse].
  return streams.reached(markers[id.value()].position);
}

void Simulator::State::synchronize(MarkerId id) {
  const engine_detail::Marker m = markers[id.value()];
  wait_for(m.position);
  if (options.check_hazards) checker.host_observes(m.snapshot);
}

}  // namespace ferry::sim
