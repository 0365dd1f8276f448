// Latent reuse: a free is judged from happens-before when it is issued (Note [Latent reuse]),
// so its verdict is the same at every kernel and copy duration. Each test sweeps the durations
// that decide whether the simulated allocator hands the bytes out again over nine orders of
// magnitude, and expects the same reports at each.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ferry/sim/report/check_report.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

using testing::kNone;
using testing::one;
using testing::whole;

// 100 ns .. 100 s.
const std::vector<std::int64_t>& durations() {
  static const std::vector<std::int64_t> all{100,         1'000,         10'000,
                                             100'000,     1'000'000,     10'000'000,
                                             100'000'000, 1'000'000'000, 100'000'000'000};
  return all;
}

struct Traced {
  Simulator sim;
  std::vector<OpId> marks;  // ops a test names
};

std::vector<Hazard> of_kind(const Simulator& sim, HazardKind kind) {
  std::vector<Hazard> out;
  for (const Hazard& h : sim.hazards()) {
    if (h.kind == kind) out.push_back(h);
  }
  return out;
}

OpId last_op(const Simulator& sim) {
  return OpId(static_cast<std::uint32_t>(sim.ops().size() - 1));
}

// The first scenario: `act` is written on compute, read on a side stream, and freed
// with neither record_stream nor an event; `reuse` then allocates 1 MiB on compute and writes
// it (the block comes back at once, so the simulated run reuses it at every duration).
// `late_stream`: a third stream is made and used between the read and the free.
Traced free_while_side_reads(std::int64_t side_ns, bool reuse, bool guard,
                             bool late_stream = false) {
  Traced r{testing::simple_sim(), {}};
  Simulator& sim = r.sim;
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId side = sim.add_stream(DeviceId(0), "side");
  const EventId produced = sim.add_event();
  const EventId consumed = sim.add_event();
  const BufferId act = testing::device_buffer(sim, compute, 1 << 20, "act");
  sim.kernel(compute, SimTime(1000), kNone, one(whole(sim, act)), "produce");
  sim.record(produced, compute);
  sim.wait(side, produced);
  r.marks.push_back(sim.kernel(side, SimTime(side_ns), one(whole(sim, act)), kNone, "side read"));
  if (guard) {
    sim.record(consumed, side);
    sim.wait(compute, consumed);
  }
  if (late_stream) {
    const StreamId late = sim.add_stream(DeviceId(0), "late");
    const BufferId other = testing::device_buffer(sim, late, 1 << 20, "other");
    sim.kernel(late, SimTime(1000), kNone, one(whole(sim, other)), "write on late");
  }
  sim.free(act, "free act");
  r.marks.push_back(last_op(sim));
  if (reuse) {
    const BufferId next = testing::device_buffer(sim, compute, 1 << 20, "next");
    r.marks.push_back(sim.kernel(compute, SimTime(1000), kNone, one(whole(sim, next)), "write"));
  }
  sim.finish();
  return r;
}

TEST(LatentReuse, FreeWhileAnotherStreamReadsIsReportedAtEveryDuration) {
  for (const bool reuse : {false, true}) {
    for (const std::int64_t d : durations()) {
      const Traced r = free_while_side_reads(d, reuse, false);
      ASSERT_EQ(r.sim.hazards().size(), 1U) << "side read of " << d << " ns, reuse " << reuse;
      const Hazard& h = r.sim.hazards()[0];
      EXPECT_EQ(h.kind, HazardKind::LatentReuse);
      EXPECT_EQ(h.conflict, Conflict::WriteAfterRead);
      EXPECT_EQ(h.first, r.marks[0]);
      EXPECT_EQ(h.second, r.marks[1]);
      EXPECT_EQ((h.hi - h.lo).count(), 1 << 20);
      // The simulated run did reuse the block: the same report says so, no second one.
      EXPECT_EQ(h.reused_by.valid(), reuse);
      if (reuse) {
        EXPECT_EQ(h.reused_by, r.marks[2]);
      }
    }
  }
}

TEST(LatentReuse, FreeAfterAnEventIsCleanAtEveryDuration) {
  for (const bool reuse : {false, true}) {
    for (const std::int64_t d : durations()) {
      const Traced r = free_while_side_reads(d, reuse, true);
      EXPECT_TRUE(r.sim.hazards().empty()) << "side read of " << d << " ns";
    }
  }
}

// The second scenario: two side streams read `act`, record_stream names only s1;
// compute then runs 2 ms, the host waits for it and allocates again. Whether the deferred
// block is back by then depends on how long s1 stays busy after its read (a copy of
// `s1_bytes` at 1 byte per ns: kernels of all streams share the device's compute engine, copies
// do not) and on s2's kernel: the verdict must depend on neither.
Traced record_stream_on_one_reader(std::int64_t s1_bytes, std::int64_t s2_ns, bool record_both) {
  Traced r{testing::simple_sim(), {}};
  Simulator& sim = r.sim;
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId s1 = sim.add_stream(DeviceId(0), "s1");
  const StreamId s2 = sim.add_stream(DeviceId(0), "s2");
  const EventId produced = sim.add_event();
  const BufferId act = testing::device_buffer(sim, compute, 1 << 20, "act");
  const BufferId ballast = testing::device_buffer(sim, s1, s1_bytes, "ballast");
  const BufferId ballast_host = testing::pinned_buffer(sim, s1_bytes, "ballast on host");
  sim.kernel(compute, SimTime(1000), kNone, one(whole(sim, act)), "produce");
  sim.record(produced, compute);
  sim.wait(s1, produced);
  sim.wait(s2, produced);
  sim.kernel(s1, SimTime(1000), one(whole(sim, act)), kNone, "read on s1");
  sim.copy(s1, whole(sim, ballast), whole(sim, ballast_host), "s1 stays busy");
  r.marks.push_back(sim.kernel(s2, SimTime(s2_ns), one(whole(sim, act)), kNone, "read on s2"));
  sim.record_stream(act, s1);
  if (record_both) sim.record_stream(act, s2);
  sim.free(act, "free act");
  r.marks.push_back(last_op(sim));
  sim.kernel(compute, SimTime(2'000'000), kNone, kNone, "other work");
  sim.sync_stream(compute);
  const BufferId next = testing::device_buffer(sim, compute, 1 << 20, "next");
  sim.kernel(compute, SimTime(1000), kNone, one(whole(sim, next)), "write");
  sim.finish();
  return r;
}

// 512 B .. 256 MiB: s1 busy from half a microsecond to a quarter of a second.
const std::vector<std::int64_t>& s1_copy_bytes() {
  static const std::vector<std::int64_t> all{512, 1LL << 16, 1LL << 20, 1LL << 24, 1LL << 28};
  return all;
}

TEST(LatentReuse, RecordStreamOnOneOfTwoReadersIsReportedAtEveryDuration) {
  int reused = 0;
  int runs = 0;
  for (const std::int64_t bytes : s1_copy_bytes()) {
    for (const std::int64_t d : durations()) {
      const Traced r = record_stream_on_one_reader(bytes, d, false);
      ASSERT_EQ(r.sim.hazards().size(), 1U)
          << "s1 copies " << bytes << " B, s2 reads " << d << " ns";
      const Hazard& h = r.sim.hazards()[0];
      EXPECT_EQ(h.kind, HazardKind::LatentReuse);
      EXPECT_EQ(h.first, r.marks[0]);  // the read on s2, which nothing covers
      EXPECT_EQ(h.second, r.marks[1]);
      reused += h.reused_by.valid() ? 1 : 0;
      ++runs;
    }
  }
  // The sweep does cover both outcomes of the simulated allocator.
  EXPECT_GT(reused, 0);
  EXPECT_LT(reused, runs);
}

TEST(LatentReuse, RecordStreamOnEveryReaderIsCleanAtEveryDuration) {
  for (const std::int64_t bytes : s1_copy_bytes()) {
    for (const std::int64_t d : durations()) {
      EXPECT_TRUE(record_stream_on_one_reader(bytes, d, true).sim.hazards().empty())
          << "s1 copies " << bytes << " B, s2 reads " << d << " ns";
    }
  }
}

// A planted fault in the checker: taking record_stream on one stream to cover all of them
// misses the second scenario.
TEST(LatentReuse, PlantedFaultDeferralCoversEveryStreamMissesTheSecondScenario) {
  Traced r{testing::simple_sim(
               1, {}, testing::simple_profile(),
               SimFaults{.checker = CheckerFaults{.deferral_covers_every_stream = true}}),
           {}};
  Simulator& sim = r.sim;
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId s1 = sim.add_stream(DeviceId(0), "s1");
  const StreamId s2 = sim.add_stream(DeviceId(0), "s2");
  const BufferId act = testing::device_buffer(sim, compute, 4096, "act");
  sim.kernel(s1, SimTime(100), one(whole(sim, act)), kNone, "read on s1");
  sim.kernel(s2, SimTime(100), one(whole(sim, act)), kNone, "read on s2");
  sim.record_stream(act, s1);
  sim.free(act);
  sim.finish();
  EXPECT_TRUE(of_kind(sim, HazardKind::LatentReuse).empty());
}

// A poll that finds a deferred free's marker done is timing: it must not order the host
// after s1, or the second free below would look safe only when the poll happened to succeed.
TEST(LatentReuse, AnAllocatorPollDoesNotOrderTheHost) {
  for (const std::int64_t d : durations()) {
    Simulator sim = testing::simple_sim();
    const StreamId compute = sim.add_stream(DeviceId(0), "compute");
    const StreamId s1 = sim.add_stream(DeviceId(0), "s1");
    const BufferId a = testing::device_buffer(sim, compute, 1 << 20, "a");
    const BufferId b = testing::device_buffer(sim, compute, 1 << 20, "b");
    sim.kernel(s1, SimTime(1000), one(whole(sim, a)), kNone, "read a");
    const OpId read_b = sim.kernel(s1, SimTime(1000), one(whole(sim, b)), kNone, "read b");
    sim.record_stream(a, s1);
    sim.free(a, "free a");  // deferred behind s1: clean
    sim.kernel(compute, SimTime(d), kNone, kNone, "other work");
    sim.sync_stream(compute);
    const BufferId c = testing::device_buffer(sim, compute, 1 << 20, "c");  // polls a's marker
    sim.kernel(compute, SimTime(1000), kNone, one(whole(sim, c)), "write c");
    sim.free(b, "free b");  // no record_stream: s1 may still read b
    sim.finish();
    ASSERT_EQ(sim.hazards().size(), 1U) << "other work of " << d << " ns";
    EXPECT_EQ(sim.hazards()[0].kind, HazardKind::LatentReuse);
    EXPECT_EQ(sim.hazards()[0].first, read_b);
  }
}

// Pinned memory returned to its pool while a copy into it may still run: the pool hands it to
// the host's next request at once.
Traced pinned_freed_during_copy(std::int64_t bytes, bool record, bool sync) {
  Traced r{testing::simple_sim(), {}};
  Simulator& sim = r.sim;
  const StreamId compute = sim.add_stream(DeviceId(0), "compute");
  const StreamId d2h = sim.add_stream(DeviceId(0), "d2h");
  const EventId copied = sim.add_event();
  const BufferId act = testing::device_buffer(sim, compute, bytes, "act");
  const BufferId host = testing::pinned_buffer(sim, bytes, "host");
  r.marks.push_back(sim.copy(d2h, whole(sim, act), whole(sim, host), "offload"));
  sim.record(copied, d2h);
  if (record) sim.record_stream(host, d2h);
  if (sync) sim.sync_event(copied);
  sim.free(host, "free host");
  r.marks.push_back(last_op(sim));
  const BufferId again = testing::pinned_buffer(sim, bytes, "again");
  sim.host_write(one(whole(sim, again)), "host fills");
  sim.sync_device(DeviceId(0));
  sim.free(act);
  sim.finish();
  return r;
}

TEST(LatentReuse, PinnedMemoryFreedDuringItsCopyIsReportedAtEveryDuration) {
  // The copy moves 1 byte per ns: its size sets its duration.
  for (const std::int64_t bytes : {512LL, 1LL << 16, 1LL << 24, 1LL << 28}) {
    const Traced r = pinned_freed_during_copy(bytes, false, false);
    const auto latent = of_kind(r.sim, HazardKind::LatentReuse);
    ASSERT_EQ(r.sim.hazards().size(), 1U) << bytes << " B";
    ASSERT_EQ(latent.size(), 1U);
    EXPECT_EQ(latent[0].first, r.marks[0]);
    EXPECT_EQ(latent[0].second, r.marks[1]);
    EXPECT_EQ(latent[0].conflict, Conflict::WriteAfterWrite);
    EXPECT_TRUE(latent[0].reused_by.valid());  // the host's write took the same block
  }
}

TEST(LatentReuse, PinnedMemoryWithRecordStreamOrASyncIsCleanAtEveryDuration) {
  for (const std::int64_t bytes : {512LL, 1LL << 16, 1LL << 24, 1LL << 28}) {
    EXPECT_TRUE(pinned_freed_during_copy(bytes, true, false).sim.hazards().empty()) << bytes;
    EXPECT_TRUE(pinned_freed_during_copy(bytes, false, true).sim.hazards().empty()) << bytes;
  }
}

// The allocation stream's own work and the host's never need a guard.
TEST(LatentReuse, WorkOnTheAllocationStreamNeedsNoGuard) {
  for (const std::int64_t d : durations()) {
    Simulator sim = testing::simple_sim();
    const StreamId compute = sim.add_stream(DeviceId(0), "compute");
    const BufferId act = testing::device_buffer(sim, compute, 4096, "act");
    sim.kernel(compute, SimTime(d), one(whole(sim, act)), one(whole(sim, act)), "use");
    sim.free(act);
    const BufferId next = testing::device_buffer(sim, compute, 4096, "next");
    sim.kernel(compute, SimTime(d), kNone, one(whole(sim, next)), "write");
    sim.finish();
    EXPECT_TRUE(sim.hazards().empty()) << d;
  }
}

// The checker keeps each buffer's latest access per stream in one row a buffer, laid out again
// wider when a stream is made after buffers were used: a row written before that must survive
// it (the side stream's read of `act`, made before the late stream).
TEST(LatentReuse, AStreamMadeLaterKeepsWhatEarlierStreamsDidToABuffer) {
  const Traced unguarded = free_while_side_reads(1000, false, false, true);
  ASSERT_EQ(unguarded.sim.hazards().size(), 1U);
  EXPECT_EQ(unguarded.sim.hazards()[0].kind, HazardKind::LatentReuse);
  EXPECT_EQ(unguarded.sim.hazards()[0].first, unguarded.marks[0]);
  EXPECT_EQ(unguarded.sim.hazards()[0].second, unguarded.marks[1]);
  EXPECT_TRUE(free_while_side_reads(1000, false, true, true).sim.hazards().empty());
}

// Three layers each free their activation while the offload stream may still read it: one
// defect, repeated. The text groups the three (count, first shown); the JSON lists each.
TEST(LatentReuse, RepeatedDefectsAreGroupedInTextAndListedInJson) {
  Program p;
  p.devices.push_back(ProgramDevice{"gpu0", testing::simple_profile()});
  p.streams.push_back(ProgramStream{"compute", DeviceId(0)});
  p.streams.push_back(ProgramStream{"d2h", DeviceId(0)});
  p.events.push_back(ProgramEvent{"produced"});
  constexpr std::uint32_t kLayers = 3;
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    p.buffers.push_back(ProgramBuffer{"act " + std::to_string(l), MemoryKind::Device, DeviceId(0),
                                      Bytes(4096), PinnedPool::Exact});
    p.buffers.push_back(ProgramBuffer{"host " + std::to_string(l), MemoryKind::Pinned, DeviceId(0),
                                      Bytes(4096), PinnedPool::Exact});
  }
  auto op = [&](OpKind kind, std::string label) {
    ProgramOp o;
    o.kind = kind;
    o.label = std::move(label);
    return o;
  };
  for (std::uint32_t l = 0; l < kLayers; ++l) {
    const SlotRange act{SlotId(2 * l), Bytes(0), Bytes(4096)};
    const SlotRange host{SlotId(2 * l + 1), Bytes(0), Bytes(4096)};
    ProgramOp alloc = op(OpKind::Alloc, "");
    alloc.slot = act.slot;
    alloc.stream = StreamId(0);
    p.ops.push_back(alloc);
    ProgramOp pin = op(OpKind::Alloc, "");
    pin.slot = host.slot;
    p.ops.push_back(pin);
    ProgramOp forward = op(OpKind::Kernel, "forward " + std::to_string(l));
    forward.stream = StreamId(0);
    forward.duration = SimTime(1000);
    forward.writes.push_back(act);
    p.ops.push_back(forward);
    ProgramOp record = op(OpKind::Record, "");
    record.event = EventId(0);
    record.stream = StreamId(0);
    p.ops.push_back(record);
    ProgramOp wait = op(OpKind::Wait, "");
    wait.event = EventId(0);
    wait.stream = StreamId(1);
    p.ops.push_back(wait);
    ProgramOp offload = op(OpKind::Copy, "offload " + std::to_string(l));
    offload.stream = StreamId(1);
    offload.src = act;
    offload.dst = host;
    p.ops.push_back(offload);
    ProgramOp free = op(OpKind::Free, "free act " + std::to_string(l));
    free.slot = act.slot;
    p.ops.push_back(free);
  }
  auto run = run_program(p);
  ASSERT_TRUE(run.ok());
  ASSERT_EQ(run.value().sim.hazards().size(), kLayers);
  const std::string text = summary_text(run.value(), "layers");
  EXPECT_NE(text.find("hazards: 3 (1 distinct)"), std::string::npos) << text;
  EXPECT_NE(text.find("repeated: 3 times in all"), std::string::npos) << text;
  EXPECT_EQ(text.find("  2. "), std::string::npos) << text;
  const std::string json = summary_json(run.value(), "layers");
  std::size_t instances = 0;
  for (std::size_t at = json.find("\"latent-reuse\""); at != std::string::npos;
       at = json.find("\"latent-reuse\"", at + 1)) {
    ++instances;
  }
  EXPECT_EQ(instances, kLayers) << json;
}

// An alloc op's label names the call, not the buffer (docs/program-format.md): reports and
// the suggested fix name the buffer by its declared name, and the alloc op keeps its label.
TEST(LatentReuse, ReportsNameTheBufferNotTheLabelOfItsAlloc) {
  Program p;
  p.devices.push_back(ProgramDevice{"gpu0", testing::simple_profile()});
  p.streams.push_back(ProgramStream{"compute", DeviceId(0)});
  p.streams.push_back(ProgramStream{"side", DeviceId(0)});
  p.events.push_back(ProgramEvent{"produced"});
  p.buffers.push_back(
      ProgramBuffer{"act", MemoryKind::Device, DeviceId(0), Bytes(4096), PinnedPool::Exact});
  const SlotRange act{SlotId(0), Bytes(0), Bytes(4096)};
  ProgramOp alloc;
  alloc.kind = OpKind::Alloc;
  alloc.label = "alloc layer 0 output";
  alloc.slot = act.slot;
  alloc.stream = StreamId(0);
  p.ops.push_back(alloc);
  ProgramOp forward;
  forward.kind = OpKind::Kernel;
  forward.label = "forward";
  forward.stream = StreamId(0);
  forward.duration = SimTime(1000);
  forward.writes.push_back(act);
  p.ops.push_back(forward);
  ProgramOp record;
  record.kind = OpKind::Record;
  record.event = EventId(0);
  record.stream = StreamId(0);
  p.ops.push_back(record);
  ProgramOp wait;
  wait.kind = OpKind::Wait;
  wait.event = EventId(0);
  wait.stream = StreamId(1);
  p.ops.push_back(wait);
  ProgramOp read;
  read.kind = OpKind::Kernel;
  read.label = "side read";
  read.stream = StreamId(1);
  read.duration = SimTime(1000);
  read.reads.push_back(act);
  p.ops.push_back(read);
  ProgramOp free;
  free.kind = OpKind::Free;
  free.slot = act.slot;
  p.ops.push_back(free);

  auto run = run_program(p);
  ASSERT_TRUE(run.ok());
  const Simulator& sim = run.value().sim;
  ASSERT_EQ(sim.hazards().size(), 1U);
  EXPECT_EQ(sim.label(sim.ops()[0].label), "alloc layer 0 output");
  const std::string text = summary_text(run.value(), "labelled alloc");
  EXPECT_NE(text.find("of buffer \"act\""), std::string::npos) << text;
  EXPECT_NE(text.find("buffer \"act\" is freed by op 5"), std::string::npos) << text;
  EXPECT_NE(text.find("record_stream(\"act\", side)"), std::string::npos) << text;
  EXPECT_EQ(text.find("\"alloc layer 0 output\""), std::string::npos) << text;
  const std::string json = summary_json(run.value(), "labelled alloc");
  EXPECT_NE(json.find("\"buffer\": \"act\""), std::string::npos) << json;
  EXPECT_EQ(json.find("alloc layer 0 output"), std::string::npos) << json;
}

}  // namespace
}  // namespace ferry::sim
