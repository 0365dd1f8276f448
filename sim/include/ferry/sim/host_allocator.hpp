#pragma once
/// Page-locked (pinned) host memory: a model of PyTorch's caching host allocator (sizes rounded
/// up to a power of two) and ferry's exact-size pool, under one host-memory cap.

#include <cstdint>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/stream_markers.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// How a pinned request is sized.
enum class PinnedPool : std::uint8_t {
  Caching,  ///< PyTorch's CachingHostAllocator: round up to a power of two, cache by size
  Exact,    ///< ferry's pool: exactly the requested size, cached and reused for that size
};

using HostBlockId = StrongId<struct HostBlockTag>;

struct HostAllocation {
  HostBlockId block;
  Bytes address;
  Bytes size;  ///< bytes reserved for the block (power of two, or exact)
};

struct HostBlockInfo {
  enum class State : std::uint8_t { Allocated, PendingFree, Free };
  Bytes address;
  Bytes size;
  Bytes requested;
  State state = State::Free;
};

struct HostAllocatorStats {
  Bytes allocated;      ///< bytes in blocks handed out (their reserved sizes)
  Bytes reserved;       ///< bytes pinned (cudaHostAlloc'ed), free or not
  Bytes allocated_peak;
  Bytes reserved_peak;
  std::int64_t host_allocs = 0;  ///< cudaHostAlloc calls
  std::int64_t host_frees = 0;   ///< cudaFreeHost calls
  std::int64_t cap_refusals = 0; ///< requests refused because of the cap
};

/// Pinned host memory with a cap. Freed blocks are reused only after the streams recorded on
/// them finished their work at free time. See Note [record_stream deferral].
class PinnedHostAllocator {
 public:
  /// `capacity`: most bytes that may be pinned at once; `base`: address of the first byte.
  PinnedHostAllocator(Bytes capacity, Bytes base);

  /// Reuses a cached free block of the pool's size or pins a new one. Over the cap, first
  /// releases cached free blocks; if still over, returns an error naming the cap and the request.
  Result<HostAllocation> malloc(Bytes requested, PinnedPool pool, StreamMarkers& markers);
  /// The block was used by work on `stream` (PyTorch's record_event on a pinned tensor).
  void record_stream(HostBlockId block, StreamId stream);
  void free(HostBlockId block, StreamMarkers& markers);
  /// Waits for pending frees, then unpins every cached free block.
  void empty_cache(StreamMarkers& markers);

  [[nodiscard]] const HostAllocatorStats& stats() const { return stats_; }
  [[nodiscard]] std::vector<HostBlockInfo> blocks() const;  ///< all blocks, address order

 private:
  HostAllocatorStats stats_;
};

/// The size a Caching request reserves: the next power of two (at least 1 byte... see .cpp).
[[nodiscard]] Bytes pinned_block_size(Bytes requested, PinnedPool pool);

}  // namespace ferry::sim
