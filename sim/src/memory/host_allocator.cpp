#include "ferry/sim/memory/host_allocator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>

namespace ferry::sim {

Bytes pinned_block_size(Bytes requested, PinnedPool pool) {
  // round_size checks the request and gives the Exact size: a multiple of 512 B, at least 512 B.
  // The Caching size is a power of two; PyTorch rounds to at least 1 byte, ferry to at least
  // 512 B so that every pinned block starts 512 B aligned, as with the device allocator.
  const Bytes rounded = round_size(requested);
  if (pool == PinnedPool::Exact) {
    return rounded;
  }
  return Bytes(
      static_cast<std::int64_t>(std::bit_ceil(static_cast<std::uint64_t>(rounded.count()))));
}

PinnedHostAllocator::PinnedHostAllocator(Bytes capacity, Bytes base)
    : PinnedHostAllocator(capacity, base, AllocatorFaults{}) {}

PinnedHostAllocator::PinnedHostAllocator(Bytes capacity, Bytes base, AllocatorFaults faults)
    : capacity_(capacity), base_(base), faults_(faults), ranges_(base, capacity) {}

Result<HostAllocation> PinnedHostAllocator::malloc(Bytes requested, PinnedPool pool,
                                                   StreamMarkers& markers) {
  const Bytes size = pinned_block_size(requested, pool);
  // See Note [record_stream deferral].
  process_pending(markers);
  // Cached blocks are reused only for a request of exactly their size, lowest address first.
  const auto cached = cached_.lower_bound({size, Bytes(0)});
  if (cached != cached_.end() && cached->first == size) {
    const Bytes address = cached->second;
    cached_.erase(cached);
    return hand_out(address, requested);
  }
  auto address = pin(size);
  if (!address) {
    // Over the cap: unpin every cached free block (pending ones still wait for their streams)
    // and try once more.
    unpin_cached();
    address = pin(size);
  }
  if (address) {
    return hand_out(*address, requested);
  }
  ++stats_.cap_refusals;
  Bytes pending_bytes;
  for (const DeferredFrees::Deferred& pending : pending_.pending()) {
    pending_bytes += blocks_.at(pending.address).size;
  }
  const std::string request =
      fmt::format("request {} B (a {} B block)", requested.count(), size.count());
  const std::string held =
      fmt::format("{} ({} B) pinned, {} of it waiting on streams", format_bytes(stats_.reserved),
                  stats_.reserved.count(), format_bytes(pending_bytes));
  if (stats_.reserved + size > capacity_) {
    return Error{
        fmt::format("pinned host memory cap of {} ({} B) reached: {}, {}. Free pinned "
                    "buffers (or let their streams finish), or raise the cap.",
                    format_bytes(capacity_), capacity_.count(), held, request)};
  }
  return Error{
      fmt::format("pinned host memory cap of {} ({} B): {}, {}; the bytes fit under the "
                  "cap but no free address range is that long (fragmented). Use fewer "
                  "distinct sizes, or raise the cap.",
                  format_bytes(capacity_), capacity_.count(), held, request)};
}

void PinnedHostAllocator::record_stream(HostBlockId block, StreamId stream) {
  FERRY_CHECK(stream.valid(), "record_stream of pinned block {} on an invalid stream",
              block.value());
  const auto found = live_.find(block);
  FERRY_CHECK(found != live_.end(), "record_stream on pinned block {}, which is not allocated",
              block.value());
  std::vector<StreamId>& streams = blocks_.at(found->second).streams;
  const auto at = std::lower_bound(streams.begin(), streams.end(), stream);
  if (at == streams.end() || *at != stream) {
    streams.insert(at, stream);
  }
}

std::span<const StreamId> PinnedHostAllocator::deferring_streams(HostBlockId block) const {
  const auto found = live_.find(block);
  FERRY_CHECK(found != live_.end(), "pinned block {} is not allocated", block.value());
  if (faults_.ignore_record_stream) {
    return {};
  }
  return blocks_.at(found->second).streams;
}

void PinnedHostAllocator::free(HostBlockId block, StreamMarkers& markers) {
  const auto found = live_.find(block);
  FERRY_CHECK(found != live_.end(),
              "free of pinned block {}, which is not allocated (unknown id "
              "or already freed)",
              block.value());
  const Bytes address = found->second;
  live_.erase(found);
  Block& b = blocks_.at(address);
  if (b.streams.empty() || faults_.ignore_record_stream) {
    release_block(address, b);
    return;
  }
  // See Note [record_stream deferral]; markers in increasing stream order for determinism.
  b.state = HostBlockInfo::State::PendingFree;
  b.id = HostBlockId{};
  pending_.defer(address, b.streams, b.markers, markers);
  ++stats_.deferred_frees;
}

void PinnedHostAllocator::empty_cache(StreamMarkers& markers) {
  synchronize_pending(markers);
  unpin_cached();
}

std::vector<HostBlockInfo> PinnedHostAllocator::blocks() const {
  std::vector<HostBlockInfo> out;
  out.reserve(blocks_.size());
  for (const auto& [address, block] : blocks_) {
    out.push_back(HostBlockInfo{address, block.size, block.requested, block.state});
  }
  return out;
}

std::optional<Bytes> PinnedHostAllocator::pin(Bytes size) {
  if (stats_.reserved + size > capacity_) {
    return std::nullopt;
  }
  const auto address = ranges_.allocate(size);
  if (!address) {
    return std::nullopt;
  }
  Block block;
  block.size = size;
  blocks_.emplace(*address, std::move(block));
  ++stats_.host_allocs;
  stats_.reserved += size;
  stats_.reserved_peak = std::max(stats_.reserved_peak, stats_.reserved);
  return address;
}

HostAllocation PinnedHostAllocator::hand_out(Bytes address, Bytes requested) {
  Block& b = blocks_.at(address);
  FERRY_CHECK(b.state == HostBlockInfo::State::Free, "pinned block at {:#x} is not free",
              address.count());
  FERRY_CHECK(next_id_ < HostBlockId::kInvalid, "pinned block ids exhausted");
  b.state = HostBlockInfo::State::Allocated;
  b.requested = requested;
  b.id = HostBlockId(next_id_++);
  live_.emplace(b.id, address);
  stats_.allocated += b.size;
  stats_.allocated_peak = std::max(stats_.allocated_peak, stats_.allocated);
  return HostAllocation{b.id, address, b.size};
}

void PinnedHostAllocator::release_block(Bytes address, Block& block) {
  stats_.allocated -= block.size;
  block.state = HostBlockInfo::State::Free;
  block.requested = Bytes(0);
  block.id = HostBlockId{};
  block.streams.clear();
  block.markers.clear();
  cached_.emplace(block.size, address);
}

void PinnedHostAllocator::process_pending(StreamMarkers& markers) {
  pending_.process(markers, [this](Bytes address) { release_block(address, blocks_.at(address)); });
}

void PinnedHostAllocator::synchronize_pending(StreamMarkers& markers) {
  pending_.synchronize(markers,
                       [this](Bytes address) { release_block(address, blocks_.at(address)); });
}

void PinnedHostAllocator::unpin_cached() {
  for (const auto& [size, address] : cached_) {
    blocks_.erase(address);
    ranges_.release(address, size);
    stats_.reserved -= size;
    ++stats_.host_frees;
  }
  cached_.clear();
}

}  // namespace ferry::sim
