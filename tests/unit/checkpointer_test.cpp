// The checkpoint bookkeeping of the core, on its own.

#include "ferry/checkpoint.hpp"

#include <gtest/gtest.h>

namespace ferry {
namespace {

SavedMeta meta(std::int64_t bytes, std::uint64_t hash = 0) {
  return SavedMeta{Bytes(bytes), 1, 0, hash};
}

TEST(Checkpointer, RecomputeFillsHoldersInOrderAndTakingClearsThem) {
  Checkpointer<int> c;
  const FrameId f = c.begin({});
  const HolderId a = c.pack(f, meta(10));
  const HolderId b = c.pack(f, meta(20));
  c.end(f);
  EXPECT_FALSE(c.recomputed(f, 1));
  c.recompute_begin(f, 1);
  EXPECT_EQ(c.recompute_pack(meta(10), 100), RecomputePack::Kept);
  EXPECT_EQ(c.recompute_pack(meta(20), 200), RecomputePack::KeptLast)
      << "early stop after the last holder";
  c.recompute_end();
  EXPECT_EQ(c.take(b, 1), 200);
  EXPECT_EQ(c.take(a, 1), 100);
  try {
    (void)c.take(a, 1);
    FAIL() << "a second unpack must fail";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("already unpacked once"), std::string::npos);
  }
}

TEST(Checkpointer, EachGraphTaskRecomputesAfresh) {
  Checkpointer<int> c;
  const FrameId f = c.begin({});
  const HolderId a = c.pack(f, meta(10));
  c.end(f);
  for (std::uint64_t gid = 1; gid <= 2; ++gid) {
    c.recompute_begin(f, gid);
    c.recompute_pack(meta(10), static_cast<int>(gid));
    c.recompute_end();
    EXPECT_EQ(c.take(a, gid), static_cast<int>(gid));
  }
}

TEST(Checkpointer, ADifferentNumberOfTensorsIsAnError) {
  Checkpointer<int> c;
  const FrameId f = c.begin({});
  c.pack(f, meta(10));
  c.pack(f, meta(20));
  c.end(f);
  c.recompute_begin(f, 1);
  c.recompute_pack(meta(10), 1);
  try {
    c.recompute_end();
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("Number of tensors saved during forward: 2"),
              std::string::npos);
  }
}

TEST(Checkpointer, SavingMoreThanForwardIsAnErrorWithoutEarlyStop) {
  Checkpointer<int> c;
  FrameOptions o;
  o.early_stop = false;
  const FrameId f = c.begin(o);
  c.pack(f, meta(10));
  c.end(f);
  c.recompute_begin(f, 1);
  EXPECT_EQ(c.recompute_pack(meta(10), 1), RecomputePack::Kept)
      << "no early stop: the replay goes on";
  EXPECT_THROW(c.recompute_pack(meta(10), 2), CheckpointError);
}

TEST(Checkpointer, MetadataMismatchIsAnErrorNamingThePosition) {
  Checkpointer<int> c;
  const FrameId f = c.begin({});
  c.pack(f, meta(10));
  c.pack(f, meta(20));
  c.end(f);
  c.recompute_begin(f, 1);
  c.recompute_pack(meta(10), 1);
  c.recompute_pack(meta(21), 2);
  try {
    c.recompute_end();
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor at position 1"), std::string::npos) << e.what();
  }
}

TEST(Checkpointer, ContentHashesAreComparedOnlyWhenAsked) {
  for (const bool check : {false, true}) {
    Checkpointer<int> c;
    FrameOptions o;
    o.content_check = check;
    const FrameId f = c.begin(o);
    c.pack(f, meta(10, 0xaa));
    c.end(f);
    c.recompute_begin(f, 1);
    c.recompute_pack(meta(10, 0xbb), 1);
    if (check) {
      EXPECT_THROW(c.recompute_end(), CheckpointError);
    } else {
      EXPECT_NO_THROW(c.recompute_end());
    }
  }
}

TEST(Checkpointer, GlobalEarlyStopOverridesThePerCallOption) {
  Checkpointer<int> c;
  c.set_global_early_stop(false);
  const FrameId f = c.begin({});  // per call: early stop on
  c.pack(f, meta(10));
  c.end(f);
  c.recompute_begin(f, 1);
  EXPECT_EQ(c.recompute_pack(meta(10), 1), RecomputePack::Kept)
      << "the global switch turned early stop off";
  c.recompute_end();
}

TEST(Checkpointer, AFrameStillRunningIgnoresWhatItHasNotSavedYet) {
  Checkpointer<int> c;
  FrameOptions o;
  o.early_stop = false;
  const FrameId f = c.begin(o);
  const HolderId a = c.pack(f, meta(10));
  c.recompute_begin(f, 1);  // a backward inside the region, before it ends
  EXPECT_EQ(c.recompute_pack(meta(10), 1), RecomputePack::Kept);
  EXPECT_EQ(c.recompute_pack(meta(20), 2), RecomputePack::Ignored);
  EXPECT_NO_THROW(c.recompute_end());
  EXPECT_EQ(c.take(a, 1), 1);
  c.end(f);
}

TEST(Checkpointer, RegionsMustNest) {
  Checkpointer<int> c;
  const FrameId outer = c.begin({});
  c.begin({});
  EXPECT_THROW(c.end(outer), InvariantError);
}

}  // namespace
}  // namespace ferry
