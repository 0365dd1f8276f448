#pragma once
/// What the simulator reports: op records, buffers, engines, memory samples, content mismatches.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/content_shadow.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/engine/program.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// A copy engine (or peer link) of the simulated machine.
using EngineId = StrongId<struct EngineTag>;

/// A byte range of a live allocation.
struct Region {
  BufferId buffer;
  Bytes offset;
  Bytes bytes;
};

enum class CopyDirection : std::uint8_t { HostToDevice, DeviceToHost, DeviceToDevice, Peer };

/// Which of a device's collective engines runs a collective: one per process group, as NCCL
/// runs each communicator's kernels on a stream of its own (Note [Collectives] in simulator.cpp).
/// `Fsdp` is the data-parallel groups' (FSDP2's shard and HSDP's replica group).
enum class CollectiveLane : std::uint8_t { Fsdp, Tensor, Context, Expert };
inline constexpr std::size_t kCollectiveLanes = 4;

/// One API call as the simulator saw it; stream work also has its execution interval.
struct OpRecord {
  OpKind kind = OpKind::Kernel;
  CopyDirection direction = CopyDirection::HostToDevice;
  /// The call returned device memory segments (cudaFree), which synchronizes the device:
  /// the host went on only after all of that device's work (alloc, empty_cache).
  bool device_synchronized = false;
  /// A kernel that ran on the device's collective engine (Simulator::collective), not on its
  /// compute engine.
  bool collective = false;
  StreamId stream;          ///< stream ops, record, record_stream, alloc (device)
  std::uint32_t label = 0;  ///< index into labels(); 0 is the empty label
  EngineId engine;          ///< the copy engine, for copies
  BufferId buffer;          ///< alloc, free, record_stream
  SimTime issued;           ///< host time at which the call took effect
  SimTime start;            ///< stream ops: start on the engine; host ops: issued
  SimTime end;              ///< stream ops: completion; host ops: when the host went on
  Bytes bytes;              ///< copies and allocations
};

/// The content id the `index`-th write range of op `op` gives its bytes (kernels and host
/// writes): predictable at issue time, so callers can state what a later read must see. Distinct
/// for every (op, index) with index below 2^32 - 1, and never 0.
[[nodiscard]] constexpr std::uint64_t written_content(OpId op, std::uint32_t index) {
  return (static_cast<std::uint64_t>(op.value()) << 32U) + index + 1;
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
  std::uint32_t label = 0;  ///< index into labels(): the buffer's name in reports
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

/// A simulated device: its name and profile.
struct DeviceSpec {
  std::string name;
  DeviceProfile profile;
};

}  // namespace ferry::sim
