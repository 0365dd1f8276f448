#pragma once
/// The simulator's machine, assembled from its parts: the event queue, the stream scheduler,
/// the compute and copy engines (resource models), the content shadow, memory sampling and the
/// hazard checker. Private to the engine; the public face is ferry/sim/engine/simulator.hpp.

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/sim/engine/compute_engines.hpp"
#include "ferry/sim/engine/content_shadow.hpp"
#include "ferry/sim/engine/copy_engines.hpp"
#include "ferry/sim/engine/event_queue.hpp"
#include "ferry/sim/engine/memory_sampling.hpp"
#include "ferry/sim/engine/observer.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/sim/engine/stream_scheduler.hpp"
#include "ferry/sim/support/small_vector.hpp"

namespace ferry::sim {

namespace engine_detail {

/// The calls' labels, in call order; index 0 is the empty label. Labels are mostly distinct (the
/// names of tensors and buffers), so each is copied once to the end of one buffer and neither
/// hashed nor looked up: a call costs one append, and the table a few allocations in all.
class LabelTable {
 public:
  std::uint32_t intern(std::string_view label) { return label.empty() ? 0 : append(label); }
  [[nodiscard]] std::string_view operator[](std::uint32_t index) const {
    const std::size_t begin = index == 0 ? 0 : ends_.at(index - 1);
    return std::string_view(text_).substr(begin, ends_.at(index) - begin);
  }

 private:
  std::uint32_t append(std::string_view label) {
    text_.append(label);
    ends_.push_back(text_.size());
    return static_cast<std::uint32_t>(ends_.size() - 1);
  }

  std::string text_;                  ///< every label, end to end
  std::vector<std::size_t> ends_{0};  ///< where label i ends in text_ (label 0 is empty)
};

// Note [Recycled records]
// A simulation appends a record per call (OpRecord, Exec, write ranges, buffers): a pipeline
// step of a large model makes half a million, and a planner runs thousands of simulations on
// short-lived worker threads. Fresh vectors map, fault in and unmap their pages again for every
// simulation, a fifth of a pipeline plan's time. The process keeps the record vectors of the
// last few finished simulations, emptied but with their capacity, for the next ones to start:
// at most kKeptRecords vectors of a type, kKeptRecordBytes of capacity in all.
inline constexpr std::size_t kKeptRecords = 4;
inline constexpr std::size_t kKeptRecordBytes = std::size_t{128} << 20U;

template <class T>
struct RecordPool {
  std::mutex mutex;
  std::vector<std::vector<T>> kept;
  std::size_t bytes = 0;  // the kept vectors' capacity
};

template <class T>
RecordPool<T>& record_pool() {
  // Never destroyed: a simulation that ends during static destruction still finds it.
  static auto* const pool = new RecordPool<T>();
  return *pool;
}

/// A kept vector, emptied, or a new one.
template <class T>
std::vector<T> take_records() {
  RecordPool<T>& pool = record_pool<T>();
  std::vector<T> taken;
  const std::scoped_lock lock(pool.mutex);
  if (pool.kept.empty()) return taken;
  taken.swap(pool.kept.back());
  pool.kept.pop_back();
  pool.bytes -= taken.capacity() * sizeof(T);
  return taken;
}

/// Keeps `records`' capacity for a later simulation when the pool has room for it.
template <class T>
void recycle_records(std::vector<T>& records) {
  const std::size_t bytes = records.capacity() * sizeof(T);
  if (bytes == 0) return;
  records.clear();
  RecordPool<T>& pool = record_pool<T>();
  const std::scoped_lock lock(pool.mutex);
  if (pool.kept.size() == kKeptRecords || pool.bytes + bytes > kKeptRecordBytes) return;
  pool.bytes += bytes;
  pool.kept.push_back(std::move(records));
}

enum class ExecKind : std::uint8_t { None, Kernel, Collective, Copy };

/// How a submitted kernel or copy executes and what it does to shadow content when it
/// completes: copies move src -> dst; kernels write fresh values into
/// write_ranges[first_write, first_write + write_count). Kept beside OpRecord, same index.
struct Exec {
  ExecKind kind = ExecKind::None;
  std::uint8_t lane = 0;  ///< Collective: its CollectiveLane
  std::uint32_t first_write = 0;
  std::uint32_t write_count = 0;
  SpaceIndex src_space = 0;
  SpaceIndex dst_space = 0;
  SimTime duration;  ///< Kernel, Collective
  Bandwidth rate;    ///< Copy, uncontended
  SimTime latency;   ///< Copy
  Bytes src_addr;
  Bytes dst_addr;
};

/// A kernel's write: bytes [lo, hi) of `space` receive value `content`.
struct WriteRange {
  SpaceIndex space = 0;
  Bytes lo;
  Bytes hi;
  std::uint64_t content = 0;
};

struct DeviceState {
  std::string name;
  DeviceProfile profile;
  CachingAllocator allocator;
  EngineId h2d{};
  EngineId d2h{};
  EngineId d2d{};
};

struct EventState {
  std::optional<StreamPosition> recorded{};  ///< what the last record captured
  std::uint32_t snapshot = 0;                ///< the checker's clock at that record
};

/// A position the allocators captured to defer a free (Note [record_stream deferral]).
struct Marker {
  StreamPosition position;
  std::uint32_t snapshot = 0;
};

/// Checked when a kernel starts: `region` (at `address` of `space`) must hold `expected`.
struct Expectation {
  SpaceIndex space = 0;
  Bytes address;
  Region region;
  SmallVector<ContentPiece, 1> expected;
};

}  // namespace engine_detail

struct Simulator::State final : StreamMarkers {
  using DeviceState = engine_detail::DeviceState;
  using EventState = engine_detail::EventState;
  using Exec = engine_detail::Exec;
  using Expectation = engine_detail::Expectation;

  State(std::vector<DeviceSpec> specs, std::vector<ProgramLink> link_list, SimOptions opts,
        SimFaults planted);
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  State(State&&) = delete;
  State& operator=(State&&) = delete;
  ~State() override;

  SimOptions options;
  SimFaults faults;
  std::vector<DeviceState> devices;
  // The program's links by (from, to) device; of two for one pair, the later given.
  std::map<std::pair<DeviceId, DeviceId>, ProgramLink> links;
  std::vector<EventState> events;
  std::vector<BufferInfo> buffers;
  std::vector<BlockId> device_blocks;  // per buffer, Device kind
  // Per buffer, Pinned kind: its block, and the pool of the process that allocated it.
  struct HostBlock {
    HostBlockId block;
    std::uint32_t pool = 0;
  };
  std::vector<HostBlock> host_blocks;
  std::vector<ThreadIndex> free_threads;  // scratch of free(): reused, never reallocated per call
  std::vector<OpRecord> ops;
  std::vector<Exec> exec;
  std::vector<engine_detail::WriteRange> write_ranges;
  engine_detail::LabelTable labels;
  // One pool, or one per process (SimOptions::process_per_device; Note [Processes]): the
  // first process's, then the others' (none without processes).
  PinnedHostAllocator pinned;
  std::vector<PinnedHostAllocator> other_pinned;
  std::vector<ThreadIndex> hosts;  // each process's host thread in the checker
  std::uint32_t caller = 0;        // the process making calls now
  Bytes pageable_next;
  HazardChecker checker;
  DeviceEventQueue queue;
  StreamScheduler streams;
  ComputeEngines compute;
  ComputeEngines collectives;  // Note [Collectives]
  CopyEngines copies;
  std::vector<ContentShadow> content;                     // per memory space; the host is the last
  std::map<OpId, std::vector<Expectation>> expectations;  // kernel -> checked at its start
  std::vector<Expectation> pending_expectations;          // for the next kernel
  std::vector<ContentMismatch> mismatches;
  SimTime now;
  SimTime host_time;
  SimTime latest_end;  // the latest end of a stream op; host calls end by host_time
  std::vector<engine_detail::Marker> markers;
  MemorySampling memory;
  ObserverList observers;

  /// Stamps one device allocator's actions with the host time and the current call and hands
  /// them to the observers (Note [Allocator tracking]).
  class AllocatorForwarder final : public AllocatorTracker {
   public:
    AllocatorForwarder(const State& state, DeviceId device) : state_(&state), device_(device) {}
    void allocator_action(const AllocatorEvent& event) override;

   private:
    const State* state_;
    DeviceId device_;
  };
  std::vector<std::unique_ptr<AllocatorForwarder>> allocator_trackers;  // by device, once observed
  std::unique_ptr<AllocatorLog> allocator_log;  // with SimOptions::record_allocator

  /// Attaches `observer` (Simulator::observe), the allocators' trackers with the first.
  void attach(SimObserver& observer);
  CopyTotals totals;

  // Look-ups that check their argument, once each.
  DeviceState& device(DeviceId id) {
    FERRY_CHECK(id.valid() && id.value() < devices.size(), "unknown device");
    return devices[id.value()];
  }
  EventState& event(EventId id) {
    FERRY_CHECK(id.valid() && id.value() < events.size(), "unknown event");
    return events[id.value()];
  }
  [[nodiscard]] const BufferInfo& buffer(BufferId id) const {
    FERRY_CHECK(id.valid() && id.value() < buffers.size(), "unknown buffer id");
    return buffers[id.value()];
  }
  void check_region(const Region& r) const;
  [[nodiscard]] ThreadIndex host_thread() const { return hosts[caller]; }
  [[nodiscard]] PinnedHostAllocator& pinned_of(std::uint32_t process) {
    return process == 0 ? pinned : other_pinned[process - 1];
  }
  [[nodiscard]] PinnedHostAllocator& pinned_pool(BufferId buffer) {
    return pinned_of(host_blocks[buffer.value()].pool);
  }
  [[nodiscard]] SpaceIndex host_space() const { return static_cast<SpaceIndex>(devices.size()); }
  [[nodiscard]] SpaceIndex space_of(const BufferInfo& b) const {
    return b.kind == MemoryKind::Device ? static_cast<SpaceIndex>(b.device.value()) : host_space();
  }
  [[nodiscard]] const LaunchOverheads& overheads(DeviceId device) const {
    return devices[device.value()].profile.overheads;
  }

  // The host side of API calls (simulator_state.cpp).
  OpId begin_call(OpKind kind, SimTime overhead, std::string_view label);
  void end_host_call(OpId op);
  template <class Done>
  void run_until(Done done) {
    while (!done()) {
      FERRY_CHECK(!queue.empty(), "host waits for work that can never complete");
      process(queue.pop());
    }
    host_time = std::max(host_time, now);
  }
  void wait_for(StreamPosition position) {
    run_until([&] { return streams.reached(position); });
  }
  void synchronize_device(DeviceId device);
  void after_segment_frees(OpId op, DeviceId device, std::int64_t frees_before);
  void sample(DeviceId device);

  // The device side: events, streams and engines.
  void advance_to(SimTime t);
  void process(const DeviceEventQueue::Entry& ev);
  void submit(OpId op, std::optional<StreamPosition> until = std::nullopt);
  void start_op(OpId op, bool wait_done);
  void start_kernel(ComputeEngines& engines, DeviceId device, std::uint8_t lane);
  // The compute engine's rate as the device's running collectives leave it (Note [Contended
  // compute] in simulator_state.cpp).
  void contend(DeviceId device);
  // Simulator::kernel and Simulator::collective: one call, on the engine `kind` and `lane` name.
  OpId launch(engine_detail::ExecKind kind, StreamId stream, SimTime duration,
              std::span<const Region> reads, std::span<const Region> writes, std::string_view label,
              std::span<const std::uint64_t> values, std::uint8_t lane = 0);
  void start_copy(EngineId engine);
  void complete(OpId op);
  EngineId copy_engine(OpRecord& rec, Exec& e, const BufferInfo& from, const BufferInfo& to);

  // Accesses, checking and content.
  bool touch(OpId op, ThreadIndex thread, AccessOrigin origin, const Region& r, bool write);
  void check_expectations(OpId op);
  void apply_content(OpId op);

  // StreamMarkers: what the allocators use to defer frees.
  MarkerId record(StreamId stream) override;
  bool query(MarkerId id) override;
  [[nodiscard]] std::optional<std::uint64_t> completions() const override {
    return streams.completions();
  }
  void synchronize(MarkerId id) override;
};

// Inline: every API call goes through these.

// Starts an API call: the host spends `overhead`, then the call takes effect.
inline OpId Simulator::State::begin_call(OpKind kind, SimTime overhead, std::string_view label) {
  host_time += overhead;
  advance_to(host_time);
  OpRecord rec;
  rec.kind = kind;
  rec.label = options.timeline ? labels.intern(label) : 0;
  rec.issued = rec.start = rec.end = host_time;
  ops.push_back(rec);
  exec.emplace_back();
  return OpId(static_cast<std::uint32_t>(ops.size() - 1));
}

// Ends a call that submitted no stream work: the host goes on now. See Note [Observers].
inline void Simulator::State::end_host_call(OpId op) {
  OpRecord& rec = ops[op.value()];
  rec.end = host_time;
  if (!observers.empty()) observers.op_finished(op, rec);
}

inline void Simulator::State::advance_to(SimTime t) {
  while (queue.due(t)) process(queue.pop());
  now = std::max(now, t);
}

inline void Simulator::State::check_region(const Region& r) const {
  const BufferInfo& b = buffer(r.buffer);
  FERRY_CHECK(r.offset.count() >= 0 && r.bytes.count() >= 0 &&
                  r.offset.count() + r.bytes.count() <= b.bytes.count(),
              "region [{}, +{}) exceeds the buffer's {} bytes", r.offset.count(), r.bytes.count(),
              b.bytes.count());
}

// Checks one access; false when the buffer is no longer live (reported as use after free).
inline bool Simulator::State::touch(OpId op, ThreadIndex thread, AccessOrigin origin,
                                    const Region& r, bool write) {
  check_region(r);
  const BufferInfo& b = buffer(r.buffer);
  if (!b.live) {
    checker.report(Hazard{HazardKind::UseAfterFree, Conflict::None, b.freed_by, op, r.buffer,
                          r.buffer, space_of(b), b.address + r.offset,
                          b.address + r.offset + r.bytes});
    return false;
  }
  if (options.check_hazards) {
    checker.access(thread, op, origin, r.buffer, space_of(b), b.address + r.offset,
                   b.address + r.offset + r.bytes, write);
  }
  return true;
}

inline void Simulator::State::submit(OpId op, std::optional<StreamPosition> until) {
  streams.submit(ops[op.value()].stream, op, until,
                 [this](OpId started, bool wait_done) { start_op(started, wait_done); });
}

}  // namespace ferry::sim
