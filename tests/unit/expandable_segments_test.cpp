// The caching allocator with expandable segments (Note [Expandable segments]).

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "fake_markers.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"

namespace ferry::sim {
namespace {

using testing::FakeMarkers;

constexpr Bytes kBase{std::int64_t{1} << 32};
const StreamId kS0{0};
const StreamId kS1{1};

DeviceAllocation must(Result<DeviceAllocation> result) {
  EXPECT_TRUE(result.ok()) << (result.ok() ? "" : result.error().message);
  return std::move(result).value();
}

CachingAllocator expandable(Bytes capacity) {
  return CachingAllocator(capacity, kBase, AllocatorMode::Expandable);
}

TEST(ExpandableSegments, ModeNamesParseBothWays) {
  EXPECT_EQ(parse_allocator_mode("default"), AllocatorMode::Default);
  EXPECT_EQ(parse_allocator_mode("expandable"), AllocatorMode::Expandable);
  EXPECT_EQ(parse_allocator_mode("expandable_segments"), std::nullopt);
  EXPECT_EQ(allocator_mode_name(AllocatorMode::Expandable), "expandable");
  EXPECT_EQ(allocator_mode_name(AllocatorMode::Default), "default");
  EXPECT_EQ(expandable_page_size(PoolKind::Small), 2 * kMiB);
  EXPECT_EQ(expandable_page_size(PoolKind::Large), 20 * kMiB);
}

TEST(ExpandableSegments, GrowByMappingPagesAtTheEndOfOneRange) {
  FakeMarkers markers;
  CachingAllocator alloc = expandable(kGiB);
  const DeviceAllocation a = must(alloc.malloc(kS0, 30 * kMiB, markers));
  EXPECT_EQ(a.size, 30 * kMiB);
  EXPECT_EQ(alloc.stats().reserved, 40 * kMiB);  // two 20 MiB pages
  // 15 MiB does not fit the 10 MiB left: one more page, mapped after the others; the free
  // 10 MiB and the new page make one block.
  const DeviceAllocation b = must(alloc.malloc(kS0, 15 * kMiB, markers));
  EXPECT_EQ(b.address, a.address + 30 * kMiB);
  EXPECT_EQ(alloc.stats().reserved, 60 * kMiB);
  EXPECT_EQ(alloc.stats().segment_allocs, 2);  // two maps
  const std::vector<SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments.size(), 1U);
  EXPECT_TRUE(segments[0].expandable);
  EXPECT_EQ(segments[0].address, a.address);
  EXPECT_EQ(segments[0].size, 60 * kMiB);
  ASSERT_EQ(segments[0].blocks.size(), 3U);
  EXPECT_EQ(segments[0].blocks[2].size, 15 * kMiB);
  EXPECT_EQ(segments[0].blocks[2].state, BlockInfo::State::Free);
}

TEST(ExpandableSegments, SmallPoolMapsTwoMebibytePages) {
  FakeMarkers markers;
  CachingAllocator alloc = expandable(kGiB);
  const DeviceAllocation a = must(alloc.malloc(kS0, Bytes(1000), markers));
  EXPECT_EQ(a.size, Bytes(1024));
  EXPECT_EQ(alloc.stats().reserved, 2 * kMiB);
  EXPECT_EQ(alloc.stats().pool_reserved[0], 2 * kMiB);
  // A second stream gets a range of its own, past the first one's virtual range.
  const DeviceAllocation b = must(alloc.malloc(kS1, Bytes(1000), markers));
  EXPECT_GE(b.address, a.address + kGiB + Bytes(kGiB.count() / 8));
  EXPECT_EQ(alloc.stats().reserved, 4 * kMiB);
}

TEST(ExpandableSegments, SplitsEveryRemainderInTheLargePool) {
  FakeMarkers markers;
  CachingAllocator plain(kGiB, kBase);
  CachingAllocator grown = expandable(kGiB);
  // 19 MiB in a 20 MiB segment leaves 1 MiB: the default allocator keeps it in the block,
  // expandable segments split it off.
  EXPECT_EQ(must(plain.malloc(kS0, 19 * kMiB, markers)).size, 20 * kMiB);
  EXPECT_EQ(must(grown.malloc(kS0, 19 * kMiB, markers)).size, 19 * kMiB);
}

TEST(ExpandableSegments, FreeKeepsPagesAndEmptyCacheUnmapsTheWholePagesOfFreeBlocks) {
  FakeMarkers markers;
  CachingAllocator alloc = expandable(kGiB);
  const DeviceAllocation a = must(alloc.malloc(kS0, 30 * kMiB, markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, 15 * kMiB, markers));
  alloc.free(a.block, markers);
  EXPECT_EQ(alloc.stats().reserved, 60 * kMiB);  // free unmaps nothing
  alloc.empty_cache(markers);
  // [0, 30) MiB was free: its one whole page [0, 20) goes; [20, 30) shares a page with b. The
  // free 15 MiB at the end holds no whole page either.
  EXPECT_EQ(alloc.stats().reserved, 40 * kMiB);
  EXPECT_EQ(alloc.stats().segment_frees, 1);
  std::vector<SegmentInfo> segments = alloc.segments();
  ASSERT_EQ(segments.size(), 1U);
  EXPECT_EQ(segments[0].address, a.address + 20 * kMiB);
  EXPECT_EQ(segments[0].size, 40 * kMiB);
  alloc.free(b.block, markers);
  alloc.empty_cache(markers);
  EXPECT_EQ(alloc.stats().reserved, Bytes(0));
  EXPECT_TRUE(alloc.segments().empty());
  // The segment itself was released: a new request maps at the start of a range again.
  const DeviceAllocation c = must(alloc.malloc(kS0, 30 * kMiB, markers));
  EXPECT_EQ(c.address, a.address);
}

// Alternating sizes freed out of order, then one request as large as them all: the default
// allocator's segments never merge, so it needs a new one; an expandable segment holds the
// freed blocks side by side, merged, and reserves the request rounded up to pages.
TEST(ExpandableSegments, AlternatingSizesFreedOutOfOrderLeaveNoFragmentation) {
  const auto run = [](CachingAllocator alloc) {
    FakeMarkers markers;
    std::vector<DeviceAllocation> blocks;
    for (const Bytes size : {11 * kMiB, 13 * kMiB, 11 * kMiB, 13 * kMiB}) {
      blocks.push_back(must(alloc.malloc(kS0, size, markers)));
    }
    for (const std::size_t i : {1, 2, 0, 3}) alloc.free(blocks[i].block, markers);
    const DeviceAllocation all = must(alloc.malloc(kS0, 48 * kMiB, markers));
    EXPECT_EQ(all.size, 48 * kMiB);
    return alloc.stats().reserved;
  };
  EXPECT_EQ(run(CachingAllocator(kGiB, kBase)), (12 + 14 + 12 + 14 + 48) * kMiB);
  EXPECT_EQ(run(expandable(kGiB)), 60 * kMiB);  // 48 MiB in 20 MiB pages
}

TEST(ExpandableSegments, OutOfMemoryRetryUnmapsFreePagesAndGrowsAgain) {
  FakeMarkers markers;
  CachingAllocator alloc = expandable(60 * kMiB);
  const DeviceAllocation a = must(alloc.malloc(kS0, 30 * kMiB, markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, 15 * kMiB, markers));
  alloc.free(a.block, markers);
  // 35 MiB: the free 15 MiB at the end and one more page, past the capacity until the retry
  // unmaps the free page at the start.
  const DeviceAllocation c = must(alloc.malloc(kS0, 35 * kMiB, markers));
  EXPECT_EQ(c.address, b.address + 15 * kMiB);
  EXPECT_EQ(alloc.stats().reserved, 60 * kMiB);
  EXPECT_EQ(alloc.stats().ooms, 0);
  const Result<DeviceAllocation> d = alloc.malloc(kS0, 30 * kMiB, markers);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(alloc.stats().ooms, 1);
  EXPECT_NE(d.error().message.find("of pages mapped in an expandable segment"), std::string::npos)
      << d.error().message;
  EXPECT_LE(alloc.stats().reserved, alloc.capacity());
}

TEST(ExpandableSegments, PendingFreesStayApartUntilTheirMarkersComplete) {
  FakeMarkers markers;
  CachingAllocator alloc = expandable(kGiB);
  const DeviceAllocation a = must(alloc.malloc(kS0, 10 * kMiB, markers));
  const DeviceAllocation b = must(alloc.malloc(kS0, 10 * kMiB, markers));
  alloc.record_stream(a.block, kS1);
  alloc.free(a.block, markers);
  alloc.free(b.block, markers);
  // a waits on stream 1: 15 MiB cannot take its bytes, so a page is mapped after b's.
  const DeviceAllocation c = must(alloc.malloc(kS0, 15 * kMiB, markers));
  EXPECT_EQ(c.address, b.address);
  EXPECT_EQ(alloc.stats().reserved, 40 * kMiB);
  markers.complete_all();
  alloc.free(c.block, markers);
  const DeviceAllocation d = must(alloc.malloc(kS0, 40 * kMiB, markers));
  EXPECT_EQ(d.address, a.address);  // a came back and merged with the rest
  EXPECT_EQ(alloc.stats().reserved, 40 * kMiB);
}

}  // namespace
}  // namespace ferry::sim
