// The link model of collectives (ferry/sim/engine/collective_cost.hpp, docs/fsdp.md "The link
// model"): where a group's ranks lie decides its link, and the ring formula its time.

#include "ferry/sim/engine/collective_cost.hpp"

#include <gtest/gtest.h>

namespace ferry::sim {
namespace {

CollectiveLinks links() {
  CollectiveLinks l;
  l.gpus_per_node = 8;
  l.intra_node = CollectiveLink{Bandwidth(100'000'000'000), SimTime(1000)};
  l.inter_node = CollectiveLink{Bandwidth(10'000'000'000), SimTime(5000)};
  return l;
}

TEST(GroupPlacement, ConsecutiveRanksShareANodeUntilItIsFull) {
  EXPECT_EQ(place_group(1, 1, 8), (GroupPlacement{1, 1}));
  EXPECT_EQ(place_group(8, 1, 8), (GroupPlacement{8, 1}));
  EXPECT_EQ(place_group(9, 1, 8), (GroupPlacement{9, 2}));
  EXPECT_EQ(place_group(16, 1, 8), (GroupPlacement{16, 2}));
}

TEST(GroupPlacement, StridedMembersSpanTheNodesTheirRanksLieOn) {
  // One member of each shard group: HSDP's replica groups.
  // Across nodes, the node's ranks each run one of min(stride, 8) such groups at once (Note
  // [Groups sharing a node's links]); inside a node none shares.
  EXPECT_EQ(place_group(2, 4, 8), (GroupPlacement{2, 1, 1}));    // ranks 0, 4
  EXPECT_EQ(place_group(4, 4, 8), (GroupPlacement{4, 2, 4}));    // ranks 0, 4, 8, 12
  EXPECT_EQ(place_group(2, 8, 8), (GroupPlacement{2, 2, 8}));    // a shard group fills a node
  EXPECT_EQ(place_group(4, 16, 8), (GroupPlacement{4, 4, 8}));   // each member a node of its own
  EXPECT_EQ(place_group(16, 1, 8), (GroupPlacement{16, 2, 1}));  // the one group of its kind
  EXPECT_EQ(place_group(1, 16, 8), (GroupPlacement{1, 1, 1}));   // one rank crosses nothing
}

TEST(CollectiveTime, GroupsSharingANodesLinksEachHaveTheirShare) {
  const Bytes gib(std::int64_t{1} << 30);
  const std::int64_t moved = (std::int64_t{1} << 30) / 4 * 3;
  // Four ranks on four nodes, the node's eight ranks each in one such group: 10 GB/s / 8.
  EXPECT_EQ(collective_time(CollectiveKind::AllGather, gib, {4, 4, 8}, links()),
            transfer_time(Bytes(moved), Bandwidth(1'250'000'000)) + SimTime(15'000));
  EXPECT_GT(collective_time(CollectiveKind::AllReduce, gib, {4, 4, 8}, links()),
            collective_time(CollectiveKind::AllReduce, gib, {4, 4, 1}, links()));
  // Inside a node each GPU has its own NVLink rate: sharing is not counted.
  EXPECT_EQ(collective_time(CollectiveKind::AllGather, gib, {4, 1, 8}, links()),
            collective_time(CollectiveKind::AllGather, gib, {4, 1, 1}, links()));
}

TEST(CollectiveTime, TheRingFormulaOverTheGroupsLink) {
  const Bytes gib(std::int64_t{1} << 30);
  // 8 ranks in a node: 7/8 of 1 GiB at 100 GB/s, and 7 steps of 1 us.
  const std::int64_t moved = (std::int64_t{1} << 30) / 8 * 7;
  const SimTime intra = collective_time(CollectiveKind::AllGather, gib, {8, 1}, links());
  EXPECT_EQ(intra, transfer_time(Bytes(moved), Bandwidth(100'000'000'000)) + SimTime(7000));
  EXPECT_EQ(collective_time(CollectiveKind::ReduceScatter, gib, {8, 1}, links()), intra);
  // The same group across two nodes: the inter-node link.
  EXPECT_EQ(collective_time(CollectiveKind::AllGather, gib, {8, 2}, links()),
            transfer_time(Bytes(moved), Bandwidth(10'000'000'000)) + SimTime(35'000));
  // An all-reduce is two passes.
  EXPECT_EQ(collective_time(CollectiveKind::AllReduce, gib, {8, 1}, links()),
            SimTime(2 * intra.ns()));
  // An all-to-all sends what a ring pass does: each rank keeps 1/g of its data.
  EXPECT_EQ(collective_time(CollectiveKind::AllToAll, gib, {8, 1}, links()), intra);
  // One rank moves nothing.
  EXPECT_EQ(collective_time(CollectiveKind::AllReduce, gib, {1, 1}, links()), SimTime(1));
}

}  // namespace
}  // namespace ferry::sim
