#include "ferry/sim/memory/caching_allocator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <utility>

namespace ferry::sim {

namespace {

/// Requests above this are caller bugs (and would overflow the rounding arithmetic).
constexpr Bytes kMaxRequest{std::int64_t{1} << 60};
/// How many live blocks an out-of-memory message lists before summarizing the rest.
constexpr std::size_t kOomListedBlocks = 20;

Bytes round_up(Bytes size, Bytes unit) {
  return Bytes((size.count() + unit.count() - 1) / unit.count() * unit.count());
}

Bytes round_down(Bytes size, Bytes unit) {
  return Bytes(size.count() / unit.count() * unit.count());
}

std::size_t pool_index(PoolKind pool) { return static_cast<std::size_t>(pool); }

// Erases `key` from the unique set `set`, if there, in one search (erase(key) makes two).
template <class Set, class Key>
void erase_key(Set& set, const Key& key) {
  if (const auto it = set.find(key); it != set.end()) set.erase(it);
}

const char* state_name(BlockInfo::State state) {
  switch (state) {
    case BlockInfo::State::Allocated:
      return "allocated";
    case BlockInfo::State::PendingFree:
      return "pending_free";
    case BlockInfo::State::Free:
      return "free";
  }
  return "?";
}

void raise_peak(Bytes& peak, Bytes value) { peak = std::max(peak, value); }

}  // namespace

Bytes round_size(Bytes requested) {
  FERRY_CHECK(requested >= Bytes(0) && requested <= kMaxRequest,
              "allocation request of {} B is negative or absurdly large", requested.count());
  // PyTorch hands out no block for 0 bytes; here a 0-byte request gets a real 512 B block so that
  // it has an id and an address like any other.
  if (requested < kMinBlockSize) {
    return kMinBlockSize;
  }
  return round_up(requested, kMinBlockSize);
}

std::optional<AllocatorMode> parse_allocator_mode(std::string_view name) {
  if (name == "default") return AllocatorMode::Default;
  if (name == "expandable") return AllocatorMode::Expandable;
  return std::nullopt;
}

std::string_view allocator_mode_name(AllocatorMode mode) {
  return mode == AllocatorMode::Expandable ? "expandable" : "default";
}

Bytes expandable_page_size(PoolKind pool) {
  return pool == PoolKind::Small ? kSmallBuffer : kLargeBuffer;
}

PoolKind pool_for(Bytes size) { return size <= kSmallSize ? PoolKind::Small : PoolKind::Large; }

Bytes segment_size_for(Bytes size) {
  if (pool_for(size) == PoolKind::Small) {
    return kSmallBuffer;
  }
  if (size < kMinLargeAlloc) {
    return kLargeBuffer;
  }
  return round_up(size, kRoundLarge);
}

AddressRangeAllocator::AddressRangeAllocator(Bytes base, Bytes capacity)
    : base_(base), limit_(base + capacity) {
  FERRY_CHECK(base >= Bytes(0) && capacity >= Bytes(0), "address range [{}, +{}) is negative",
              base.count(), capacity.count());
  if (capacity > Bytes(0)) {
    free_.emplace(base, limit_);
  }
}

std::optional<Bytes> AddressRangeAllocator::allocate(Bytes size) {
  FERRY_CHECK(size > Bytes(0), "address range of {} B requested", size.count());
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const auto [start, end] = *it;
    if (end - start >= size) {
      free_.erase(it);
      if (start + size < end) {
        free_.emplace(start + size, end);
      }
      return start;
    }
  }
  return std::nullopt;
}

void AddressRangeAllocator::release(Bytes address, Bytes size) {
  Bytes start = address;
  Bytes end = address + size;
  FERRY_CHECK(size > Bytes(0) && start >= base_ && end <= limit_,
              "released range [{:#x}, {:#x}) is empty or outside [{:#x}, {:#x})", start.count(),
              end.count(), base_.count(), limit_.count());
  auto next = free_.lower_bound(start);
  FERRY_CHECK(next == free_.end() || next->first >= end,
              "released range [{:#x}, {:#x}) overlaps a free range", start.count(), end.count());
  if (next != free_.begin()) {
    const auto prev = std::prev(next);
    FERRY_CHECK(prev->second <= start, "released range [{:#x}, {:#x}) overlaps a free range",
                start.count(), end.count());
    if (prev->second == start) {
      start = prev->first;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == end) {
    end = next->second;
    free_.erase(next);
  }
  free_.emplace(start, end);
}

CachingAllocator::CachingAllocator(Bytes capacity, Bytes base)
    : CachingAllocator(capacity, base, AllocatorFaults{}) {}

CachingAllocator::CachingAllocator(Bytes capacity, Bytes base, AllocatorFaults faults)
    : CachingAllocator(capacity, base, AllocatorMode::Default, faults) {}

CachingAllocator::CachingAllocator(Bytes capacity, Bytes base, AllocatorMode mode,
                                   AllocatorFaults faults)
    : capacity_(capacity),
      base_(base),
      mode_(mode),
      faults_(faults),
      ranges_(base, mode == AllocatorMode::Expandable ? kExpandableAddressSpan : capacity) {}

// Note [Expandable segments]
// With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, c10's caching allocator
// (c10/cuda/CUDACachingAllocator.cpp, torch 2.11) obtains memory not by cudaMalloc but by
// mapping pages into a virtual range it reserved: an ExpandableSegment per stream and pool,
// 1 1/8 of the device's memory long, whose page is the pool's segment size (kSmallBuffer for
// the small pool, kLargeBuffer for the large one: find_expandable_block). What is modelled:
//  * A request no free mapped block fits goes to try_allocate_expandable_block: the lowest
//    unmapped range of the stream and pool, started at the free mapped block before it if there
//    is one (find_expandable_block), whose free and unmapped blocks together hold the request.
//    map_block maps just enough whole pages of it, merges them with the free neighbours, and
//    reserved memory grows by the pages mapped (a SegmentMap action; segment_allocs counts it).
//    Mapping fails, as cuMemCreate does, when the pages would take reserved past capacity.
//  * should_split: every remainder of at least 512 B is split off, in both pools.
//  * Blocks merge only with free neighbours that are mapped too.
//  * free never unmaps. release_cached_blocks (empty_cache, and the retry after a failed map)
//    unmaps the whole pages inside every free block (unmap_block, a SegmentUnmap action), large
//    pool first; a segment left wholly unmapped is released (release_expandable_segment).
//  * Its virtual range comes from kExpandableAddressSpan; only mapped pages count against the
//    capacity. segments() reports each contiguous mapped range as a segment, as torch's
//    snapshot does.

Result<DeviceAllocation> CachingAllocator::malloc(StreamId stream, Bytes requested,
                                                  StreamMarkers& markers, BufferId buffer) {
  FERRY_CHECK(stream.valid(), "malloc of {} B on an invalid stream", requested.count());
  const Bytes size = round_size(requested);
  const PoolKind pool = pool_for(size);
  // See Note [record_stream deferral]: the next malloc is where deferred frees come back.
  process_pending(markers);
  if (const auto free = take_free_block(stream, pool, size)) {
    return hand_out(*free, size, requested, buffer);
  }
  // A new segment, or with expandable segments more pages of the stream's range (Note
  // [Expandable segments]); `reserve` is what the device is asked for.
  const bool expandable = mode_ == AllocatorMode::Expandable;
  const Bytes reserve =
      expandable ? round_up(size, expandable_page_size(pool)) : segment_size_for(size);
  const auto obtain = [&] {
    return expandable ? grow_expandable(stream, pool, size) : new_segment(stream, pool, reserve);
  };
  auto segment = obtain();
  if (!segment) {
    // Note [OOM retry]
    // As PyTorch does when cudaMalloc fails: wait for every deferred free, then return every
    // fully free cached segment (of all streams and pools) to the device, and try once more.
    // The pool is not searched again: a block that the synchronization freed either completed
    // a whole segment (released just now, its range reusable) or sits in a segment that is still
    // partly used, where PyTorch would not look either. These releases stay done even if the
    // retry fails; they are what the real allocator does, and nothing else changes on OOM.
    synchronize_pending(markers);
    release_free_segments();
    segment = obtain();
  }
  if (!segment) {
    ++stats_.ooms;
    track(AllocatorEvent::Action::Oom, capacity_ - stats_.reserved, size, stream, BufferId());
    return out_of_memory(stream, requested, size, reserve);
  }
  return hand_out(*segment, size, requested, buffer);
}

void CachingAllocator::record_stream(BlockId block, StreamId stream) {
  FERRY_CHECK(stream.valid(), "record_stream of block {} on an invalid stream", block.value());
  const auto entry = live_entry(block);
  FERRY_CHECK(entry.has_value(), "record_stream on block {}, which is not allocated",
              block.value());
  Block& b = (*entry)->second;
  if (stream == b.stream) {
    return;
  }
  const auto at = std::lower_bound(b.stream_uses.begin(), b.stream_uses.end(), stream);
  if (at == b.stream_uses.end() || *at != stream) {
    b.stream_uses.insert(at, stream);
  }
}

std::span<const StreamId> CachingAllocator::deferring_streams(BlockId block) const {
  const auto entry = live_entry(block);
  FERRY_CHECK(entry.has_value(), "block {} is not allocated", block.value());
  if (faults_.ignore_record_stream) {
    return {};
  }
  return (*entry)->second.stream_uses;
}

void CachingAllocator::free(BlockId block, StreamMarkers& markers) {
  const auto entry = live_entry(block);
  FERRY_CHECK(entry.has_value(),
              "free of block {}, which is not allocated (unknown id or "
              "already freed)",
              block.value());
  live_[block.value()].reset();
  const auto it = *entry;
  const Bytes address = it->first;
  Block& b = it->second;
  track(AllocatorEvent::Action::FreeRequested, address, b.size, b.stream, b.buffer);
  if (b.stream_uses.empty() || faults_.ignore_record_stream) {
    release_block(it);
    return;
  }
  // See Note [record_stream deferral]. Markers are recorded in increasing stream order so that
  // the simulated device sees the same calls on every run.
  b.state = BlockInfo::State::PendingFree;
  pending_bytes_ += b.size;
  b.id = BlockId{};
  pending_.defer(address, b.stream_uses, b.markers, markers);
  ++stats_.deferred_frees;
}

void CachingAllocator::empty_cache(StreamMarkers& markers) {
  synchronize_pending(markers);
  release_free_segments();
}

std::vector<SegmentInfo> CachingAllocator::segments() const {
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [address, segment] : segments_) {
    if (segment.expandable) {
      // One SegmentInfo per contiguous mapped range, as torch's snapshot reports them.
      std::optional<SegmentInfo> run;
      for (auto it = blocks_.lower_bound(address);
           it != blocks_.end() && it->first < address + segment.size; ++it) {
        if (!it->second.mapped) {
          if (run) out.push_back(*std::exchange(run, std::nullopt));
          continue;
        }
        if (!run) run = SegmentInfo{it->first, Bytes(0), segment.stream, segment.pool, {}, true};
        run->size += it->second.size;
        run->blocks.push_back(info(it->first, it->second));
      }
      if (run) out.push_back(std::move(*run));
      continue;
    }
    SegmentInfo info_out{address, segment.size, segment.stream, segment.pool, {}};
    for (auto it = blocks_.lower_bound(address);
         it != blocks_.end() && it->first < address + segment.size; ++it) {
      info_out.blocks.push_back(info(it->first, it->second));
    }
    out.push_back(std::move(info_out));
  }
  return out;
}

std::vector<BlockInfo> CachingAllocator::live_blocks() const {
  std::vector<BlockInfo> out;
  for (const auto& [address, block] : blocks_) {
    if (block.state != BlockInfo::State::Free) {
      out.push_back(info(address, block));
    }
  }
  return out;
}

DeviceAllocation CachingAllocator::describe(BlockId block) const {
  const auto entry = live_entry(block);
  FERRY_CHECK(entry.has_value(), "describe of block {}, which is not allocated", block.value());
  return DeviceAllocation{block, (*entry)->first, (*entry)->second.size};
}

std::optional<CachingAllocator::BlockMap::iterator> CachingAllocator::live_entry(
    BlockId block) const {
  if (!block.valid() || block.value() >= live_.size()) return std::nullopt;
  return live_[block.value()];
}

std::optional<CachingAllocator::FreeMap::iterator> CachingAllocator::take_free_block(
    StreamId stream, PoolKind pool, Bytes size) {
  // Best fit: the smallest free block of this pool and stream that is large enough, the lowest
  // address among equals (the key order).
  const auto it = free_.lower_bound(FreeKey{pool, stream, size, Bytes(0)});
  if (it == free_.end() || it->first.pool != pool || it->first.stream != stream) {
    return std::nullopt;
  }
  return it;
}

std::optional<Bytes> CachingAllocator::new_segment(StreamId stream, PoolKind pool,
                                                   Bytes segment_size) {
  if (stats_.reserved + segment_size > capacity_) {
    return std::nullopt;
  }
  const auto address = ranges_.allocate(segment_size);
  if (!address) {
    return std::nullopt;
  }
  segments_.emplace(*address, Segment{segment_size, stream, pool});
  Block block;
  block.size = segment_size;
  block.segment = *address;
  block.stream = stream;
  block.pool = pool;
  const auto entry = blocks_.emplace(*address, std::move(block)).first;
  free_.emplace(FreeKey{pool, stream, segment_size, *address}, entry);
  track(AllocatorEvent::Action::SegmentAlloc, *address, segment_size, stream, BufferId());
  ++stats_.segment_allocs;
  stats_.reserved += segment_size;
  stats_.pool_reserved[pool_index(pool)] += segment_size;
  raise_peak(stats_.reserved_peak, stats_.reserved);
  raise_peak(stats_.pool_reserved_peak[pool_index(pool)], stats_.pool_reserved[pool_index(pool)]);
  return address;
}

DeviceAllocation CachingAllocator::hand_out(Bytes address, Bytes size, Bytes requested,
                                            BufferId buffer) {
  const auto it = blocks_.find(address);
  if (it != blocks_.end())
    erase_key(free_, FreeKey{it->second.pool, it->second.stream, it->second.size, address});
  return hand_out(it, size, requested, buffer);
}

DeviceAllocation CachingAllocator::hand_out(FreeMap::iterator free, Bytes size, Bytes requested,
                                            BufferId buffer) {
  const auto it = free->second;
  free_.erase(free);
  return hand_out(it, size, requested, buffer);
}

DeviceAllocation CachingAllocator::hand_out(BlockMap::iterator it, Bytes size, Bytes requested,
                                            BufferId buffer) {
  FERRY_CHECK(
      it != blocks_.end() && it->second.state == BlockInfo::State::Free && it->second.size >= size,
      "no free block of at least {} B", size.count());
  const Bytes address = it->first;
  Block& b = it->second;
  const Bytes remainder = b.size - size;
  // should_split: an expandable segment splits off every remainder of at least 512 B.
  const bool split = b.pool == PoolKind::Small || mode_ == AllocatorMode::Expandable
                         ? remainder >= kMinBlockSize
                         : remainder > kSmallSize;
  if (split) {
    Block rest;
    rest.size = remainder;
    rest.segment = b.segment;
    rest.stream = b.stream;
    rest.pool = b.pool;
    const auto entry = blocks_.emplace_hint(std::next(it), address + size, std::move(rest));
    free_.emplace(FreeKey{b.pool, b.stream, remainder, address + size}, entry);
    b.size = size;
  }
  FERRY_CHECK(next_id_ < BlockId::kInvalid, "block ids exhausted");
  b.state = BlockInfo::State::Allocated;
  b.requested = requested;
  b.id = BlockId(next_id_++);
  b.buffer = buffer;
  live_.push_back(it);  // at index b.id
  stats_.allocated += b.size;
  stats_.requested += requested;
  stats_.requested_peak = std::max(stats_.requested_peak, stats_.requested);
  stats_.pool_allocated[pool_index(b.pool)] += b.size;
  raise_peak(stats_.allocated_peak, stats_.allocated);
  track(AllocatorEvent::Action::Alloc, address, b.size, b.stream, buffer);
  return DeviceAllocation{b.id, address, b.size};
}

void CachingAllocator::release_block(BlockMap::iterator it) {
  Block& b = it->second;
  track(AllocatorEvent::Action::FreeCompleted, it->first, b.size, b.stream, b.buffer);
  stats_.allocated -= b.size;
  stats_.requested -= b.requested;
  stats_.pool_allocated[pool_index(b.pool)] -= b.size;
  b.state = BlockInfo::State::Free;
  b.requested = Bytes(0);
  b.id = BlockId{};
  b.buffer = BufferId{};
  b.stream_uses.clear();
  b.markers.clear();
  merge_free(it);
}

CachingAllocator::BlockMap::iterator CachingAllocator::merge_free(BlockMap::iterator it) {
  // Merge with free mapped neighbours of the same segment; allocated, pending and unmapped ones
  // stay apart.
  const auto mergeable = [&](const Block& other, const Block& b) {
    return other.segment == b.segment && other.state == BlockInfo::State::Free && other.mapped;
  };
  if (it != blocks_.begin()) {
    const auto prev = std::prev(it);
    Block& p = prev->second;
    if (mergeable(p, it->second)) {
      erase_key(free_, FreeKey{p.pool, p.stream, p.size, prev->first});
      p.size += it->second.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  Block& merged = it->second;
  const auto next = std::next(it);
  if (next != blocks_.end() && mergeable(next->second, merged)) {
    erase_key(free_,
              FreeKey{next->second.pool, next->second.stream, next->second.size, next->first});
    merged.size += next->second.size;
    blocks_.erase(next);
  }
  free_.emplace(FreeKey{merged.pool, merged.stream, merged.size, it->first}, it);
  return it;
}

std::optional<Bytes> CachingAllocator::grow_expandable(StreamId stream, PoolKind pool, Bytes size) {
  // try_allocate_expandable_block: the candidate is unmapped, or free and followed by unmapped
  // pages; map what the request still lacks until the merged free block holds it.
  const auto candidate = find_expandable_block(stream, pool, size);
  if (!candidate) return std::nullopt;
  Bytes at = *candidate;
  if (!blocks_.at(at).mapped) {
    const auto mapped = map_block(at, std::min(blocks_.at(at).size, size));
    if (!mapped) return std::nullopt;
    at = *mapped;
  }
  while (blocks_.at(at).size < size) {
    const auto it = blocks_.find(at);
    const auto next = std::next(it);
    FERRY_CHECK(
        next != blocks_.end() && next->second.segment == it->second.segment && !next->second.mapped,
        "expandable block at {:#x} is followed by no unmapped range", at.count());
    const auto mapped = map_block(next->first, std::min(size - it->second.size, next->second.size));
    if (!mapped) return std::nullopt;
    at = *mapped;
  }
  return at;
}

std::optional<Bytes> CachingAllocator::find_expandable_block(StreamId stream, PoolKind pool,
                                                             Bytes size) {
  // The lowest unmapped range of this stream and pool (with the free block before it, if any)
  // whose free and unmapped blocks hold `size`; else a new segment.
  for (auto u = unmapped_.lower_bound(UnmappedKey{pool, stream, Bytes(0)});
       u != unmapped_.end() && u->pool == pool && u->stream == stream; ++u) {
    auto c = blocks_.find(u->address);
    const Bytes segment = c->second.segment;
    if (c != blocks_.begin()) {
      const auto prev = std::prev(c);
      if (prev->second.segment == segment && prev->second.state == BlockInfo::State::Free) {
        c = prev;
      }
    }
    Bytes bytes;
    for (auto w = c; w != blocks_.end() && bytes < size && w->second.segment == segment &&
                     w->second.state == BlockInfo::State::Free;
         ++w) {
      bytes += w->second.size;
    }
    if (bytes >= size) return c->first;
  }
  const Bytes page = expandable_page_size(pool);
  const Bytes span = std::max(page, round_up(capacity_ + Bytes(capacity_.count() / 8), page));
  const auto address = ranges_.allocate(span);
  if (!address) return std::nullopt;
  segments_.emplace(*address, Segment{span, stream, pool, true});
  Block block;
  block.size = span;
  block.segment = *address;
  block.stream = stream;
  block.pool = pool;
  block.mapped = false;
  blocks_.emplace(*address, std::move(block));
  unmapped_.insert(UnmappedKey{pool, stream, *address});
  return address;
}

std::optional<Bytes> CachingAllocator::map_block(Bytes address, Bytes size) {
  const auto it = blocks_.find(address);
  FERRY_CHECK(it != blocks_.end() && !it->second.mapped, "no unmapped range at {:#x}",
              address.count());
  Block& b = it->second;
  const Bytes mapped = std::min(b.size, round_up(size, expandable_page_size(b.pool)));
  // cuMemCreate fails when the device has no room for the pages.
  if (stats_.reserved + mapped > capacity_) return std::nullopt;
  unmapped_.erase(UnmappedKey{b.pool, b.stream, address});
  b.mapped = true;
  if (mapped < b.size) {
    Block rest;
    rest.size = b.size - mapped;
    rest.segment = b.segment;
    rest.stream = b.stream;
    rest.pool = b.pool;
    rest.mapped = false;
    blocks_.emplace_hint(std::next(it), address + mapped, std::move(rest));
    unmapped_.insert(UnmappedKey{b.pool, b.stream, address + mapped});
    b.size = mapped;
  }
  const PoolKind pool = b.pool;
  track(AllocatorEvent::Action::SegmentMap, address, mapped, b.stream, BufferId());
  ++stats_.segment_allocs;
  stats_.reserved += mapped;
  stats_.pool_reserved[pool_index(pool)] += mapped;
  raise_peak(stats_.reserved_peak, stats_.reserved);
  raise_peak(stats_.pool_reserved_peak[pool_index(pool)], stats_.pool_reserved[pool_index(pool)]);
  return merge_free(it)->first;
}

void CachingAllocator::unmap_block(Bytes address) {
  auto it = blocks_.find(address);
  FERRY_CHECK(
      it != blocks_.end() && it->second.mapped && it->second.state == BlockInfo::State::Free,
      "no free mapped block at {:#x}", address.count());
  Block proto = it->second;  // segment, stream, pool
  const Bytes page = expandable_page_size(proto.pool);
  const Bytes end_address = address + proto.size;
  // ExpandableSegment::unmap: only the whole pages inside the block.
  const Bytes begin = proto.segment + round_up(address - proto.segment, page);
  const Bytes end = proto.segment + round_down(end_address - proto.segment, page);
  if (end <= begin) return;
  free_.erase(FreeKey{proto.pool, proto.stream, proto.size, address});
  if (begin > address) {
    it->second.size = begin - address;
    free_.emplace(FreeKey{proto.pool, proto.stream, it->second.size, address}, it);
    Block middle = proto;
    it = blocks_.emplace_hint(std::next(it), begin, std::move(middle));
  }
  it->second.size = end - begin;
  it->second.mapped = false;
  if (end < end_address) {
    Block after = proto;
    after.size = end_address - end;
    const auto entry = blocks_.emplace_hint(std::next(it), end, std::move(after));
    free_.emplace(FreeKey{proto.pool, proto.stream, end_address - end, end}, entry);
  }
  track(AllocatorEvent::Action::SegmentUnmap, begin, end - begin, proto.stream, BufferId());
  ++stats_.segment_frees;
  stats_.reserved -= end - begin;
  stats_.pool_reserved[pool_index(proto.pool)] -= end - begin;
  // Merge with unmapped neighbours of the same segment.
  const auto unmapped_neighbour = [&](const Block& other) {
    return other.segment == proto.segment && !other.mapped;
  };
  if (it != blocks_.begin()) {
    const auto prev = std::prev(it);
    if (unmapped_neighbour(prev->second)) {
      prev->second.size += it->second.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  const auto next = std::next(it);
  if (next != blocks_.end() && unmapped_neighbour(next->second)) {
    unmapped_.erase(UnmappedKey{proto.pool, proto.stream, next->first});
    it->second.size += next->second.size;
    blocks_.erase(next);
  }
  const auto segment = segments_.find(proto.segment);
  if (it->first == proto.segment && it->second.size == segment->second.size) {
    // release_expandable_segment: nothing of it is mapped any more.
    unmapped_.erase(UnmappedKey{proto.pool, proto.stream, it->first});
    ranges_.release(proto.segment, segment->second.size);
    blocks_.erase(it);
    segments_.erase(segment);
    return;
  }
  unmapped_.insert(UnmappedKey{proto.pool, proto.stream, it->first});
}

void CachingAllocator::release_pending(Bytes address) {
  const auto it = blocks_.find(address);
  FERRY_CHECK(it != blocks_.end() && it->second.state == BlockInfo::State::PendingFree,
              "pending free at {:#x} is missing", address.count());
  pending_bytes_ -= it->second.size;
  release_block(it);
}

void CachingAllocator::process_pending(StreamMarkers& markers) {
  pending_.process(markers, [this](Bytes address) { release_pending(address); });
}

void CachingAllocator::synchronize_pending(StreamMarkers& markers) {
  pending_.synchronize(markers, [this](Bytes address) { release_pending(address); });
}

void CachingAllocator::release_free_segments() {
  if (mode_ == AllocatorMode::Expandable) {
    // release_cached_blocks: release_blocks of the large pool, then of the small one, unmapping
    // the whole pages of every free block (Note [Expandable segments]). Unmapping one block
    // leaves the others where they are.
    std::vector<Bytes> to_unmap;
    for (const PoolKind pool : {PoolKind::Large, PoolKind::Small}) {
      for (const auto& [key, entry] : free_) {
        if (key.pool == pool) to_unmap.push_back(key.address);
      }
    }
    for (const Bytes address : to_unmap) unmap_block(address);
    return;
  }
  for (auto seg = segments_.begin(); seg != segments_.end();) {
    const auto block = blocks_.find(seg->first);
    FERRY_CHECK(block != blocks_.end(), "segment at {:#x} has no first block", seg->first.count());
    const Segment& s = seg->second;
    if (block->second.state != BlockInfo::State::Free || block->second.size != s.size) {
      ++seg;
      continue;
    }
    track(AllocatorEvent::Action::SegmentFree, seg->first, s.size, s.stream, BufferId());
    free_.erase(FreeKey{s.pool, s.stream, s.size, seg->first});
    blocks_.erase(block);
    ranges_.release(seg->first, s.size);
    ++stats_.segment_frees;
    stats_.reserved -= s.size;
    stats_.pool_reserved[pool_index(s.pool)] -= s.size;
    seg = segments_.erase(seg);
  }
}

Error CachingAllocator::out_of_memory(StreamId stream, Bytes requested, Bytes size,
                                      Bytes segment_size) const {
  const Bytes free_bytes = capacity_ - stats_.reserved;
  std::string why =
      segment_size > free_bytes ? fmt::format("only {} ({} B) is not reserved",
                                              format_bytes(free_bytes), free_bytes.count())
      : mode_ == AllocatorMode::Expandable
          ? fmt::format(
                "{} is not reserved but the virtual address space of expandable segments is "
                "used up",
                format_bytes(free_bytes))
          : fmt::format(
                "{} is not reserved but no free address range is that long (the device "
                "range is fragmented)",
                format_bytes(free_bytes));
  const std::string needed =
      mode_ == AllocatorMode::Expandable
          ? fmt::format("{} of pages mapped in an expandable segment", format_bytes(segment_size))
          : fmt::format("a new {} segment", format_bytes(segment_size));
  std::string message = fmt::format(
      "out of memory: tried to allocate {} ({} B) on stream {}; capacity {}, reserved {}, "
      "allocated {}; the {} B block needs {} and {}; {} is reserved but unallocated "
      "in partly used segments. Free or shrink live tensors, or give the device more memory.",
      format_bytes(requested), requested.count(), stream.value(), format_bytes(capacity_),
      format_bytes(stats_.reserved), format_bytes(stats_.allocated), size.count(), needed, why,
      format_bytes(stats_.reserved - stats_.allocated));
  const std::vector<BlockInfo> live = live_blocks();
  message += fmt::format("\nlive blocks ({}, by address):", live.size());
  for (std::size_t i = 0; i < live.size() && i < kOomListedBlocks; ++i) {
    const BlockInfo& b = live[i];
    message +=
        fmt::format("\n  {:#x} size {} B requested {} B stream {} {}", b.address.count(),
                    b.size.count(), b.requested.count(), b.stream.value(), state_name(b.state));
  }
  if (live.size() > kOomListedBlocks) {
    message += fmt::format("\n  ... and {} more", live.size() - kOomListedBlocks);
  }
  return Error{std::move(message)};
}

BlockInfo CachingAllocator::info(Bytes address, const Block& block) {
  return BlockInfo{address, block.size, block.requested, block.stream, block.state};
}

}  // namespace ferry::sim
