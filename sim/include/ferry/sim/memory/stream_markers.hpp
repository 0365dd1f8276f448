#pragma once
/// The device services an allocator needs to defer frees behind streams' outstanding work.

#include <algorithm>
#include <utility>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/units.hpp"

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

/// The blocks an allocator has freed behind markers (Note [record_stream deferral]), by address
/// in order of free: the device and the pinned host allocator models keep theirs here. Each
/// block's markers live in the allocator's block; `markers_of(address)` returns that list and
/// `release(address)` hands the block back to its pool.
class DeferredFrees {
 public:
  /// Defers the block at `address`: a marker on each of `streams` (in their order, so that the
  /// device sees the same calls on every run) goes into `block_markers`.
  template <class Streams>
  void defer(Bytes address, const Streams& streams, std::vector<MarkerId>& block_markers,
             StreamMarkers& markers) {
    for (const StreamId used : streams) block_markers.push_back(markers.record(used));
    pending_.push_back(address);
  }

  [[nodiscard]] const std::vector<Bytes>& addresses() const { return pending_; }

  /// Drops the markers that answer "done" (each is observed once, as PyTorch drops a completed
  /// event) and releases the blocks left with none; the others stay, in order.
  template <class MarkersOf, class Release>
  void process(StreamMarkers& markers, MarkersOf&& markers_of, Release&& release) {
    if (pending_.empty()) return;
    std::vector<Bytes> still_pending;
    for (const Bytes address : pending_) {
      std::vector<MarkerId>& outstanding = markers_of(address);
      std::erase_if(outstanding, [&markers](MarkerId m) { return markers.query(m); });
      if (outstanding.empty()) {
        release(address);
      } else {
        still_pending.push_back(address);
      }
    }
    pending_ = std::move(still_pending);
  }

  /// Blocks the host on every outstanding marker and releases every block.
  template <class MarkersOf, class Release>
  void synchronize(StreamMarkers& markers, MarkersOf&& markers_of, Release&& release) {
    for (const Bytes address : pending_) {
      for (const MarkerId m : markers_of(address)) markers.synchronize(m);
      release(address);
    }
    pending_.clear();
  }

 private:
  std::vector<Bytes> pending_;
};

}  // namespace ferry::sim
