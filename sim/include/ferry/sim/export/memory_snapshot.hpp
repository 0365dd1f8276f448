#pragma once
/// The device memory of a simulation as a PyTorch memory snapshot: the pickle that
/// torch.cuda.memory._dump_snapshot writes, which pytorch.org/memory_viz and
/// torch.cuda._memory_viz open. See docs/memory-snapshot.md.

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/sim/memory/allocator_event.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// What a device's caching allocator did during a run and how it stands at the end.
struct AllocatorHistory {
  DeviceId device;                              ///< the device whose allocator this is
  std::span<const AllocatorEvent> events;       ///< in the order taken; the simulator owns them
  std::vector<SegmentInfo> segments;            ///< at the end of the run, by address
  std::map<Bytes, BufferId> block_buffers;      ///< allocated or pending block -> its buffer
  std::map<Bytes, OpId> segment_ops;            ///< segment (or mapped range) -> the call that
                                                ///< obtained it
  AllocatorMode mode = AllocatorMode::Default;  ///< how the allocator obtained memory
};

/// The allocator history of every device of the finished run `sim`, in device order: the
/// actions the run kept (SimOptions::record_allocator, Note [Allocator tracking]) and the
/// segment and block table at its end. The error says the run kept none.
[[nodiscard]] Result<std::vector<AllocatorHistory>> allocator_history(const Simulator& sim);

/// The PyTorch memory snapshot pickle of the finished run `sim`: the segments at the end of
/// the run and every allocator action as the device trace, with frames naming ferry's calls.
/// The error is allocator_history's.
[[nodiscard]] Result<std::string> memory_snapshot(const Simulator& sim);

}  // namespace ferry::sim
