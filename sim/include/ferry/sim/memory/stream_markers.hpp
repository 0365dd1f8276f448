#pragma once
/// The device services an allocator needs to defer frees behind streams' outstanding work.

#include <algorithm>
#include <cstdint>
#include <optional>
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
  /// A count that stays the same only while no query's answer can change (no captured work
  /// completed), or none when the device does not keep one.
  [[nodiscard]] virtual std::optional<std::uint64_t> completions() const { return std::nullopt; }
};

/// The blocks an allocator has freed behind markers (Note [record_stream deferral]), by address
/// in order of free: the device and the pinned host allocator models keep theirs here. Each
/// block's markers live in the allocator's block, which stays where it is while its free is
/// deferred (the allocators keep blocks in node-based maps and merge free blocks only), so
/// the list is reached without a lookup; `release(address)` hands the block back to its pool.
class DeferredFrees {
 public:
  /// A deferred block: its address and its markers.
  struct Deferred {
    Bytes address;
    std::vector<MarkerId>* markers;
  };

  /// Defers the block at `address`: a marker on each of `streams` (in their order, so that the
  /// device sees the same calls on every run) goes into `block_markers`, which must stay where
  /// it is until the block is released.
  template <class Streams>
  void defer(Bytes address, const Streams& streams, std::vector<MarkerId>& block_markers,
             StreamMarkers& markers) {
    for (const StreamId used : streams) block_markers.push_back(markers.record(used));
    pending_.push_back(Deferred{address, &block_markers});
  }

  [[nodiscard]] const std::vector<Deferred>& pending() const { return pending_; }

  /// Drops the markers that answer "done" (each is observed once, as PyTorch drops a completed
  /// event) and releases the blocks left with none; the others stay, in order. The blocks a
  /// call found waiting are not asked again until some work completed (`completions`): the
  /// answers would be the same.
  template <class Release>
  void process(StreamMarkers& markers, Release&& release) {
    const std::optional<std::uint64_t> completions = markers.completions();
    const std::size_t from = completions && completions == asked_at_ ? asked_ : 0;
    asked_at_ = completions;
    std::size_t kept = from;
    for (std::size_t i = from; i < pending_.size(); ++i) {
      const Deferred d = pending_[i];
      std::erase_if(*d.markers, [&markers](MarkerId m) { return markers.query(m); });
      if (d.markers->empty()) {
        release(d.address);
      } else {
        pending_[kept++] = d;
      }
    }
    pending_.resize(kept);
    asked_ = kept;
  }

  /// Blocks the host on every outstanding marker and releases every block.
  template <class Release>
  void synchronize(StreamMarkers& markers, Release&& release) {
    for (const Deferred& d : pending_) {
      for (const MarkerId m : *d.markers) markers.synchronize(m);
      release(d.address);
    }
    pending_.clear();
    asked_ = 0;
  }

 private:
  std::vector<Deferred> pending_;
  std::size_t asked_ = 0;  // the first blocks of pending_, which waited at completions asked_at_
  std::optional<std::uint64_t> asked_at_;
};

}  // namespace ferry::sim
