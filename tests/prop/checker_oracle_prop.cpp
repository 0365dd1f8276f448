// The hazard checker against a brute-force oracle. The oracle rebuilds the happens-before
// graph of a program from its text alone (stream order, launches, event record -> wait,
// synchronizations, pageable copies), closes it transitively, and compares every pair of
// accesses. The checker must report only real hazards, and every real one (see Note [Access
// frontiers] for how a report can stand for an earlier access of the same kind).

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>
#include <iostream>

#include <algorithm>
#include <optional>
#include <random>
#include <sstream>

#include "ferry/sim/analysis/run_program.hpp"
#include "prop/planted.hpp"
#include "prop/rc_gens.hpp"

namespace ferry::sim {
namespace {

using testing::OpChoice;
using testing::ProgramShape;
using testing::RandomProgramOptions;

struct OracleAccess {
  std::uint32_t op;
  SpaceIndex space;
  std::int64_t lo;
  std::int64_t hi;
  bool write;
};

struct Oracle {
  std::size_t nodes = 0;
  std::vector<std::vector<std::uint64_t>> reach;  // reach[a] has bit b: a happens before b
  std::vector<std::int64_t> node_of_op;           // program op -> node (-1: none)
  std::vector<OracleAccess> accesses;             // in issue order

  [[nodiscard]] bool before(std::uint32_t op_a, std::uint32_t op_b) const {
    const auto a = static_cast<std::size_t>(node_of_op[op_a]);
    const auto b = static_cast<std::size_t>(node_of_op[op_b]);
    return a == b || ((reach[a][b / 64] >> (b % 64)) & 1U) != 0;
  }
};

Oracle build_oracle(const Program& p, const Simulator& sim) {
  Oracle o;
  std::vector<std::vector<std::size_t>> preds;
  auto new_node = [&] {
    preds.emplace_back();
    return o.nodes++;
  };
  std::optional<std::size_t> last_host;
  std::vector<std::optional<std::size_t>> last_on_stream(p.streams.size());
  std::vector<std::optional<std::size_t>> event_node(p.events.size());
  std::vector<BufferId> slot(p.buffers.size());
  o.node_of_op.assign(p.ops.size(), -1);

  auto host_node = [&] {
    const std::size_t n = new_node();
    if (last_host) preds[n].push_back(*last_host);
    last_host = n;
    return n;
  };
  auto stream_node = [&](StreamId s) {
    const std::size_t n = new_node();
    if (last_host) preds[n].push_back(*last_host);  // launched after the host's past
    if (last_on_stream[s.value()]) preds[n].push_back(*last_on_stream[s.value()]);
    last_on_stream[s.value()] = n;
    return n;
  };
  auto add_access = [&](std::uint32_t op, const SlotRange& r, bool write) {
    const BufferInfo& b = sim.buffers()[slot[r.slot.value()].value()];
    const SpaceIndex space =
        b.kind == MemoryKind::Device ? b.device.value() : static_cast<SpaceIndex>(p.devices.size());
    const std::int64_t lo = (b.address + r.offset).count();
    o.accesses.push_back(OracleAccess{op, space, lo, lo + r.bytes.count(), write});
  };

  for (std::uint32_t i = 0; i < p.ops.size(); ++i) {
    const ProgramOp& op = p.ops[i];
    std::size_t n = 0;
    switch (op.kind) {
      case OpKind::Alloc:
        slot[op.slot.value()] = sim.ops()[i].buffer;
        n = host_node();
        break;
      case OpKind::Kernel:
        n = stream_node(op.stream);
        for (const SlotRange& r : op.reads) add_access(i, r, false);
        for (const SlotRange& r : op.writes) add_access(i, r, true);
        break;
      case OpKind::Copy: {
        n = stream_node(op.stream);
        add_access(i, op.src, false);
        add_access(i, op.dst, true);
        const bool pageable = p.buffers[op.src.slot.value()].kind == MemoryKind::Pageable ||
                              p.buffers[op.dst.slot.value()].kind == MemoryKind::Pageable;
        if (pageable) {  // the host returns only after the copy completed
          const std::size_t ret = host_node();
          preds[ret].push_back(n);
        }
        break;
      }
      case OpKind::Record:
        // The event captures the stream's last submitted op (if any).
        event_node[op.event.value()] = last_on_stream[op.stream.value()];
        if (!event_node[op.event.value()]) event_node[op.event.value()] = last_host;
        n = host_node();
        break;
      case OpKind::Wait: {
        n = stream_node(op.stream);
        // Note the event may be "recorded" on an empty stream: then nothing to wait for.
        if (event_node[op.event.value()]) preds[n].push_back(*event_node[op.event.value()]);
        break;
      }
      case OpKind::SyncStream:
        n = host_node();
        if (last_on_stream[op.stream.value()])
          preds[n].push_back(*last_on_stream[op.stream.value()]);
        break;
      case OpKind::SyncEvent:
        n = host_node();
        if (event_node[op.event.value()]) preds[n].push_back(*event_node[op.event.value()]);
        break;
      case OpKind::SyncDevice:
        n = host_node();
        for (std::size_t s = 0; s < p.streams.size(); ++s) {
          if (p.streams[s].device == op.device && last_on_stream[s])
            preds[n].push_back(*last_on_stream[s]);
        }
        break;
      case OpKind::HostRead:
        n = host_node();
        for (const SlotRange& r : op.reads) add_access(i, r, false);
        break;
      case OpKind::HostWrite:
        n = host_node();
        for (const SlotRange& r : op.writes) add_access(i, r, true);
        break;
      case OpKind::Free:
      case OpKind::RecordStream:
      case OpKind::Query:
      case OpKind::EmptyCache:
        n = host_node();
        break;
    }
    // A call that returned device segments (cudaFree) synchronized that device; whether it
    // did is the allocator's state, which the oracle takes from the run (like addresses).
    if (sim.ops()[i].device_synchronized) {
      const std::uint32_t device = op.kind == OpKind::EmptyCache
                                       ? op.device.value()
                                       : p.buffers[op.slot.value()].device.value();
      for (std::size_t st = 0; st < p.streams.size(); ++st) {
        if (p.streams[st].device.value() == device && last_on_stream[st]) {
          preds[n].push_back(*last_on_stream[st]);
        }
      }
    }
    o.node_of_op[i] = static_cast<std::int64_t>(n);
  }
  // Transitive closure: nodes are created in an order consistent with every edge.
  const std::size_t words = (o.nodes + 63) / 64;
  o.reach.assign(o.nodes, std::vector<std::uint64_t>(words, 0));
  std::vector<std::vector<std::uint64_t>> ancestors(o.nodes, std::vector<std::uint64_t>(words, 0));
  for (std::size_t n = 0; n < o.nodes; ++n) {
    for (const std::size_t q : preds[n]) {
      ancestors[n][q / 64] |= 1ULL << (q % 64);
      for (std::size_t w = 0; w < words; ++w) ancestors[n][w] |= ancestors[q][w];
    }
  }
  for (std::size_t b = 0; b < o.nodes; ++b) {
    for (std::size_t a = 0; a < o.nodes; ++a) {
      if ((ancestors[b][a / 64] >> (a % 64)) & 1U) o.reach[a][b / 64] |= 1ULL << (b % 64);
    }
  }
  return o;
}

Conflict conflict_of(bool first_write, bool second_write) {
  if (first_write) return second_write ? Conflict::WriteAfterWrite : Conflict::ReadAfterWrite;
  return Conflict::WriteAfterRead;
}

bool is_access_hazard(const Hazard& h) {
  return h.kind == HazardKind::Race || h.kind == HazardKind::Reuse ||
         h.kind == HazardKind::HostBeforeCopy;
}

// Returns an empty string when the checker agrees with the oracle, else what differs.
std::string compare(const Program& p, const Simulator& sim) {
  const Oracle o = build_oracle(p, sim);
  std::ostringstream diff;
  // Soundness: every report is a real unordered conflict over the reported bytes.
  for (const Hazard& h : sim.hazards()) {
    if (!is_access_hazard(h)) {
      diff << "unexpected misuse report at op " << h.second.value() << "\n";
      continue;
    }
    const bool first_write = h.conflict != Conflict::WriteAfterRead;
    const bool second_write = h.conflict != Conflict::ReadAfterWrite;
    auto covers = [&](std::uint32_t op, bool write) {
      return std::any_of(o.accesses.begin(), o.accesses.end(), [&](const OracleAccess& a) {
        return a.op == op && a.write == write && a.space == h.space && a.lo <= h.lo.count() &&
               h.hi.count() <= a.hi;
      });
    };
    if (o.before(h.first.value(), h.second.value()) || h.first.value() >= h.second.value() ||
        !covers(h.first.value(), first_write) || !covers(h.second.value(), second_write)) {
      diff << "false report: op " << h.first.value() << " vs op " << h.second.value() << " ["
           << h.lo.count() << ", " << h.hi.count() << ")\n";
    }
  }
  // Completeness: every unordered conflicting pair is covered, byte for byte, by reports on
  // the later op from the earlier op or an access it happens before, of the same conflict.
  for (std::size_t j = 0; j < o.accesses.size(); ++j) {
    const OracleAccess& b = o.accesses[j];
    for (std::size_t i = 0; i < j; ++i) {
      const OracleAccess& a = o.accesses[i];
      if (a.op == b.op || a.space != b.space || (!a.write && !b.write)) continue;
      const std::int64_t lo = std::max(a.lo, b.lo);
      const std::int64_t hi = std::min(a.hi, b.hi);
      if (lo >= hi || o.before(a.op, b.op)) continue;
      const Conflict want = conflict_of(a.write, b.write);
      std::vector<std::pair<std::int64_t, std::int64_t>> covered;
      for (const Hazard& h : sim.hazards()) {
        if (h.second.value() != b.op || h.conflict != want || h.space != a.space) continue;
        if (!o.before(a.op, h.first.value())) continue;
        covered.emplace_back(std::max(lo, h.lo.count()), std::min(hi, h.hi.count()));
      }
      std::sort(covered.begin(), covered.end());
      std::int64_t pos = lo;
      for (const auto& [clo, chi] : covered) {
        if (clo <= pos) pos = std::max(pos, chi);
      }
      if (pos < hi) {
        diff << "missed hazard: op " << a.op << " (" << (a.write ? "write" : "read") << ") vs op "
             << b.op << " (" << (b.write ? "write" : "read") << ") bytes [" << pos << ", " << hi
             << ")\n";
      }
    }
  }
  return diff.str();
}

std::string describe(const Program& p) {
  std::ostringstream out;
  out << p.devices.size() << " device(s), " << p.streams.size() << " streams, " << p.buffers.size()
      << " buffers\n";
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    const ProgramOp& op = p.ops[i];
    out << "  " << i << ": " << op_kind_name(op.kind);
    if (op.stream.valid()) out << " s" << op.stream.value();
    if (op.event.valid()) out << " e" << op.event.value();
    if (op.slot.valid()) out << " b" << op.slot.value();
    for (const SlotRange& r : op.reads)
      out << " R(b" << r.slot.value() << "+" << r.offset.count() << ":" << r.bytes.count() << ")";
    for (const SlotRange& r : op.writes)
      out << " W(b" << r.slot.value() << "+" << r.offset.count() << ":" << r.bytes.count() << ")";
    if (op.kind == OpKind::Copy) {
      out << " b" << op.src.slot.value() << "+" << op.src.offset.count() << " -> b"
          << op.dst.slot.value() << "+" << op.dst.offset.count() << " (" << op.src.bytes.count()
          << ")";
    }
    out << "\n";
  }
  return out.str();
}

// The property: for any random program, checker == oracle.
void checker_matches_oracle(const ProgramShape& shape, const std::vector<OpChoice>& choices,
                            CheckerFaults faults) {
  const Program program = build_random_program(shape, choices, RandomProgramOptions{});
  auto run = run_program(program, {}, SimFaults{.checker = faults});
  RC_ASSERT(run.ok());
  const std::string diff = compare(program, run.value().sim);
  if (!diff.empty()) RC_FAIL(describe(program) + diff);
}

RC_GTEST_PROP(CheckerOracle, VerdictsEqualTheBruteForceOracle, ()) {
  const ProgramShape shape = *testing::gen_shape();
  const auto choices = *testing::gen_choices();
  checker_matches_oracle(shape, choices, CheckerFaults{});
}

TEST(CheckerOracle, RandomProgramsAreOftenRacyAndOftenNot) {
  // Keeps the generator honest: the oracle property is only meaningful if random programs
  // have hazards often enough, and are often clean too.
  std::mt19937_64 rng(20261121);
  int racy = 0;
  constexpr int kPrograms = 300;
  for (int i = 0; i < kPrograms; ++i) {
    const ProgramShape shape =
        testing::random_shape(rng, 2 + static_cast<std::uint32_t>(rng() % 5));
    const auto choices = testing::random_choices(rng, 1 + rng() % 60);
    auto run = run_program(build_random_program(shape, choices, RandomProgramOptions{}));
    ASSERT_TRUE(run.ok());
    racy += run.value().sim.hazards().empty() ? 0 : 1;
  }
  EXPECT_GE(racy, kPrograms / 5) << racy << " racy programs of " << kPrograms;
  EXPECT_LE(racy, kPrograms * 4 / 5) << racy << " racy programs of " << kPrograms;
}

TEST(CheckerOracle, PlantedFaultIgnoringEventWaitsIsCaught) {
  CheckerFaults faults;
  faults.ignore_event_waits = true;
  const std::string found = ferry::testing::counterexample(
      [&] { checker_matches_oracle(*testing::gen_shape(), *testing::gen_choices(), faults); });
  ASSERT_FALSE(found.empty()) << "checker ignoring waits: the property did not notice";
  std::cout << "checker ignoring waits, shrunk counterexample:\n" << found << "\n";
}

TEST(CheckerOracle, PlantedFaultSkippingWriteAfterReadIsCaught) {
  CheckerFaults faults;
  faults.skip_write_after_read = true;
  const std::string found = ferry::testing::counterexample(
      [&] { checker_matches_oracle(*testing::gen_shape(), *testing::gen_choices(), faults); });
  ASSERT_FALSE(found.empty()) << "checker skipping write-after-read: the property did not notice";
  std::cout << "checker skipping write-after-read, shrunk counterexample:\n" << found << "\n";
}

}  // namespace
}  // namespace ferry::sim
