// SmallVector: in place up to its inline count, on the heap beyond it, and copies, moves and
// swaps that keep every element wherever it lives.

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "ferry/sim/support/small_vector.hpp"

namespace ferry::sim {
namespace {

using Small = SmallVector<std::uint64_t, 2>;

std::vector<std::uint64_t> items(const Small& v) { return {v.begin(), v.end()}; }

TEST(SmallVector, KeepsItsElementsInOrderInPlaceAndBeyond) {
  Small v;
  EXPECT_TRUE(v.empty());
  v.push_back(1);
  v.push_back(2);
  EXPECT_EQ(v.capacity(), 2U);  // still in place
  const std::uint64_t* in_place = v.data();
  v.push_back(3);
  EXPECT_NE(v.data(), in_place);  // moved to the heap
  EXPECT_GE(v.capacity(), 3U);
  EXPECT_EQ(items(v), (std::vector<std::uint64_t>{1, 2, 3}));
  EXPECT_EQ(v.back(), 3U);
  v.clear();
  EXPECT_TRUE(v.empty());
  EXPECT_GE(v.capacity(), 3U);  // clearing keeps the storage
}

TEST(SmallVector, PushingOneOfItsOwnElementsAcrossAGrowthCopiesItFirst) {
  Small v{7, 8, 9};  // on the heap, full: the next push frees that storage
  ASSERT_EQ(v.capacity(), 3U);
  v.push_back(v[0]);  // (read after the free, under the sanitizers, if taken by reference)
  EXPECT_EQ(items(v), (std::vector<std::uint64_t>{7, 8, 9, 7}));
}

TEST(SmallVector, CopiesAreEqualAndIndependent) {
  for (const std::size_t n : {1U, 2U, 5U}) {
    Small v;
    for (std::uint64_t i = 0; i < n; ++i) v.push_back(10 + i);
    Small copy = v;
    EXPECT_EQ(copy, v);
    copy[0] = 99;
    EXPECT_EQ(v[0], 10U);
    EXPECT_FALSE(copy == v);
    copy = v;
    EXPECT_EQ(copy, v);
  }
}

TEST(SmallVector, MovesAndSwapsKeepEveryElementWhereverItLives) {
  Small in_place{1, 2};
  Small on_heap{3, 4, 5, 6};
  in_place.swap(on_heap);
  EXPECT_EQ(items(in_place), (std::vector<std::uint64_t>{3, 4, 5, 6}));
  EXPECT_EQ(items(on_heap), (std::vector<std::uint64_t>{1, 2}));
  Small moved(std::move(in_place));
  EXPECT_EQ(items(moved), (std::vector<std::uint64_t>{3, 4, 5, 6}));
  EXPECT_TRUE(in_place.empty());  // NOLINT(bugprone-use-after-move): a move leaves it empty
  Small assigned;
  assigned = std::move(on_heap);
  EXPECT_EQ(items(assigned), (std::vector<std::uint64_t>{1, 2}));
  Small appended;
  appended.append(moved.begin(), moved.end());
  appended.append(assigned.begin(), assigned.end());
  EXPECT_EQ(items(appended), (std::vector<std::uint64_t>{3, 4, 5, 6, 1, 2}));
}

}  // namespace
}  // namespace ferry::sim
