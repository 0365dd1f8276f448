#pragma once
/// The simulated machine: devices with streams, compute and copy engines, events, caching
/// allocators, pinned and pageable host memory, and a host thread issuing API calls.
///
/// Every call is made by the host at the current host time; it costs the profile's launch
/// overhead, and stream work it submits runs later on the device, in stream order, when its
/// engine is free. Calls that block the host (synchronize, pageable copies) run the
/// discrete-event engine forward until the condition holds. See Note [Simulated time].

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/check/hazard_checker.hpp"
#include "ferry/sim/engine/allocator_log.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/engine/observer.hpp"
#include "ferry/sim/engine/program.hpp"
#include "ferry/sim/engine/records.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/sim/memory/host_allocator.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// What the simulator does, beyond timing.
struct SimOptions {
  bool check_hazards = true;  ///< run the happens-before checker on every access
  bool track_content = true;  ///< keep shadow content ids per byte range
  /// Keep every caching allocator action (Simulator::allocator_log), for memory snapshots.
  bool record_allocator = false;
  /// Each device is driven by a process of its own, as the ranks of FSDP are: set_host names
  /// the process making the calls that follow; each has its own host thread in the checker and
  /// its own pinned pool, its device's pinned capacity (Note [Processes] in simulator.cpp).
  bool process_per_device = false;
  /// How every device's caching allocator obtains memory (Note [Expandable segments]).
  AllocatorMode allocator = AllocatorMode::Default;
  /// Keep each call's label and the memory timeline (memory_samples), which reports, traces
  /// and snapshots read. Off, every label reads empty and the memory is sampled only while an
  /// observer is attached: a run read only for its step times, its allocators' peaks and its
  /// ops (the planner's unchecked runs) makes neither.
  bool timeline = true;
};

/// Test-only switches that break the simulator on purpose (planted faults), passed apart from
/// the options.
struct SimFaults {
  CheckerFaults checker;
  bool timing_ignores_waits = false;  ///< streams start work without honouring event waits
  /// With process_per_device, every process's pinned pool starts at the same address: one
  /// host buffer written by two ranks' offloads.
  bool shared_pinned_pool = false;
};

/// The simulated machine; see the top of this header.
class Simulator {
 public:
  Simulator(std::vector<DeviceSpec> devices, std::vector<ProgramLink> links,
            SimOptions options = {}, SimFaults faults = {});
  ~Simulator();
  Simulator(Simulator&&) noexcept;
  Simulator& operator=(Simulator&&) noexcept;
  Simulator(const Simulator&) = delete;
  Simulator& operator=(const Simulator&) = delete;

  // Set-up (free of simulated cost).
  StreamId add_stream(DeviceId device, std::string name);
  EventId add_event();

  /// Reserves room for `calls` API calls and `buffers` allocations (avoids regrowth on long
  /// programs; more are taken as before).
  void reserve(std::size_t calls, std::size_t buffers = 0);
  /// Attaches `observer` (not owned; it must outlive the run) and announces the engines that
  /// exist so far. See Note [Observers].
  void observe(SimObserver& observer);

  /// With SimOptions::process_per_device: the calls that follow come from `device`'s process.
  void set_host(DeviceId device);

  // Host API calls, in host order.
  /// Allocates from the device's caching allocator (on `stream`), the pinned allocator
  /// (`pool`) or pageable memory. `label` is the call's label; `name`, the buffer's name in
  /// reports, is the label when empty. The error is the allocator's out-of-memory report.
  Result<BufferId> alloc(MemoryKind kind, DeviceId device, Bytes bytes, StreamId stream,
                         PinnedPool pool, std::string_view label, std::string_view name = {});
  void free(BufferId buffer, std::string_view label = {});
  void record_stream(BufferId buffer, StreamId stream, std::string_view label = {});
  /// `values`, when given (one per write, non-zero), are the content ids the writes produce,
  /// so that recomputing a tensor yields the same content as computing it the first time;
  /// otherwise each write gets written_content(op, index).
  OpId kernel(StreamId stream, SimTime duration, std::span<const Region> reads,
              std::span<const Region> writes, std::string_view label = {},
              std::span<const std::uint64_t> values = {});
  /// A collective (all-gather, reduce-scatter, all-reduce) on `stream`: a kernel to the stream
  /// order and the checker, run by the device's collective engine `lane` beside its compute
  /// kernels (Note [Collectives] in simulator.cpp); `duration` comes from the caller's link
  /// model.
  OpId collective(StreamId stream, SimTime duration, std::span<const Region> reads,
                  std::span<const Region> writes, std::string_view label = {},
                  std::span<const std::uint64_t> values = {},
                  CollectiveLane lane = CollectiveLane::Fsdp);
  OpId copy(StreamId stream, Region src, Region dst, std::string_view label = {});
  void record(EventId event, StreamId stream, std::string_view label = {});
  void wait(StreamId stream, EventId event, std::string_view label = {});
  void sync_stream(StreamId stream, std::string_view label = {});
  void sync_event(EventId event, std::string_view label = {});
  void sync_device(DeviceId device, std::string_view label = {});
  bool query(EventId event, std::string_view label = {});
  void host_read(std::span<const Region> regions, std::string_view label = {});
  void host_write(std::span<const Region> regions, std::string_view label = {});
  void empty_cache(DeviceId device, std::string_view label = {});
  /// When the next kernel issued starts on the device, `region` must hold exactly `expected`;
  /// otherwise a ContentMismatch is recorded. A no-op without track_content.
  void expect_content_at_next_kernel(Region region, std::span<const ContentPiece> expected);
  /// Records a misuse found above the simulator (e.g. a program naming an empty slot).
  OpId report_misuse(HazardKind kind, OpKind op_kind, std::string_view label);

  /// Runs all submitted work to completion.
  void finish();
  /// Feeds what has happened so far to `observer`, as if it had been attached from the start:
  /// the engines, each op's record in op order, the memory samples.
  void replay(SimObserver& observer) const;

  // Results and names.
  [[nodiscard]] SimTime host_time() const;
  [[nodiscard]] SimTime makespan() const;
  [[nodiscard]] const std::vector<Hazard>& hazards() const;
  [[nodiscard]] const std::vector<ContentMismatch>& content_mismatches() const;
  [[nodiscard]] const std::vector<OpRecord>& ops() const;
  [[nodiscard]] const std::vector<BufferInfo>& buffers() const;
  [[nodiscard]] const std::vector<EngineInfo>& engines() const;
  [[nodiscard]] const std::vector<MemorySample>& memory_samples() const;
  [[nodiscard]] std::string_view label(std::uint32_t index) const;
  [[nodiscard]] std::size_t device_count() const;
  [[nodiscard]] const std::string& device_name(DeviceId device) const;
  [[nodiscard]] const DeviceProfile& device_profile(DeviceId device) const;
  [[nodiscard]] std::size_t stream_count() const;
  [[nodiscard]] const std::string& stream_name(StreamId stream) const;
  [[nodiscard]] DeviceId stream_device(StreamId stream) const;
  [[nodiscard]] const CachingAllocator& device_allocator(DeviceId device) const;
  [[nodiscard]] const PinnedHostAllocator& pinned_allocator() const;
  /// The pinned pool of `device`'s process (the one pool without process_per_device).
  [[nodiscard]] const PinnedHostAllocator& pinned_allocator(DeviceId device) const;
  /// Every device allocator action of the run; null unless SimOptions::record_allocator.
  [[nodiscard]] const AllocatorLog* allocator_log() const;
  [[nodiscard]] CopyTotals copied() const;
  /// Shadow content of a region, in offset order, as it stands now in simulated time.
  [[nodiscard]] std::vector<ContentPiece> content(Region region) const;
  /// The memory space (device index, or device_count() for the host) of a buffer.
  [[nodiscard]] SpaceIndex space_of(BufferId buffer) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ferry::sim
