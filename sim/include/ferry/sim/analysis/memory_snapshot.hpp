#pragma once
/// The device memory of a simulation as a PyTorch memory snapshot: the pickle that
/// torch.cuda.memory._dump_snapshot writes, which pytorch.org/memory_viz and
/// torch.cuda._memory_viz open. See docs/memory-snapshot.md.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// One action of a device's caching allocator, named as PyTorch's memory history names it.
struct AllocatorEvent {
  enum class Action : std::uint8_t {
    Alloc,          ///< a block handed out
    FreeRequested,  ///< the host freed the block
    FreeCompleted,  ///< the block went back to its pool (later than the request under
                    ///< record_stream, see Note [record_stream deferral])
    SegmentAlloc,   ///< a segment obtained from the device (cudaMalloc)
    SegmentFree,    ///< a segment returned to the device (cudaFree)
    Oom,            ///< an allocation that failed
  };
  Action action = Action::Alloc;
  Bytes address;    ///< of the block or segment; for Oom, the device bytes not reserved
  Bytes size;       ///< block size (rounded, as allocated bytes count it), segment size, or
                    ///< for Oom the rounded size that did not fit
  StreamId stream;  ///< allocation stream of the block or segment (Oom: of the request)
  SimTime time;     ///< simulated host time of the action
  OpId op;          ///< the API call during which it happened
  BufferId buffer;  ///< block actions: the allocation the block holds; otherwise invalid
};

/// What a device's caching allocator did during a run and how it stands at the end.
struct AllocatorHistory {
  DeviceId device;                          ///< the device whose allocator this is
  std::vector<AllocatorEvent> events;       ///< in the order the allocator took them
  std::vector<SegmentInfo> segments;        ///< at the end of the run, by address
  std::map<Bytes, BufferId> block_buffers;  ///< allocated or pending block -> its buffer
  std::map<Bytes, OpId> segment_ops;        ///< segment -> the call that obtained it
};

// Note [Allocator replay]
// The simulator's allocators keep no history, and the engine's hot paths stay free of any
// hook for one. The history is rebuilt after the run instead: a fresh CachingAllocator of the
// same capacity is fed the run's device alloc, free, record_stream and empty_cache calls in
// op order. The only input the allocator takes from the device is whether a deferred free's
// markers have completed (Note [record_stream deferral]); the replay answers that from the op
// records: a marker on a stream completes when the last work submitted to that stream before
// the free completed, and a query at a call's issue time sees every completion at or before
// it, as the simulator's does. Every replayed allocation must land at the address the run gave
// it and the final counters and segments must equal the run's; anything else is a broken
// invariant, never a silently different picture.

/// Replays the allocator of every device of the finished run `sim`; one history per device,
/// in device order. See Note [Allocator replay]. The error names a call the op log does not
/// describe fully enough (empty_cache on a machine of several devices).
[[nodiscard]] Result<std::vector<AllocatorHistory>> allocator_history(const Simulator& sim);

/// The PyTorch memory snapshot pickle of the finished run `sim`: the segments at the end of
/// the run and every allocator action as the device trace, with frames naming ferry's calls.
/// The error is allocator_history's.
[[nodiscard]] Result<std::string> memory_snapshot(const Simulator& sim);

}  // namespace ferry::sim
