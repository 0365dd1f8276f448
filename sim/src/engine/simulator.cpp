#include "ferry/sim/engine/simulator.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <queue>
#include <utility>

#include "ferry/check.hpp"

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
// Copies use a fluid model: a copy in its transfer phase drains its bytes at its engine's
// rate, and when the opposite direction starts or stops moving data both rates change (the
// profile's bidirectional factor). Remaining work is kept exactly, in byte-nanoseconds per
// second (bytes * 1e9), in 128-bit integers, so no rounding accumulates.

namespace {

__extension__ using Wide = __int128;
constexpr std::uint32_t kNone = 0xffffffffU;
constexpr std::int64_t kNsPerSecond = 1'000'000'000;
constexpr std::int64_t kDeviceBase = 0x1'0000'0000;       // first device address
constexpr std::int64_t kPinnedBase = 0x2000'0000'0000;    // pinned host memory
constexpr std::int64_t kPageableBase = 0x3000'0000'0000;  // pageable host memory

enum class EventType : std::uint8_t { KernelDone, CopyPhaseDone };

struct QueuedEvent {
  std::int64_t time;
  std::uint64_t seq;
  std::uint32_t index;
  std::uint32_t generation;
  EventType type;
};

struct Later {
  bool operator()(const QueuedEvent& a, const QueuedEvent& b) const {
    return a.time != b.time ? a.time > b.time : a.seq > b.seq;
  }
};

enum class ExecKind : std::uint8_t { None, Kernel, Copy, Wait };

// How a submitted stream op executes. Kept beside OpRecord, same index.
struct Exec {
  ExecKind kind = ExecKind::None;
  std::uint32_t target_stream = kNone;  // Wait
  std::uint64_t target_count = 0;       // Wait
  std::int64_t duration = 0;            // Kernel
  std::int64_t rate = 0;                // Copy, bytes per second
  std::int64_t latency = 0;             // Copy
  std::uint32_t device = 0;             // Kernel: compute engine
  // Content movement at completion: copies move src -> dst; kernels write fresh values
  // into write_ranges_[first_write, first_write + write_count).
  SpaceIndex src_space = 0;
  SpaceIndex dst_space = 0;
  std::int64_t src_addr = 0;
  std::int64_t dst_addr = 0;
  std::uint32_t first_write = 0;
  std::uint32_t write_count = 0;
};

struct WriteRange {
  SpaceIndex space;
  std::int64_t lo;
  std::int64_t hi;
  std::uint64_t content;
};

struct StreamState {
  std::string name;
  DeviceId device;
  ThreadIndex thread = 0;
  std::deque<std::uint32_t> queue;  // submitted, not yet started; head may be a blocked wait
  std::uint64_t submitted = 0;
  std::uint64_t completed = 0;
  bool busy = false;                                             // head op handed to an engine
  std::vector<std::pair<std::uint64_t, std::uint32_t>> waiters;  // (count, waiting stream)
};

struct EventState {
  std::string name;
  bool recorded = false;
  std::uint32_t stream = kNone;
  std::uint64_t count = 0;
  std::uint32_t snapshot = 0;
};

struct ComputeEngine {
  std::deque<std::uint32_t> ready;
  bool busy = false;
};

enum class Phase : std::uint8_t { Idle, Latency, Transfer };

struct CopyEngine {
  std::deque<std::uint32_t> ready;
  std::uint32_t current = kNone;
  Phase phase = Phase::Idle;
  Wide remaining = 0;  // bytes * 1e9 still to move
  std::int64_t rate = 0;
  std::int64_t since = 0;
  std::uint32_t generation = 0;
  std::int32_t partner = -1;
  std::int32_t permille = 1000;
  CopyDirection direction = CopyDirection::HostToDevice;
};

struct DeviceState {
  std::string name;
  DeviceProfile profile;
  CachingAllocator allocator;
  ComputeEngine compute;
  std::int32_t h2d = -1;
  std::int32_t d2h = -1;
  std::int32_t d2d = -1;
};

struct Marker {
  std::uint32_t stream;
  std::uint64_t count;
  std::uint32_t snapshot;
};

struct ContentSeg {
  std::int64_t hi;
  std::uint64_t id;
  std::int64_t base;
};

using ContentMap = std::map<std::int64_t, ContentSeg>;

}  // namespace

struct Simulator::State final : StreamMarkers {
  SimOptions options;
  SimFaults faults;
  std::vector<DeviceState> devices;
  std::vector<ProgramLink> links;
  std::vector<StreamState> streams;
  std::vector<EventState> events;
  std::vector<BufferInfo> buffers;
  std::vector<BlockId> device_blocks;    // per buffer, Device kind
  std::vector<HostBlockId> host_blocks;  // per buffer, Pinned kind
  std::vector<OpRecord> ops;
  std::vector<Exec> exec;
  std::vector<WriteRange> write_ranges;
  std::vector<CopyEngine> engines;
  std::vector<EngineInfo> engine_info;
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::int32_t> peer_engines;
  std::vector<std::string> labels{std::string()};
  std::map<std::string, std::uint32_t, std::less<>> label_index;
  PinnedHostAllocator pinned;
  std::int64_t pageable_next = kPageableBase;
  HazardChecker checker;
  std::vector<ContentMap> content;
  // Expectations checked when a kernel starts: kernel op -> (space, address, region, pieces).
  struct Expectation {
    SpaceIndex space;
    std::int64_t address;
    Region region;
    std::vector<ContentPiece> expected;
  };
  std::map<std::uint32_t, std::vector<Expectation>> expectations;
  std::vector<Expectation> pending_expectations;  // for the next kernel
  std::vector<ContentMismatch> mismatches;
  std::priority_queue<QueuedEvent, std::vector<QueuedEvent>, Later> queue;
  std::uint64_t seq = 0;
  std::int64_t now = 0;
  std::int64_t host_time = 0;
  std::vector<Marker> markers;
  std::vector<MemorySample> samples;
  CopyTotals totals;

  State(std::vector<DeviceSpec> specs, std::vector<ProgramLink> link_list, SimOptions opts,
        SimFaults planted)
      : options(opts),
        faults(planted),
        links(std::move(link_list)),
        pinned(pinned_capacity(specs), Bytes(kPinnedBase)),
        checker(planted.checker) {
    FERRY_CHECK(!specs.empty(), "a simulation needs at least one device");
    for (auto& spec : specs) {
      const Bytes memory = spec.profile.memory;
      devices.push_back(DeviceState{std::move(spec.name),
                                    std::move(spec.profile),
                                    CachingAllocator(memory, Bytes(kDeviceBase)),
                                    {},
                                    -1,
                                    -1,
                                    -1});
    }
    for (std::uint32_t d = 0; d < devices.size(); ++d) {
      DeviceState& dev = devices[d];
      dev.h2d = add_engine(dev.name + " H2D", d, CopyDirection::HostToDevice,
                           dev.profile.h2d.bidirectional_permille);
      dev.d2h = add_engine(dev.name + " D2H", d, CopyDirection::DeviceToHost,
                           dev.profile.d2h.bidirectional_permille);
      dev.d2d = add_engine(dev.name + " D2D", d, CopyDirection::DeviceToDevice, 1000);
      engines[static_cast<std::size_t>(dev.h2d)].partner = dev.d2h;
      engines[static_cast<std::size_t>(dev.d2h)].partner = dev.h2d;
    }
    content.resize(devices.size() + 1);
  }

  static Bytes pinned_capacity(const std::vector<DeviceSpec>& specs) {
    Bytes cap;
    for (const auto& s : specs) cap = std::max(cap, s.profile.pinned_host_capacity);
    return cap;
  }

  std::int32_t add_engine(std::string name, std::uint32_t device, CopyDirection direction,
                          std::int32_t permille) {
    CopyEngine e;
    e.permille = permille;
    e.direction = direction;
    engines.push_back(std::move(e));
    engine_info.push_back(EngineInfo{std::move(name), DeviceId(device)});
    return static_cast<std::int32_t>(engines.size() - 1);
  }

  [[nodiscard]] SpaceIndex host_space() const { return static_cast<SpaceIndex>(devices.size()); }
  [[nodiscard]] const LaunchOverheads& overheads(std::uint32_t device) const {
    return devices[device].profile.overheads;
  }

  std::uint32_t intern(std::string_view label) {
    if (label.empty()) return 0;
    auto it = label_index.find(label);
    if (it != label_index.end()) return it->second;
    const auto index = static_cast<std::uint32_t>(labels.size());
    labels.emplace_back(label);
    label_index.emplace(std::string(label), index);
    return index;
  }

  // --- the event queue ------------------------------------------------------------------

  void schedule(std::int64_t time, EventType type, std::uint32_t index, std::uint32_t gen) {
    queue.push(QueuedEvent{time, seq++, index, gen, type});
  }

  void process(const QueuedEvent& ev) {
    now = ev.time;
    if (ev.type == EventType::KernelDone) {
      const std::uint32_t op = ev.index;
      ComputeEngine& compute = devices[exec[op].device].compute;
      compute.busy = false;
      complete(op);
      start_compute(exec[op].device);
    } else {
      copy_phase_done(ev.index, ev.generation);
    }
  }

  void advance_to(std::int64_t t) {
    while (!queue.empty() && queue.top().time <= t) {
      const QueuedEvent ev = queue.top();
      queue.pop();
      process(ev);
    }
    now = std::max(now, t);
  }

  template <class Done>
  void run_until(Done done) {
    while (!done()) {
      FERRY_CHECK(!queue.empty(), "host waits for work that can never complete");
      const QueuedEvent ev = queue.top();
      queue.pop();
      process(ev);
    }
    host_time = std::max(host_time, now);
  }

  // Starts an API call: the host spends `overhead`, then the call takes effect.
  std::uint32_t begin_call(OpKind kind, std::int64_t overhead, std::string_view label) {
    host_time += overhead;
    advance_to(host_time);
    OpRecord rec;
    rec.kind = kind;
    rec.label = intern(label);
    rec.issued = rec.start = rec.end = SimTime(host_time);
    ops.push_back(rec);
    exec.emplace_back();
    return static_cast<std::uint32_t>(ops.size() - 1);
  }

  void end_host_call(std::uint32_t op) { ops[op].end = SimTime(host_time); }

  // --- streams ----------------------------------------------------------------------------

  void submit(std::uint32_t op) {
    StreamState& s = streams[ops[op].stream.value()];
    s.queue.push_back(op);
    ++s.submitted;
    if (!s.busy && s.queue.size() == 1) advance_stream(ops[op].stream.value());
  }

  void advance_stream(std::uint32_t sid) {
    StreamState& s = streams[sid];
    while (!s.busy && !s.queue.empty()) {
      const std::uint32_t op = s.queue.front();
      const Exec& e = exec[op];
      if (e.kind == ExecKind::Wait) {
        StreamState& target = streams[e.target_stream];
        if (!faults.timing_ignores_waits && target.completed < e.target_count) {
          target.waiters.emplace_back(e.target_count, sid);
          return;
        }
        s.queue.pop_front();
        ops[op].start = ops[op].end = SimTime(now);
        ++s.completed;
        notify_waiters(sid);
        continue;
      }
      s.queue.pop_front();
      s.busy = true;
      if (e.kind == ExecKind::Kernel) {
        devices[e.device].compute.ready.push_back(op);
        start_compute(e.device);
      } else {
        const auto engine = static_cast<std::uint32_t>(ops[op].engine);
        engines[engine].ready.push_back(op);
        start_copy(engine);
      }
    }
  }

  void notify_waiters(std::uint32_t sid) {
    StreamState& s = streams[sid];
    if (s.waiters.empty()) return;
    std::vector<std::uint32_t> woken;
    std::erase_if(s.waiters, [&](const std::pair<std::uint64_t, std::uint32_t>& w) {
      if (w.first > s.completed) return false;
      woken.push_back(w.second);
      return true;
    });
    for (const std::uint32_t w : woken) advance_stream(w);
  }

  void complete(std::uint32_t op) {
    OpRecord& rec = ops[op];
    rec.end = SimTime(now);
    const std::uint32_t sid = rec.stream.value();
    StreamState& s = streams[sid];
    s.busy = false;
    ++s.completed;
    if (options.track_content) apply_content(op);
    notify_waiters(sid);
    advance_stream(sid);
  }

  // --- engines ----------------------------------------------------------------------------

  void start_compute(std::uint32_t device) {
    ComputeEngine& c = devices[device].compute;
    if (c.busy || c.ready.empty()) return;
    const std::uint32_t op = c.ready.front();
    c.ready.pop_front();
    c.busy = true;
    ops[op].start = SimTime(now);
    if (!expectations.empty()) check_expectations(op);
    schedule(now + exec[op].duration, EventType::KernelDone, op, 0);
  }

  void start_copy(std::uint32_t index) {
    CopyEngine& e = engines[index];
    if (e.current != kNone || e.ready.empty()) return;
    e.current = e.ready.front();
    e.ready.pop_front();
    ops[e.current].start = SimTime(now);
    const std::int64_t latency = exec[e.current].latency;
    if (latency > 0) {
      e.phase = Phase::Latency;
      schedule(now + latency, EventType::CopyPhaseDone, index, ++e.generation);
    } else {
      begin_transfer(index);
    }
  }

  void set_rate(CopyEngine& e) {
    const std::int64_t base = exec[e.current].rate;
    const bool contended =
        e.partner >= 0 && engines[static_cast<std::size_t>(e.partner)].phase == Phase::Transfer;
    e.rate = contended ? std::max<std::int64_t>(
                             1, base / 1000 * e.permille + base % 1000 * e.permille / 1000)
                       : base;
  }

  void schedule_transfer_end(std::uint32_t index) {
    CopyEngine& e = engines[index];
    const Wide r = e.rate;
    const auto wait = static_cast<std::int64_t>((e.remaining + r - 1) / r);
    schedule(now + wait, EventType::CopyPhaseDone, index, ++e.generation);
  }

  void begin_transfer(std::uint32_t index) {
    CopyEngine& e = engines[index];
    e.phase = Phase::Transfer;
    e.remaining = static_cast<Wide>(ops[e.current].bytes.count()) * kNsPerSecond;
    e.since = now;
    set_rate(e);
    schedule_transfer_end(index);
    if (e.partner >= 0) partner_changed(static_cast<std::uint32_t>(e.partner));
  }

  // The opposite direction started or stopped moving data: settle progress, re-rate.
  void partner_changed(std::uint32_t index) {
    CopyEngine& e = engines[index];
    if (e.phase != Phase::Transfer) return;
    e.remaining -= static_cast<Wide>(now - e.since) * e.rate;
    if (e.remaining < 0) e.remaining = 0;
    e.since = now;
    set_rate(e);
    schedule_transfer_end(index);
  }

  void copy_phase_done(std::uint32_t index, std::uint32_t generation) {
    CopyEngine& e = engines[index];
    if (generation != e.generation) return;  // superseded by a re-rate
    if (e.phase == Phase::Latency) {
      begin_transfer(index);
      return;
    }
    const std::uint32_t op = e.current;
    e.phase = Phase::Idle;
    e.current = kNone;
    if (e.partner >= 0) partner_changed(static_cast<std::uint32_t>(e.partner));
    Bytes& total = ops[op].direction == CopyDirection::HostToDevice   ? totals.h2d
                   : ops[op].direction == CopyDirection::DeviceToHost ? totals.d2h
                   : ops[op].direction == CopyDirection::Peer         ? totals.peer
                                                                      : totals.d2d;
    total += ops[op].bytes;
    complete(op);
    start_copy(index);
  }

  std::int32_t peer_engine(std::uint32_t from, std::uint32_t to) {
    auto it = peer_engines.find({from, to});
    if (it != peer_engines.end()) return it->second;
    const std::int32_t index =
        add_engine(devices[from].name + "->" + devices[to].name, from, CopyDirection::Peer, 1000);
    peer_engines.emplace(std::make_pair(from, to), index);
    return index;
  }

  // --- memory, content and checking --------------------------------------------------------

  [[nodiscard]] SpaceIndex space_of(const BufferInfo& b) const {
    return b.kind == MemoryKind::Device ? static_cast<SpaceIndex>(b.device.value()) : host_space();
  }

  const BufferInfo& buffer(BufferId id) const {
    FERRY_CHECK(id.valid() && id.value() < buffers.size(), "unknown buffer id");
    return buffers[id.value()];
  }

  void check_region(const Region& r) const {
    const BufferInfo& b = buffer(r.buffer);
    FERRY_CHECK(r.offset.count() >= 0 && r.bytes.count() >= 0 &&
                    r.offset.count() + r.bytes.count() <= b.bytes.count(),
                "region [{}, +{}) exceeds the buffer's {} bytes", r.offset.count(), r.bytes.count(),
                b.bytes.count());
  }

  // Checks one access; false when the buffer is no longer live (reported as use after free).
  bool touch(std::uint32_t op, ThreadIndex thread, AccessOrigin origin, const Region& r,
             bool write) {
    check_region(r);
    const BufferInfo& b = buffer(r.buffer);
    if (!b.live) {
      checker.report(Hazard{HazardKind::UseAfterFree, Conflict::None, b.freed_by, OpId(op),
                            r.buffer, r.buffer, space_of(b), b.address + r.offset,
                            b.address + r.offset + r.bytes});
      return false;
    }
    if (options.check_hazards) {
      checker.access(thread, OpId(op), origin, r.buffer, space_of(b), b.address + r.offset,
                     b.address + r.offset + r.bytes, write);
    }
    return true;
  }

  void write_content(SpaceIndex space, std::int64_t lo, std::int64_t hi, std::uint64_t id,
                     std::int64_t base) {
    ContentMap& map = content[space];
    // Trim segments overlapping [lo, hi), keeping their outside parts.
    auto it = map.lower_bound(lo);
    if (it != map.begin()) {
      auto prev = std::prev(it);
      if (prev->second.hi > lo) {
        const ContentSeg old = prev->second;
        prev->second.hi = lo;
        if (old.hi > hi) {
          map.emplace(hi, ContentSeg{old.hi, old.id, old.base + (hi - prev->first)});
        }
      }
    }
    it = map.lower_bound(lo);
    while (it != map.end() && it->first < hi) {
      const ContentSeg old = it->second;
      const std::int64_t start = it->first;
      it = map.erase(it);
      if (old.hi > hi) {
        map.emplace(hi, ContentSeg{old.hi, old.id, old.base + (hi - start)});
        break;
      }
    }
    if (id != 0) map.emplace(lo, ContentSeg{hi, id, base});
  }

  [[nodiscard]] std::vector<ContentPiece> read_content(SpaceIndex space, std::int64_t lo,
                                                       std::int64_t hi) const {
    std::vector<ContentPiece> out;
    const ContentMap& map = content[space];
    auto it = map.upper_bound(lo);
    if (it != map.begin()) --it;
    std::int64_t pos = lo;
    for (; it != map.end() && it->first < hi; ++it) {
      const std::int64_t seg_lo = std::max(it->first, lo);
      const std::int64_t seg_hi = std::min(it->second.hi, hi);
      if (seg_lo >= seg_hi) continue;
      if (seg_lo > pos) out.push_back(ContentPiece{Bytes(pos - lo), Bytes(seg_lo - pos), 0, {}});
      out.push_back(ContentPiece{Bytes(seg_lo - lo), Bytes(seg_hi - seg_lo), it->second.id,
                                 Bytes(it->second.base + (seg_lo - it->first))});
      pos = seg_hi;
    }
    if (pos < hi) out.push_back(ContentPiece{Bytes(pos - lo), Bytes(hi - pos), 0, {}});
    return out;
  }

  void check_expectations(std::uint32_t op) {
    auto it = expectations.find(op);
    if (it == expectations.end()) return;
    for (Expectation& e : it->second) {
      auto actual = read_content(e.space, e.address, e.address + e.region.bytes.count());
      if (actual != e.expected) {
        mismatches.push_back(
            ContentMismatch{OpId(op), e.region, std::move(e.expected), std::move(actual)});
      }
    }
    expectations.erase(it);
  }

  void apply_content(std::uint32_t op) {
    const Exec& e = exec[op];
    if (e.kind == ExecKind::Copy) {
      const std::int64_t n = ops[op].bytes.count();
      if (n == 0) return;
      for (const ContentPiece& p : read_content(e.src_space, e.src_addr, e.src_addr + n)) {
        const std::int64_t lo = e.dst_addr + p.offset.count();
        write_content(e.dst_space, lo, lo + p.bytes.count(), p.id, p.base.count());
      }
    } else if (e.kind == ExecKind::Kernel) {
      for (std::uint32_t i = 0; i < e.write_count; ++i) {
        const WriteRange& w = write_ranges[e.first_write + i];
        write_content(w.space, w.lo, w.hi, w.content, 0);
      }
    }
  }

  void sample(DeviceId device) {
    if (device.valid()) {
      const AllocatorStats& st = devices[device.value()].allocator.stats();
      samples.push_back(MemorySample{SimTime(host_time), device, st.allocated, st.reserved});
    } else {
      const HostAllocatorStats& st = pinned.stats();
      samples.push_back(MemorySample{SimTime(host_time), device, st.allocated, st.reserved});
    }
  }

  // Waits for every stream of `device` (a device synchronize) and orders the host after it.
  void synchronize_device(std::uint32_t device) {
    for (StreamState& st : streams) {
      if (st.device.value() != device) continue;
      const std::uint64_t target = st.submitted;
      run_until([&] { return st.completed >= target; });
      if (options.check_hazards) checker.host_joins(st.thread);
    }
  }

  // Note [cudaFree synchronizes]
  // Returning a segment to the device (cudaFree, in empty_cache or in an out-of-memory retry)
  // synchronizes the whole device. Calls that may do so compare the allocator's segment-free
  // count before and after, and when it moved, the host waits for the device and is ordered
  // after all of its work, in time and in happens-before.
  void after_segment_frees(std::uint32_t op, std::uint32_t device, std::int64_t frees_before) {
    if (devices[device].allocator.stats().segment_frees == frees_before) return;
    synchronize_device(device);
    ops[op].device_synchronized = true;
  }

  // --- StreamMarkers: what the allocators use to defer frees --------------------------------

  MarkerId record(StreamId stream) override {
    const std::uint32_t snapshot =
        options.check_hazards ? checker.capture(streams[stream.value()].thread) : 0;
    markers.push_back(Marker{stream.value(), streams[stream.value()].submitted, snapshot});
    return MarkerId(static_cast<std::uint32_t>(markers.size() - 1));
  }

  bool query(MarkerId id) override {
    // A poll's answer depends on timing: it orders only the bytes' next owner (checker's
    // allocated()), not the host. See Note [Latent reuse].
    const Marker& m = markers[id.value()];
    return streams[m.stream].completed >= m.count;
  }

  void synchronize(MarkerId id) override {
    const Marker m = markers[id.value()];
    run_until([&] { return streams[m.stream].completed >= m.count; });
    if (options.check_hazards) checker.host_observes(m.snapshot);
  }
};

// --- Simulator ------------------------------------------------------------------------------

Simulator::Simulator(std::vector<DeviceSpec> devices, std::vector<ProgramLink> links,
                     SimOptions options, SimFaults faults)
    : state_(std::make_unique<State>(std::move(devices), std::move(links), options, faults)) {}
Simulator::~Simulator() = default;
Simulator::Simulator(Simulator&&) noexcept = default;
Simulator& Simulator::operator=(Simulator&&) noexcept = default;

StreamId Simulator::add_stream(DeviceId device, std::string name) {
  State& s = *state_;
  FERRY_CHECK(device.valid() && device.value() < s.devices.size(), "unknown device");
  StreamState st;
  st.name = std::move(name);
  st.device = device;
  st.thread = s.checker.add_thread();
  s.streams.push_back(std::move(st));
  return StreamId(static_cast<std::uint32_t>(s.streams.size() - 1));
}

void Simulator::reserve(std::size_t ops) {
  state_->ops.reserve(ops);
  state_->exec.reserve(ops);
}

EventId Simulator::add_event(std::string name) {
  State& s = *state_;
  s.events.push_back(EventState{std::move(name), false, kNone, 0, 0});
  return EventId(static_cast<std::uint32_t>(s.events.size() - 1));
}

Result<BufferId> Simulator::alloc(MemoryKind kind, DeviceId device, Bytes bytes, StreamId stream,
                                  PinnedPool pool, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(bytes.count() >= 0, "negative allocation size");
  const std::uint32_t overhead_device = device.valid() ? device.value() : 0;
  const std::uint32_t op =
      s.begin_call(OpKind::Alloc, s.overheads(overhead_device).malloc.ns(), label);
  s.ops[op].bytes = bytes;
  BufferInfo info;
  info.kind = kind;
  info.bytes = bytes;
  info.label = s.ops[op].label;
  info.live = true;
  info.allocated_by = OpId(op);
  BlockId block;
  HostBlockId host_block;
  if (kind == MemoryKind::Device) {
    FERRY_CHECK(device.valid() && device.value() < s.devices.size(), "unknown device");
    FERRY_CHECK(stream.valid() && stream.value() < s.streams.size() &&
                    s.streams[stream.value()].device == device,
                "a device allocation needs a stream of its device");
    s.ops[op].stream = stream;
    info.device = device;
    const std::int64_t frees = s.devices[device.value()].allocator.stats().segment_frees;
    auto got = s.devices[device.value()].allocator.malloc(stream, bytes, s);
    s.after_segment_frees(op, device.value(), frees);
    s.end_host_call(op);
    if (!got) return got.error();
    info.address = got.value().address;
    block = got.value().block;
  } else if (kind == MemoryKind::Pinned) {
    auto got = s.pinned.malloc(bytes, pool, s);
    s.end_host_call(op);
    if (!got) return got.error();
    info.address = got.value().address;
    host_block = got.value().block;
  } else {
    info.address = Bytes(s.pageable_next);
    s.pageable_next += (std::max<std::int64_t>(bytes.count(), 1) + 511) / 512 * 512;
  }
  const BufferId id(static_cast<std::uint32_t>(s.buffers.size()));
  s.ops[op].buffer = id;
  s.buffers.push_back(info);
  s.device_blocks.push_back(block);
  s.host_blocks.push_back(host_block);
  // Checker: bytes a deferred free returned are ordered after its markers (Note [Latent reuse]).
  if (s.options.check_hazards && kind != MemoryKind::Pageable) {
    s.checker.allocated(id, s.space_of(info), info.address, info.address + bytes);
  }
  if (kind != MemoryKind::Pageable) s.sample(info.device);
  return id;
}

void Simulator::free(BufferId buffer, std::string_view label) {
  State& s = *state_;
  const BufferInfo& b = s.buffer(buffer);
  const std::uint32_t device = b.kind == MemoryKind::Device ? b.device.value() : 0;
  const std::uint32_t op = s.begin_call(OpKind::Free, s.overheads(device).free.ns(), label);
  s.ops[op].buffer = buffer;
  BufferInfo& info = s.buffers[buffer.value()];
  if (!info.live) {
    s.checker.report(Hazard{HazardKind::DoubleFree, Conflict::None, info.freed_by, OpId(op), buffer,
                            buffer, s.space_of(info), info.address, info.address + info.bytes});
    return;
  }
  info.live = false;
  info.freed_by = OpId(op);
  // Checker: judge the free for latent reuse before the allocator forgets the block's
  // record_stream streams (Note [Latent reuse]).
  if (s.options.check_hazards && info.kind != MemoryKind::Pageable) {
    const bool on_device = info.kind == MemoryKind::Device;
    const std::span<const StreamId> deferring =
        on_device ? s.devices[device].allocator.deferring_streams(s.device_blocks[buffer.value()])
                  : s.pinned.deferring_streams(s.host_blocks[buffer.value()]);
    std::vector<ThreadIndex> deferred;
    for (const StreamId d : deferring) deferred.push_back(s.streams[d.value()].thread);
    const ThreadIndex alloc_thread =
        on_device ? s.streams[s.ops[info.allocated_by.value()].stream.value()].thread : 0;
    s.checker.release(OpId(op), buffer, s.space_of(info), info.address, info.address + info.bytes,
                      std::span<const ThreadIndex>(&alloc_thread, on_device ? 1 : 0), deferred);
  }
  if (info.kind == MemoryKind::Device) {
    s.devices[device].allocator.free(s.device_blocks[buffer.value()], s);
    s.sample(info.device);
  } else if (info.kind == MemoryKind::Pinned) {
    s.pinned.free(s.host_blocks[buffer.value()], s);
    s.sample(DeviceId());
  }
  s.end_host_call(op);
}

void Simulator::record_stream(BufferId buffer, StreamId stream, std::string_view label) {
  State& s = *state_;
  const std::uint32_t op = s.begin_call(OpKind::RecordStream, 0, label);
  s.ops[op].buffer = buffer;
  s.ops[op].stream = stream;
  const BufferInfo& b = s.buffer(buffer);
  if (!b.live) {
    s.checker.report(Hazard{HazardKind::UseAfterFree, Conflict::None, b.freed_by, OpId(op), buffer,
                            buffer, s.space_of(b), b.address, b.address + b.bytes});
    return;
  }
  if (b.kind == MemoryKind::Device) {
    s.devices[b.device.value()].allocator.record_stream(s.device_blocks[buffer.value()], stream);
  } else if (b.kind == MemoryKind::Pinned) {
    s.pinned.record_stream(s.host_blocks[buffer.value()], stream);
  }
}

OpId Simulator::kernel(StreamId stream, SimTime duration, std::span<const Region> reads,
                       std::span<const Region> writes, std::string_view label,
                       std::span<const std::uint64_t> values) {
  State& s = *state_;
  FERRY_CHECK(stream.valid() && stream.value() < s.streams.size(), "unknown stream");
  FERRY_CHECK(duration.ns() >= 0, "negative kernel duration");
  const std::uint32_t device = s.streams[stream.value()].device.value();
  const std::uint32_t op = s.begin_call(OpKind::Kernel, s.overheads(device).kernel.ns(), label);
  OpRecord& rec = s.ops[op];
  rec.stream = stream;
  Exec& e = s.exec[op];
  e.kind = ExecKind::Kernel;
  e.duration = duration.ns();
  e.device = device;
  const ThreadIndex thread = s.streams[stream.value()].thread;
  if (s.options.check_hazards) s.checker.begin_op(thread);
  for (const Region& r : reads) s.touch(op, thread, AccessOrigin::Kernel, r, false);
  e.first_write = static_cast<std::uint32_t>(s.write_ranges.size());
  FERRY_CHECK(writes.size() < 256, "a kernel writes at most 255 ranges");
  FERRY_CHECK(values.empty() || values.size() == writes.size(), "{} content values for {} writes",
              values.size(), writes.size());
  for (std::uint32_t i = 0; i < writes.size(); ++i) {
    const Region& r = writes[i];
    if (!s.touch(op, thread, AccessOrigin::Kernel, r, true)) continue;
    const BufferInfo& b = s.buffer(r.buffer);
    const std::int64_t lo = (b.address + r.offset).count();
    s.write_ranges.push_back(WriteRange{s.space_of(b), lo, lo + r.bytes.count(),
                                        values.empty() ? written_content(OpId(op), i) : values[i]});
  }
  e.write_count = static_cast<std::uint32_t>(s.write_ranges.size()) - e.first_write;
  if (!s.pending_expectations.empty()) {
    s.expectations.emplace(op, std::move(s.pending_expectations));
    s.pending_expectations.clear();
  }
  s.submit(op);
  return OpId(op);
}

OpId Simulator::copy(StreamId stream, Region src, Region dst, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(stream.valid() && stream.value() < s.streams.size(), "unknown stream");
  FERRY_CHECK(src.bytes == dst.bytes, "copy of {} bytes into {} bytes", src.bytes.count(),
              dst.bytes.count());
  s.check_region(src);
  s.check_region(dst);
  const BufferInfo& from = s.buffer(src.buffer);
  const BufferInfo& to = s.buffer(dst.buffer);
  const bool from_device = from.kind == MemoryKind::Device;
  const bool to_device = to.kind == MemoryKind::Device;
  FERRY_CHECK(from_device || to_device, "a copy needs at least one device buffer");
  const std::uint32_t device = s.streams[stream.value()].device.value();
  const std::uint32_t op = s.begin_call(OpKind::Copy, s.overheads(device).copy.ns(), label);
  OpRecord& rec = s.ops[op];
  rec.stream = stream;
  rec.bytes = src.bytes;
  Exec& e = s.exec[op];
  e.kind = ExecKind::Copy;
  const bool pageable = from.kind == MemoryKind::Pageable || to.kind == MemoryKind::Pageable;
  if (from_device && to_device) {
    const DeviceState& dev = s.devices[from.device.value()];
    if (from.device == to.device) {
      rec.direction = CopyDirection::DeviceToDevice;
      rec.engine = dev.d2d;
      e.rate = dev.profile.d2d.bandwidth.bytes_per_s();
      e.latency = dev.profile.d2d.latency.ns();
    } else {
      rec.direction = CopyDirection::Peer;
      rec.engine = s.peer_engine(from.device.value(), to.device.value());
      e.rate = dev.profile.peer.bandwidth.bytes_per_s();
      e.latency = dev.profile.peer.latency.ns();
      for (const ProgramLink& l : s.links) {
        if (l.from == from.device && l.to == to.device) {
          e.rate = l.bandwidth.bytes_per_s();
          e.latency = l.latency.ns();
        }
      }
    }
  } else if (to_device) {
    const DeviceProfile& p = s.devices[to.device.value()].profile;
    rec.direction = CopyDirection::HostToDevice;
    rec.engine = s.devices[to.device.value()].h2d;
    e.rate = pageable ? p.pageable_h2d.bytes_per_s() : p.h2d.bandwidth.bytes_per_s();
    e.latency = p.h2d.latency.ns();
  } else {
    const DeviceProfile& p = s.devices[from.device.value()].profile;
    rec.direction = CopyDirection::DeviceToHost;
    rec.engine = s.devices[from.device.value()].d2h;
    e.rate = pageable ? p.pageable_d2h.bytes_per_s() : p.d2h.bandwidth.bytes_per_s();
    e.latency = p.d2h.latency.ns();
  }
  FERRY_CHECK(e.rate > 0, "copy path with zero bandwidth");
  const ThreadIndex thread = s.streams[stream.value()].thread;
  if (s.options.check_hazards) s.checker.begin_op(thread);
  const bool src_ok = s.touch(op, thread, AccessOrigin::Copy, src, false);
  const bool dst_ok = s.touch(op, thread, AccessOrigin::Copy, dst, true);
  if (src_ok && dst_ok) {
    e.src_space = s.space_of(from);
    e.dst_space = s.space_of(to);
    e.src_addr = (from.address + src.offset).count();
    e.dst_addr = (to.address + dst.offset).count();
  } else {
    rec.bytes = Bytes(0);  // nothing sensible moves through freed memory
  }
  s.submit(op);
  if (pageable) {
    // A pageable copy returns to the host only once it has completed.
    StreamState& st = s.streams[stream.value()];
    const std::uint64_t target = st.submitted;
    s.run_until([&] { return st.completed >= target; });
    if (s.options.check_hazards) s.checker.host_joins(thread);
  }
  return OpId(op);
}

void Simulator::record(EventId event, StreamId stream, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(event.valid() && event.value() < s.events.size(), "unknown event");
  FERRY_CHECK(stream.valid() && stream.value() < s.streams.size(), "unknown stream");
  const std::uint32_t device = s.streams[stream.value()].device.value();
  const std::uint32_t op =
      s.begin_call(OpKind::Record, s.overheads(device).event_record.ns(), label);
  s.ops[op].stream = stream;
  EventState& ev = s.events[event.value()];
  ev.recorded = true;
  ev.stream = stream.value();
  ev.count = s.streams[stream.value()].submitted;
  if (s.options.check_hazards) ev.snapshot = s.checker.capture(s.streams[stream.value()].thread);
}

void Simulator::wait(StreamId stream, EventId event, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(event.valid() && event.value() < s.events.size(), "unknown event");
  FERRY_CHECK(stream.valid() && stream.value() < s.streams.size(), "unknown stream");
  const std::uint32_t device = s.streams[stream.value()].device.value();
  const std::uint32_t op = s.begin_call(OpKind::Wait, s.overheads(device).stream_wait.ns(), label);
  s.ops[op].stream = stream;
  const EventState& ev = s.events[event.value()];
  if (!ev.recorded) return;  // CUDA: waiting on a never-recorded event does nothing
  Exec& e = s.exec[op];
  e.kind = ExecKind::Wait;
  e.target_stream = ev.stream;
  e.target_count = ev.count;
  if (s.options.check_hazards) s.checker.wait(s.streams[stream.value()].thread, ev.snapshot);
  s.submit(op);
}

void Simulator::sync_stream(StreamId stream, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(stream.valid() && stream.value() < s.streams.size(), "unknown stream");
  const std::uint32_t device = s.streams[stream.value()].device.value();
  const std::uint32_t op =
      s.begin_call(OpKind::SyncStream, s.overheads(device).synchronize.ns(), label);
  s.ops[op].stream = stream;
  StreamState& st = s.streams[stream.value()];
  const std::uint64_t target = st.submitted;
  s.run_until([&] { return st.completed >= target; });
  if (s.options.check_hazards) s.checker.host_joins(st.thread);
  s.end_host_call(op);
}

void Simulator::sync_event(EventId event, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(event.valid() && event.value() < s.events.size(), "unknown event");
  const std::uint32_t op = s.begin_call(OpKind::SyncEvent, s.overheads(0).synchronize.ns(), label);
  const EventState ev = s.events[event.value()];
  if (ev.recorded) {
    s.run_until([&] { return s.streams[ev.stream].completed >= ev.count; });
    if (s.options.check_hazards) s.checker.host_observes(ev.snapshot);
  }
  s.end_host_call(op);
}

void Simulator::sync_device(DeviceId device, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(device.valid() && device.value() < s.devices.size(), "unknown device");
  const std::uint32_t op =
      s.begin_call(OpKind::SyncDevice, s.overheads(device.value()).synchronize.ns(), label);
  s.synchronize_device(device.value());
  s.end_host_call(op);
}

bool Simulator::query(EventId event, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(event.valid() && event.value() < s.events.size(), "unknown event");
  s.begin_call(OpKind::Query, s.overheads(0).event_query.ns(), label);
  const EventState& ev = s.events[event.value()];
  if (!ev.recorded) return true;
  if (s.streams[ev.stream].completed < ev.count) return false;
  if (s.options.check_hazards) s.checker.host_observes(ev.snapshot);
  return true;
}

void Simulator::host_read(std::span<const Region> regions, std::string_view label) {
  State& s = *state_;
  const std::uint32_t op = s.begin_call(OpKind::HostRead, s.overheads(0).host_access.ns(), label);
  if (s.options.check_hazards) s.checker.begin_op(kHostThread);
  for (const Region& r : regions) {
    FERRY_CHECK(s.buffer(r.buffer).kind != MemoryKind::Device,
                "the host cannot read device memory directly");
    s.touch(op, kHostThread, AccessOrigin::Host, r, false);
  }
}

void Simulator::host_write(std::span<const Region> regions, std::string_view label) {
  State& s = *state_;
  const std::uint32_t op = s.begin_call(OpKind::HostWrite, s.overheads(0).host_access.ns(), label);
  if (s.options.check_hazards) s.checker.begin_op(kHostThread);
  FERRY_CHECK(regions.size() < 256, "a host write covers at most 255 ranges");
  for (std::uint32_t i = 0; i < regions.size(); ++i) {
    const Region& r = regions[i];
    const BufferInfo& b = s.buffer(r.buffer);
    FERRY_CHECK(b.kind != MemoryKind::Device, "the host cannot write device memory directly");
    if (!s.touch(op, kHostThread, AccessOrigin::Host, r, true)) continue;
    if (s.options.track_content) {
      const std::int64_t lo = (b.address + r.offset).count();
      s.write_content(s.host_space(), lo, lo + r.bytes.count(), written_content(OpId(op), i), 0);
    }
  }
}

void Simulator::empty_cache(DeviceId device, std::string_view label) {
  State& s = *state_;
  FERRY_CHECK(device.valid() && device.value() < s.devices.size(), "unknown device");
  const std::uint32_t op =
      s.begin_call(OpKind::EmptyCache, s.overheads(device.value()).free.ns(), label);
  const std::int64_t frees = s.devices[device.value()].allocator.stats().segment_frees;
  s.devices[device.value()].allocator.empty_cache(s);
  s.after_segment_frees(op, device.value(), frees);
  s.sample(device);
  s.end_host_call(op);
}

void Simulator::expect_content_at_next_kernel(Region region, std::vector<ContentPiece> expected) {
  State& s = *state_;
  if (!s.options.track_content) return;
  s.check_region(region);
  const BufferInfo& b = s.buffer(region.buffer);
  s.pending_expectations.push_back(State::Expectation{
      s.space_of(b), (b.address + region.offset).count(), region, std::move(expected)});
}

OpId Simulator::report_misuse(HazardKind kind, OpKind op_kind, std::string_view label) {
  State& s = *state_;
  const std::uint32_t op = s.begin_call(op_kind, 0, label);
  s.checker.report(Hazard{kind, Conflict::None, OpId(), OpId(op), BufferId(), BufferId(), 0,
                          Bytes(0), Bytes(0)});
  return OpId(op);
}

void Simulator::finish() {
  State& s = *state_;
  while (!s.queue.empty()) {
    const QueuedEvent ev = s.queue.top();
    s.queue.pop();
    s.process(ev);
  }
}

SimTime Simulator::host_time() const { return SimTime(state_->host_time); }

SimTime Simulator::makespan() const {
  std::int64_t end = state_->host_time;
  for (const OpRecord& r : state_->ops) end = std::max(end, r.end.ns());
  return SimTime(end);
}

const std::vector<Hazard>& Simulator::hazards() const { return state_->checker.hazards(); }
const std::vector<ContentMismatch>& Simulator::content_mismatches() const {
  return state_->mismatches;
}
const std::vector<OpRecord>& Simulator::ops() const { return state_->ops; }
const std::vector<BufferInfo>& Simulator::buffers() const { return state_->buffers; }
const std::vector<EngineInfo>& Simulator::engines() const { return state_->engine_info; }
const std::vector<MemorySample>& Simulator::memory_samples() const { return state_->samples; }
std::string_view Simulator::label(std::uint32_t index) const { return state_->labels.at(index); }
std::size_t Simulator::device_count() const { return state_->devices.size(); }
const std::string& Simulator::device_name(DeviceId device) const {
  return state_->devices.at(device.value()).name;
}
const DeviceProfile& Simulator::device_profile(DeviceId device) const {
  return state_->devices.at(device.value()).profile;
}
std::size_t Simulator::stream_count() const { return state_->streams.size(); }
std::size_t Simulator::event_count() const { return state_->events.size(); }
const std::string& Simulator::stream_name(StreamId stream) const {
  return state_->streams.at(stream.value()).name;
}
DeviceId Simulator::stream_device(StreamId stream) const {
  return state_->streams.at(stream.value()).device;
}
const CachingAllocator& Simulator::device_allocator(DeviceId device) const {
  return state_->devices.at(device.value()).allocator;
}
const PinnedHostAllocator& Simulator::pinned_allocator() const { return state_->pinned; }
CopyTotals Simulator::copied() const { return state_->totals; }

std::vector<ContentPiece> Simulator::content(Region region) const {
  const State& s = *state_;
  s.check_region(region);
  const BufferInfo& b = s.buffer(region.buffer);
  const std::int64_t lo = (b.address + region.offset).count();
  return s.read_content(s.space_of(b), lo, lo + region.bytes.count());
}

SpaceIndex Simulator::space_of(BufferId buffer) const {
  return state_->space_of(state_->buffer(buffer));
}

}  // namespace ferry::sim
