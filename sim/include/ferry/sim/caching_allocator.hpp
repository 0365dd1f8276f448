#pragma once
/// A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), used to
/// predict reserved memory, fragmentation and record_stream behaviour.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/stream_markers.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// Allocator constants, as in PyTorch's caching allocator.
inline constexpr Bytes kMinBlockSize{512};            ///< all sizes round up to this
inline constexpr Bytes kSmallSize{1024 * 1024};       ///< largest request served by the small pool
inline constexpr Bytes kSmallBuffer{2 * 1024 * 1024};  ///< segment size of the small pool
inline constexpr Bytes kMinLargeAlloc{10 * 1024 * 1024};  ///< below this, large requests get...
inline constexpr Bytes kLargeBuffer{20 * 1024 * 1024};    ///< ...a 20 MiB segment
inline constexpr Bytes kRoundLarge{2 * 1024 * 1024};      ///< larger segments round to 2 MiB

/// Identifies one allocated block until it is freed.
using BlockId = StrongId<struct BlockTag>;

enum class PoolKind : std::uint8_t { Small = 0, Large = 1 };

/// What malloc hands out.
struct DeviceAllocation {
  BlockId block;
  Bytes address;  ///< device address of the block's first byte
  Bytes size;     ///< rounded size actually reserved for the caller (>= requested)
};

/// A block as seen from outside, for reports and tests.
struct BlockInfo {
  enum class State : std::uint8_t { Allocated, PendingFree, Free };
  Bytes address;
  Bytes size;
  Bytes requested;  ///< size the caller asked for (0 when Free)
  StreamId stream;  ///< allocation stream
  State state = State::Free;
};

/// One cudaMalloc'ed segment and the blocks it is split into, in address order.
struct SegmentInfo {
  Bytes address;
  Bytes size;
  StreamId stream;
  PoolKind pool = PoolKind::Small;
  std::vector<BlockInfo> blocks;
};

/// Counters in the spirit of torch.cuda.memory_stats. Pending frees count as allocated.
struct AllocatorStats {
  Bytes allocated;       ///< bytes in blocks handed out (rounded sizes)
  Bytes requested;       ///< bytes the callers asked for
  Bytes reserved;        ///< bytes in segments obtained from the device
  Bytes allocated_peak;
  Bytes reserved_peak;
  std::array<Bytes, 2> pool_allocated{};       ///< indexed by PoolKind
  std::array<Bytes, 2> pool_reserved{};
  std::array<Bytes, 2> pool_reserved_peak{};
  std::int64_t segment_allocs = 0;    ///< cudaMalloc calls
  std::int64_t segment_frees = 0;     ///< cudaFree calls
  std::int64_t deferred_frees = 0;    ///< frees delayed by record_stream
  std::int64_t ooms = 0;
};

/// The caching allocator of one device. Blocks are reusable only on their allocation stream.
class CachingAllocator {
 public:
  /// `capacity`: bytes of device memory segments may occupy; `base`: address of the first byte.
  CachingAllocator(Bytes capacity, Bytes base);

  /// Allocates `requested` bytes for use on `stream`. First hands back deferred frees whose
  /// markers completed; on exhaustion releases cached segments (synchronizing pending frees)
  /// and retries. The error lists what is live.
  Result<DeviceAllocation> malloc(StreamId stream, Bytes requested, StreamMarkers& markers);

  /// Marks the block as used on `stream` too: its free will wait for that stream's work.
  void record_stream(BlockId block, StreamId stream);

  /// Returns the block to its pool, or defers that behind markers on the recorded streams.
  void free(BlockId block, StreamMarkers& markers);

  /// Waits for pending frees, then returns every fully free segment to the device.
  void empty_cache(StreamMarkers& markers);

  [[nodiscard]] const AllocatorStats& stats() const { return stats_; }
  /// All segments, in address order.
  [[nodiscard]] std::vector<SegmentInfo> segments() const;
  /// Allocated and pending-free blocks, in address order.
  [[nodiscard]] std::vector<BlockInfo> live_blocks() const;
  /// The block's current size and address; the block must be allocated.
  [[nodiscard]] DeviceAllocation describe(BlockId block) const;

 private:
  // (private members: block slab, per-pool ordered free sets keyed by (stream, size, address),
  // segment address map, pending-free list)
  AllocatorStats stats_;
};

/// Size rounding of the caching allocator: at least 512 B, a multiple of 512 B.
[[nodiscard]] Bytes round_size(Bytes requested);
/// Segment size requested from the device for a block of (rounded) `size`.
[[nodiscard]] Bytes segment_size_for(Bytes size);
/// Which pool serves a (rounded) request.
[[nodiscard]] PoolKind pool_for(Bytes size);

}  // namespace ferry::sim
