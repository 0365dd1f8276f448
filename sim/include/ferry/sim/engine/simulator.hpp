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
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/engine/program.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/sim/memory/host_allocator.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// A byte range of a live allocation.
struct Region {
  BufferId buffer;
  Bytes offset;
  Bytes bytes;
};

enum class CopyDirection : std::uint8_t { HostToDevice, DeviceToHost, DeviceToDevice, Peer };

/// What the simulator does, beyond timing.
struct SimOptions {
  bool check_hazards = true;  ///< run the happens-before checker on every access
  bool track_content = true;  ///< keep shadow content ids per byte range
};

/// Test-only switches that break the simulator on purpose (planted faults), passed apart from
/// the options.
struct SimFaults {
  CheckerFaults checker;
  bool timing_ignores_waits = false;  ///< streams start work without honouring event waits
};

/// One API call as the simulator saw it; stream work also has its execution interval.
struct OpRecord {
  OpKind kind = OpKind::Kernel;
  StreamId stream;           ///< stream ops, record, record_stream, alloc (device)
  std::uint32_t label = 0;   ///< index into labels(); 0 is the empty label
  std::int32_t engine = -1;  ///< copy engine index, for copies
  CopyDirection direction = CopyDirection::HostToDevice;
  SimTime issued;   ///< host time at which the call took effect
  SimTime start;    ///< stream ops: start on the engine; host ops: issued
  SimTime end;      ///< stream ops: completion; host ops: when the host went on
  Bytes bytes;      ///< copies and allocations
  BufferId buffer;  ///< alloc, free, record_stream
  /// The call returned device memory segments (cudaFree), which synchronizes the device:
  /// the host went on only after all of that device's work (alloc, empty_cache).
  bool device_synchronized = false;
};

/// A piece of shadow content: bytes [offset, offset+bytes) of a region hold bytes
/// [base, base+bytes) of the value identified by `id` (0: never written).
struct ContentPiece {
  Bytes offset;
  Bytes bytes;
  std::uint64_t id = 0;
  Bytes base;
  friend bool operator==(const ContentPiece&, const ContentPiece&) = default;
};

/// The content id the `index`-th write range of op `op` gives its bytes (kernels and host
/// writes): predictable at issue time, so callers can state what a later read must see.
[[nodiscard]] constexpr std::uint64_t written_content(OpId op, std::uint32_t index) {
  return (static_cast<std::uint64_t>(op.value()) << 8) + index + 1;
}

/// Combines content ids into a new one (never 0): the value an op computes from its inputs.
[[nodiscard]] constexpr std::uint64_t mix_content(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a * 0x9e3779b97f4a7c15ULL + b + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30U)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27U)) * 0x94d049bb133111ebULL;
  z ^= z >> 31U;
  return z == 0 ? 1 : z;
}

/// A kernel that, when it started, read bytes other than the ones expected.
struct ContentMismatch {
  OpId kernel;
  Region region;
  std::vector<ContentPiece> expected;
  std::vector<ContentPiece> actual;
};

/// Memory in use at one moment, for traces. `device` invalid means pinned host memory.
struct MemorySample {
  SimTime time;
  DeviceId device;
  Bytes allocated;
  Bytes reserved;
};

/// A copy engine (or peer link) and what it is called in reports.
struct EngineInfo {
  std::string name;  ///< e.g. "gpu0 H2D", "gpu0->gpu1"
  DeviceId device;
};

/// An allocation as the simulator tracks it.
struct BufferInfo {
  MemoryKind kind = MemoryKind::Device;
  DeviceId device;
  Bytes address;
  Bytes bytes;
  std::uint32_t label = 0;
  bool live = false;
  OpId allocated_by;
  OpId freed_by;
};

/// Bytes moved, per copy direction.
struct CopyTotals {
  Bytes h2d;
  Bytes d2h;
  Bytes d2d;
  Bytes peer;
};

struct DeviceSpec {
  std::string name;
  DeviceProfile profile;
};

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
  EventId add_event(std::string name);

  /// Reserves room for `ops` API calls (avoids regrowth on long programs).
  void reserve(std::size_t ops);

  // Host API calls, in host order.
  /// Allocates from the device's caching allocator (on `stream`), the pinned allocator
  /// (`pool`) or pageable memory. The error is the allocator's out-of-memory report.
  Result<BufferId> alloc(MemoryKind kind, DeviceId device, Bytes bytes, StreamId stream,
                         PinnedPool pool, std::string_view label);
  void free(BufferId buffer, std::string_view label = {});
  void record_stream(BufferId buffer, StreamId stream, std::string_view label = {});
  /// `values`, when given (one per write, non-zero), are the content ids the writes produce,
  /// so that recomputing a tensor yields the same content as computing it the first time;
  /// otherwise each write gets written_content(op, index).
  OpId kernel(StreamId stream, SimTime duration, std::span<const Region> reads,
              std::span<const Region> writes, std::string_view label = {},
              std::span<const std::uint64_t> values = {});
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
  void expect_content_at_next_kernel(Region region, std::vector<ContentPiece> expected);
  /// Records a misuse found above the simulator (e.g. a program naming an empty slot).
  OpId report_misuse(HazardKind kind, OpKind op_kind, std::string_view label);

  /// Runs all submitted work to completion.
  void finish();

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
  [[nodiscard]] std::size_t event_count() const;
  [[nodiscard]] const std::string& stream_name(StreamId stream) const;
  [[nodiscard]] DeviceId stream_device(StreamId stream) const;
  [[nodiscard]] const CachingAllocator& device_allocator(DeviceId device) const;
  [[nodiscard]] const PinnedHostAllocator& pinned_allocator() const;
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
