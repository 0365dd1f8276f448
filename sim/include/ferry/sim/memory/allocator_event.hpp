#pragma once
/// The actions of a device's caching allocator as it takes them, and the tracker that hears
/// them (c10's trace tracker: CUDACachingAllocator's TraceEntry and attachAllocatorTraceTracker).

#include <cstdint>

#include "ferry/ids.hpp"
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
    SegmentMap,     ///< pages mapped at the end of an expandable segment's mapped range
    SegmentUnmap,   ///< pages of an expandable segment unmapped
  };
  Action action = Action::Alloc;
  Bytes address;    ///< of the block or segment; for Oom, the device bytes not reserved
  Bytes size;       ///< block size (rounded, as allocated bytes count it), segment size, or
                    ///< for Oom the rounded size that did not fit
  StreamId stream;  ///< allocation stream of the block or segment (Oom: of the request)
  SimTime time;     ///< simulated host time of the action (set by the simulator)
  OpId op;          ///< the API call during which it happened (set by the simulator)
  BufferId buffer;  ///< block actions: the allocation the block holds; otherwise invalid
};

// Note [Allocator tracking]
// A caching allocator with a tracker reports each action to it the moment it takes it, in
// the allocator's own order: the deferred frees a malloc completes, the segments an
// out-of-memory retry or empty_cache returns, the segment a malloc obtains, then the block it
// hands out (or the failure). The allocator knows neither time nor calls; it fills the
// action, address, size, stream and the buffer its caller named at malloc, and the simulator
// stamps the time and the call before it hands the event to its observers
// (SimObserver::allocator_action). Without a tracker the allocator pays one pointer test per
// action and keeps nothing.

/// Hears a caching allocator's actions. See Note [Allocator tracking].
class AllocatorTracker {
 public:
  AllocatorTracker() = default;
  AllocatorTracker(const AllocatorTracker&) = default;
  AllocatorTracker& operator=(const AllocatorTracker&) = default;
  AllocatorTracker(AllocatorTracker&&) = default;
  AllocatorTracker& operator=(AllocatorTracker&&) = default;
  virtual ~AllocatorTracker() = default;

  /// The allocator took `event` just now.
  virtual void allocator_action(const AllocatorEvent& event) = 0;
};

}  // namespace ferry::sim
