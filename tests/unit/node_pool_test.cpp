// NodePool: freed nodes are reused, other sizes go to the general allocator, and a map drawing
// from a pool keeps its nodes when its owner moves.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "ferry/sim/support/node_pool.hpp"

namespace ferry::sim {
namespace {

TEST(NodePool, FreedNodeIsTheNextOneHandedOut) {
  NodePool pool;
  void* a = pool.allocate(48);
  void* b = pool.allocate(48);
  EXPECT_NE(a, b);
  pool.deallocate(a, 48);
  EXPECT_EQ(pool.allocate(48), a);
  pool.deallocate(b, 48);
}

TEST(NodePool, NodesOfOneSlabDoNotOverlap) {
  NodePool pool;
  std::vector<std::uintptr_t> nodes;
  for (int i = 0; i < 200; ++i)
    nodes.push_back(reinterpret_cast<std::uintptr_t>(pool.allocate(40)));
  std::sort(nodes.begin(), nodes.end());
  for (std::size_t i = 1; i < nodes.size(); ++i) EXPECT_GE(nodes[i] - nodes[i - 1], 40U);
  for (const auto n : nodes) EXPECT_EQ(n % alignof(std::max_align_t), 0U);
}

TEST(NodePool, OtherSizesBypassThePool) {
  NodePool pool;
  void* node = pool.allocate(64);
  void* big = pool.allocate(1000);  // not the node size: the general allocator's
  pool.deallocate(big, 1000);
  pool.deallocate(node, 64);
  EXPECT_EQ(pool.allocate(64), node);  // the free list holds only the node
}

// An owner as the simulator's shadows are: the pool first, then the map.
struct Owner {
  std::unique_ptr<NodePool> pool = std::make_unique<NodePool>();
  PooledMap<int, std::vector<int>> map{
      PooledMap<int, std::vector<int>>::allocator_type(pool.get())};
};

TEST(NodePool, MapKeepsItsContentThroughChurnAndMoves) {
  std::vector<Owner> owners(1);
  std::map<int, std::vector<int>> reference;
  for (int i = 0; i < 5000; ++i) {
    const int key = (i * 7919) % 301;
    if (i % 3 == 0) {
      owners[0].map.erase(key);
      reference.erase(key);
    } else {
      owners[0].map[key].push_back(i);
      reference[key].push_back(i);
    }
    if (i % 997 == 0) owners.emplace_back();  // reallocation moves owners[0]
  }
  ASSERT_EQ(owners[0].map.size(), reference.size());
  auto it = owners[0].map.begin();
  for (const auto& [key, values] : reference) {
    EXPECT_EQ(it->first, key);
    EXPECT_EQ(it->second, values);
    ++it;
  }
}

}  // namespace
}  // namespace ferry::sim
