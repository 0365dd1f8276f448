#pragma once
/// Page-locked (pinned) host memory: a model of PyTorch's caching host allocator (sizes rounded
/// up to a power of two) and ferry's exact-size pool, under one host-memory cap.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/program/program.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/sim/memory/stream_markers.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// How a pinned request is sized.
using ferry::PinnedPool;

/// Identifies one pinned block until it is freed.
using HostBlockId = StrongId<struct HostBlockTag>;

/// What malloc hands out.
struct HostAllocation {
  HostBlockId block;
  Bytes address;
  Bytes size;  ///< bytes reserved for the block (power of two, or exact)
};

/// A pinned block as seen from outside, for reports and tests.
struct HostBlockInfo {
  enum class State : std::uint8_t { Allocated, PendingFree, Free };
  Bytes address;
  Bytes size;
  Bytes requested;  ///< size the caller asked for (0 when Free)
  State state = State::Free;
};

/// Counters of the pinned allocator. Pending frees count as allocated.
struct HostAllocatorStats {
  Bytes allocated;  ///< bytes in blocks handed out (their reserved sizes)
  Bytes reserved;   ///< bytes pinned (cudaHostAlloc'ed), free or not
  Bytes allocated_peak;
  Bytes reserved_peak;
  std::int64_t host_allocs = 0;     ///< cudaHostAlloc calls
  std::int64_t host_frees = 0;      ///< cudaFreeHost calls
  std::int64_t cap_refusals = 0;    ///< requests refused because of the cap
  std::int64_t deferred_frees = 0;  ///< frees delayed by record_stream
};

/// Pinned host memory with a cap. Freed blocks are reused only after the streams recorded on
/// them finished their work at free time. See Note [record_stream deferral].
class PinnedHostAllocator {
 public:
  /// `capacity`: most bytes that may be pinned at once; `base`: address of the first byte.
  PinnedHostAllocator(Bytes capacity, Bytes base);
  /// As above, with test-only faults planted.
  PinnedHostAllocator(Bytes capacity, Bytes base, AllocatorFaults faults);

  /// Reuses a cached free block of the pool's size or pins a new one. Over the cap, first
  /// releases cached free blocks; if still over, returns an error naming the cap and the request.
  Result<HostAllocation> malloc(Bytes requested, PinnedPool pool, StreamMarkers& markers);
  /// The block was used by work on `stream` (PyTorch's record_event on a pinned tensor).
  void record_stream(HostBlockId block, StreamId stream);
  /// Caches the block for reuse, or defers that behind markers on the recorded streams.
  void free(HostBlockId block, StreamMarkers& markers);
  /// The streams a free of the (allocated) block will wait for, sorted; none when frees ignore
  /// record_stream.
  [[nodiscard]] std::span<const StreamId> deferring_streams(HostBlockId block) const;
  /// Waits for pending frees, then unpins every cached free block.
  void empty_cache(StreamMarkers& markers);

  /// Current counters; pending frees count as allocated.
  [[nodiscard]] const HostAllocatorStats& stats() const { return stats_; }
  [[nodiscard]] std::vector<HostBlockInfo> blocks() const;  ///< all blocks, address order
  /// Most bytes that may be pinned at once.
  [[nodiscard]] Bytes capacity() const { return capacity_; }
  /// Address of the first byte blocks may occupy.
  [[nodiscard]] Bytes base() const { return base_; }

 private:
  /// One pinned allocation (blocks are never split or merged).
  struct Block {
    Bytes size;
    Bytes requested;  // 0 when Free
    HostBlockInfo::State state = HostBlockInfo::State::Free;
    HostBlockId id;                 // valid while Allocated
    std::vector<StreamId> streams;  // recorded streams, sorted
    std::vector<MarkerId> markers;  // outstanding markers of a pending free
  };

  std::optional<Bytes> pin(Bytes size);
  HostAllocation hand_out(Bytes address, Bytes requested);
  void release_block(Bytes address, Block& block);
  void process_pending(StreamMarkers& markers);
  void synchronize_pending(StreamMarkers& markers);
  void unpin_cached();

  Bytes capacity_;
  Bytes base_;
  AllocatorFaults faults_;
  AddressRangeAllocator ranges_;
  std::map<Bytes, Block> blocks_;                // every pinned block, by address
  std::set<std::pair<Bytes, Bytes>> cached_;     // Free blocks as (size, address)
  std::unordered_map<HostBlockId, Bytes> live_;  // Allocated blocks -> address; lookup only
  DeferredFrees pending_;                        // PendingFree blocks
  HostBlockId::rep_type next_id_ = 0;
  HostAllocatorStats stats_;
};

/// Bytes a request reserves. Caching: the next power of two, at least 512 B; Exact: the request
/// rounded up to a multiple of 512 B, at least 512 B. Both keep blocks 512 B aligned.
[[nodiscard]] Bytes pinned_block_size(Bytes requested, PinnedPool pool);

}  // namespace ferry::sim
