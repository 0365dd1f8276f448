// Timing sanity and determinism of the simulator on random programs.
//  - The makespan is at least the longest chain of dependent work, each op at its fastest
//    (uncontended) duration and never before the host could have issued it.
//  - It is at most the serial sum of all work at its slowest (contended) duration plus every
//    host overhead: the engine never idles while work is ready.
//  - Every op starts only after what it depends on has finished.
//  - Two runs of one program give byte-identical traces and summaries.

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>
#include <iostream>

#include <algorithm>

#include "ferry/sim/export/trace.hpp"
#include "ferry/sim/report/check_report.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "prop/planted.hpp"
#include "prop/rc_gens.hpp"

namespace ferry::sim {
namespace {

using testing::OpChoice;
using testing::ProgramShape;

struct Bounds {
  std::int64_t lower = 0;
  std::int64_t upper = 0;
};

std::int64_t overhead_of(const LaunchOverheads& o, OpKind kind) {
  switch (kind) {
    case OpKind::Alloc:
      return o.malloc.ns();
    case OpKind::Free:
      return o.free.ns();
    case OpKind::RecordStream:
      return 0;
    case OpKind::Kernel:
      return o.kernel.ns();
    case OpKind::Copy:
      return o.copy.ns();
    case OpKind::Record:
      return o.event_record.ns();
    case OpKind::Wait:
      return o.stream_wait.ns();
    case OpKind::SyncStream:
    case OpKind::SyncEvent:
    case OpKind::SyncDevice:
      return o.synchronize.ns();
    case OpKind::Query:
      return o.event_query.ns();
    case OpKind::HostRead:
    case OpKind::HostWrite:
      return o.host_access.ns();
    case OpKind::EmptyCache:
      return o.free.ns();
  }
  return 0;
}

// Bounds computed from the program text and the profile alone (all devices share it).
Bounds bounds(const Program& p) {
  const DeviceProfile& prof = p.devices[0].profile;
  Bounds b;
  std::int64_t issue = 0;  // earliest host time of each call (blocking only delays it)
  std::vector<std::int64_t> stream_end(p.streams.size(), 0);
  std::vector<std::int64_t> event_end(p.events.size(), 0);
  for (const ProgramOp& op : p.ops) {
    const std::int64_t overhead = overhead_of(prof.overheads, op.kind);
    issue += overhead;
    b.upper += overhead;
    // A pinned allocation may pin a new block (cudaHostAlloc), or take a cached one.
    if (op.kind == OpKind::Alloc && p.buffers[op.slot.value()].kind == MemoryKind::Pinned) {
      b.upper += prof.overheads.host_alloc.ns();
    }
    std::int64_t fast = 0;
    std::int64_t slow = 0;
    if (op.kind == OpKind::Kernel) {
      fast = slow = op.duration.ns();
    } else if (op.kind == OpKind::Copy) {
      const ProgramBuffer& src = p.buffers[op.src.slot.value()];
      const ProgramBuffer& dst = p.buffers[op.dst.slot.value()];
      const bool pageable = src.kind == MemoryKind::Pageable || dst.kind == MemoryKind::Pageable;
      CopyPath path;
      Bandwidth rate;
      if (src.kind == MemoryKind::Device && dst.kind == MemoryKind::Device) {
        path = src.device == dst.device ? prof.d2d : prof.peer;
        rate = path.bandwidth;
      } else if (dst.kind == MemoryKind::Device) {
        path = prof.h2d;
        rate = pageable ? prof.pageable_h2d : prof.h2d.bandwidth;
      } else {
        path = prof.d2h;
        rate = pageable ? prof.pageable_d2h : prof.d2h.bandwidth;
      }
      fast = path.latency.ns() + transfer_time(op.src.bytes, rate).ns();
      const Bandwidth slowest(
          std::max<std::int64_t>(1, rate.bytes_per_s() / 1000 * path.bidirectional_permille));
      slow = path.latency.ns() + transfer_time(op.src.bytes, slowest).ns() + 1;
    }
    if (op.kind == OpKind::Kernel || op.kind == OpKind::Copy) {
      std::int64_t& end = stream_end[op.stream.value()];
      end = std::max(end, issue) + fast;
      b.lower = std::max(b.lower, end);
      b.upper += slow;
    } else if (op.kind == OpKind::Record) {
      event_end[op.event.value()] = stream_end[op.stream.value()];
    } else if (op.kind == OpKind::Wait) {
      std::int64_t& end = stream_end[op.stream.value()];
      end = std::max({end, issue, event_end[op.event.value()]});
    }
    b.lower = std::max(b.lower, issue);
  }
  return b;
}

// Every stream op starts after it was issued, after its stream predecessor ended, and (for a
// wait) ends after the work its event captured ended. Checked on the simulated schedule.
void schedule_respects_dependencies(const Program& p, const Simulator& sim) {
  const auto& rec = sim.ops();
  std::vector<std::int64_t> last(p.streams.size(), -1);
  std::vector<std::int64_t> captured(p.events.size(), -1);
  std::vector<bool> recorded(p.events.size(), false);
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    const ProgramOp& op = p.ops[i];
    const bool stream_work = op.kind == OpKind::Kernel || op.kind == OpKind::Copy ||
                             (op.kind == OpKind::Wait && recorded[op.event.value()]);
    if (op.kind == OpKind::Record) {
      captured[op.event.value()] = last[op.stream.value()];
      recorded[op.event.value()] = true;
    }
    if (!stream_work) continue;
    const std::int64_t prev = last[op.stream.value()];
    RC_ASSERT(rec[i].start >= rec[i].issued);
    if (prev >= 0) RC_ASSERT(rec[i].start >= rec[static_cast<std::size_t>(prev)].end);
    if (op.kind == OpKind::Wait && captured[op.event.value()] >= 0) {
      RC_ASSERT(rec[i].end >= rec[static_cast<std::size_t>(captured[op.event.value()])].end);
    }
    RC_ASSERT(rec[i].end >= rec[i].start);
    last[op.stream.value()] = static_cast<std::int64_t>(i);
  }
}

void timing_is_sane(const ProgramShape& shape, const std::vector<OpChoice>& choices,
                    SimFaults faults) {
  const Program program = build_random_program(shape, choices, {});
  auto run = run_program(program, {}, faults);
  RC_ASSERT(run.ok());
  schedule_respects_dependencies(program, run.value().sim);
  const Bounds b = bounds(program);
  const std::int64_t makespan = run.value().sim.makespan().ns();
  RC_ASSERT(makespan >= b.lower);
  RC_ASSERT(makespan <= b.upper);
}

RC_GTEST_PROP(Timing, MakespanLiesBetweenCriticalPathAndSerialSum, ()) {
  timing_is_sane(*testing::gen_shape(), *testing::gen_choices(), SimFaults{});
}

RC_GTEST_PROP(Timing, TwoRunsGiveIdenticalTraceAndSummaryBytes, ()) {
  const ProgramShape shape = *testing::gen_shape();
  const auto choices = *testing::gen_choices();
  // Record_stream and query make verdicts timing dependent: determinism must hold anyway.
  const Program program = build_random_program(shape, choices, {true, true, true, true});
  auto first = run_program(program);
  auto second = run_program(program);
  RC_ASSERT(first.ok() && second.ok());
  RC_ASSERT(chrome_trace(first.value().sim) == chrome_trace(second.value().sim));
  RC_ASSERT(summary_json(first.value(), "p") == summary_json(second.value(), "p"));
}

TEST(Timing, PlantedFaultIgnoringWaitsBreaksTheCriticalPathBound) {
  SimFaults faults;
  faults.timing_ignores_waits = true;
  const std::string found = ferry::testing::counterexample(
      [&] { timing_is_sane(*testing::gen_shape(), *testing::gen_choices(), faults); });
  ASSERT_FALSE(found.empty()) << "timing ignoring waits: the property did not notice";
  std::cout << "timing ignoring waits, shrunk counterexample:\n" << found << "\n";
}

}  // namespace
}  // namespace ferry::sim
