#include "ferry/sim/memory/host_allocator.hpp"

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "fake_markers.hpp"
#include "ferry/check.hpp"

namespace ferry::sim {
namespace {

using testing::FakeMarkers;

constexpr Bytes kBase{std::int64_t{1} << 40};
const StreamId kS1{1};
const StreamId kS2{2};

HostAllocation must(Result<HostAllocation> result) {
  EXPECT_TRUE(result.ok()) << (result.ok() ? "" : result.error().message);
  return std::move(result).value();
}

TEST(PinnedHostAllocator, CachingPoolRoundsToAPowerOfTwoOfAtLeast512Bytes) {
  EXPECT_EQ(pinned_block_size(Bytes(0), PinnedPool::Caching), Bytes(512));
  EXPECT_EQ(pinned_block_size(Bytes(1), PinnedPool::Caching), Bytes(512));
  EXPECT_EQ(pinned_block_size(Bytes(512), PinnedPool::Caching), Bytes(512));
  EXPECT_EQ(pinned_block_size(Bytes(513), PinnedPool::Caching), Bytes(1024));
  EXPECT_EQ(pinned_block_size(Bytes(3000), PinnedPool::Caching), Bytes(4096));
  EXPECT_EQ(pinned_block_size(kMiB + Bytes(1), PinnedPool::Caching), 2 * kMiB);
  EXPECT_EQ(pinned_block_size(96 * kMiB, PinnedPool::Caching), 128 * kMiB);
}

TEST(PinnedHostAllocator, ExactPoolRoundsTo512Bytes) {
  EXPECT_EQ(pinned_block_size(Bytes(0), PinnedPool::Exact), Bytes(512));
  EXPECT_EQ(pinned_block_size(Bytes(513), PinnedPool::Exact), Bytes(1024));
  EXPECT_EQ(pinned_block_size(Bytes(3000), PinnedPool::Exact), Bytes(3072));
  EXPECT_EQ(pinned_block_size(96 * kMiB, PinnedPool::Exact), 96 * kMiB);
}

TEST(PinnedHostAllocator, PinsBlocksAtIncreasingAddresses) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(3000), PinnedPool::Caching, markers));
  const HostAllocation b = must(alloc.malloc(Bytes(3000), PinnedPool::Exact, markers));
  EXPECT_EQ(a.address, kBase);
  EXPECT_EQ(a.size, Bytes(4096));
  EXPECT_EQ(b.address, kBase + Bytes(4096));
  EXPECT_EQ(b.size, Bytes(3072));
  EXPECT_EQ(alloc.stats().reserved, Bytes(4096 + 3072));
  EXPECT_EQ(alloc.stats().allocated, Bytes(4096 + 3072));
  EXPECT_EQ(alloc.stats().host_allocs, 2);
  const std::vector<HostBlockInfo> blocks = alloc.blocks();
  ASSERT_EQ(blocks.size(), 2U);
  EXPECT_EQ(blocks[0].requested, Bytes(3000));
  EXPECT_EQ(blocks[1].state, HostBlockInfo::State::Allocated);
}

TEST(PinnedHostAllocator, ReusesAFreedBlockForARequestOfTheSameBlockSize) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(3000), PinnedPool::Caching, markers));
  alloc.free(a.block, markers);
  EXPECT_EQ(alloc.stats().allocated, Bytes(0));
  EXPECT_EQ(alloc.stats().reserved, Bytes(4096));
  const HostAllocation b = must(alloc.malloc(Bytes(4000), PinnedPool::Caching, markers));
  EXPECT_EQ(b.address, a.address);
  EXPECT_EQ(alloc.stats().host_allocs, 1);
  EXPECT_EQ(alloc.blocks()[0].requested, Bytes(4000));
}

TEST(PinnedHostAllocator, DoesNotReuseABlockOfAnotherSize) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(3000), PinnedPool::Exact, markers));
  alloc.free(a.block, markers);
  const HostAllocation smaller = must(alloc.malloc(Bytes(2000), PinnedPool::Exact, markers));
  EXPECT_NE(smaller.address, a.address);  // 2048 B does not take the cached 3072 B block
  const HostAllocation same = must(alloc.malloc(Bytes(2900), PinnedPool::Exact, markers));
  EXPECT_EQ(same.address, a.address);
  EXPECT_EQ(alloc.stats().host_allocs, 2);
}

TEST(PinnedHostAllocator, PoolsShareCachedBlocksOfEqualSize) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(1024), PinnedPool::Exact, markers));
  alloc.free(a.block, markers);
  EXPECT_EQ(must(alloc.malloc(Bytes(700), PinnedPool::Caching, markers)).address, a.address);
}

TEST(PinnedHostAllocator, RecordStreamDefersReuseUntilMarkersComplete) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(kMiB, PinnedPool::Caching, markers));
  alloc.record_stream(a.block, kS2);
  alloc.record_stream(a.block, kS1);
  alloc.record_stream(a.block, kS2);
  alloc.free(a.block, markers);
  ASSERT_EQ(markers.recorded, (std::vector<StreamId>{kS1, kS2}));
  EXPECT_EQ(alloc.stats().deferred_frees, 1);
  EXPECT_EQ(alloc.stats().allocated, kMiB);
  EXPECT_EQ(alloc.blocks()[0].state, HostBlockInfo::State::PendingFree);

  markers.complete(MarkerId(0));
  const HostAllocation b = must(alloc.malloc(kMiB, PinnedPool::Caching, markers));
  EXPECT_NE(b.address, a.address);
  EXPECT_EQ(markers.queries, 2);

  markers.complete(MarkerId(1));
  const HostAllocation c = must(alloc.malloc(kMiB, PinnedPool::Caching, markers));
  EXPECT_EQ(c.address, a.address);
  EXPECT_EQ(markers.queries, 3);
  EXPECT_EQ(markers.synchronizes, 0);
}

TEST(PinnedHostAllocator, CapRefusalNamesTheCapThePinnedBytesAndTheRequest) {
  PinnedHostAllocator alloc(Bytes(4096), kBase);
  FakeMarkers markers;
  (void)must(alloc.malloc(Bytes(4096), PinnedPool::Exact, markers));
  const Result<HostAllocation> r = alloc.malloc(Bytes(100), PinnedPool::Caching, markers);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("pinned host memory cap of 4.00 KiB (4096 B) reached: 4.00 KiB "
                                   "(4096 B) pinned, 0 B of it waiting on streams, request 100 B "
                                   "(a 512 B block)"),
            std::string::npos)
      << r.error().message;
  EXPECT_EQ(alloc.stats().cap_refusals, 1);
  EXPECT_EQ(alloc.stats().reserved, Bytes(4096));
}

TEST(PinnedHostAllocator, CapRetryUnpinsCachedBlocks) {
  PinnedHostAllocator alloc(Bytes(4096), kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(2048), PinnedPool::Exact, markers));
  const HostAllocation b = must(alloc.malloc(Bytes(2048), PinnedPool::Exact, markers));
  alloc.free(a.block, markers);
  alloc.free(b.block, markers);
  const HostAllocation c = must(alloc.malloc(Bytes(4096), PinnedPool::Exact, markers));
  EXPECT_EQ(c.address, kBase);
  EXPECT_EQ(alloc.stats().host_frees, 2);
  EXPECT_EQ(alloc.stats().reserved, Bytes(4096));
  EXPECT_EQ(alloc.stats().cap_refusals, 0);
}

TEST(PinnedHostAllocator, CapRetryLeavesPendingBlocksPinned) {
  PinnedHostAllocator alloc(Bytes(4096), kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(4096), PinnedPool::Exact, markers));
  alloc.record_stream(a.block, kS1);
  alloc.free(a.block, markers);
  const Result<HostAllocation> r = alloc.malloc(Bytes(512), PinnedPool::Exact, markers);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("4.00 KiB of it waiting on streams"), std::string::npos)
      << r.error().message;
  EXPECT_EQ(markers.synchronizes, 0);
  ASSERT_EQ(alloc.blocks().size(), 1U);
  EXPECT_EQ(alloc.blocks()[0].state, HostBlockInfo::State::PendingFree);
}

TEST(PinnedHostAllocator, EmptyCacheWaitsForPendingFreesAndUnpinsEverythingFree) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation keep = must(alloc.malloc(Bytes(512), PinnedPool::Exact, markers));
  const HostAllocation pending = must(alloc.malloc(Bytes(1024), PinnedPool::Exact, markers));
  const HostAllocation cached = must(alloc.malloc(Bytes(2048), PinnedPool::Exact, markers));
  alloc.record_stream(pending.block, kS1);
  alloc.free(pending.block, markers);
  alloc.free(cached.block, markers);
  alloc.empty_cache(markers);
  EXPECT_EQ(markers.synchronizes, 1);
  ASSERT_EQ(alloc.blocks().size(), 1U);
  EXPECT_EQ(alloc.blocks()[0].address, keep.address);
  EXPECT_EQ(alloc.stats().reserved, Bytes(512));
  EXPECT_EQ(alloc.stats().allocated, Bytes(512));
  EXPECT_EQ(alloc.stats().host_frees, 2);
  // Unpinned ranges are reused, lowest address first.
  EXPECT_EQ(must(alloc.malloc(Bytes(1024), PinnedPool::Exact, markers)).address,
            kBase + Bytes(512));
}

TEST(PinnedHostAllocator, StatsKeepPeaks) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(kMiB, PinnedPool::Exact, markers));
  const HostAllocation b = must(alloc.malloc(3 * kMiB, PinnedPool::Caching, markers));
  alloc.free(a.block, markers);
  alloc.free(b.block, markers);
  alloc.empty_cache(markers);
  const HostAllocatorStats& s = alloc.stats();
  EXPECT_EQ(s.allocated, Bytes(0));
  EXPECT_EQ(s.reserved, Bytes(0));
  EXPECT_EQ(s.allocated_peak, 5 * kMiB);
  EXPECT_EQ(s.reserved_peak, 5 * kMiB);
  EXPECT_EQ(s.host_allocs, 2);
  EXPECT_EQ(s.host_frees, 2);
  EXPECT_TRUE(alloc.blocks().empty());
}

TEST(PinnedHostAllocator, PlantedFaultIgnoresRecordStream) {
  PinnedHostAllocator alloc(kGiB, kBase, AllocatorFaults{.ignore_record_stream = true});
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(512), PinnedPool::Exact, markers));
  alloc.record_stream(a.block, kS1);
  alloc.free(a.block, markers);
  EXPECT_TRUE(markers.recorded.empty());
  EXPECT_EQ(must(alloc.malloc(Bytes(512), PinnedPool::Exact, markers)).address, a.address);
}

TEST(PinnedHostAllocator, MisuseIsAnInvariantError) {
  PinnedHostAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const HostAllocation a = must(alloc.malloc(Bytes(512), PinnedPool::Exact, markers));
  EXPECT_THROW(alloc.free(HostBlockId(42), markers), InvariantError);
  alloc.free(a.block, markers);
  EXPECT_THROW(alloc.free(a.block, markers), InvariantError);
  EXPECT_THROW(alloc.record_stream(a.block, kS1), InvariantError);
  EXPECT_THROW((void)alloc.malloc(Bytes(-5), PinnedPool::Exact, markers), InvariantError);
}

}  // namespace
}  // namespace ferry::sim
