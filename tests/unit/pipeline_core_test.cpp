// The core's pipeline pieces on their own, over fake backends: the clock, the stream
// choreography (Note [Pipeline streams]) and the holders that free a shared buffer with
// record_stream (Note [Receive buffers and record_stream]).

#include <gtest/gtest.h>

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
