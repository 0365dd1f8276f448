#include <gtest/gtest.h>

#include "ferry/sim/export/trace.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

using testing::device_buffer;
using testing::pinned_buffer;
using testing::simple_profile;
using testing::simple_sim;
using testing::whole;

constexpr std::span<const Region> kNone{};

TEST(Simulator, KernelsOnOneStreamRunInOrder) {
  Simulator sim = simple_sim();
  const StreamId s = sim.add_stream(DeviceId(0), "compute");
  const OpId a = sim.kernel(s, SimTime(100), kNone, kNone, "a");
  const OpId b = sim.kernel(s, SimTime(200), kNone, kNone, "b");
  sim.finish();
  EXPECT_EQ(sim.ops()[a.value()].end.ns(), 100);
  EXPECT_EQ(sim.ops()[b.value()].start.ns(), 100);
  EXPECT_EQ(sim.ops()[b.value()].end.ns(), 300);
}

// Note [Recycled records]: a simulation may start with the emptied record vectors of a finished
// one; it sees none of their records.
TEST(Simulator, ASimulationSeesNoneOfAFinishedOnesRecords) {
  const auto run = [](int kernels) {
    Simulator sim = simple_sim();
    const StreamId s = sim.add_stream(DeviceId(0), "compute");
    const BufferId b = device_buffer(sim, s, 1024);
    for (int k = 0; k < kernels; ++k) {
      const Region r = whole(sim, b);
      sim.kernel(s, SimTime(10), std::span(&r, 1), std::span(&r, 1), "k");
    }
    sim.free(b);
    sim.finish();
    std::vector<std::int64_t> seen{static_cast<std::int64_t>(sim.ops().size()),
                                   static_cast<std::int64_t>(sim.buffers().size()),
                                   sim.makespan().ns()};
    for (const OpRecord& op : sim.ops()) seen.push_back(op.end.ns());
    return seen;
  };
  const std::vector<std::int64_t> fresh = run(3);
  EXPECT_EQ(fresh[0], 5);  // the alloc, three kernels, the free
  EXPECT_EQ(fresh[2], 30);
  run(100'000);  // finished: its record vectors are kept for the next simulation
  EXPECT_EQ(run(3), fresh);
}

TEST(Simulator, KernelsOnTwoStreamsShareTheComputeEngine) {
  Simulator sim = simple_sim();
  const StreamId s1 = sim.add_stream(DeviceId(0), "a");
  const StreamId s2 = sim.add_stream(DeviceId(0), "b");
  sim.kernel(s1, SimTime(100), kNone, kNone);
  sim.kernel(s2, SimTime(200), kNone, kNone);
  sim.finish();
  EXPECT_EQ(sim.makespan().ns(), 300);
}

TEST(Simulator, ACollectiveRunsBesideComputeKernels) {
  Simulator sim = simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId comm = sim.add_stream(DeviceId(0), "comm");
  sim.kernel(compute, SimTime(300), kNone, kNone);
  const OpId c = sim.collective(comm, SimTime(200), kNone, kNone);
  sim.finish();
  EXPECT_EQ(sim.ops()[c.value()].start.ns(), 0);
  EXPECT_EQ(sim.makespan().ns(), 300);
}

// Note [Contended compute]: with the profile's figure, compute kernels run at that fraction of
// their rate while a collective runs on the device, keeping the work they have done.
TEST(Simulator, ComputeSlowsWhileACollectiveRunsWhereTheProfileSaysSo) {
  const auto makespan = [](std::int32_t permille, bool later) {
    DeviceProfile profile = simple_profile();
    profile.kernels.collective_overlap_permille = permille;
    Simulator sim = simple_sim(1, {}, profile);
    const StreamId compute = sim.add_stream(DeviceId(0), "compute");
    const StreamId comm = sim.add_stream(DeviceId(0), "comm");
    if (later) {  // the collective starts when a first kernel ends, in the second's run
      const EventId first = sim.add_event();
      sim.kernel(compute, SimTime(100), kNone, kNone);
      sim.record(first, compute);
      sim.wait(comm, first);
    }
    sim.kernel(compute, SimTime(300), kNone, kNone);
    sim.collective(comm, SimTime(100), kNone, kNone);
    sim.finish();
    return sim.makespan().ns();
  };
  EXPECT_EQ(makespan(0, false), 300);
  EXPECT_EQ(makespan(1000, false), 300);
  // 0..100 at half the rate (50 ns of work), then the 250 left: 350.
  EXPECT_EQ(makespan(500, false), 350);
  // The first kernel alone, then 100..200 shared: 100 + 50 + 250.
  EXPECT_EQ(makespan(0, true), 400);
  EXPECT_EQ(makespan(500, true), 450);
}

// Note [Collectives]: one engine per lane (process group) on each device.
TEST(Simulator, CollectivesOfOneLaneQueueAndOfTwoLanesOverlap) {
  for (const CollectiveLane second : {CollectiveLane::Fsdp, CollectiveLane::Tensor,
                                      CollectiveLane::Context, CollectiveLane::Expert}) {
    SCOPED_TRACE(static_cast<int>(second));
    Simulator sim = simple_sim();
    const StreamId a = sim.add_stream(DeviceId(0), "fsdp comm");
    const StreamId b = sim.add_stream(DeviceId(0), "other comm");
    const OpId first = sim.collective(a, SimTime(400), kNone, kNone, "prefetch");
    const OpId next = sim.collective(b, SimTime(100), kNone, kNone, "blocking", {}, second);
    sim.finish();
    const bool same = second == CollectiveLane::Fsdp;
    EXPECT_EQ(sim.ops()[first.value()].end.ns(), 400);
    EXPECT_EQ(sim.ops()[next.value()].start.ns(), same ? 400 : 0);
    EXPECT_EQ(sim.makespan().ns(), same ? 500 : 400);
  }
}

TEST(Simulator, EachDeviceHasItsOwnCollectiveLanes) {
  Simulator sim = simple_sim(2);
  const StreamId a = sim.add_stream(DeviceId(0), "comm");
  const StreamId b = sim.add_stream(DeviceId(1), "comm");
  sim.collective(a, SimTime(400), kNone, kNone, "", {}, CollectiveLane::Tensor);
  const OpId other = sim.collective(b, SimTime(100), kNone, kNone, "", {}, CollectiveLane::Tensor);
  sim.finish();
  EXPECT_EQ(sim.ops()[other.value()].start.ns(), 0);
}

TEST(Simulator, CopyOverlapsComputeOnAnotherStream) {
  Simulator sim = simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId side = sim.add_stream(DeviceId(0), "d2h");
  const BufferId act = device_buffer(sim, compute, 512);
  const BufferId host = pinned_buffer(sim, 512);
  sim.kernel(compute, SimTime(1000), kNone, kNone);
  const OpId c = sim.copy(side, whole(sim, act), whole(sim, host));
  sim.finish();
  EXPECT_EQ(sim.ops()[c.value()].end.ns(), 512);
  EXPECT_EQ(sim.makespan().ns(), 1000);
}

TEST(Simulator, CopyTakesLatencyPlusBytesOverBandwidth) {
  DeviceProfile p = simple_profile();
  p.h2d.latency = SimTime(40);
  p.h2d.bandwidth = Bandwidth(3'000'000'000);  // 3 bytes/ns: 1000 bytes -> 334 ns (rounded up)
  Simulator sim = simple_sim(1, {}, p);
  const StreamId s = sim.add_stream(DeviceId(0), "h2d");
  const BufferId dev = device_buffer(sim, s, 1000);
  const BufferId host = pinned_buffer(sim, 1000);
  const OpId c = sim.copy(s, whole(sim, host), whole(sim, dev));
  sim.finish();
  EXPECT_EQ(sim.ops()[c.value()].end.ns(), 40 + 334);
}

TEST(Simulator, SameDirectionCopiesSerializeOnTheEngine) {
  Simulator sim = simple_sim();
  const StreamId s1 = sim.add_stream(DeviceId(0), "a");
  const StreamId s2 = sim.add_stream(DeviceId(0), "b");
  const BufferId d1 = device_buffer(sim, s1, 1000);
  const BufferId d2 = device_buffer(sim, s2, 1000);
  const BufferId h1 = pinned_buffer(sim, 1000);
  const BufferId h2 = pinned_buffer(sim, 1000);
  sim.copy(s1, whole(sim, d1), whole(sim, h1));
  const OpId second = sim.copy(s2, whole(sim, d2), whole(sim, h2));
  sim.finish();
  EXPECT_EQ(sim.ops()[second.value()].start.ns(), 1000);
  EXPECT_EQ(sim.ops()[second.value()].end.ns(), 2000);
}

TEST(Simulator, OppositeDirectionsSlowEachOtherByTheProfileFactor) {
  DeviceProfile p = simple_profile();
  p.h2d.bidirectional_permille = 500;   // H2D halves while D2H runs (A100-like)
  p.d2h.bidirectional_permille = 1000;  // D2H unaffected
  Simulator sim = simple_sim(1, {}, p);
  const StreamId up = sim.add_stream(DeviceId(0), "h2d");
  const StreamId down = sim.add_stream(DeviceId(0), "d2h");
  const BufferId d1 = device_buffer(sim, up, 1000);
  const BufferId d2 = device_buffer(sim, down, 1000);
  const BufferId h1 = pinned_buffer(sim, 1000);
  const BufferId h2 = pinned_buffer(sim, 1000);
  const OpId h2d = sim.copy(up, whole(sim, h1), whole(sim, d1));
  const OpId d2h = sim.copy(down, whole(sim, d2), whole(sim, h2));
  sim.finish();
  // D2H: 1000 ns. H2D: 500 bytes by t=1000 at half rate, then 500 more at full rate.
  EXPECT_EQ(sim.ops()[d2h.value()].end.ns(), 1000);
  EXPECT_EQ(sim.ops()[h2d.value()].end.ns(), 1500);
}

TEST(Simulator, StreamWaitsForRecordedEvent) {
  Simulator sim = simple_sim();
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(0), "b");
  const BufferId d = device_buffer(sim, b, 100);
  const BufferId h = pinned_buffer(sim, 100);
  const EventId e = sim.add_event();
  sim.kernel(a, SimTime(700), kNone, kNone);
  sim.record(e, a);
  sim.wait(b, e);
  const OpId c = sim.copy(b, whole(sim, d), whole(sim, h));
  sim.finish();
  EXPECT_EQ(sim.ops()[c.value()].start.ns(), 700);
}

TEST(Simulator, RecordCapturesOnlyWorkSubmittedBeforeIt) {
  Simulator sim = simple_sim();
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(0), "b");
  const BufferId d = device_buffer(sim, b, 100);
  const BufferId h = pinned_buffer(sim, 100);
  const EventId e = sim.add_event();
  sim.kernel(a, SimTime(300), kNone, kNone);
  sim.record(e, a);
  sim.kernel(a, SimTime(5000), kNone, kNone);
  sim.wait(b, e);
  const OpId c = sim.copy(b, whole(sim, d), whole(sim, h));
  sim.finish();
  EXPECT_EQ(sim.ops()[c.value()].start.ns(), 300);
}

TEST(Simulator, WaitingOnANeverRecordedEventDoesNothing) {
  Simulator sim = simple_sim();
  const StreamId a = sim.add_stream(DeviceId(0), "a");
  const StreamId b = sim.add_stream(DeviceId(0), "b");
  const BufferId d = device_buffer(sim, b, 100);
  const BufferId h = pinned_buffer(sim, 100);
  const EventId e = sim.add_event();
  sim.wait(b, e);
  sim.kernel(a, SimTime(300), kNone, kNone);
  sim.record(e, a);
  const OpId c = sim.copy(b, whole(sim, d), whole(sim, h));
  sim.finish();
  EXPECT_EQ(sim.ops()[c.value()].start.ns(), 0);
}

TEST(Simulator, StreamSynchronizeBlocksTheHostUntilTheWorkIsDone) {
  Simulator sim = simple_sim();
  const StreamId s = sim.add_stream(DeviceId(0), "s");
  sim.kernel(s, SimTime(900), kNone, kNone);
  EXPECT_EQ(sim.host_time().ns(), 0);
  sim.sync_stream(s);
  EXPECT_EQ(sim.host_time().ns(), 900);
}

TEST(Simulator, QueryAnswersWhetherTheEventCompletedAtHostTime) {
  Simulator sim = simple_sim();
  const StreamId s = sim.add_stream(DeviceId(0), "s");
  const EventId e = sim.add_event();
  const EventId never = sim.add_event();
  sim.kernel(s, SimTime(900), kNone, kNone);
  sim.record(e, s);
  EXPECT_FALSE(sim.query(e));
  EXPECT_TRUE(sim.query(never));
  sim.sync_event(e);
  EXPECT_EQ(sim.host_time().ns(), 900);
  EXPECT_TRUE(sim.query(e));
}

TEST(Simulator, LaunchOverheadsAdvanceTheHostClock) {
  DeviceProfile p = simple_profile();
  p.overheads.kernel = SimTime(5);
  p.overheads.event_record = SimTime(2);
  Simulator sim = simple_sim(1, {}, p);
  const StreamId s = sim.add_stream(DeviceId(0), "s");
  const EventId e = sim.add_event();
  const OpId k = sim.kernel(s, SimTime(10), kNone, kNone);
  sim.record(e, s);
  const OpId k2 = sim.kernel(s, SimTime(1), kNone, kNone);
  EXPECT_EQ(sim.host_time().ns(), 12);
  sim.finish();
  EXPECT_EQ(sim.ops()[k.value()].start.ns(), 5);  // work starts once the launch returns
  EXPECT_EQ(sim.ops()[k2.value()].start.ns(), 15);
}

// A pinned allocation that no cached block serves pins a new one (cudaHostAlloc): the host pays
// `host_alloc` on top of `malloc`; a cached block of the size costs `malloc` alone, in either pool.
TEST(Simulator, PinningANewHostBlockCostsTheHostItsAllocation) {
  DeviceProfile p = simple_profile();
  p.overheads.malloc = SimTime(10);
  p.overheads.host_alloc = SimTime(1000);
  p.pinned_host_capacity = Bytes(8192);
  Simulator sim = simple_sim(1, {}, p);
  const auto pinned = [&](std::int64_t bytes, PinnedPool pool) {
    return sim.alloc(MemoryKind::Pinned, DeviceId(), Bytes(bytes), StreamId(), pool, "h").value();
  };
  const BufferId a = pinned(4096, PinnedPool::Caching);
  EXPECT_EQ(sim.host_time().ns(), 1010);
  sim.free(a);
  const BufferId b = pinned(4096, PinnedPool::Caching);  // the cached block
  EXPECT_EQ(sim.host_time().ns(), 1020);
  const BufferId c = pinned(1024, PinnedPool::Exact);  // a new size
  EXPECT_EQ(sim.host_time().ns(), 2030);
  sim.free(c);
  const BufferId d = pinned(1024, PinnedPool::Exact);
  EXPECT_EQ(sim.host_time().ns(), 2040);
  sim.free(b);
  sim.free(d);
  // Over the cap the cached blocks are unpinned and the request pinned anew.
  (void)pinned(8192, PinnedPool::Exact);
  EXPECT_EQ(sim.host_time().ns(), 3050);
  EXPECT_EQ(sim.pinned_allocator().stats().host_allocs, 3);
  EXPECT_EQ(sim.pinned_allocator().stats().host_frees, 2);
}

TEST(Simulator, PageableCopyBlocksTheHostAndRunsAtPageableBandwidth) {
  Simulator sim = simple_sim();
  const StreamId s = sim.add_stream(DeviceId(0), "s");
  const BufferId d = device_buffer(sim, s, 1000);
  const BufferId page = sim.alloc(MemoryKind::Pageable, DeviceId(), Bytes(1000), StreamId(),
                                  PinnedPool::Caching, "page")
                            .value();
  sim.kernel(s, SimTime(100), kNone, std::vector<Region>{whole(sim, d)});
  const OpId c = sim.copy(s, whole(sim, d), whole(sim, page));
  EXPECT_EQ(sim.ops()[c.value()].end.ns(), 100 + 2000);  // 0.5 bytes/ns
  EXPECT_EQ(sim.host_time().ns(), 2100);
  sim.host_read(std::vector<Region>{whole(sim, page)});
  sim.finish();
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(Simulator, PeerCopyUsesTheLinkBandwidth) {
  Simulator sim = simple_sim(2);
  const StreamId s0 = sim.add_stream(DeviceId(0), "s0");
  const StreamId s1 = sim.add_stream(DeviceId(1), "s1");
  const BufferId a = device_buffer(sim, s0, 4000);
  const BufferId b = device_buffer(sim, s1, 4000);
  const OpId c = sim.copy(s0, whole(sim, a), whole(sim, b));
  sim.finish();
  EXPECT_EQ(sim.ops()[c.value()].end.ns(), 2000);  // 2 bytes/ns
  EXPECT_EQ(sim.copied().peer.count(), 4000);
}

TEST(Simulator, ContentFollowsCopiesSoAReloadEqualsWhatWasSaved) {
  Simulator sim = simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId side = sim.add_stream(DeviceId(0), "side");
  const EventId produced = sim.add_event();
  const EventId offloaded = sim.add_event();
  const BufferId act = device_buffer(sim, compute, 4096, "act");
  const BufferId host = pinned_buffer(sim, 4096);
  const BufferId reload = device_buffer(sim, side, 4096, "reload");
  sim.kernel(compute, SimTime(10), kNone, std::vector<Region>{whole(sim, act)});
  sim.record(produced, compute);
  sim.wait(side, produced);
  sim.copy(side, whole(sim, act), whole(sim, host));
  sim.record(offloaded, side);
  sim.wait(side, offloaded);
  sim.copy(side, whole(sim, host), whole(sim, reload));
  sim.finish();
  const auto saved = sim.content(whole(sim, act));
  ASSERT_EQ(saved.size(), 1U);
  EXPECT_NE(saved[0].id, 0U);
  EXPECT_EQ(sim.content(whole(sim, reload)), saved);
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(Simulator, ContentOfAPartialCopyKeepsItsOffsets) {
  Simulator sim = simple_sim();
  const StreamId s = sim.add_stream(DeviceId(0), "s");
  const BufferId a = device_buffer(sim, s, 1024, "a");
  const BufferId h = pinned_buffer(sim, 1024);
  sim.kernel(s, SimTime(1), kNone, std::vector<Region>{whole(sim, a)});
  sim.copy(s, Region{a, Bytes(256), Bytes(512)}, Region{h, Bytes(0), Bytes(512)});
  sim.finish();
  const auto src = sim.content(Region{a, Bytes(256), Bytes(512)});
  const auto dst = sim.content(Region{h, Bytes(0), Bytes(512)});
  ASSERT_EQ(dst.size(), 1U);
  EXPECT_EQ(dst[0].id, src[0].id);
  EXPECT_EQ(dst[0].base.count(), 256);
  const auto rest = sim.content(Region{h, Bytes(512), Bytes(512)});
  ASSERT_EQ(rest.size(), 1U);
  EXPECT_EQ(rest[0].id, 0U);  // never written
}

TEST(Simulator, OutOfMemoryIsAnErrorValue) {
  DeviceProfile p = simple_profile();
  p.memory = Bytes(64LL << 20);
  Simulator sim = simple_sim(1, {}, p);
  const StreamId s = sim.add_stream(DeviceId(0), "s");
  device_buffer(sim, s, 40LL << 20, "big");
  auto second = sim.alloc(MemoryKind::Device, DeviceId(0), Bytes(40LL << 20), s,
                          PinnedPool::Caching, "second");
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.error().message.find("out of memory"), std::string::npos)
      << second.error().message;
}

TEST(Simulator, SameProgramGivesByteIdenticalTraces) {
  auto build = [] {
    Simulator sim = simple_sim();
    const StreamId a = sim.add_stream(DeviceId(0), "a");
    const StreamId b = sim.add_stream(DeviceId(0), "b");
    const EventId e = sim.add_event();
    const BufferId d = device_buffer(sim, a, 3000);
    const BufferId h = pinned_buffer(sim, 3000);
    for (int i = 0; i < 20; ++i) {
      sim.kernel(a, SimTime(100 + i), kNone, std::vector<Region>{whole(sim, d)}, "k");
      sim.record(e, a);
      sim.wait(b, e);
      sim.copy(b, whole(sim, d), whole(sim, h), "c");
      sim.record(e, b);
      sim.wait(a, e);
    }
    sim.finish();
    return chrome_trace(sim);
  };
  EXPECT_EQ(build(), build());
}

}  // namespace
}  // namespace ferry::sim

namespace ferry::sim {
namespace {

TEST(Simulator, ContentExpectationIsCheckedWhenTheKernelStarts) {
  Simulator sim = testing::simple_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId h2d = sim.add_stream(DeviceId(0), "h2d");
  const BufferId host = testing::pinned_buffer(sim, 1000);
  const BufferId act = testing::device_buffer(sim, compute, 1000, "act");
  const EventId done = sim.add_event();
  sim.host_write(std::vector<Region>{testing::whole(sim, host)});
  const OpId write = OpId(static_cast<std::uint32_t>(sim.ops().size() - 1));
  const std::vector<ContentPiece> saved{
      ContentPiece{Bytes(0), Bytes(1000), written_content(write, 0), Bytes(0)}};
  sim.copy(h2d, testing::whole(sim, host), testing::whole(sim, act));
  sim.record(done, h2d);
  // Without the wait the kernel starts before the copy lands: it reads stale bytes.
  sim.expect_content_at_next_kernel(testing::whole(sim, act), saved);
  sim.kernel(compute, SimTime(10), std::vector<Region>{testing::whole(sim, act)}, {});
  sim.wait(compute, done);
  sim.expect_content_at_next_kernel(testing::whole(sim, act), saved);
  sim.kernel(compute, SimTime(10), std::vector<Region>{testing::whole(sim, act)}, {});
  sim.finish();
  ASSERT_EQ(sim.content_mismatches().size(), 1U);
  EXPECT_EQ(sim.content_mismatches()[0].actual[0].id, 0U);
}

// Note [Processes]: two ranks, one process each. Process 0 copies into its pinned buffer and
// waits for the copy; process 1 then writes its own pinned buffer from the host.
std::vector<Hazard> two_processes_write(bool shared_pool) {
  SimFaults faults;
  faults.shared_pinned_pool = shared_pool;
  Simulator sim = simple_sim(2, SimOptions{.process_per_device = true}, simple_profile(), faults);
  const StreamId s0 = sim.add_stream(DeviceId(0), "rank0");
  sim.set_host(DeviceId(0));
  const BufferId d0 = device_buffer(sim, s0, 4096);
  const BufferId h0 = pinned_buffer(sim, 4096);
  sim.copy(s0, whole(sim, d0), whole(sim, h0), "offload");
  sim.sync_stream(s0);
  sim.set_host(DeviceId(1));
  const BufferId h1 = pinned_buffer(sim, 4096);
  EXPECT_EQ(sim.buffers()[h0.value()].address == sim.buffers()[h1.value()].address, shared_pool);
  const std::vector<Region> write{whole(sim, h1)};
  sim.host_write(write);
  sim.finish();
  EXPECT_EQ(sim.pinned_allocator(DeviceId(1)).stats().allocated.count(), 4096);
  return sim.hazards();
}

TEST(Simulator, ProcessesPinFromPoolsAtAddressesOfTheirOwn) {
  EXPECT_TRUE(two_processes_write(false).empty());
}

TEST(Simulator, ProcessesAreOrderedOnlyThroughWhatTheyWaitFor) {
  // Process 0's host waited for the copy; process 1's did not, so with the pools planted on
  // the same addresses its write races the copy.
  const std::vector<Hazard> hazards = two_processes_write(true);
  ASSERT_EQ(hazards.size(), 1U);
  EXPECT_EQ(hazards[0].conflict, Conflict::WriteAfterWrite);
}

}  // namespace
}  // namespace ferry::sim
