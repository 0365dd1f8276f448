// The simulator's engine parts on their own: the event queue, the stream scheduler, the copy
// engines' contention model, the content shadow, and the observer interface.

#include <gtest/gtest.h>

#include <algorithm>
#include <span>
#include <vector>

#include "ferry/sim/engine/content_shadow.hpp"
#include "ferry/sim/engine/copy_engines.hpp"
#include "ferry/sim/engine/event_queue.hpp"
#include "ferry/sim/engine/stream_scheduler.hpp"
#include "ferry/sim/export/trace.hpp"
#include "ferry/sim/runs/metrics.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

TEST(EventQueue, EqualTimesComeOutInSchedulingOrder) {
  EventQueue<int> q;
  q.schedule(SimTime(20), 1);
  q.schedule(SimTime(10), 2);
  q.schedule(SimTime(20), 3);
  q.schedule(SimTime(10), 4);
  std::vector<int> order;
  while (!q.empty()) order.push_back(q.pop().payload);
  EXPECT_EQ(order, (std::vector<int>{2, 4, 1, 3}));
}

TEST(EventQueue, DueSeesOnlyEventsAtOrBeforeTheTime) {
  EventQueue<int> q;
  EXPECT_FALSE(q.due(SimTime(100)));
  q.schedule(SimTime(50), 0);
  EXPECT_FALSE(q.due(SimTime(49)));
  EXPECT_TRUE(q.due(SimTime(50)));
}

TEST(ContentShadow, UnwrittenBytesReadAsIdZero) {
  ContentShadow shadow;
  EXPECT_EQ(shadow.read(Bytes(10), Bytes(20)),
            (std::vector<ContentPiece>{{Bytes(0), Bytes(10), 0, Bytes(0)}}));
}

TEST(ContentShadow, AnOverwriteSplitsTheRunItLandsIn) {
  ContentShadow shadow;
  shadow.write(Bytes(0), Bytes(100), 7, Bytes(0));
  shadow.write(Bytes(40), Bytes(60), 9, Bytes(0));
  EXPECT_EQ(shadow.read(Bytes(0), Bytes(100)),
            (std::vector<ContentPiece>{{Bytes(0), Bytes(40), 7, Bytes(0)},
                                       {Bytes(40), Bytes(20), 9, Bytes(0)},
                                       {Bytes(60), Bytes(40), 7, Bytes(60)}}));
}

TEST(ContentShadow, WritingIdZeroForgetsTheBytes) {
  ContentShadow shadow;
  shadow.write(Bytes(0), Bytes(100), 7, Bytes(0));
  shadow.write(Bytes(0), Bytes(50), 0, Bytes(0));
  EXPECT_EQ(shadow.read(Bytes(0), Bytes(100)),
            (std::vector<ContentPiece>{{Bytes(0), Bytes(50), 0, Bytes(0)},
                                       {Bytes(50), Bytes(50), 7, Bytes(50)}}));
}

TEST(ContentShadow, HoldsExactlyWhatItReads) {
  ContentShadow shadow;
  shadow.write(Bytes(0), Bytes(100), 7, Bytes(0));
  shadow.write(Bytes(40), Bytes(60), 9, Bytes(0));
  const std::vector<ContentPiece> read = shadow.read(Bytes(20), Bytes(120));
  ASSERT_EQ(read.size(), 4U);  // 7, 9, 7 and the unwritten tail
  EXPECT_TRUE(shadow.holds(Bytes(20), Bytes(120), read));
  std::vector<ContentPiece> other_base = read;
  other_base[2].base += Bytes(1);
  EXPECT_FALSE(shadow.holds(Bytes(20), Bytes(120), other_base));
  EXPECT_FALSE(shadow.holds(Bytes(20), Bytes(120), std::span(read).first(3)));
  std::vector<ContentPiece> longer = read;
  longer.push_back(read.back());
  EXPECT_FALSE(shadow.holds(Bytes(20), Bytes(120), longer));
  EXPECT_FALSE(shadow.holds(Bytes(20), Bytes(120), {}));
}

TEST(ContentShadow, CopyMovesPiecesWithTheirBase) {
  ContentShadow from;
  ContentShadow to;
  from.write(Bytes(100), Bytes(200), 5, Bytes(0));
  to.copy_from(from, Bytes(150), Bytes(0), Bytes(100));
  EXPECT_EQ(to.read(Bytes(0), Bytes(100)),
            (std::vector<ContentPiece>{{Bytes(0), Bytes(50), 5, Bytes(50)},
                                       {Bytes(50), Bytes(50), 0, Bytes(0)}}));
}

TEST(ContentShadow, CopyWithinOneSpaceReadsBeforeItWrites) {
  ContentShadow shadow;
  shadow.write(Bytes(0), Bytes(10), 1, Bytes(0));
  shadow.write(Bytes(10), Bytes(20), 2, Bytes(0));
  shadow.copy_from(shadow, Bytes(0), Bytes(5), Bytes(20));
  EXPECT_EQ(shadow.read(Bytes(0), Bytes(25)),
            (std::vector<ContentPiece>{{Bytes(0), Bytes(5), 1, Bytes(0)},
                                       {Bytes(5), Bytes(10), 1, Bytes(0)},
                                       {Bytes(15), Bytes(10), 2, Bytes(0)}}));
}

// What a scheduler started, in order.
struct Started {
  std::vector<std::pair<OpId, bool>> ops;  // (op, wait_done)
  auto sink() {
    return [this](OpId op, bool wait_done) { ops.emplace_back(op, wait_done); };
  }
};

TEST(StreamScheduler, AWaitHoldsItsStreamUntilTheOtherStreamGetsThere) {
  StreamScheduler s(false);
  const StreamId a = s.add("a", DeviceId(0), 1);
  const StreamId b = s.add("b", DeviceId(0), 2);
  Started started;
  s.submit(a, OpId(0), std::nullopt, started.sink());
  const StreamPosition after_first = s.submitted(a);
  s.submit(b, OpId(1), after_first, started.sink());
  s.submit(b, OpId(2), std::nullopt, started.sink());
  ASSERT_EQ(started.ops.size(), 1U);  // only a's op; b is held
  EXPECT_EQ(started.ops[0].first, OpId(0));
  started.ops.clear();
  s.complete(a, started.sink());
  ASSERT_EQ(started.ops.size(), 2U);
  EXPECT_EQ(started.ops[0], std::make_pair(OpId(1), true));
  EXPECT_EQ(started.ops[1], std::make_pair(OpId(2), false));
  EXPECT_TRUE(s.reached(after_first));
}

TEST(StreamScheduler, IgnoringWaitsIsAPlantedFaultThatReleasesAtOnce) {
  StreamScheduler s(true);
  const StreamId a = s.add("a", DeviceId(0), 1);
  const StreamId b = s.add("b", DeviceId(0), 2);
  Started started;
  s.submit(a, OpId(0), std::nullopt, started.sink());
  s.submit(b, OpId(1), s.submitted(a), started.sink());
  ASSERT_EQ(started.ops.size(), 2U);
  EXPECT_TRUE(started.ops[1].second);
}

TEST(StreamScheduler, OneOpAtATimePerStream) {
  StreamScheduler s(false);
  const StreamId a = s.add("a", DeviceId(0), 1);
  Started started;
  s.submit(a, OpId(0), std::nullopt, started.sink());
  s.submit(a, OpId(1), std::nullopt, started.sink());
  EXPECT_EQ(started.ops.size(), 1U);
  EXPECT_FALSE(s.reached(s.submitted(a)));
}

// Runs the queue until the copy engines report completions; returns (op, time) pairs.
std::vector<std::pair<OpId, SimTime>> drain(DeviceEventQueue& q, CopyEngines& engines) {
  std::vector<std::pair<OpId, SimTime>> done;
  while (!q.empty()) {
    const auto ev = q.pop();
    if (auto op = engines.phase_done(ev.payload.engine, ev.payload.generation, ev.time)) {
      done.emplace_back(*op, ev.time);
      (void)engines.try_start(ev.payload.engine, ev.time);
    }
  }
  return done;
}

TEST(CopyEngines, OppositeDirectionsSlowEachOtherWhileBothTransfer) {
  DeviceEventQueue q;
  CopyEngines engines(q);
  const EngineId h2d = engines.add(EngineInfo{"h2d", DeviceId(0)}, 500);
  const EngineId d2h = engines.add(EngineInfo{"d2h", DeviceId(0)}, 500);
  engines.pair(h2d, d2h);
  // 1000 bytes at 1 byte/ns each; both at half rate while they overlap.
  engines.enqueue(h2d, CopyJob{OpId(0), Bytes(1000), Bandwidth(1'000'000'000), SimTime(0)});
  engines.enqueue(d2h, CopyJob{OpId(1), Bytes(1000), Bandwidth(1'000'000'000), SimTime(0)});
  EXPECT_EQ(engines.try_start(h2d, SimTime(0)), OpId(0));
  EXPECT_EQ(engines.try_start(d2h, SimTime(0)), OpId(1));
  const auto done = drain(q, engines);
  ASSERT_EQ(done.size(), 2U);
  EXPECT_EQ(done[0].second, SimTime(2000));
  EXPECT_EQ(done[1].second, SimTime(2000));
}

TEST(CopyEngines, AnEngineRunsOneCopyAtATimeAfterItsLatency) {
  DeviceEventQueue q;
  CopyEngines engines(q);
  const EngineId e = engines.add(EngineInfo{"e", DeviceId(0)}, 1000);
  engines.enqueue(e, CopyJob{OpId(0), Bytes(100), Bandwidth(1'000'000'000), SimTime(10)});
  engines.enqueue(e, CopyJob{OpId(1), Bytes(100), Bandwidth(1'000'000'000), SimTime(10)});
  EXPECT_EQ(engines.try_start(e, SimTime(0)), OpId(0));
  EXPECT_EQ(engines.try_start(e, SimTime(0)), std::nullopt);
  const auto done = drain(q, engines);
  ASSERT_EQ(done.size(), 2U);
  EXPECT_EQ(done[0], std::make_pair(OpId(0), SimTime(110)));
  EXPECT_EQ(done[1], std::make_pair(OpId(1), SimTime(220)));
}

TEST(CopyEngines, PeerLinksAreCreatedOncePerDirection) {
  DeviceEventQueue q;
  CopyEngines engines(q);
  EXPECT_EQ(engines.peer(DeviceId(0), DeviceId(1)), std::nullopt);
  const EngineId link = engines.add_peer(DeviceId(0), DeviceId(1), EngineInfo{"0->1", DeviceId(0)});
  EXPECT_EQ(engines.peer(DeviceId(0), DeviceId(1)), link);
  EXPECT_EQ(engines.peer(DeviceId(1), DeviceId(0)), std::nullopt);
}

// Counts what it hears.
class CountingObserver final : public SimObserver {
 public:
  void engine_added(EngineId /*engine*/, const EngineInfo& /*info*/) override { ++engines; }
  void op_finished(OpId op, const OpRecord& record) override {
    finished.push_back(op);
    last_end = record.end;
  }
  void memory_sampled(const MemorySample& /*sample*/) override { ++samples; }
  int engines = 0;
  int samples = 0;
  std::vector<OpId> finished;
  SimTime last_end;
};

TEST(SimObserver, HearsEveryOpOnceWhenItsRecordIsFinal) {
  Simulator sim = testing::simple_sim(2);
  CountingObserver counter;
  sim.observe(counter);
  EXPECT_EQ(counter.engines, 6);  // H2D, D2H, D2D per device
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(1), "b");
  const BufferId d0 = testing::device_buffer(sim, a, 1000);
  const BufferId d1 = testing::device_buffer(sim, b, 1000);
  const EventId e = sim.add_event();
  sim.kernel(a, SimTime(500), {}, std::vector<Region>{testing::whole(sim, d0)}, "k");
  sim.record(e, a);
  sim.wait(b, e);
  sim.copy(b, testing::whole(sim, d0), testing::whole(sim, d1), "peer");
  sim.free(d0);
  sim.finish();
  EXPECT_EQ(counter.engines, 7);  // and the peer link, when first used
  EXPECT_EQ(counter.samples, 3);  // two allocs, one free
  std::vector<OpId> sorted = counter.finished;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_EQ(sorted.size(), sim.ops().size());
  for (std::uint32_t i = 0; i < sorted.size(); ++i) EXPECT_EQ(sorted[i], OpId(i));
  EXPECT_EQ(counter.last_end, sim.makespan());  // the copy finishes last
}

TEST(ChromeTrace, AnAttachedTraceEqualsOneReplayedAfterTheRun) {
  Simulator sim = testing::simple_sim(2);
  ChromeTrace live;
  sim.observe(live);
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(1), "b");
  const BufferId d0 = testing::device_buffer(sim, a, 4000);
  const BufferId d1 = testing::device_buffer(sim, b, 4000);
  const BufferId h = testing::pinned_buffer(sim, 4000);
  const EventId e = sim.add_event();
  for (int i = 0; i < 5; ++i) {
    sim.kernel(a, SimTime(100 + i), {}, std::vector<Region>{testing::whole(sim, d0)}, "k");
    sim.copy(a, testing::whole(sim, d0), testing::whole(sim, h), "d2h");
    sim.record(e, a);
    sim.wait(b, e);
    sim.copy(b, testing::whole(sim, d0), testing::whole(sim, d1), "peer");
  }
  sim.free(h);
  sim.finish();
  EXPECT_EQ(live.json(sim), chrome_trace(sim));
}

TEST(TimelineMetrics, AnAttachedCollectorEqualsOneReplayedAfterTheRun) {
  Simulator sim = testing::simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId side = sim.add_stream(DeviceId(0), "side");
  TimelineMetrics live(compute);
  sim.observe(live);
  const BufferId d = testing::device_buffer(sim, compute, 1 << 20);
  const BufferId h = testing::pinned_buffer(sim, 1 << 20);
  const EventId e = sim.add_event();
  const SimTime start = sim.host_time();
  sim.kernel(compute, SimTime(1000), {}, std::vector<Region>{testing::whole(sim, d)}, "k0");
  sim.copy(side, testing::whole(sim, d), testing::whole(sim, h), "d2h");
  sim.record(e, side);
  sim.wait(compute, e);  // the compute stream stalls until the copy is done
  sim.kernel(compute, SimTime(1000), std::vector<Region>{testing::whole(sim, d)}, {}, "k1");
  sim.finish();
  const SimTime end = sim.makespan();

  TimelineMetrics replayed(compute);
  sim.replay(replayed);
  EXPECT_EQ(live.stall(start, end), replayed.stall(start, end));
  EXPECT_EQ(live.copy_overlap_permille(), replayed.copy_overlap_permille());
  // A span counts the copies issued in it: all of them here, none after the end.
  EXPECT_EQ(live.copy_overlap_permille(start, end), live.copy_overlap_permille());
  EXPECT_EQ(live.copy_overlap_permille(end + SimTime(1), end + SimTime(2)), 0);
  EXPECT_EQ(live.copied(CopyDirection::DeviceToHost, start, end), Bytes(1 << 20));
  EXPECT_EQ(live.copied(CopyDirection::HostToDevice, start, end), Bytes(0));

  // The stall is the time from the wait's issue (or the end of k0) to the copy's end.
  SimTime copy_end;
  SimTime k0_end;
  SimTime wait_issued;
  for (const OpRecord& r : sim.ops()) {
    if (r.kind == OpKind::Copy) copy_end = r.end;
    if (r.kind == OpKind::Kernel && k0_end == SimTime()) k0_end = r.end;
    if (r.kind == OpKind::Wait) wait_issued = r.issued;
  }
  const SimTime ready = std::max(k0_end, wait_issued);
  ASSERT_GT(copy_end, ready);
  EXPECT_EQ(live.stall(start, end), copy_end - ready);
  EXPECT_EQ(compute_stall(sim, compute, start, end), copy_end - ready);
  EXPECT_EQ(live.stall(end, end + SimTime(1)), SimTime(0));  // no wait issued then
  // The planner's one pass over the records reads the same stall and bytes copied.
  const StepFigures figures = step_figures(sim, compute, start, end);
  EXPECT_EQ(figures.stall, copy_end - ready);
  EXPECT_EQ(figures.d2h, Bytes(1 << 20));
  EXPECT_EQ(step_figures(sim, compute, end, end + SimTime(1)).stall, SimTime(0));
  EXPECT_EQ(step_figures(sim, side, start, end).stall, SimTime(0));  // side's work is no stall
}

}  // namespace
}  // namespace ferry::sim
