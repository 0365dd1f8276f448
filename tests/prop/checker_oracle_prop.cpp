// The hazard checker against a brute-force oracle. The oracle rebuilds the happens-before
// graph of a program from its text alone (stream order, launches, event record -> wait,
// synchronizations, pageable copies), closes it transitively, and compares every pair of
// accesses. The checker must report only real hazards, and every real one (see Note [Access
// frontiers] for how a report can stand for an earlier access of the same kind).
//
// Frees, record_stream and re-allocations: for each free the oracle adds the point where the
// allocator may hand the bytes out (the free on the host, joined with the allocation stream
// and every record_stream stream as of the free) and decides latent reuse for every access of
// the freed buffer over all timings the graph allows: an access is safe iff it reaches that
// point. A deferred free's markers order only the buffers that later get its bytes (their
// floor), never the host (see Note [Latent reuse]).

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>
#include <iostream>

#include <algorithm>
#include <optional>
#include <random>
#include <sstream>

#include "ferry/sim/runs/run_program.hpp"
#include "prop/planted.hpp"
#include "prop/rc_gens.hpp"

namespace ferry::sim {
namespace {

using testing::OpChoice;
using testing::ProgramShape;
using testing::RandomProgramOptions;

struct OracleAccess {
  std::uint32_t op;
  BufferId buffer;
  SpaceIndex space;
  std::int64_t lo;
  std::int64_t hi;
  bool write;
};

// A free: its op, the buffer, and the node where the allocator may hand the bytes out.
struct OracleFree {
  std::uint32_t op;
  BufferId buffer;
  std::size_t reuse;
};

struct Oracle {
  std::size_t nodes = 0;
  std::vector<std::vector<std::uint64_t>> reach;  // reach[a] has bit b: a happens before b
  std::vector<std::int64_t> node_of_op;           // program op -> node (-1: none)
  std::vector<OracleAccess> accesses;             // in issue order
  std::vector<OracleFree> frees;
  std::vector<std::vector<std::size_t>> floors;  // per buffer: deferred frees' marker nodes

  [[nodiscard]] bool reaches(std::size_t a, std::size_t b) const {
    return a == b || ((reach[a][b / 64] >> (b % 64)) & 1U) != 0;
  }
  [[nodiscard]] bool before(std::uint32_t op_a, std::uint32_t op_b) const {
    return reaches(static_cast<std::size_t>(node_of_op[op_a]),
                   static_cast<std::size_t>(node_of_op[op_b]));
  }
  // Op a happens before op b's access to `buffer`: through the graph, or through the markers
  // of a deferred free whose bytes the buffer got.
  [[nodiscard]] bool before(std::uint32_t op_a, std::uint32_t op_b, BufferId buffer) const {
    if (before(op_a, op_b)) return true;
    if (!buffer.valid() || buffer.value() >= floors.size()) return false;
    const auto a = static_cast<std::size_t>(node_of_op[op_a]);
    return std::any_of(floors[buffer.value()].begin(), floors[buffer.value()].end(),
                       [&](std::size_t f) { return reaches(a, f); });
  }
  // The access is not ordered before the point its free lets the bytes go.
  [[nodiscard]] bool latent(const OracleAccess& a, const OracleFree& f) const {
    return a.buffer == f.buffer && !reaches(static_cast<std::size_t>(node_of_op[a.op]), f.reuse);
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
  std::vector<std::vector<std::uint32_t>> recorded(p.buffers.size());  // record_stream streams
  struct FloorRange {
    SpaceIndex space;
    std::int64_t lo;
    std::int64_t hi;
    std::size_t node;
  };
  std::vector<FloorRange> floor_ranges;
  o.floors.resize(sim.buffers().size());
  o.node_of_op.assign(p.ops.size(), -1);
  auto space_of = [&](const BufferInfo& b) {
    return b.kind == MemoryKind::Device ? b.device.value()
                                        : static_cast<SpaceIndex>(p.devices.size());
  };

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
    const BufferId id = slot[r.slot.value()];
    const BufferInfo& b = sim.buffers()[id.value()];
    const std::int64_t lo = (b.address + r.offset).count();
    o.accesses.push_back(OracleAccess{op, id, space_of(b), lo, lo + r.bytes.count(), write});
  };

  for (std::uint32_t i = 0; i < p.ops.size(); ++i) {
    const ProgramOp& op = p.ops[i];
    std::size_t n = 0;
    switch (op.kind) {
      case OpKind::Alloc: {
        const BufferId id = sim.ops()[i].buffer;
        slot[op.slot.value()] = id;
        recorded[op.slot.value()].clear();
        n = host_node();
        // Bytes of a deferred free come back only after its markers completed.
        const BufferInfo& b = sim.buffers()[id.value()];
        const std::int64_t lo = b.address.count();
        const std::int64_t hi = lo + b.bytes.count();
        for (const FloorRange& f : floor_ranges) {
          if (f.space == space_of(b) && f.lo < hi && lo < f.hi) {
            o.floors[id.value()].push_back(f.node);
          }
        }
        break;
      }
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
      case OpKind::Free: {
        n = host_node();
        const BufferId id = slot[op.slot.value()];
        const BufferInfo& b = sim.buffers()[id.value()];
        if (b.kind == MemoryKind::Pageable) break;
        std::vector<std::size_t> deferred;
        for (const std::uint32_t st : recorded[op.slot.value()]) {
          if (last_on_stream[st]) deferred.push_back(*last_on_stream[st]);
        }
        const std::size_t reuse = new_node();
        preds[reuse] = deferred;
        preds[reuse].push_back(n);
        if (b.kind == MemoryKind::Device) {
          const StreamId owner = sim.ops()[b.allocated_by.value()].stream;
          if (last_on_stream[owner.value()]) preds[reuse].push_back(*last_on_stream[owner.value()]);
        }
        o.frees.push_back(OracleFree{i, id, reuse});
        if (!recorded[op.slot.value()].empty() && b.bytes.count() > 0) {
          const std::size_t marker = new_node();
          preds[marker] = deferred;
          preds[marker].push_back(n);
          for (const std::size_t f : o.floors[id.value()]) preds[marker].push_back(f);
          floor_ranges.push_back(
              FloorRange{space_of(b), b.address.count(), (b.address + b.bytes).count(), marker});
        }
        break;
      }
      case OpKind::RecordStream: {
        n = host_node();
        const BufferInfo& b = sim.buffers()[slot[op.slot.value()].value()];
        const bool own =
            b.kind == MemoryKind::Device && sim.ops()[b.allocated_by.value()].stream == op.stream;
        auto& streams = recorded[op.slot.value()];
        if (!own && std::find(streams.begin(), streams.end(), op.stream.value()) == streams.end()) {
          streams.push_back(op.stream.value());
        }
        break;
      }
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
         h.kind == HazardKind::HostBeforeCopy || h.kind == HazardKind::LatentReuse;
}

// Whether [lo, hi) is covered by the union of `covered`.
bool covers_all(std::vector<std::pair<std::int64_t, std::int64_t>> covered, std::int64_t lo,
                std::int64_t hi, std::int64_t& missing_from) {
  std::sort(covered.begin(), covered.end());
  std::int64_t pos = lo;
  for (const auto& [clo, chi] : covered) {
    if (clo <= pos) pos = std::max(pos, chi);
  }
  missing_from = pos;
  return pos >= hi;
}

// Returns an empty string when the checker agrees with the oracle, else what differs.
std::string compare(const Program& p, const Simulator& sim) {
  const Oracle o = build_oracle(p, sim);
  std::ostringstream diff;
  auto covers = [&](std::uint32_t op, BufferId buffer, bool write, const Hazard& h) {
    return std::any_of(o.accesses.begin(), o.accesses.end(), [&](const OracleAccess& a) {
      return a.op == op && a.buffer == buffer && a.write == write && a.space == h.space &&
             a.lo <= h.lo.count() && h.hi.count() <= a.hi;
    });
  };
  // Soundness: every report is a real unordered conflict over the reported bytes, or an access
  // of a freed buffer not ordered before the point its free lets the bytes go.
  for (const Hazard& h : sim.hazards()) {
    if (!is_access_hazard(h)) {
      diff << "unexpected misuse report at op " << h.second.value() << "\n";
      continue;
    }
    const bool first_write = h.conflict != Conflict::WriteAfterRead;
    if (h.kind == HazardKind::LatentReuse) {
      const auto f = std::find_if(o.frees.begin(), o.frees.end(), [&](const OracleFree& fr) {
        return fr.op == h.second.value() && fr.buffer == h.first_buffer;
      });
      const OracleAccess probe{h.first.value(), h.first_buffer, h.space, 0, 0, first_write};
      if (h.conflict == Conflict::ReadAfterWrite || f == o.frees.end() || !o.latent(probe, *f) ||
          !covers(h.first.value(), h.first_buffer, first_write, h)) {
        diff << "false latent reuse: op " << h.first.value() << " freed by op " << h.second.value()
             << " [" << h.lo.count() << ", " << h.hi.count() << ")\n";
      }
      continue;
    }
    const bool second_write = h.conflict != Conflict::ReadAfterWrite;
    if (o.before(h.first.value(), h.second.value(), h.second_buffer) ||
        h.first.value() >= h.second.value() ||
        !covers(h.first.value(), h.first_buffer, first_write, h) ||
        !covers(h.second.value(), h.second_buffer, second_write, h)) {
      diff << "false report: op " << h.first.value() << " vs op " << h.second.value() << " ["
           << h.lo.count() << ", " << h.hi.count() << ")\n";
    }
  }
  // Latent reports that cover access `a`, bytes intersected with [lo, hi): reports on `a` or on
  // a later access of the same kind it happens before (Note [Access frontiers]). With a free
  // op: the reports of that free (on `a`'s buffer). Without, for a pair (a, b) across a free:
  // any latent report on such a later access that b is not ordered after either; b's meeting
  // it was folded into that report (reused_by), and b races a only if it races that access.
  auto latent_cover = [&](const OracleAccess& a, std::int64_t lo, std::int64_t hi,
                          std::optional<std::uint32_t> free_op, const OracleAccess* b) {
    std::vector<std::pair<std::int64_t, std::int64_t>> covered;
    for (const Hazard& h : sim.hazards()) {
      if (h.kind != HazardKind::LatentReuse || h.space != a.space ||
          (h.conflict != Conflict::WriteAfterRead) != a.write) {
        continue;
      }
      if (free_op && (h.second.value() != *free_op || h.first_buffer != a.buffer)) continue;
      if (b && (h.first.value() >= b->op || o.before(h.first.value(), b->op, b->buffer))) continue;
      if (!o.before(a.op, h.first.value(), h.first_buffer)) continue;
      covered.emplace_back(std::max(lo, h.lo.count()), std::min(hi, h.hi.count()));
    }
    return covered;
  };
  // Completeness of latent reuse: every access of a freed buffer not ordered before the point
  // the free lets its bytes go is covered, byte for byte.
  for (const OracleFree& f : o.frees) {
    for (const OracleAccess& a : o.accesses) {
      if (!o.latent(a, f) || a.lo >= a.hi) continue;
      std::int64_t pos = 0;
      if (!covers_all(latent_cover(a, a.lo, a.hi, f.op, nullptr), a.lo, a.hi, pos)) {
        diff << "missed latent reuse: op " << a.op << " (" << (a.write ? "write" : "read")
             << ") freed by op " << f.op << " bytes [" << pos << ", " << a.hi << ")\n";
      }
    }
  }
  // Completeness: every unordered conflicting pair is covered, byte for byte, by reports on
  // the later op from the earlier op or an access it happens before, of the same conflict; for
  // a pair across a free, the latent report of the earlier access covers it as well.
  for (std::size_t j = 0; j < o.accesses.size(); ++j) {
    const OracleAccess& b = o.accesses[j];
    for (std::size_t i = 0; i < j; ++i) {
      const OracleAccess& a = o.accesses[i];
      if (a.op == b.op || a.space != b.space || (!a.write && !b.write)) continue;
      const std::int64_t lo = std::max(a.lo, b.lo);
      const std::int64_t hi = std::min(a.hi, b.hi);
      if (lo >= hi || o.before(a.op, b.op, b.buffer)) continue;
      const Conflict want = conflict_of(a.write, b.write);
      std::vector<std::pair<std::int64_t, std::int64_t>> covered;
      for (const Hazard& h : sim.hazards()) {
        if (h.kind == HazardKind::LatentReuse) continue;
        if (h.second.value() != b.op || h.conflict != want || h.space != a.space) continue;
        if (!o.before(a.op, h.first.value(), h.first_buffer)) continue;
        covered.emplace_back(std::max(lo, h.lo.count()), std::min(hi, h.hi.count()));
      }
      if (a.buffer != b.buffer) {
        const auto more = latent_cover(a, lo, hi, std::nullopt, &b);
        covered.insert(covered.end(), more.begin(), more.end());
      }
      std::int64_t pos = 0;
      if (!covers_all(std::move(covered), lo, hi, pos)) {
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
                            CheckerFaults faults, RandomProgramOptions options = {}) {
  const Program program = build_random_program(shape, choices, options);
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

// With record_stream: a deferred free waits for markers the allocator polls, at timings the
// checker must not depend on. (empty_cache stays out: its blocking waits for pending frees are
// allocator state the oracle would have to take from the run.)
RandomProgramOptions with_record_stream() {
  RandomProgramOptions options;
  options.record_stream = true;
  options.empty_cache = false;
  return options;
}

RC_GTEST_PROP(CheckerOracle, VerdictsEqualTheOracleWithRecordStream, ()) {
  const ProgramShape shape = *testing::gen_shape();
  const auto choices = *testing::gen_choices();
  checker_matches_oracle(shape, choices, CheckerFaults{}, with_record_stream());
}

TEST(CheckerOracle, RandomProgramsOftenFreeWhileInUse) {
  // Keeps the generator honest for frees: latent reuse must be common, and so must programs
  // whose frees are all safe, with and without record_stream.
  for (const bool record : {false, true}) {
    std::mt19937_64 rng(20261123);
    int latent = 0;
    int deferred = 0;
    constexpr int kPrograms = 300;
    for (int i = 0; i < kPrograms; ++i) {
      const ProgramShape shape =
          testing::random_shape(rng, 2 + static_cast<std::uint32_t>(rng() % 5));
      const auto choices = testing::random_choices(rng, 1 + rng() % 60);
      auto run = run_program(build_random_program(
          shape, choices, record ? with_record_stream() : RandomProgramOptions{}));
      ASSERT_TRUE(run.ok());
      const auto& hazards = run.value().sim.hazards();
      latent += std::any_of(hazards.begin(), hazards.end(),
                            [](const Hazard& h) { return h.kind == HazardKind::LatentReuse; })
                    ? 1
                    : 0;
      deferred += run.value().sim.device_allocator(DeviceId(0)).stats().deferred_frees > 0 ||
                  run.value().sim.pinned_allocator().stats().deferred_frees > 0;
    }
    EXPECT_GE(latent, kPrograms / 10) << latent << " programs with latent reuse";
    EXPECT_LE(latent, kPrograms * 4 / 5) << latent << " programs with latent reuse";
    if (record) {
      EXPECT_GE(deferred, kPrograms / 10) << deferred << " with deferred frees";
    }
  }
}

TEST(CheckerOracle, PlantedFaultDeferralCoveringEveryStreamIsCaught) {
  CheckerFaults faults;
  faults.deferral_covers_every_stream = true;
  const std::string found = ferry::testing::counterexample([&] {
    checker_matches_oracle(*testing::gen_shape(), *testing::gen_choices(), faults,
                           with_record_stream());
  });
  ASSERT_FALSE(found.empty()) << "record_stream taken to cover every stream: not noticed";
  std::cout << "record_stream taken to cover every stream, shrunk counterexample:\n"
            << found << "\n";
}

TEST(CheckerOracle, PlantedFaultIgnoringDeferredFreeMarkersIsCaught) {
  CheckerFaults faults;
  faults.ignore_floors = true;
  const std::string found = ferry::testing::counterexample([&] {
    checker_matches_oracle(*testing::gen_shape(), *testing::gen_choices(), faults,
                           with_record_stream());
  });
  ASSERT_FALSE(found.empty()) << "next owner not ordered after the markers: not noticed";
  std::cout << "next owner of a deferred free not ordered after its markers, shrunk "
               "counterexample:\n"
            << found << "\n";
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
