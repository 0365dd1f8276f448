// The core's pipeline pieces on their own, over fake backends: the clock, the stream
// choreography (Note [Pipeline streams]) and the holders that free a shared buffer with
// record_stream (Note [Receive buffers and record_stream]).

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "fake_backend.hpp"
#include "ferry/pipeline/schedule.hpp"
#include "ferry/pipeline/streams.hpp"

namespace ferry::pipeline {
namespace {

using testing::FakeBackend;

std::vector<std::vector<Cell>> cells(const std::vector<Tick>& ticks, Phase phase) {
  std::vector<std::vector<Cell>> out;
  for (const Tick& t : ticks) {
    if (t.phase == phase) out.push_back(t.cells);
  }
  return out;
}

TEST(PipelineClock, GPipeRunsForwardDiagonalsThenTheSameInReverse) {
  const std::vector<Tick> ticks = clock(Schedule::GPipe, 2, 3);
  ASSERT_EQ(ticks.size(), 8U);
  using V = std::vector<std::vector<Cell>>;
  EXPECT_EQ(cells(ticks, Phase::Forward),
            (V{{{0, 0}}, {{1, 0}, {0, 1}}, {{1, 1}, {0, 2}}, {{1, 2}}}));
  EXPECT_EQ(cells(ticks, Phase::Backward),
            (V{{{1, 2}}, {{0, 2}, {1, 1}}, {{0, 1}, {1, 0}}, {{0, 0}}}));
  for (std::size_t k = 0; k < 4; ++k) EXPECT_EQ(ticks[k].phase, Phase::Forward);
}

TEST(PipelineClock, SequentialRunsEachMicroBatchForwardThenBackward) {
  const std::vector<Tick> ticks = clock(Schedule::Sequential, 2, 1);
  ASSERT_EQ(ticks.size(), 4U);
  EXPECT_EQ(ticks[0].phase, Phase::Forward);
  EXPECT_EQ(ticks[1].phase, Phase::Backward);
  EXPECT_EQ(ticks[1].cells, (std::vector<Cell>{{0, 0}}));
  EXPECT_EQ(ticks[2].cells, (std::vector<Cell>{{1, 0}}));
}

// "0F0 0F1 2B0 ..." as torch prints its actions: stage, F or B, micro-batch.
std::string actions(const std::vector<Action>& list) {
  std::string out;
  for (const Action& a : list) {
    if (!out.empty()) out += ' ';
    const char* step = a.phase == Phase::Forward ? "F" : a.phase == Phase::Backward ? "B" : "W";
    out += std::to_string(a.cell.partition) + step + std::to_string(a.cell.micro_batch);
  }
  return out;
}

TEST(PipelineOrder, OneFOneBWarmsUpThenAlternatesThenCoolsDown) {
  const auto orders = rank_orders(Schedule::OneFOneB, 6, 4, 1);
  ASSERT_EQ(orders.size(), 4U);
  // Stage s warms up with min(m, pp - s) forwards, then one backward and one forward in turn.
  EXPECT_EQ(actions(orders[0]), "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5");
  EXPECT_EQ(actions(orders[2]), "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5");
  EXPECT_EQ(actions(orders[3]), "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5");
}

// The expected lists are what torch 2.11's _get_1f1b_rank_ops gives for
// ScheduleInterleaved1F1B with the same counts, its no-op padding left out.
TEST(PipelineOrder, InterleavedFollowsTorchsLoopedOrder) {
  const auto two = rank_orders(Schedule::Interleaved1F1B, 4, 2, 2);
  EXPECT_EQ(actions(two[0]), "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3");
  EXPECT_EQ(actions(two[1]), "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3");
  const auto three = rank_orders(Schedule::Interleaved1F1B, 3, 3, 2);
  EXPECT_EQ(actions(three[0]), "0F0 0F1 0F2 3F0 3F1 3F2 3B0 3B1 3B2 0B0 0B1 0B2");
  EXPECT_EQ(actions(three[2]), "2F0 2F1 2F2 5F0 5B0 5F1 5B1 5F2 5B2 2B0 2B1 2B2");
}

// torch 2.11's _get_1f1b_rank_ops for ScheduleInterleavedZeroBubble (warm-up factor 1, zero
// bubble on), its I (input-gradient) steps written B here.
TEST(PipelineOrder, ZeroBubbleSplitsBackwardsAndDefersWeightsAsTorchDoes) {
  const auto two = rank_orders(Schedule::InterleavedZeroBubble, 4, 2, 2);
  EXPECT_EQ(actions(two[0]),
            "0F0 0F1 2F0 2F1 2B0 2W0 0F2 2B1 2W1 0F3 0B0 0W0 2F2 0B1 0W1 2F3 2B2 2W2 2B3 2W3 0B2 "
            "0W2 0B3 0W3");
  EXPECT_EQ(actions(two[1]),
            "1F0 1F1 3F0 3B0 3F1 3B1 3W0 1F2 1B0 3W1 1F3 1B1 1W0 3F2 3B2 1W1 3F3 3B3 3W2 1B2 3W3 "
            "1B3 1W2 1W3");
  const auto one = rank_orders(Schedule::InterleavedZeroBubble, 4, 2, 1);
  EXPECT_EQ(actions(one[0]), "0F0 0F1 0B0 0W0 0F2 0B1 0W1 0F3 0B2 0W2 0B3 0W3");
  EXPECT_EQ(actions(one[1]), "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3");
}

// torch 2.11's ScheduleZBVZeroBubble._calculate_single_rank_operations for each rank, its
// padding (None) left out and its I (input-gradient) steps written B here. With pp = 3 and
// m = 3 < 2 pp - 1 torch drops the micro-batches it padded with.
TEST(PipelineOrder, ZeroBubbleVFollowsTorchsOrder) {
  const auto two = rank_orders(Schedule::ZeroBubbleV, 4, 2, 2);
  ASSERT_EQ(two.size(), 2U);
  EXPECT_EQ(actions(two[0]),
            "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 "
            "0W2 0B3 0W3");
  EXPECT_EQ(actions(two[1]),
            "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 "
            "1W2 2W3 1W3");
  const auto three = rank_orders(Schedule::ZeroBubbleV, 3, 3, 2);
  EXPECT_EQ(actions(three[0]),
            "0F0 0F1 0F2 5F0 5B0 5W0 5F1 5B1 5W1 5F2 5B2 5W2 0B0 0W0 0B1 0W1 0B2 0W2");
  EXPECT_EQ(actions(three[1]),
            "1F0 1F1 1F2 4F0 4F1 4B0 4W0 4F2 4B1 4W1 1B0 1W0 4B2 4W2 1B1 1W1 1B2 1W2");
  EXPECT_EQ(actions(three[2]),
            "2F0 3F0 2F1 3F1 2F2 3F2 3B0 3W0 2B0 2W0 3B1 3W1 2B1 2W1 3B2 3W2 2B2 2W2");
  const auto four = rank_orders(Schedule::ZeroBubbleV, 8, 4, 2);
  EXPECT_EQ(actions(four[1]),
            "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6B0 6W0 6F2 6B1 6W1 6F3 6B2 6W2 1F6 1B0 1W0 6F4 6B3 "
            "6W3 1F7 1B1 1W1 6F5 6B4 6W4 1B2 1W2 6F6 6B5 6W5 1B3 1W3 6F7 6B6 6W6 1B4 6B7 1B5 1W4 "
            "1B6 1W5 1B7 1W6 6W7 1W7");
  EXPECT_EQ(actions(four[3]),
            "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4B0 4W0 3F4 3B0 3W0 4F4 4B1 4W1 3F5 3B1 3W1 4F5 4B2 "
            "4W2 3F6 3B2 3W2 4F6 4B3 4W3 3F7 3B3 3W3 4F7 4B4 4W4 3B4 4B5 3B5 4B6 3B6 4B7 3B7 3W4 "
            "4W5 4W6 4W7 3W5 3W6 3W7");
}

// torch's generate_stage_to_rank_mapping: "loop" for the others, "v" for ZBV.
TEST(PipelineOrder, ZeroBubbleVPlacesStagesInAV) {
  std::vector<std::uint32_t> v;
  std::vector<std::uint32_t> loop;
  for (std::uint32_t s = 0; s < 8; ++s) {
    v.push_back(rank_of_stage(Schedule::ZeroBubbleV, s, 4));
    loop.push_back(rank_of_stage(Schedule::Interleaved1F1B, s, 4));
  }
  EXPECT_EQ(v, (std::vector<std::uint32_t>{0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_EQ(loop, (std::vector<std::uint32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  // Each rank's list holds only its own two stages.
  const auto orders = rank_orders(Schedule::ZeroBubbleV, 5, 4, 2);
  for (std::uint32_t r = 0; r < 4; ++r) {
    for (const Action& a : orders[r]) {
      EXPECT_EQ(rank_of_stage(Schedule::ZeroBubbleV, a.cell.partition, 4), r);
    }
  }
}

TEST(PipelineOrder, RefusesCountsTorchRefuses) {
  EXPECT_NE(schedule_error(Schedule::OneFOneB, 3, 4, 1), std::nullopt);
  EXPECT_NE(schedule_error(Schedule::OneFOneB, 4, 4, 2), std::nullopt);
  EXPECT_NE(schedule_error(Schedule::GPipe, 4, 4, 2), std::nullopt);
  // rounds = max(1, 10 / 4) = 2 divides 10; rounds = 2 does not divide 9.
  EXPECT_EQ(schedule_error(Schedule::Interleaved1F1B, 10, 4, 2), std::nullopt);
  const auto nine = schedule_error(Schedule::Interleaved1F1B, 9, 4, 2);
  ASSERT_NE(nine, std::nullopt);
  EXPECT_NE(nine->find("multiple of the rounds"), std::string::npos) << *nine;
  EXPECT_NE(schedule_error(Schedule::Interleaved1F1B, 4, 1, 2), std::nullopt);
  EXPECT_EQ(schedule_error(Schedule::OneFOneB, 4, 4, 1), std::nullopt);
  // ScheduleZBVZeroBubble: exactly two stages a rank, any micro-batch count.
  const auto zbv = schedule_error(Schedule::ZeroBubbleV, 8, 4, 1);
  ASSERT_NE(zbv, std::nullopt);
  EXPECT_NE(zbv->find("exactly 2 stages"), std::string::npos) << *zbv;
  EXPECT_NE(schedule_error(Schedule::ZeroBubbleV, 8, 4, 3), std::nullopt);
  EXPECT_EQ(schedule_error(Schedule::ZeroBubbleV, 1, 4, 2), std::nullopt);
  EXPECT_EQ(schedule_error(Schedule::ZeroBubbleV, 9, 4, 2), std::nullopt);
}

TEST(PipelineOrder, IssueOrderKeepsEachRanksOrderAndEveryDependency) {
  for (const auto& [schedule, m, ranks, v] :
       {std::tuple{Schedule::OneFOneB, 8U, 4U, 1U}, std::tuple{Schedule::GPipe, 3U, 3U, 1U},
        std::tuple{Schedule::Interleaved1F1B, 8U, 4U, 2U},
        std::tuple{Schedule::Interleaved1F1B, 6U, 3U, 3U},
        std::tuple{Schedule::InterleavedZeroBubble, 8U, 4U, 2U},
        std::tuple{Schedule::ZeroBubbleV, 8U, 4U, 2U},
        std::tuple{Schedule::ZeroBubbleV, 3U, 4U, 2U},
        std::tuple{Schedule::ZeroBubbleV, 2U, 1U, 2U}}) {
    SCOPED_TRACE(std::string(schedule_name(schedule)) + " m" + std::to_string(m));
    const auto orders = rank_orders(schedule, m, ranks, v);
    const std::vector<Action> issued = issue_order(orders, ranks * v);
    std::vector<std::size_t> next(ranks, 0);
    std::set<std::tuple<Phase, std::uint32_t, std::uint32_t>> done;
    for (const Action& a : issued) {
      const std::uint32_t s = a.cell.partition;
      const std::uint32_t i = a.cell.micro_batch;
      const std::uint32_t r = rank_of_stage(schedule, s, ranks);
      ASSERT_LT(next[r], orders[r].size());
      EXPECT_EQ(orders[r][next[r]++], a);
      if (a.phase == Phase::Weight) {
        EXPECT_TRUE(done.contains({Phase::Backward, s, i}));
      } else if (a.phase == Phase::Forward) {
        if (s > 0) {
          EXPECT_TRUE(done.contains({Phase::Forward, s - 1, i}));
        }
      } else {
        EXPECT_TRUE(done.contains({Phase::Forward, s, i}));
        if (s + 1 < ranks * v) {
          EXPECT_TRUE(done.contains({Phase::Backward, s + 1, i}));
        }
      }
      done.insert({a.phase, s, i});
    }
    const std::size_t steps = splits_backward(schedule) ? 3U : 2U;
    EXPECT_EQ(done.size(), steps * m * ranks * v);
  }
}

TEST(PipelineStreams, ReceiveWaitsForTheReceivingComputeStream) {
  FakeBackend gpu0;
  FakeBackend gpu1;
  Choreography<FakeBackend> streams({&gpu0, &gpu1});
  gpu1.log.clear();
  streams.receive_after_compute(streams.copy(0, 1));
  // The event is recorded on gpu1's compute stream (s0); the copy stream from gpu0 (s1) waits.
  EXPECT_EQ(gpu1.log, (std::vector<std::string>{"record e0 s0", "wait s1 e0"}));
}

TEST(PipelineStreams, PartitionsLoopOverTheDevices) {
  FakeBackend gpu0;
  FakeBackend gpu1;
  Choreography<FakeBackend> streams({&gpu0, &gpu1}, {0, 1, 0, 1});
  EXPECT_EQ(streams.device_of_partition(2), 0U);
  gpu1.log.clear();
  streams.finish(Phase::Forward, Cell{0, 3});
  ASSERT_FALSE(gpu1.log.empty());
  EXPECT_EQ(streams.copy_after(Phase::Forward, Cell{0, 3}, 0), streams.copy(1, 0));
}

TEST(PipelineStreams, CopyStreamsLiveOnTheDestinationDevice) {
  FakeBackend gpu0;
  FakeBackend gpu1;
  const Choreography<FakeBackend> streams({&gpu0, &gpu1});
  EXPECT_EQ(gpu1.log, (std::vector<std::string>{"stream s1 copy gpu0->gpu1"}));
  EXPECT_EQ(gpu0.log, (std::vector<std::string>{"stream s1 copy gpu1->gpu0"}));
  EXPECT_EQ(streams.device_of(streams.copy(0, 1)), 1U);
  EXPECT_EQ(streams.device_of(streams.copy(1, 0)), 0U);
  EXPECT_EQ(streams.device_of(streams.compute(1)), 1U);
}

TEST(PipelineStreams, CopiesWaitOnceForTheProducerAndComputeWaitsForTheCopies) {
  FakeBackend gpu0;
  FakeBackend gpu1;
  Choreography<FakeBackend> streams({&gpu0, &gpu1});
  gpu0.log.clear();
  gpu1.log.clear();
  streams.finish(Phase::Forward, Cell{0, 0});
  EXPECT_EQ(gpu0.log, (std::vector<std::string>{"record e0 s0"}));
  streams.begin_fence();
  const StreamRef s = streams.copy_after(Phase::Forward, Cell{0, 0}, 1);
  streams.wait_for(s, Phase::Forward, Cell{0, 0});  // a second copy from the same task
  streams.arrived(Cell{0, 1}, s);
  streams.start(Cell{0, 1});
  EXPECT_EQ(gpu1.log, (std::vector<std::string>{"wait s1 e0", "record e0 s1", "wait s0 e0"}));
  // The next fence waits again; the arrivals were consumed by the start.
  streams.begin_fence();
  streams.wait_for(s, Phase::Forward, Cell{0, 0});
  streams.start(Cell{0, 1});
  EXPECT_EQ(gpu1.log.size(), 4U);
}

TEST(PipelineStreams, WaitingForATaskThatHasNotFinishedIsABug) {
  FakeBackend gpu0;
  FakeBackend gpu1;
  Choreography<FakeBackend> streams({&gpu0, &gpu1});
  streams.begin_fence();
  EXPECT_ANY_THROW(streams.copy_after(Phase::Backward, Cell{0, 1}, 0));
}

TEST(SharedBuffers, TheLastHolderFreesWithRecordStreamOnEveryOtherStreamThatUsedIt) {
  FakeBackend gpu0;
  FakeBackend gpu1;
  const Choreography<FakeBackend> streams({&gpu0, &gpu1});
  SharedBuffers<FakeBackend> holders(streams);
  gpu1.log.clear();
  const auto received = holders.adopt(gpu1.tensor(), streams.copy(0, 1), 2);
  holders.used_on(received, streams.copy(0, 1));  // its own stream: no record_stream
  holders.used_on(received, streams.compute(1));
  holders.used_on(received, streams.compute(1));
  EXPECT_FALSE(holders.release(received));
  EXPECT_TRUE(gpu1.log.empty());
  EXPECT_TRUE(holders.release(received));
  EXPECT_EQ(gpu1.log, (std::vector<std::string>{"record_stream b0 s0", "free b0"}));
  EXPECT_FALSE(holders.live(received));
  EXPECT_ANY_THROW(holders.release(received));
}

TEST(SharedBuffers, AnotherReferenceKeepsTheStorageAfterThePipelineLetsGo) {
  FakeBackend gpu0;
  FakeBackend gpu1;
  const Choreography<FakeBackend> streams({&gpu0, &gpu1});
  SharedBuffers<FakeBackend> holders(streams);
  const auto buffer = gpu0.tensor();
  const auto h = holders.adopt(buffer, streams.compute(0), 1);
  gpu0.hold(buffer);  // an offloader packed it
  gpu0.log.clear();
  EXPECT_TRUE(holders.release(h));
  EXPECT_TRUE(gpu0.log.empty());
  gpu0.drop(buffer);
  EXPECT_EQ(gpu0.log, (std::vector<std::string>{"free b0"}));
}

}  // namespace
}  // namespace ferry::pipeline
