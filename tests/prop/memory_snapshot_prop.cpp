// The allocator actions behind memory snapshots (Note [Allocator tracking]) on random programs:
// with record_stream deferrals, event queries, empty_cache and devices small enough for
// out-of-memory retries, the actions a run keeps add up to its allocator's counters and peaks,
// leave exactly its segments and live blocks in the block table, every block at the address
// its buffer got, and the snapshot's bytes are a function of the run.

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>

#include "ferry/sim/export/memory_snapshot.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "prop/rc_gens.hpp"

namespace ferry::sim {
namespace {

using Action = AllocatorEvent::Action;

RC_GTEST_PROP(MemorySnapshot, KeptActionsAgreeWithTheAllocatorsOfRandomPrograms, ()) {
  testing::ProgramShape shape = *testing::gen_shape();
  // Small pool segments are 2 MiB: room for one to three of them makes streams compete.
  const std::int64_t segments = *rc::gen::inRange<std::int64_t>(1, 5);
  shape.profile.memory = Bytes(segments * (2 << 20));
  auto choices = *testing::gen_choices();
  // About one choice in four becomes a record_stream (kind 13 with an even `a`), so that frees
  // are often deferred behind other streams; left alone, one run in a hundred defers one.
  for (testing::OpChoice& c : choices) {
    if (c.x % 4 == 0) {
      c.kind = 13;
      c.a &= ~1U;
    }
  }
  const Program program = build_random_program(
      shape, choices, {.record_stream = true, .query = true, .empty_cache = true});
  auto run = run_program(program, SimOptions{.record_allocator = true});
  RC_ASSERT(run.ok());
  const Simulator& sim = run.value().sim;

  auto histories = allocator_history(sim);
  RC_ASSERT(histories.ok());
  RC_ASSERT(histories.value().size() == sim.device_count());
  AllocatorStats total;
  for (std::uint32_t d = 0; d < sim.device_count(); ++d) {
    const AllocatorStats& st = sim.device_allocator(DeviceId(d)).stats();
    total.deferred_frees += st.deferred_frees;
    total.ooms += st.ooms;
    total.segment_frees += st.segment_frees;
  }
  RC_TAG(total.deferred_frees > 0 ? "deferred free" : "no deferred free",
         total.ooms > 0 ? "out of memory" : "fits",
         total.segment_frees > 0 ? "segments returned" : "no segment returned");
  for (const AllocatorHistory& h : histories.value()) {
    const AllocatorStats& st = sim.device_allocator(h.device).stats();
    Bytes allocated, peak;
    std::int64_t ooms = 0;
    for (const AllocatorEvent& e : h.events) {
      if (e.action == Action::Alloc) allocated += e.size;
      if (e.action == Action::FreeCompleted) allocated -= e.size;
      if (e.action == Action::Oom) ++ooms;
      peak = std::max(peak, allocated);
      RC_ASSERT(e.time >= h.events.front().time);
    }
    RC_ASSERT(peak == st.allocated_peak);
    RC_ASSERT(allocated == st.allocated);
    Bytes reserved;
    for (const AllocatorEvent& e : h.events) {
      if (e.action == Action::SegmentAlloc) reserved += e.size;
      if (e.action == Action::SegmentFree) reserved -= e.size;
    }
    RC_ASSERT(reserved == st.reserved);
    RC_ASSERT(h.segment_ops.size() == h.segments.size());
    std::size_t live = 0;
    for (const SegmentInfo& seg : h.segments) {
      RC_ASSERT(h.segment_ops.count(seg.address) == 1U);
      for (const BlockInfo& b : seg.blocks) {
        if (b.state == BlockInfo::State::Free) continue;
        ++live;
        const auto it = h.block_buffers.find(b.address);
        RC_ASSERT(it != h.block_buffers.end());
        RC_ASSERT(sim.buffers().at(it->second.value()).address == b.address);
      }
    }
    RC_ASSERT(live == h.block_buffers.size());
    RC_ASSERT(ooms == st.ooms);
    RC_ASSERT(std::is_sorted(
        h.events.begin(), h.events.end(),
        [](const AllocatorEvent& a, const AllocatorEvent& b) { return a.time < b.time; }));
  }
  const auto first = memory_snapshot(sim);
  RC_ASSERT(first.ok());
  RC_ASSERT(first.value() == memory_snapshot(sim).value());
}

}  // namespace
}  // namespace ferry::sim
