#pragma once
/// The device services an allocator needs to defer frees behind streams' outstanding work.

#include "ferry/ids.hpp"

namespace ferry::sim {

/// A captured point in a stream: all work submitted to it before the capture (an event).
using MarkerId = StrongId<struct MarkerTag>;

// Note [record_stream deferral]
// A block whose storage was used on streams other than its allocation stream (record_stream)
// cannot go back to its pool when the host frees it: those streams may still be reading it.
// The allocator records a marker on each such stream at free time and hands the block back
// only once every marker has completed, which it learns by querying at the next malloc (or,
// under memory pressure and in empty_cache, by synchronizing). Whether a query answers "done"
// depends on timing, so the hazard checker does not order the host after a queried marker;
// it orders only the buffer that later gets the returned bytes after the markers, and a
// blocking synchronize orders the host. See Note [Latent reuse] in the hazard checker.

/// Implemented by the simulated device; called by the allocators.
class StreamMarkers {
 public:
  virtual ~StreamMarkers() = default;
  /// Captures all work submitted to `stream` so far.
  virtual MarkerId record(StreamId stream) = 0;
  /// True when the captured work has completed at the current host time.
  virtual bool query(MarkerId marker) = 0;
  /// Blocks the host until the captured work has completed.
  virtual void synchronize(MarkerId marker) = 0;
};

}  // namespace ferry::sim
