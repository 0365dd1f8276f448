// The core's portal table: the three tensor lives of Note [Portal tensor life], the errors the
// reference raises, gradients, copies, counters and the planted wrong-life fault.

#include <gtest/gtest.h>

#include <string>

#include "ferry/portal.hpp"

namespace ferry {
namespace {

constexpr PortalKey kKey{0, 0};
const TensorId kStashed(10);
const TensorId kCopied(11);
const TensorId kRecomputed(12);

std::string error_of(const auto& call) {
  try {
    call();
  } catch (const PortalError& e) {
    return e.what();
  }
  return {};
}

TEST(PortalLife, FollowsTheThreeRules) {
  EXPECT_EQ(portal_tensor_life(false, false), 2);
  EXPECT_EQ(portal_tensor_life(false, true), 3);
  EXPECT_EQ(portal_tensor_life(true, false), 1);
  EXPECT_EQ(portal_tensor_life(true, true), 1);
}

TEST(PortalTable, WithoutCheckpointReleasesAtTheOrangeUse) {
  PortalTable table;
  const PortalStash stash = table.stash(kKey, kStashed, false);
  EXPECT_EQ(stash.life, 2);
  EXPECT_FALSE(stash.dropped);
  const PortalUse blue = table.use_tensor(kKey);
  EXPECT_EQ(blue.tensor, kStashed);
  EXPECT_FALSE(blue.released);
  EXPECT_EQ(table.copy_tensor(kKey, kCopied), kStashed);
  const PortalUse orange = table.use_tensor(kKey);
  EXPECT_EQ(orange.tensor, kCopied);
  EXPECT_TRUE(orange.released);
  EXPECT_EQ(table.tensor_life(kKey), 0);
  EXPECT_TRUE(table.holding_tensors().empty());
}

TEST(PortalTable, UnderCheckpointSurvivesForTheRecomputedOrange) {
  PortalTable table;
  EXPECT_EQ(table.stash(kKey, kStashed, true).life, 3);
  EXPECT_FALSE(table.use_tensor(kKey).released);  // blue
  static_cast<void>(table.copy_tensor(kKey, kCopied));
  EXPECT_FALSE(table.use_tensor(kKey).released);   // orange
  const PortalUse again = table.use_tensor(kKey);  // recomputed orange
  EXPECT_EQ(again.tensor, kCopied);
  EXPECT_TRUE(again.released);
}

TEST(PortalTable, RecomputeStashGetsLifeOneAndReleasesAtTheRecomputedBlue) {
  PortalTable table;
  static_cast<void>(table.stash(kKey, kStashed, true));
  for (int use = 0; use < 3; ++use) static_cast<void>(table.use_tensor(kKey));
  const PortalStash restash = table.stash(kKey, kRecomputed, false);
  EXPECT_EQ(restash.life, 1);
  EXPECT_FALSE(restash.dropped);
  const PortalUse blue = table.use_tensor(kKey);  // recomputed blue
  EXPECT_EQ(blue.tensor, kRecomputed);
  EXPECT_TRUE(blue.released);
}

TEST(PortalTable, UseAfterTheLifeRanOutIsTheReferenceError) {
  PortalTable table;
  static_cast<void>(table.stash(kKey, kStashed, false));
  static_cast<void>(table.use_tensor(kKey));
  static_cast<void>(table.use_tensor(kKey));
  const std::string message = error_of([&] { static_cast<void>(table.use_tensor(kKey)); });
  EXPECT_NE(message.find("tensor in portal has been removed"), std::string::npos) << message;
  const std::string copy = error_of([&] { static_cast<void>(table.copy_tensor(kKey, kCopied)); });
  EXPECT_NE(copy.find("tensor in portal has been removed"), std::string::npos) << copy;
}

TEST(PortalTable, UseOfAPortalNeverStashedNamesIt) {
  PortalTable table;
  const std::string message = error_of([&] {
    static_cast<void>(table.use_tensor(PortalKey{3, 1}));
  });
  EXPECT_NE(message.find("skip 3 of micro-batch 1 has not been stashed"), std::string::npos)
      << message;
}

TEST(PortalTable, GradientIsUsedOncePerPut) {
  PortalTable table;
  static_cast<void>(table.stash(kKey, kStashed, false));
  const std::string never = error_of([&] { static_cast<void>(table.use_grad(kKey)); });
  EXPECT_NE(never.find("grad in portal has been removed or never set"), std::string::npos) << never;
  EXPECT_FALSE(table.put_grad(kKey, TensorId(20)));
  EXPECT_EQ(table.holding_grads(), std::vector<PortalKey>{kKey});
  EXPECT_EQ(table.use_grad(kKey), TensorId(20));
  const std::string twice = error_of([&] { static_cast<void>(table.use_grad(kKey)); });
  EXPECT_NE(twice.find("grad in portal has been removed or never set"), std::string::npos) << twice;
}

TEST(PortalTable, PortalCopyOfTheGradientReplacesIt) {
  PortalTable table;
  static_cast<void>(table.stash(kKey, kStashed, false));
  EXPECT_FALSE(table.put_grad(kKey, TensorId(20)));   // the orange's backward
  const TensorId on_consumer = table.use_grad(kKey);  // PortalCopy.backward takes it ...
  EXPECT_FALSE(table.put_grad(kKey, TensorId(21)));   // ... and puts its copy
  EXPECT_EQ(on_consumer, TensorId(20));
  EXPECT_EQ(table.use_grad(kKey), TensorId(21));  // the blue's backward
  EXPECT_TRUE(table.holding_grads().empty());
}

TEST(PortalTable, PutOverAHeldTensorHandsBackTheOldOne) {
  PortalTable table;
  static_cast<void>(table.stash(kKey, kStashed, false));
  const auto dropped = table.put_tensor(kKey, kRecomputed, 1);
  ASSERT_TRUE(dropped);
  EXPECT_EQ(*dropped, kStashed);
  EXPECT_EQ(table.stats().releases, 1);
}

TEST(PortalTable, MicroBatchesHaveSeparatePortals) {
  PortalTable table;
  static_cast<void>(table.stash(PortalKey{0, 0}, TensorId(1), false));
  EXPECT_EQ(table.stash(PortalKey{0, 1}, TensorId(2), false).life, 2);
  EXPECT_EQ(table.stash(PortalKey{1, 0}, TensorId(3), true).life, 3);
  EXPECT_EQ(table.use_tensor(PortalKey{0, 1}).tensor, TensorId(2));
  EXPECT_EQ(table.holding_tensors(),
            (std::vector<PortalKey>{PortalKey{0, 0}, PortalKey{0, 1}, PortalKey{1, 0}}));
}

TEST(PortalTable, CountsPutsUsesAndLivePortals) {
  PortalTable table;
  static_cast<void>(table.stash(PortalKey{0, 0}, TensorId(1), false));
  static_cast<void>(table.stash(PortalKey{0, 1}, TensorId(2), false));
  for (int use = 0; use < 2; ++use) static_cast<void>(table.use_tensor(PortalKey{0, 0}));
  static_cast<void>(table.stash(PortalKey{0, 2}, TensorId(3), false));
  const PortalStats& stats = table.stats();
  EXPECT_EQ(stats.puts, 3);
  EXPECT_EQ(stats.uses, 2);
  EXPECT_EQ(stats.releases, 1);
  EXPECT_EQ(stats.live, 2);
  EXPECT_EQ(stats.max_live, 2);
}

TEST(PortalTable, ClearHandsBackWhatIsStillHeld) {
  PortalTable table;
  static_cast<void>(table.stash(PortalKey{0, 0}, TensorId(1), true));
  static_cast<void>(table.stash(PortalKey{1, 0}, TensorId(2), false));
  static_cast<void>(table.put_grad(PortalKey{1, 0}, TensorId(5)));
  EXPECT_EQ(table.clear(), (std::vector<TensorId>{TensorId(1), TensorId(2), TensorId(5)}));
  EXPECT_FALSE(table.contains(PortalKey{0, 0}));
  EXPECT_EQ(table.stats().live, 0);
  // A stash after the clear is a first stash again.
  EXPECT_EQ(table.stash(PortalKey{0, 0}, TensorId(7), false).life, 2);
}

TEST(PortalFault, FixedLifeDropsTheTensorBeforeTheRecomputedOrange) {
  PortalTable table(PortalFaults{.fixed_life = true});
  EXPECT_EQ(table.stash(kKey, kStashed, true).life, 2);
  static_cast<void>(table.use_tensor(kKey));
  EXPECT_TRUE(table.use_tensor(kKey).released);
  const std::string message = error_of([&] { static_cast<void>(table.use_tensor(kKey)); });
  EXPECT_NE(message.find("tensor in portal has been removed"), std::string::npos);
}

TEST(PortalFault, FixedLifeKeepsTheRecomputedTensorPastItsOnlyUse) {
  PortalTable table(PortalFaults{.fixed_life = true});
  static_cast<void>(table.stash(kKey, kStashed, false));
  static_cast<void>(table.use_tensor(kKey));
  static_cast<void>(table.use_tensor(kKey));
  EXPECT_EQ(table.stash(kKey, kRecomputed, false).life, 2);
  EXPECT_FALSE(table.use_tensor(kKey).released);
  EXPECT_EQ(table.holding_tensors(), std::vector<PortalKey>{kKey});
}

}  // namespace
}  // namespace ferry
