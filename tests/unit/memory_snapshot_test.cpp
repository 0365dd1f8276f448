#include "ferry/sim/export/memory_snapshot.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

using testing::device_buffer;
using testing::simple_profile;
using testing::simple_sim;
using testing::whole;
using Action = AllocatorEvent::Action;

// A simulator that keeps its allocator actions, for memory snapshots.
Simulator recording_sim(int devices = 1, DeviceProfile profile = simple_profile()) {
  return simple_sim(devices, SimOptions{.record_allocator = true}, profile);
}

std::vector<Action> actions(const AllocatorHistory& h) {
  std::vector<Action> out;
  for (const AllocatorEvent& e : h.events) out.push_back(e.action);
  return out;
}

AllocatorHistory history_of(const Simulator& sim) {
  auto h = allocator_history(sim);
  EXPECT_TRUE(h.ok()) << (h.ok() ? "" : h.error().message);
  return std::move(h).value().at(0);
}

TEST(AllocatorHistory, DeferredFreeCompletesAtTheFirstMallocAfterTheSideStreamIsDone) {
  Simulator sim = recording_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId side = sim.add_stream(DeviceId(0), "side");
  const BufferId a = device_buffer(sim, compute, 1000, "layers.0.out");
  const Region read = whole(sim, a);
  sim.kernel(side, SimTime(5000), std::span(&read, 1), {}, "reader");
  sim.record_stream(a, side);
  sim.free(a);
  const BufferId b = device_buffer(sim, compute, 1000, "b");  // the side stream still reads a
  sim.sync_stream(side);
  const BufferId c = device_buffer(sim, compute, 1000, "c");  // a's block is back
  sim.finish();

  const AllocatorHistory h = history_of(sim);
  EXPECT_EQ(actions(h),
            (std::vector<Action>{Action::SegmentAlloc, Action::Alloc, Action::FreeRequested,
                                 Action::Alloc, Action::FreeCompleted, Action::Alloc}));
  const auto& ev = h.events;
  EXPECT_EQ(ev[1].buffer, a);
  EXPECT_EQ(ev[1].size, Bytes(1024)) << "events carry the rounded block size";
  EXPECT_EQ(ev[3].buffer, b);
  EXPECT_EQ(ev[4].buffer, a);
  EXPECT_GE(ev[4].time, SimTime(5000)) << "completed only after the reader";
  EXPECT_EQ(ev[5].buffer, c);
  EXPECT_EQ(ev[5].address, ev[1].address) << "c reuses a's block";
  EXPECT_EQ(ev[5].address, sim.buffers()[c.value()].address);
  ASSERT_EQ(h.segments.size(), 1U);
  EXPECT_EQ(h.segment_ops.at(h.segments[0].address), sim.buffers()[a.value()].allocated_by);
  EXPECT_EQ(h.block_buffers.size(), 2U) << "b and c are live at the end";
}

TEST(AllocatorHistory, AFreeWithoutRecordStreamCompletesAtOnce) {
  Simulator sim = recording_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const BufferId a = device_buffer(sim, compute, 3 << 20, "a");
  sim.free(a);
  sim.empty_cache(DeviceId(0));
  sim.finish();
  const AllocatorHistory h = history_of(sim);
  EXPECT_EQ(actions(h),
            (std::vector<Action>{Action::SegmentAlloc, Action::Alloc, Action::FreeRequested,
                                 Action::FreeCompleted, Action::SegmentFree}));
  EXPECT_EQ(h.events[0].size, kLargeBuffer);
  EXPECT_EQ(h.events[4].size, kLargeBuffer);
  EXPECT_TRUE(h.segments.empty());
  EXPECT_TRUE(h.block_buffers.empty());
}

TEST(AllocatorHistory, OutOfMemoryRetryAndFailureAreTraced) {
  DeviceProfile small = simple_profile();
  small.memory = Bytes(64 << 20);
  Simulator sim = recording_sim(1, small);
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const BufferId a = device_buffer(sim, compute, 40 << 20, "a");
  sim.free(a);                                 // cached: 40 MiB stay reserved
  device_buffer(sim, compute, 50 << 20, "b");  // only after the cached segment goes back
  const auto failed = sim.alloc(MemoryKind::Device, DeviceId(0), Bytes(30 << 20), compute,
                                PinnedPool::Caching, "c");
  EXPECT_FALSE(failed.ok());
  sim.finish();

  const AllocatorHistory h = history_of(sim);
  EXPECT_EQ(actions(h),
            (std::vector<Action>{Action::SegmentAlloc, Action::Alloc, Action::FreeRequested,
                                 Action::FreeCompleted, Action::SegmentFree, Action::SegmentAlloc,
                                 Action::Alloc, Action::Oom}));
  const AllocatorEvent& oom = h.events.back();
  EXPECT_EQ(oom.size, Bytes(30 << 20));
  EXPECT_EQ(oom.address, Bytes(14 << 20)) << "the device bytes not reserved";
  EXPECT_FALSE(oom.buffer.valid());
}

TEST(AllocatorHistory, EventsAddUpToTheRunsPeaks) {
  Simulator sim = recording_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  std::vector<BufferId> live;
  for (int i = 0; i < 12; ++i) {
    live.push_back(device_buffer(sim, compute, (i % 4 + 1) * 700'000, "x"));
    if (i % 3 == 2) {
      sim.free(live.front());
      live.erase(live.begin());
    }
  }
  sim.finish();
  const AllocatorHistory h = history_of(sim);
  Bytes allocated, reserved, allocated_peak, reserved_peak;
  for (const AllocatorEvent& e : h.events) {
    if (e.action == Action::Alloc) allocated += e.size;
    if (e.action == Action::FreeCompleted) allocated -= e.size;
    if (e.action == Action::SegmentAlloc) reserved += e.size;
    if (e.action == Action::SegmentFree) reserved -= e.size;
    allocated_peak = std::max(allocated_peak, allocated);
    reserved_peak = std::max(reserved_peak, reserved);
  }
  const AllocatorStats& st = sim.device_allocator(DeviceId(0)).stats();
  EXPECT_EQ(allocated_peak, st.allocated_peak);
  EXPECT_EQ(reserved_peak, st.reserved_peak);
  EXPECT_EQ(allocated, st.allocated);
  EXPECT_GT(st.allocated_peak, st.allocated) << "the scenario frees after its peak";
}

Simulator small_run() {
  Simulator sim = recording_sim();
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const BufferId a = device_buffer(sim, compute, 5000, "layers.1.attn.out");
  device_buffer(sim, compute, 30 << 20, "layers.1.mlp.up.out");
  sim.free(a);
  sim.finish();
  return sim;
}

TEST(MemorySnapshot, SameRunGivesSameBytes) {
  const Simulator first = small_run();
  const Simulator second = small_run();
  const auto a = memory_snapshot(first);
  const auto b = memory_snapshot(second);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a.value(), b.value());
  EXPECT_EQ(a.value(), memory_snapshot(first).value());
  EXPECT_EQ(a.value().substr(0, 4), std::string("\x80\x02}(", 4));
  EXPECT_EQ(a.value().back(), '.');
  EXPECT_NE(a.value().find("layers.1.mlp"), std::string::npos) << "frames name the layers";
}

TEST(MemorySnapshot, EmptyCacheOnTheSecondOfTwoDevicesIsTracedOnThatDevice) {
  Simulator sim = recording_sim(2);
  const StreamId s = sim.add_stream(DeviceId(1), "compute");
  sim.free(device_buffer(sim, s, 1000, "a"));
  sim.empty_cache(DeviceId(1));
  sim.finish();
  auto histories = allocator_history(sim);
  ASSERT_TRUE(histories.ok()) << histories.error().message;
  EXPECT_TRUE(histories.value().at(0).events.empty());
  EXPECT_EQ(actions(histories.value().at(1)),
            (std::vector<Action>{Action::SegmentAlloc, Action::Alloc, Action::FreeRequested,
                                 Action::FreeCompleted, Action::SegmentFree}));
  EXPECT_EQ(histories.value().at(1).events.back().op, OpId(2)) << "the empty_cache call";
  EXPECT_TRUE(memory_snapshot(sim).ok());
}

TEST(MemorySnapshot, ARunThatKeptNoAllocatorActionsIsRefusedWithAReason) {
  Simulator sim = simple_sim();
  const StreamId s = sim.add_stream(DeviceId(0), "compute");
  device_buffer(sim, s, 1000, "a");
  sim.finish();
  const auto snapshot = memory_snapshot(sim);
  ASSERT_FALSE(snapshot.ok());
  EXPECT_NE(snapshot.error().message.find("record_allocator"), std::string::npos)
      << snapshot.error().message;
}

TEST(AllocatorHistory, AnObserverHearsTheSameActionsAsTheLog) {
  struct Listener final : SimObserver {
    std::vector<AllocatorEvent> heard;
    void allocator_action(DeviceId /*device*/, const AllocatorEvent& e) override {
      heard.push_back(e);
    }
  } listener;
  Simulator sim = recording_sim();
  sim.observe(listener);
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  sim.free(device_buffer(sim, compute, 5000, "a"));
  sim.finish();
  const AllocatorHistory h = history_of(sim);
  ASSERT_EQ(listener.heard.size(), h.events.size());
  for (std::size_t i = 0; i < h.events.size(); ++i) {
    EXPECT_EQ(listener.heard[i].action, h.events[i].action);
    EXPECT_EQ(listener.heard[i].time, h.events[i].time);
    EXPECT_EQ(listener.heard[i].op, h.events[i].op);
  }
}

}  // namespace
}  // namespace ferry::sim
