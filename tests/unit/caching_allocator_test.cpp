#include "ferry/sim/memory/caching_allocator.hpp"

#include <fmt/format.h>
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

constexpr Bytes kBase{std::int64_t{1} << 32};
constexpr Bytes kHalfMiB{512 * 1024};
const StreamId kS0{0};
const StreamId kS1{1};
const StreamId kS2{2};

DeviceAllocation must(Result<DeviceAllocation> result) {
  EXPECT_TRUE(result.ok()) << (result.ok() ? "" : result.error().message);
  return std::move(result).value();
}

TEST(CachingAllocatorSizes, RoundSizeRoundsUpToMultiplesOf512Bytes) {
  EXPECT_EQ(round_size(Bytes(0)), Bytes(512));
  EXPECT_EQ(round_size(Bytes(1)), Bytes(512));
  EXPECT_EQ(round_size(Bytes(512)), Bytes(512));
  EXPECT_EQ(round_size(Bytes(513)), Bytes(1024));
  EXPECT_EQ(round_size(kMiB + Bytes(1)), kMiB + Bytes(512));
  EXPECT_THROW((void)round_size(Bytes(-1)), InvariantError);
}

TEST(CachingAllocatorSizes, PoolForSplitsAtOneMebibyte) {
  EXPECT_EQ(pool_for(Bytes(512)), PoolKind::Small);
  EXPECT_EQ(pool_for(kMiB), PoolKind::Small);
  EXPECT_EQ(pool_for(kMiB + Bytes(512)), PoolKind::Large);
}

TEST(CachingAllocatorSizes, SegmentSizeDependsOnPoolAndSize) {
  EXPECT_EQ(segment_size_for(Bytes(512)), 2 * kMiB);
  EXPECT_EQ(segment_size_for(kMiB), 2 * kMiB);
  EXPECT_EQ(segment_size_for(round_size(kMiB + Bytes(1))), 20 * kMiB);
  EXPECT_EQ(segment_size_for(10 * kMiB - Bytes(512)), 20 * kMiB);
  EXPECT_EQ(segment_size_for(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(segment_size_for(11 * kMiB), 12 * kMiB);
  EXPECT_EQ(segment_size_for(round_size(11 * kMiB + Bytes(1))), 12 * kMiB);
  EXPECT_EQ(segment_size_for(20 * kMiB), 20 * kMiB);
}

TEST(AddressRangeAllocator, TakesFirstFitAndCoalescesReleasedRanges) {
  AddressRangeAllocator ranges(Bytes(1000), Bytes(100));
  EXPECT_EQ(ranges.allocate(Bytes(30)), Bytes(1000));
  EXPECT_EQ(ranges.allocate(Bytes(30)), Bytes(1030));
  EXPECT_EQ(ranges.allocate(Bytes(30)), Bytes(1060));
  EXPECT_EQ(ranges.allocate(Bytes(20)), std::nullopt);
  ranges.release(Bytes(1000), Bytes(30));
  ranges.release(Bytes(1060), Bytes(30));
  EXPECT_EQ(ranges.allocate(Bytes(40)), Bytes(1060));  // 1060..1100 after coalescing
  ranges.release(Bytes(1030), Bytes(30));              // 1000..1060 in one piece
  EXPECT_EQ(ranges.allocate(Bytes(60)), Bytes(1000));
  EXPECT_THROW(ranges.release(Bytes(990), Bytes(20)), InvariantError);
}

TEST(CachingAllocator, FirstAllocationReservesOneSmallSegment) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, Bytes(1000), markers));
  EXPECT_EQ(a.address, kBase);
  EXPECT_EQ(a.size, Bytes(1024));
  EXPECT_EQ(alloc.stats().reserved, 2 * kMiB);
  EXPECT_EQ(alloc.stats().allocated, Bytes(1024));
  EXPECT_EQ(alloc.stats().requested, Bytes(1000));
  EXPECT_EQ(alloc.stats().segment_allocs, 1);

  const std::vector<SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments.size(), 1U);
  EXPECT_EQ(segments[0].pool, PoolKind::Small);
  EXPECT_EQ(segments[0].stream, kS0);
  ASSERT_EQ(segments[0].blocks.size(), 2U);
  EXPECT_EQ(segments[0].blocks[0].state, BlockInfo::State::Allocated);
  EXPECT_EQ(segments[0].blocks[0].requested, Bytes(1000));
  EXPECT_EQ(segments[0].blocks[1].state, BlockInfo::State::Free);
  EXPECT_EQ(segments[0].blocks[1].address, kBase + Bytes(1024));
  EXPECT_EQ(segments[0].blocks[1].size, 2 * kMiB - Bytes(1024));
}

TEST(CachingAllocator, ZeroByteRequestGetsA512ByteBlock) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, Bytes(0), markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, Bytes(0), markers));
  EXPECT_EQ(a.size, Bytes(512));
  EXPECT_EQ(b.address, a.address + Bytes(512));
  EXPECT_EQ(alloc.stats().requested, Bytes(0));
}

TEST(CachingAllocator, LargeRequestsGetTheirOwnSegmentSizes) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  (void)must(alloc.malloc(kS0, kMiB + Bytes(1), markers));
  EXPECT_EQ(alloc.stats().reserved, 20 * kMiB);
  EXPECT_EQ(alloc.stats().pool_reserved[1], 20 * kMiB);
  (void)must(alloc.malloc(kS1, 11 * kMiB, markers));
  EXPECT_EQ(alloc.stats().reserved, 32 * kMiB);
  EXPECT_EQ(alloc.segments().back().size, 12 * kMiB);
}

TEST(CachingAllocator, SplitsSmallBlockWhenRemainderIsAtLeast512Bytes) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  (void)must(alloc.malloc(kS0, kMiB, markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, kMiB - Bytes(512), markers));
  EXPECT_EQ(b.size, kMiB - Bytes(512));
  const DeviceAllocation c = must(alloc.malloc(kS0, Bytes(1), markers));
  EXPECT_EQ(c.address, kBase + 2 * kMiB - Bytes(512));
  EXPECT_EQ(c.size, Bytes(512));
  EXPECT_EQ(alloc.stats().segment_allocs, 1);
}

TEST(CachingAllocator, LargeBlockKeepsRemainderOfAtMostOneMebibyte) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation whole = must(alloc.malloc(kS0, 19 * kMiB, markers));
  EXPECT_EQ(whole.size, 20 * kMiB);  // a 1 MiB remainder is not split off
  EXPECT_EQ(alloc.stats().allocated, 20 * kMiB);
  EXPECT_EQ(alloc.stats().requested, 19 * kMiB);

  const DeviceAllocation split = must(alloc.malloc(kS0, 19 * kMiB - Bytes(512), markers));
  EXPECT_EQ(split.size, 19 * kMiB - Bytes(512));  // 1 MiB + 512 B is split off
  ASSERT_EQ(alloc.segments().size(), 2U);
  EXPECT_EQ(alloc.segments()[1].blocks.size(), 2U);
}

TEST(CachingAllocator, SplitsLargeBlockAndReusesRemainder) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, 2 * kMiB, markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, 5 * kMiB, markers));
  EXPECT_EQ(a.address, kBase);
  EXPECT_EQ(b.address, kBase + 2 * kMiB);
  EXPECT_EQ(alloc.stats().segment_allocs, 1);
  EXPECT_EQ(alloc.stats().reserved, 20 * kMiB);
}

TEST(CachingAllocator, BestFitPicksSmallestBlockThenLowestAddress) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  // One 20 MiB segment cut into 4 | 2 | 3 | 2 | 3 | 2 | (4 free) MiB.
  const DeviceAllocation a1 = must(alloc.malloc(kS0, 4 * kMiB, markers));
  (void)must(alloc.malloc(kS0, 2 * kMiB, markers));
  const DeviceAllocation a2 = must(alloc.malloc(kS0, 3 * kMiB, markers));
  (void)must(alloc.malloc(kS0, 2 * kMiB, markers));
  const DeviceAllocation a3 = must(alloc.malloc(kS0, 3 * kMiB, markers));
  (void)must(alloc.malloc(kS0, 2 * kMiB, markers));
  alloc.free(a1.block, markers);
  alloc.free(a2.block, markers);
  alloc.free(a3.block, markers);

  EXPECT_EQ(must(alloc.malloc(kS0, 3 * kMiB, markers)).address, a2.address);
  EXPECT_EQ(must(alloc.malloc(kS0, 3 * kMiB, markers)).address, a3.address);
  const DeviceAllocation c = must(alloc.malloc(kS0, 2 * kMiB + kHalfMiB, markers));
  EXPECT_EQ(c.address, a1.address);  // 4 MiB at the lowest address beats 4 MiB at the end
  EXPECT_EQ(c.size, 2 * kMiB + kHalfMiB);
  EXPECT_EQ(alloc.stats().segment_allocs, 1);
}

TEST(CachingAllocator, BlocksAreReusedOnlyOnTheirAllocationStream) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, kMiB, markers));
  alloc.free(a.block, markers);
  const DeviceAllocation b = must(alloc.malloc(kS1, kMiB, markers));
  EXPECT_NE(b.address, a.address);
  EXPECT_EQ(alloc.stats().segment_allocs, 2);
  const std::vector<SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments.size(), 2U);
  EXPECT_EQ(segments[0].stream, kS0);
  EXPECT_EQ(segments[1].stream, kS1);
  EXPECT_EQ(must(alloc.malloc(kS0, kMiB, markers)).address, a.address);
}

TEST(CachingAllocator, SmallAndLargePoolsDoNotShareBlocks) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation large = must(alloc.malloc(kS0, 4 * kMiB, markers));
  alloc.free(large.block, markers);
  const DeviceAllocation small = must(alloc.malloc(kS0, Bytes(4096), markers));
  EXPECT_EQ(alloc.stats().segment_allocs, 2);
  EXPECT_EQ(small.address, kBase + 20 * kMiB);
}

TEST(CachingAllocator, FreeMergesWithFreeNeighboursInTheSameSegment) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, kHalfMiB, markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, kHalfMiB, markers));
  const DeviceAllocation c = must(alloc.malloc(kS0, kHalfMiB, markers));
  alloc.free(a.block, markers);
  alloc.free(c.block, markers);
  ASSERT_EQ(alloc.segments()[0].blocks.size(), 3U);  // a | b | c+rest
  EXPECT_EQ(alloc.segments()[0].blocks[2].size, kMiB);
  alloc.free(b.block, markers);
  const std::vector<SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments[0].blocks.size(), 1U);
  EXPECT_EQ(segments[0].blocks[0].size, 2 * kMiB);
  EXPECT_EQ(segments[0].blocks[0].state, BlockInfo::State::Free);
}

TEST(CachingAllocator, DoesNotMergeAcrossAdjacentSegments) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, kMiB, markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, kMiB, markers));
  const DeviceAllocation c = must(alloc.malloc(kS0, kMiB, markers));  // second segment
  EXPECT_EQ(c.address, kBase + 2 * kMiB);
  alloc.free(a.block, markers);
  alloc.free(b.block, markers);
  alloc.free(c.block, markers);
  const std::vector<SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments.size(), 2U);
  EXPECT_EQ(segments[0].blocks.size(), 1U);
  EXPECT_EQ(segments[1].blocks.size(), 1U);
  // Equal best fits: the lowest address wins.
  EXPECT_EQ(must(alloc.malloc(kS0, kMiB, markers)).address, kBase);
}

TEST(CachingAllocator, RecordStreamDefersFreeUntilMarkerCompletes) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation x = must(alloc.malloc(kS0, 20 * kMiB, markers));
  alloc.record_stream(x.block, kS1);
  alloc.free(x.block, markers);
  ASSERT_EQ(markers.recorded, std::vector<StreamId>{kS1});
  EXPECT_EQ(alloc.stats().deferred_frees, 1);
  EXPECT_EQ(alloc.stats().allocated, 20 * kMiB);  // pending frees count as allocated
  ASSERT_EQ(alloc.live_blocks().size(), 1U);
  EXPECT_EQ(alloc.live_blocks()[0].state, BlockInfo::State::PendingFree);
  EXPECT_EQ(markers.queries, 0);

  // The marker is incomplete: the next malloc asks, and must take fresh memory.
  const DeviceAllocation y = must(alloc.malloc(kS0, 20 * kMiB, markers));
  EXPECT_EQ(markers.queries, 1);
  EXPECT_EQ(y.address, kBase + 20 * kMiB);

  markers.complete(MarkerId(0));
  EXPECT_EQ(alloc.live_blocks()[0].state, BlockInfo::State::PendingFree);  // not asked yet
  const DeviceAllocation z = must(alloc.malloc(kS0, 20 * kMiB, markers));
  EXPECT_EQ(markers.queries, 2);
  EXPECT_EQ(z.address, x.address);
  EXPECT_EQ(alloc.stats().segment_allocs, 2);
  EXPECT_EQ(markers.synchronizes, 0);
}

TEST(CachingAllocator, PendingBlockReturnsOnlyWhenAllMarkersComplete) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation x = must(alloc.malloc(kS0, 4 * kMiB, markers));
  alloc.record_stream(x.block, kS2);
  alloc.record_stream(x.block, kS1);
  alloc.free(x.block, markers);
  ASSERT_EQ(markers.recorded, (std::vector<StreamId>{kS1, kS2}));  // increasing stream order
  markers.complete(MarkerId(0));
  (void)must(alloc.malloc(kS0, Bytes(512), markers));
  EXPECT_EQ(markers.queries, 2);
  ASSERT_EQ(alloc.live_blocks().size(), 2U);
  EXPECT_EQ(alloc.live_blocks()[0].state, BlockInfo::State::PendingFree);
  markers.complete(MarkerId(1));
  const DeviceAllocation again = must(alloc.malloc(kS0, 4 * kMiB, markers));
  EXPECT_EQ(markers.queries, 3);  // the completed marker is not asked again
  EXPECT_EQ(again.address, x.address);
}

// A device that counts completed work: the blocks a malloc found waiting are asked again only
// once some work completed; a block deferred since is asked at once.
TEST(CachingAllocator, WaitingBlocksAreNotAskedAgainUntilWorkCompletes) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  markers.counts_completions = true;
  const DeviceAllocation x = must(alloc.malloc(kS0, 4 * kMiB, markers));
  alloc.record_stream(x.block, kS1);
  alloc.free(x.block, markers);
  (void)must(alloc.malloc(kS0, Bytes(512), markers));
  EXPECT_EQ(markers.queries, 1);
  (void)must(alloc.malloc(kS0, Bytes(512), markers));
  EXPECT_EQ(markers.queries, 1);  // nothing completed: the same answer

  const DeviceAllocation y = must(alloc.malloc(kS0, 8 * kMiB, markers));
  alloc.record_stream(y.block, kS2);
  alloc.free(y.block, markers);
  (void)must(alloc.malloc(kS0, Bytes(512), markers));
  EXPECT_EQ(markers.queries, 2);  // only the block deferred since

  markers.complete(MarkerId(0));
  const DeviceAllocation again = must(alloc.malloc(kS0, 4 * kMiB, markers));
  EXPECT_EQ(markers.queries, 4);  // both asked once work completed; x's bytes come back
  EXPECT_EQ(again.address, x.address);
  ASSERT_EQ(alloc.live_blocks().size(), 5U);
}

TEST(CachingAllocator, RecordStreamOnAllocationStreamIsANoOp) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation x = must(alloc.malloc(kS1, kMiB, markers));
  alloc.record_stream(x.block, kS1);
  alloc.free(x.block, markers);
  EXPECT_TRUE(markers.recorded.empty());
  EXPECT_EQ(alloc.stats().deferred_frees, 0);
  EXPECT_TRUE(alloc.live_blocks().empty());
}

TEST(CachingAllocator, PlantedFaultIgnoresRecordStream) {
  CachingAllocator alloc(kGiB, kBase, AllocatorFaults{.ignore_record_stream = true});
  FakeMarkers markers;
  const DeviceAllocation x = must(alloc.malloc(kS0, kMiB, markers));
  alloc.record_stream(x.block, kS1);
  alloc.free(x.block, markers);
  EXPECT_TRUE(markers.recorded.empty());
  EXPECT_EQ(must(alloc.malloc(kS0, kMiB, markers)).address, x.address);
}

TEST(CachingAllocator, OomErrorListsLiveBlocksByAddress) {
  CachingAllocator alloc(4 * kMiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, Bytes(1000), markers));
  const DeviceAllocation b = must(alloc.malloc(kS1, Bytes(3000), markers));
  const DeviceAllocation c = must(alloc.malloc(kS0, Bytes(700), markers));
  alloc.record_stream(c.block, kS2);
  alloc.free(c.block, markers);
  const std::vector<SegmentInfo> before = alloc.segments();

  const Result<DeviceAllocation> r = alloc.malloc(kS2, Bytes(5000), markers);
  ASSERT_FALSE(r.ok());
  const std::string& message = r.error().message;
  EXPECT_NE(message.find("out of memory: tried to allocate 4.88 KiB (5000 B) on stream 2; "
                         "capacity 4.00 MiB, reserved 4.00 MiB, allocated"),
            std::string::npos)
      << message;
  // The pending free was synchronized and released while trying; nothing else changed.
  EXPECT_EQ(markers.synchronizes, 1);
  EXPECT_EQ(alloc.stats().ooms, 1);
  EXPECT_EQ(alloc.stats().reserved, 4 * kMiB);
  EXPECT_EQ(alloc.live_blocks().size(), 2U);
  EXPECT_EQ(alloc.segments().size(), before.size());
  const std::string line_a =
      fmt::format("{:#x} size 1024 B requested 1000 B stream 0 allocated", a.address.count());
  const std::string line_b =
      fmt::format("{:#x} size 3072 B requested 3000 B stream 1 allocated", b.address.count());
  ASSERT_NE(message.find(line_a), std::string::npos) << message;
  ASSERT_NE(message.find(line_b), std::string::npos) << message;
  EXPECT_LT(message.find(line_a), message.find(line_b));
  EXPECT_NE(message.find("live blocks (2, by address)"), std::string::npos) << message;
}

TEST(CachingAllocator, OomErrorCapsTheListOfLiveBlocks) {
  CachingAllocator alloc(2 * kMiB, kBase);
  FakeMarkers markers;
  for (int i = 0; i < 25; ++i) {
    (void)must(alloc.malloc(kS0, Bytes(512), markers));
  }
  const Result<DeviceAllocation> r = alloc.malloc(kS1, Bytes(512), markers);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("\n  ... and 5 more"), std::string::npos) << r.error().message;
}

TEST(CachingAllocator, OomRetryReleasesCachedSegmentsAndSucceeds) {
  CachingAllocator alloc(20 * kMiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, 20 * kMiB, markers));
  alloc.free(a.block, markers);
  EXPECT_EQ(alloc.stats().reserved, 20 * kMiB);  // cached, on stream 0
  const DeviceAllocation b = must(alloc.malloc(kS1, kMiB, markers));
  EXPECT_EQ(b.address, kBase);
  EXPECT_EQ(alloc.stats().segment_frees, 1);
  EXPECT_EQ(alloc.stats().segment_allocs, 2);
  EXPECT_EQ(alloc.stats().reserved, 2 * kMiB);
  EXPECT_EQ(alloc.stats().ooms, 0);
}

TEST(CachingAllocator, OomRetrySynchronizesPendingFrees) {
  CachingAllocator alloc(20 * kMiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, 20 * kMiB, markers));
  alloc.record_stream(a.block, kS1);
  alloc.free(a.block, markers);
  const DeviceAllocation b = must(alloc.malloc(kS0, Bytes(512), markers));
  EXPECT_EQ(markers.queries, 1);
  EXPECT_EQ(markers.synchronizes, 1);
  EXPECT_EQ(b.address, kBase);
  EXPECT_EQ(alloc.stats().segment_frees, 1);
  EXPECT_EQ(alloc.stats().allocated, Bytes(512));
}

TEST(CachingAllocator, OomWhenAddressRangeIsFragmented) {
  CachingAllocator alloc(44 * kMiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, 20 * kMiB, markers));  // [0, 20)
  (void)must(alloc.malloc(kS0, Bytes(512), markers));                      // [20, 22)
  alloc.free(a.block, markers);
  // 22 MiB are unreserved after the retry frees [0, 20), but only as 20 + 22 MiB pieces.
  const Result<DeviceAllocation> r = alloc.malloc(kS1, 24 * kMiB, markers);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("fragmented"), std::string::npos) << r.error().message;
  EXPECT_EQ(alloc.stats().segment_frees, 1);
}

TEST(CachingAllocator, EmptyCacheReleasesFullyFreeSegmentsOnly) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation keep = must(alloc.malloc(kS0, kMiB, markers));
  const DeviceAllocation gone = must(alloc.malloc(kS1, 4 * kMiB, markers));
  const DeviceAllocation pending = must(alloc.malloc(kS2, 4 * kMiB, markers));
  const DeviceAllocation part = must(alloc.malloc(kS0, kHalfMiB, markers));
  alloc.record_stream(pending.block, kS0);
  alloc.free(gone.block, markers);
  alloc.free(pending.block, markers);
  alloc.free(part.block, markers);
  alloc.empty_cache(markers);
  EXPECT_EQ(markers.synchronizes, 1);
  const std::vector<SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments.size(), 1U);
  EXPECT_EQ(segments[0].address, keep.address);
  EXPECT_EQ(alloc.stats().reserved, 2 * kMiB);
  EXPECT_EQ(alloc.stats().segment_frees, 2);
  EXPECT_EQ(alloc.live_blocks().size(), 1U);
}

TEST(CachingAllocator, ReleasedSegmentRangesAreReusedLowestFirst) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, 20 * kMiB, markers));
  (void)must(alloc.malloc(kS1, 20 * kMiB, markers));
  alloc.free(a.block, markers);
  alloc.empty_cache(markers);
  EXPECT_EQ(must(alloc.malloc(kS2, Bytes(512), markers)).address, kBase);
  EXPECT_EQ(must(alloc.malloc(kS2, 16 * kMiB, markers)).address, kBase + 2 * kMiB);
  EXPECT_EQ(must(alloc.malloc(kS2, 20 * kMiB, markers)).address, kBase + 40 * kMiB);
}

TEST(CachingAllocator, StatsTrackCurrentAndPeakPerPool) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation small = must(alloc.malloc(kS0, Bytes(1000), markers));
  const DeviceAllocation large = must(alloc.malloc(kS0, 3 * kMiB, markers));
  const AllocatorStats& s = alloc.stats();
  EXPECT_EQ(s.allocated, Bytes(1024) + 3 * kMiB);
  EXPECT_EQ(s.requested, Bytes(1000) + 3 * kMiB);
  EXPECT_EQ(s.reserved, 22 * kMiB);
  EXPECT_EQ(s.pool_allocated[0], Bytes(1024));
  EXPECT_EQ(s.pool_allocated[1], 3 * kMiB);
  EXPECT_EQ(s.pool_reserved[0], 2 * kMiB);
  EXPECT_EQ(s.pool_reserved[1], 20 * kMiB);

  alloc.free(large.block, markers);
  alloc.empty_cache(markers);
  EXPECT_EQ(s.allocated, Bytes(1024));
  EXPECT_EQ(s.requested, Bytes(1000));
  EXPECT_EQ(s.reserved, 2 * kMiB);
  EXPECT_EQ(s.allocated_peak, Bytes(1024) + 3 * kMiB);
  EXPECT_EQ(s.reserved_peak, 22 * kMiB);
  EXPECT_EQ(s.pool_reserved_peak[1], 20 * kMiB);
  EXPECT_EQ(s.pool_reserved[1], Bytes(0));

  alloc.free(small.block, markers);
  alloc.empty_cache(markers);
  EXPECT_EQ(s.reserved, Bytes(0));
  EXPECT_EQ(s.allocated, Bytes(0));
  EXPECT_EQ(s.segment_allocs, 2);
  EXPECT_EQ(s.segment_frees, 2);
  EXPECT_TRUE(alloc.segments().empty());
}

TEST(CachingAllocator, DescribeReturnsTheBlocksAddressAndSize) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  (void)must(alloc.malloc(kS0, Bytes(512), markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, Bytes(700), markers));
  const DeviceAllocation d = alloc.describe(b.block);
  EXPECT_EQ(d.block, b.block);
  EXPECT_EQ(d.address, kBase + Bytes(512));
  EXPECT_EQ(d.size, Bytes(1024));
}

TEST(CachingAllocator, MisuseIsAnInvariantError) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, Bytes(512), markers));
  EXPECT_THROW(alloc.free(BlockId(99), markers), InvariantError);
  alloc.free(a.block, markers);
  EXPECT_THROW(alloc.free(a.block, markers), InvariantError);
  EXPECT_THROW(alloc.record_stream(a.block, kS1), InvariantError);
  EXPECT_THROW((void)alloc.describe(a.block), InvariantError);
  EXPECT_THROW((void)alloc.malloc(StreamId{}, Bytes(512), markers), InvariantError);
}

TEST(CachingAllocator, FreeingAPendingBlockAgainIsAnInvariantError) {
  CachingAllocator alloc(kGiB, kBase);
  FakeMarkers markers;
  const DeviceAllocation a = must(alloc.malloc(kS0, Bytes(512), markers));
  alloc.record_stream(a.block, kS1);
  alloc.free(a.block, markers);
  EXPECT_THROW(alloc.free(a.block, markers), InvariantError);
  EXPECT_THROW(alloc.record_stream(a.block, kS2), InvariantError);
}

}  // namespace
}  // namespace ferry::sim
