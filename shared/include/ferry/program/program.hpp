#pragma once
/// A stream program (`ferry.program/1`): devices, streams, buffers, events and a host-ordered
/// list of operations. The in-memory form of the format in docs/program-format.md: the real
/// backend records it, the simulator reads and runs it (`ferry check`).

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/program/device_profile.hpp"
#include "ferry/units.hpp"

namespace ferry {

/// Index of a buffer declared by a program. A slot names a tensor; each `alloc` gives it new
/// memory.
using SlotId = StrongId<struct SlotTag>;

enum class MemoryKind : std::uint8_t {
  Device,    ///< device memory from the caching allocator
  Pinned,    ///< page-locked host memory
  Pageable,  ///< ordinary host memory: copies from/to it block the host
};

/// Which pinned-host allocator a pinned buffer comes from.
enum class PinnedPool : std::uint8_t {
  Caching,  ///< PyTorch's CachingHostAllocator: round up to a power of two, cache by size
  Exact,    ///< ferry's pool: exactly the requested size, cached and reused for that size
};

struct ProgramDevice {
  std::string name;
  DeviceProfile profile;
  /// Set when the file names a bundled profile instead of giving it inline; written back as
  /// the name.
  std::string profile_name{};
};

struct ProgramStream {
  std::string name;
  DeviceId device;
};

struct ProgramBuffer {
  std::string name;
  MemoryKind kind = MemoryKind::Device;
  DeviceId device;  ///< Device kind only
  Bytes bytes;
  PinnedPool pool = PinnedPool::Caching;  ///< Pinned kind only
};

struct ProgramEvent {
  std::string name;
};

/// A directed device-to-device link overriding the profiles' default peer path.
struct ProgramLink {
  DeviceId from;
  DeviceId to;
  Bandwidth bandwidth;
  SimTime latency;
};

/// A byte range of a buffer slot, resolved: offset + bytes <= the slot's size.
struct SlotRange {
  SlotId slot;
  Bytes offset;
  Bytes bytes;
};

enum class OpKind : std::uint8_t {
  Alloc,         ///< slot gets memory; device buffers on `stream`
  Free,          ///< slot's memory goes back to its allocator
  RecordStream,  ///< slot's memory is also used on `stream`
  Kernel,        ///< `duration` on the compute engine, reading and writing ranges
  Copy,          ///< `src` -> `dst` on `stream` (direction from the memory kinds)
  Record,        ///< `event` captures the work submitted to `stream`
  Wait,          ///< `stream` waits for `event` (no-op if never recorded)
  SyncStream,    ///< host waits for `stream`
  SyncEvent,     ///< host waits for `event`
  SyncDevice,    ///< host waits for every stream of `device`
  Query,         ///< host asks whether `event` completed
  HostRead,      ///< host reads `reads`
  HostWrite,     ///< host writes `writes`
  EmptyCache,    ///< device's caching allocator releases cached segments
};

/// One host API call. Fields not used by the kind keep their default (invalid) values.
struct ProgramOp {
  OpKind kind = OpKind::Kernel;
  std::string label;  ///< optional name shown in reports and traces
  StreamId stream;
  EventId event;
  SlotId slot;
  DeviceId device;
  SimTime duration;
  std::vector<SlotRange> reads;
  std::vector<SlotRange> writes;
  SlotRange src;
  SlotRange dst;
};

struct Program {
  std::string description;  ///< optional, one line for humans
  std::vector<ProgramDevice> devices;
  std::vector<ProgramLink> links;
  std::vector<ProgramStream> streams;
  std::vector<ProgramBuffer> buffers;
  std::vector<ProgramEvent> events;
  std::vector<ProgramOp> ops;
};

/// Stable lower-case name of an op kind, as used in the JSON format ("record_stream").
[[nodiscard]] const char* op_kind_name(OpKind kind);
/// Stable lower-case name of a memory kind ("device", "pinned", "pageable").
[[nodiscard]] const char* memory_kind_name(MemoryKind kind);

}  // namespace ferry
