#include <fmt/format.h>
#include <gtest/gtest.h>

#include <vector>

#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

using testing::kNone;
using testing::one;
using testing::simple_sim;
using testing::whole;

// A reload: H2D copy on a side stream, then a backward kernel on compute that reads it.
struct Reload {
  Simulator sim;
  StreamId compute;
  StreamId h2d;
  OpId copy;
  OpId use;
};

Reload reload(bool wait, CheckerFaults faults = {}) {
  Reload r{
      simple_sim(1, {}, testing::simple_profile(), SimFaults{.checker = faults}), {}, {}, {}, {}};
  Simulator& sim = r.sim;
  r.compute = sim.add_stream(DeviceId(0), "compute");
  r.h2d = sim.add_stream(DeviceId(0), "h2d");
  const EventId done = sim.add_event();
  const BufferId host = testing::pinned_buffer(sim, 4096);
  const BufferId act = testing::device_buffer(sim, r.compute, 4096, "act");
  r.copy = sim.copy(r.h2d, whole(sim, host), whole(sim, act), "reload");
  sim.record(done, r.h2d);
  if (wait) sim.wait(r.compute, done);
  r.use = sim.kernel(r.compute, SimTime(50), one(whole(sim, act)), kNone, "backward");
  sim.finish();
  return r;
}

TEST(HazardChecker, ReloadReadWithoutWaitIsReadAfterWrite) {
  const Reload r = reload(false);
  ASSERT_EQ(r.sim.hazards().size(), 1U);
  const Hazard& h = r.sim.hazards()[0];
  EXPECT_EQ(h.kind, HazardKind::Race);
  EXPECT_EQ(h.conflict, Conflict::ReadAfterWrite);
  EXPECT_EQ(h.first, r.copy);
  EXPECT_EQ(h.second, r.use);
  EXPECT_EQ((h.hi - h.lo).count(), 4096);
}

TEST(HazardChecker, WaitingForTheReloadEventMakesItSafe) {
  EXPECT_TRUE(reload(true).sim.hazards().empty());
}

TEST(HazardChecker, PlantedFaultIgnoringWaitsReportsTheSafeReload) {
  CheckerFaults faults;
  faults.ignore_event_waits = true;
  EXPECT_EQ(reload(true, faults).sim.hazards().size(), 1U);
}

TEST(HazardChecker, VerdictDoesNotDependOnTiming) {
  // The copy finishes long before the kernel starts, yet nothing orders them.
  Simulator sim = simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId h2d = sim.add_stream(DeviceId(0), "h2d");
  const BufferId host = testing::pinned_buffer(sim, 16);
  const BufferId act = testing::device_buffer(sim, compute, 16);
  sim.copy(h2d, whole(sim, host), whole(sim, act));
  sim.kernel(compute, SimTime(1'000'000), kNone, kNone);
  sim.kernel(compute, SimTime(1), one(whole(sim, act)), kNone);
  sim.finish();
  EXPECT_EQ(sim.hazards().size(), 1U);
}

TEST(HazardChecker, WriteAfterReadAcrossStreams) {
  Simulator sim = simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId d2h = sim.add_stream(DeviceId(0), "d2h");
  const EventId e = sim.add_event();
  const BufferId act = testing::device_buffer(sim, compute, 1024);
  const BufferId host = testing::pinned_buffer(sim, 1024);
  sim.kernel(compute, SimTime(10), kNone, one(whole(sim, act)));
  sim.record(e, compute);
  sim.wait(d2h, e);
  const OpId offload = sim.copy(d2h, whole(sim, act), whole(sim, host));
  const OpId overwrite = sim.kernel(compute, SimTime(10), kNone, one(whole(sim, act)));
  sim.finish();
  ASSERT_EQ(sim.hazards().size(), 1U);
  EXPECT_EQ(sim.hazards()[0].conflict, Conflict::WriteAfterRead);
  EXPECT_EQ(sim.hazards()[0].first, offload);
  EXPECT_EQ(sim.hazards()[0].second, overwrite);
}

TEST(HazardChecker, WriteAfterWriteAcrossStreams) {
  Simulator sim = simple_sim();
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(0), "b");
  const BufferId x = testing::device_buffer(sim, a, 64);
  sim.kernel(a, SimTime(10), kNone, one(whole(sim, x)));
  sim.kernel(b, SimTime(10), kNone, one(whole(sim, x)));
  sim.finish();
  ASSERT_EQ(sim.hazards().size(), 1U);
  EXPECT_EQ(sim.hazards()[0].conflict, Conflict::WriteAfterWrite);
}

TEST(HazardChecker, ReadsOnTwoStreamsDoNotConflict) {
  Simulator sim = simple_sim();
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(0), "b");
  const BufferId x = testing::device_buffer(sim, a, 64);
  sim.kernel(a, SimTime(10), one(whole(sim, x)), kNone);
  sim.kernel(b, SimTime(10), one(whole(sim, x)), kNone);
  sim.finish();
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(HazardChecker, PartialOverlapReportsOnlyTheSharedBytes) {
  Simulator sim = simple_sim();
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(0), "b");
  const BufferId x = testing::device_buffer(sim, a, 4096);
  sim.kernel(a, SimTime(10), kNone, one(Region{x, Bytes(0), Bytes(1000)}));
  sim.kernel(b, SimTime(10), one(Region{x, Bytes(600), Bytes(1000)}), kNone);
  sim.kernel(b, SimTime(10), one(Region{x, Bytes(1000), Bytes(1000)}), kNone);
  sim.finish();
  ASSERT_EQ(sim.hazards().size(), 1U);
  const Hazard& h = sim.hazards()[0];
  const Bytes base = sim.buffers()[x.value()].address;
  EXPECT_EQ((h.lo - base).count(), 600);
  EXPECT_EQ((h.hi - base).count(), 1000);
}

TEST(HazardChecker, HostReadingPinnedMemoryBeforeTheCopyCompletes) {
  Simulator sim = simple_sim();
  const StreamId d2h = sim.add_stream(DeviceId(0), "d2h");
  const EventId done = sim.add_event();
  const BufferId act = testing::device_buffer(sim, d2h, 256);
  const BufferId host = testing::pinned_buffer(sim, 256);
  sim.copy(d2h, whole(sim, act), whole(sim, host));
  sim.record(done, d2h);
  sim.host_read(one(whole(sim, host)));
  sim.sync_event(done);
  sim.host_read(one(whole(sim, host)));
  sim.finish();
  ASSERT_EQ(sim.hazards().size(), 1U);
  EXPECT_EQ(sim.hazards()[0].kind, HazardKind::HostBeforeCopy);
  EXPECT_EQ(sim.hazards()[0].conflict, Conflict::ReadAfterWrite);
}

TEST(HazardChecker, SuccessfulQueryOrdersTheHostAfterTheEvent) {
  Simulator sim = simple_sim();
  const StreamId d2h = sim.add_stream(DeviceId(0), "d2h");
  const StreamId other = sim.add_stream(DeviceId(0), "other");
  const EventId done = sim.add_event();
  const BufferId act = testing::device_buffer(sim, d2h, 256);
  const BufferId host = testing::pinned_buffer(sim, 256);
  sim.copy(d2h, whole(sim, act), whole(sim, host));
  sim.record(done, d2h);
  sim.kernel(other, SimTime(10'000), kNone, kNone);
  sim.sync_stream(other);  // long enough for the copy to finish
  ASSERT_TRUE(sim.query(done));
  sim.host_write(one(whole(sim, host)));
  sim.finish();
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(HazardChecker, EmptyCacheThatFreesASegmentSynchronizesTheDevice) {
  // See Note [cudaFree synchronizes]: after it, the host may read what a copy wrote.
  for (const bool free_segment : {false, true}) {
    Simulator sim = simple_sim();
    const StreamId d2h = sim.add_stream(DeviceId(0), "d2h");
    const BufferId act = testing::device_buffer(sim, d2h, 4096, "act");
    const BufferId scratch = testing::device_buffer(sim, d2h, 4096, "scratch");
    const BufferId host = testing::pinned_buffer(sim, 4096);
    sim.copy(d2h, whole(sim, act), whole(sim, host));
    if (free_segment) {
      sim.free(act);
      sim.free(scratch);  // the whole 2 MiB segment is free now
    }
    sim.empty_cache(DeviceId(0));
    sim.host_read(one(whole(sim, host)));
    sim.finish();
    EXPECT_EQ(sim.hazards().size(), free_segment ? 0U : 1U) << free_segment;
    EXPECT_EQ(sim.ops()[sim.ops().size() - 2].device_synchronized, free_segment);
  }
}

TEST(HazardChecker, UseAfterFreeAndDoubleFree) {
  Simulator sim = simple_sim();
  const StreamId s = sim.add_stream(DeviceId(0), "s");
  const BufferId x = testing::device_buffer(sim, s, 64, "x");
  sim.free(x);
  sim.kernel(s, SimTime(1), one(Region{x, Bytes(0), Bytes(64)}), kNone);
  sim.free(x);
  sim.finish();
  ASSERT_EQ(sim.hazards().size(), 2U);
  EXPECT_EQ(sim.hazards()[0].kind, HazardKind::UseAfterFree);
  EXPECT_EQ(sim.hazards()[1].kind, HazardKind::DoubleFree);
}

// An activation offloaded on a side stream and freed at once; the next allocation on the
// compute stream gets the same block and overwrites it while the copy may still read it.
struct FreeDuringOffload {
  Simulator sim;
  BufferId act0;
  BufferId act1;
};

FreeDuringOffload free_during_offload(bool record_stream) {
  FreeDuringOffload f{simple_sim(), {}, {}};
  Simulator& sim = f.sim;
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId d2h = sim.add_stream(DeviceId(0), "d2h");
  const EventId produced = sim.add_event();
  f.act0 = testing::device_buffer(sim, compute, 4LL << 20, "act0");
  const BufferId host = testing::pinned_buffer(sim, 4LL << 20);
  sim.kernel(compute, SimTime(10), kNone, one(whole(sim, f.act0)));
  sim.record(produced, compute);
  sim.wait(d2h, produced);
  sim.copy(d2h, whole(sim, f.act0), whole(sim, host));
  if (record_stream) sim.record_stream(f.act0, d2h);
  sim.free(f.act0);
  f.act1 = testing::device_buffer(sim, compute, 4LL << 20, "act1");
  sim.kernel(compute, SimTime(10), kNone, one(whole(sim, f.act1)));
  sim.finish();
  return f;
}

TEST(HazardChecker, ReuseOfAFreedBlockByTheAllocatingStreamWhileACopyReadsIt) {
  // Reported at the free, as latent reuse; the simulated reuse by act1's kernel is the same
  // defect and only adds reused_by (Note [Latent reuse]).
  const FreeDuringOffload f = free_during_offload(false);
  EXPECT_EQ(f.sim.buffers()[f.act0.value()].address, f.sim.buffers()[f.act1.value()].address);
  ASSERT_EQ(f.sim.hazards().size(), 1U);
  const Hazard& h = f.sim.hazards()[0];
  EXPECT_EQ(h.kind, HazardKind::LatentReuse);
  EXPECT_EQ(h.conflict, Conflict::WriteAfterRead);
  EXPECT_EQ(h.second, f.sim.buffers()[f.act0.value()].freed_by);
  ASSERT_TRUE(h.reused_by.valid());
  EXPECT_EQ(f.sim.ops()[h.reused_by.value()].kind, OpKind::Kernel);
}

TEST(HazardChecker, ANewOwnerOnAnUnorderedStreamIsStillAReuse) {
  // The free is safe (the allocation stream waited for the copy), but the next owner writes
  // the block on another stream that is ordered after neither: a reuse the free could not
  // foresee, reported when it happens.
  Simulator sim = simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId d2h = sim.add_stream(DeviceId(0), "d2h");
  const StreamId other = sim.add_stream(DeviceId(0), "other");
  const EventId copied = sim.add_event();
  const BufferId act0 = testing::device_buffer(sim, compute, 4096, "act0");
  const BufferId host = testing::pinned_buffer(sim, 4096);
  sim.copy(d2h, whole(sim, act0), whole(sim, host));
  sim.record(copied, d2h);
  sim.wait(compute, copied);
  sim.free(act0);
  const BufferId act1 = testing::device_buffer(sim, compute, 4096, "act1");
  const OpId write = sim.kernel(other, SimTime(10), kNone, one(whole(sim, act1)));
  sim.finish();
  ASSERT_EQ(sim.hazards().size(), 1U);
  EXPECT_EQ(sim.hazards()[0].kind, HazardKind::Reuse);
  EXPECT_EQ(sim.hazards()[0].second, write);
}

// A buffer read on three side streams after its kernel wrote it: the third reader's access is
// past the two a buffer keeps inline (HazardChecker's last accesses). Freed while the compute
// stream has not waited for that reader, the block's next owner is a latent reuse; waited, safe.
Simulator read_on_three_streams(bool wait_for_every_reader) {
  Simulator sim = simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const EventId produced = sim.add_event();
  const BufferId act0 = testing::device_buffer(sim, compute, 4LL << 20, "act0");
  sim.kernel(compute, SimTime(10), kNone, one(whole(sim, act0)));
  sim.record(produced, compute);
  std::vector<EventId> read;
  for (int i = 0; i < 3; ++i) {
    const StreamId side = sim.add_stream(DeviceId(0), fmt::format("side{}", i));
    read.push_back(sim.add_event());
    sim.wait(side, produced);
    sim.kernel(side, SimTime(10), one(whole(sim, act0)), kNone);
    sim.record(read.back(), side);
  }
  for (std::size_t i = 0; i < read.size(); ++i) {
    if (i + 1 < read.size() || wait_for_every_reader) sim.wait(compute, read[i]);
  }
  sim.free(act0);
  const BufferId act1 = testing::device_buffer(sim, compute, 4LL << 20, "act1");
  sim.kernel(compute, SimTime(10), kNone, one(whole(sim, act1)));
  sim.finish();
  return sim;
}

TEST(HazardChecker, AThirdReaderOfABufferStillOrdersItsReuse) {
  const Simulator unsafe = read_on_three_streams(false);
  ASSERT_EQ(unsafe.hazards().size(), 1U);
  EXPECT_EQ(unsafe.hazards()[0].kind, HazardKind::LatentReuse);
  EXPECT_EQ(unsafe.hazards()[0].conflict, Conflict::WriteAfterRead);
  EXPECT_TRUE(read_on_three_streams(true).hazards().empty());
}

TEST(HazardChecker, RecordStreamDefersTheReuseAndMakesItSafe) {
  const FreeDuringOffload f = free_during_offload(true);
  EXPECT_NE(f.sim.buffers()[f.act0.value()].address, f.sim.buffers()[f.act1.value()].address);
  EXPECT_TRUE(f.sim.hazards().empty());
}

TEST(HazardChecker, FrontiersStayBoundedOnLongSingleStreamPrograms) {
  HazardChecker checker;
  const ThreadIndex t = checker.add_thread();
  for (std::uint32_t i = 0; i < 10'000; ++i) {
    checker.begin_op(t);
    checker.access(t, OpId(i), AccessOrigin::Kernel, BufferId(0), 0, Bytes(0), Bytes(100),
                   i % 2 == 0);
  }
  EXPECT_TRUE(checker.hazards().empty());
  EXPECT_EQ(checker.tracked_segments(), 1U);
  EXPECT_EQ(checker.tracked_entries(), 2U);  // the latest read and the latest write
}

TEST(HazardChecker, UnorderedAccessesFromManyStreamsKeepOneEntryPerStream) {
  HazardChecker checker;
  std::vector<ThreadIndex> threads;
  for (int i = 0; i < 4; ++i) threads.push_back(checker.add_thread());
  for (std::uint32_t i = 0; i < 400; ++i) {
    const ThreadIndex t = threads[i % 4];
    checker.begin_op(t);
    checker.access(t, OpId(i), AccessOrigin::Kernel, BufferId(0), 0, Bytes(0), Bytes(64), false);
  }
  EXPECT_EQ(checker.tracked_entries(), 4U);
}

}  // namespace
}  // namespace ferry::sim
