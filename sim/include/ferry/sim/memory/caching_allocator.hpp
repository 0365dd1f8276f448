#pragma once
/// A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), used to
/// predict reserved memory, fragmentation and record_stream behaviour.

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/memory/allocator_event.hpp"
#include "ferry/sim/memory/stream_markers.hpp"
#include "ferry/sim/support/node_pool.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// Allocator constants, as in PyTorch's caching allocator.
inline constexpr Bytes kMinBlockSize{512};             ///< all sizes round up to this
inline constexpr Bytes kSmallSize{1024 * 1024};        ///< largest request served by the small pool
inline constexpr Bytes kSmallBuffer{2 * 1024 * 1024};  ///< segment size of the small pool
inline constexpr Bytes kMinLargeAlloc{10 * 1024 * 1024};  ///< below this, large requests get...
inline constexpr Bytes kLargeBuffer{20 * 1024 * 1024};    ///< ...a 20 MiB segment
inline constexpr Bytes kRoundLarge{2 * 1024 * 1024};      ///< larger segments round to 2 MiB

/// Virtual address space the expandable segments of one device may take, from the device's base:
/// room for many segments of 1 1/8 of the device's memory, below the simulator's host ranges.
inline constexpr Bytes kExpandableAddressSpan{std::int64_t{1} << 44};

/// How the caching allocator obtains device memory: PyTorch's default (one cudaMalloc per
/// segment) or `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (Note [Expandable segments]).
enum class AllocatorMode : std::uint8_t { Default = 0, Expandable = 1 };

/// The mode named `name` (`default`, `expandable`); nullopt for any other name.
[[nodiscard]] std::optional<AllocatorMode> parse_allocator_mode(std::string_view name);
/// The name parse_allocator_mode reads for `mode`.
[[nodiscard]] std::string_view allocator_mode_name(AllocatorMode mode);

/// Identifies one allocated block until it is freed.
using BlockId = StrongId<struct BlockTag>;

/// The two size classes of the allocator, each with its own segments and free blocks.
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

/// One cudaMalloc'ed segment and the blocks it is split into, in address order. Of an expandable
/// segment, one contiguous mapped range (as PyTorch's snapshot reports it).
struct SegmentInfo {
  Bytes address;
  Bytes size;
  StreamId stream;
  PoolKind pool = PoolKind::Small;
  std::vector<BlockInfo> blocks;
  bool expandable = false;  ///< part of an expandable segment
};

/// Counters in the spirit of torch.cuda.memory_stats. Pending frees count as allocated.
struct AllocatorStats {
  Bytes allocated;       ///< bytes in blocks handed out (rounded sizes)
  Bytes requested;       ///< bytes the callers asked for
  Bytes reserved;        ///< bytes in segments obtained from the device
  Bytes requested_peak;  ///< most bytes callers held at once, before rounding
  Bytes allocated_peak;
  Bytes reserved_peak;
  std::array<Bytes, 2> pool_allocated{};  ///< indexed by PoolKind
  std::array<Bytes, 2> pool_reserved{};
  std::array<Bytes, 2> pool_reserved_peak{};
  std::int64_t segment_allocs = 0;  ///< cudaMalloc calls (expandable: page-range maps)
  std::int64_t segment_frees = 0;   ///< cudaFree calls (expandable: page-range unmaps)
  std::int64_t deferred_frees = 0;  ///< frees delayed by record_stream
  std::int64_t ooms = 0;
};

/// Test-only switches that each drop one safety rule, so that property tests can show they catch
/// the fault. Production code uses the default (no fault).
struct AllocatorFaults {
  bool ignore_record_stream = false;  ///< free returns blocks at once, ignoring record_stream
};

/// First-fit allocator of address ranges inside [base, base + capacity): where segments (and
/// pinned blocks) are placed. Released ranges coalesce and are reused, lowest address first.
class AddressRangeAllocator {
 public:
  /// Manages [base, base + capacity).
  AddressRangeAllocator(Bytes base, Bytes capacity);
  /// The lowest address of a free range of `size` bytes, now taken; nullopt when none is long
  /// enough. Linear in the number of free ranges (holes), which stays small.
  [[nodiscard]] std::optional<Bytes> allocate(Bytes size);
  /// Gives back a range obtained from allocate.
  void release(Bytes address, Bytes size);

 private:
  Bytes base_;
  Bytes limit_;                  // one past the last byte
  std::map<Bytes, Bytes> free_;  // start -> end of each maximal free range
};

/// The caching allocator of one device. Blocks are reusable only on their allocation stream.
class CachingAllocator {
 public:
  /// `capacity`: bytes of device memory segments may occupy; `base`: address of the first byte.
  CachingAllocator(Bytes capacity, Bytes base);
  // Move-only, and not move-assignable: its maps' nodes live in pools it owns.
  CachingAllocator(CachingAllocator&&) noexcept = default;
  CachingAllocator& operator=(CachingAllocator&&) = delete;
  /// As above, with test-only faults planted.
  CachingAllocator(Bytes capacity, Bytes base, AllocatorFaults faults);
  /// As above, in `mode` (Note [Expandable segments]).
  CachingAllocator(Bytes capacity, Bytes base, AllocatorMode mode, AllocatorFaults faults = {});

  /// Allocates `requested` bytes for use on `stream`. First hands back deferred frees whose
  /// markers completed; on exhaustion releases cached segments (synchronizing pending frees)
  /// and retries. The error lists what is live. `buffer` names the allocation to the tracker.
  Result<DeviceAllocation> malloc(StreamId stream, Bytes requested, StreamMarkers& markers,
                                  BufferId buffer = BufferId());

  /// Marks the block as used on `stream` too: its free will wait for that stream's work.
  void record_stream(BlockId block, StreamId stream);

  /// Returns the block to its pool, or defers that behind markers on the recorded streams.
  void free(BlockId block, StreamMarkers& markers);
  /// The streams a free of the (allocated) block will wait for, sorted: those record_stream
  /// named, other than the allocation stream; none when frees ignore record_stream.
  [[nodiscard]] std::span<const StreamId> deferring_streams(BlockId block) const;

  /// Waits for pending frees, then returns every fully free segment to the device.
  void empty_cache(StreamMarkers& markers);

  /// Current counters; pending frees count as allocated.
  [[nodiscard]] const AllocatorStats& stats() const { return stats_; }
  /// All segments, in address order.
  [[nodiscard]] std::vector<SegmentInfo> segments() const;
  /// Allocated and pending-free blocks, in address order.
  [[nodiscard]] std::vector<BlockInfo> live_blocks() const;
  /// Bytes of the blocks whose free waits behind record_stream markers (PendingFree).
  [[nodiscard]] Bytes pending_free_bytes() const { return pending_bytes_; }
  /// The block's current size and address; the block must be allocated.
  [[nodiscard]] DeviceAllocation describe(BlockId block) const;
  /// Bytes of device memory segments may occupy.
  [[nodiscard]] Bytes capacity() const { return capacity_; }
  /// Address of the first byte segments may occupy.
  [[nodiscard]] Bytes base() const { return base_; }
  /// How the allocator obtains device memory.
  [[nodiscard]] AllocatorMode mode() const { return mode_; }
  /// Reports every action to `tracker` from now on (not owned; null: none). See Note
  /// [Allocator tracking].
  void set_tracker(AllocatorTracker* tracker) { tracker_ = tracker; }

 private:
  /// A piece of a segment: handed out, pending behind markers, or free in its pool.
  struct Block {
    Bytes size;
    Bytes requested;  // 0 unless handed out
    Bytes segment;    // address of the enclosing segment
    StreamId stream;  // allocation stream (that of the segment)
    PoolKind pool = PoolKind::Small;
    BlockInfo::State state = BlockInfo::State::Free;
    BlockId id;                         // valid while Allocated
    BufferId buffer;                    // what malloc's caller named it, until it is Free
    std::vector<StreamId> stream_uses;  // record_stream targets, sorted, never `stream`
    std::vector<MarkerId> markers;      // outstanding markers of a pending free
    bool mapped = true;                 // false: unmapped pages of an expandable segment (Free)
  };
  struct Segment {
    Bytes size;  // expandable: the whole virtual range, mapped or not
    StreamId stream;
    PoolKind pool = PoolKind::Small;
    bool expandable = false;
  };
  /// Orders free blocks as the best-fit search needs them: per pool and stream, by size, then
  /// address.
  struct FreeKey {
    PoolKind pool = PoolKind::Small;
    StreamId stream;
    Bytes size;
    Bytes address;
    friend auto operator<=>(const FreeKey&, const FreeKey&) = default;
  };
  /// Orders the unmapped ranges of expandable segments as find_expandable_block walks them.
  struct UnmappedKey {
    PoolKind pool = PoolKind::Small;
    StreamId stream;
    Bytes address;
    friend auto operator<=>(const UnmappedKey&, const UnmappedKey&) = default;
  };
  using BlockMap = PooledMap<Bytes, Block>;
  // Free blocks in best-fit order, each with its entry in blocks_.
  using FreeMap = PooledMap<FreeKey, BlockMap::iterator>;

  std::optional<FreeMap::iterator> take_free_block(StreamId stream, PoolKind pool, Bytes size);
  std::optional<Bytes> new_segment(StreamId stream, PoolKind pool, Bytes segment_size);
  DeviceAllocation hand_out(Bytes address, Bytes size, Bytes requested, BufferId buffer);
  // hand_out of the free block `free` names, found by the best-fit search.
  DeviceAllocation hand_out(FreeMap::iterator free, Bytes size, Bytes requested, BufferId buffer);
  // The rest of hand_out, once the block `it` (free, of at least `size`) has left free_.
  DeviceAllocation hand_out(BlockMap::iterator it, Bytes size, Bytes requested, BufferId buffer);
  void track(AllocatorEvent::Action action, Bytes address, Bytes size, StreamId stream,
             BufferId buffer) const {
    if (tracker_ != nullptr) {
      tracker_->allocator_action(AllocatorEvent{.action = action,
                                                .address = address,
                                                .size = size,
                                                .stream = stream,
                                                .time = SimTime(),
                                                .op = OpId(),
                                                .buffer = buffer});
    }
  }
  void release_block(BlockMap::iterator it);
  BlockMap::iterator merge_free(BlockMap::iterator it);
  std::optional<Bytes> grow_expandable(StreamId stream, PoolKind pool, Bytes size);
  std::optional<Bytes> find_expandable_block(StreamId stream, PoolKind pool, Bytes size);
  std::optional<Bytes> map_block(Bytes address, Bytes size);
  void unmap_block(Bytes address);
  void release_pending(Bytes address);
  void process_pending(StreamMarkers& markers);
  void synchronize_pending(StreamMarkers& markers);
  void release_free_segments();
  [[nodiscard]] Error out_of_memory(StreamId stream, Bytes requested, Bytes size,
                                    Bytes segment_size) const;
  [[nodiscard]] static BlockInfo info(Bytes address, const Block& block);

  Bytes capacity_;
  Bytes base_;
  AllocatorMode mode_ = AllocatorMode::Default;
  AllocatorFaults faults_;
  AllocatorTracker* tracker_ = nullptr;  // not owned
  AddressRangeAllocator ranges_;
  // The maps below change on every malloc and free: their nodes come from pools of their own
  // (Note [Node pools] in node_pool.hpp), declared first so that they outlive the maps.
  std::unique_ptr<NodePool> block_nodes_ = std::make_unique<NodePool>();
  std::unique_ptr<NodePool> segment_nodes_ = std::make_unique<NodePool>();
  std::unique_ptr<NodePool> free_nodes_ = std::make_unique<NodePool>();
  BlockMap blocks_{BlockMap::allocator_type(block_nodes_.get())};  // every block, by address
  PooledMap<Bytes, Segment> segments_{
      // by address
      PooledMap<Bytes, Segment>::allocator_type(segment_nodes_.get())};
  FreeMap free_{FreeMap::allocator_type(free_nodes_.get())};  // Free only
  std::set<UnmappedKey> unmapped_;  // unmapped blocks of expandable segments
  // Each block id's entry in blocks_ while it is allocated, by id (ids are handed out in order
  // and never again); none before and after. An allocated block is never merged away, so its
  // entry stays where it is (and stays valid when the allocator moves, as a map's do).
  std::vector<std::optional<BlockMap::iterator>> live_;
  [[nodiscard]] std::optional<BlockMap::iterator> live_entry(BlockId block) const;
  DeferredFrees pending_;  // PendingFree blocks
  Bytes pending_bytes_;    // their sizes, summed
  BlockId::rep_type next_id_ = 0;
  AllocatorStats stats_;
};

/// Size rounding of the caching allocator: at least 512 B, a multiple of 512 B.
[[nodiscard]] Bytes round_size(Bytes requested);
/// Segment size requested from the device for a block of (rounded) `size`.
[[nodiscard]] Bytes segment_size_for(Bytes size);
/// Which pool serves a (rounded) request.
[[nodiscard]] PoolKind pool_for(Bytes size);
/// The page an expandable segment of `pool` maps and unmaps at a time (its segment size).
[[nodiscard]] Bytes expandable_page_size(PoolKind pool);

}  // namespace ferry::sim
