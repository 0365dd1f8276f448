#include "ferry/sim/runs/run_program.hpp"

#include <fmt/format.h>

#include <optional>
#include <string>
#include <vector>

#include "ferry/check.hpp"

namespace ferry::sim {

namespace {

std::vector<DeviceSpec> device_specs(const Program& program) {
  std::vector<DeviceSpec> specs;
  specs.reserve(program.devices.size());
  for (const ProgramDevice& d : program.devices) specs.push_back(DeviceSpec{d.name, d.profile});
  return specs;
}

// Issues a program's ops to its simulator in order. Each slot of the program names the buffer
// it holds now (a slot is allocated, freed and allocated again).
class Issuer {
 public:
  Issuer(const Program& program, Simulator& sim)
      : program_(program), sim_(sim), slot_(program.buffers.size()) {}

  // Issues ops[i]. An error for a program that cannot be run as written; a failure (out of
  // memory) stops the program, in failure().
  Status issue(std::size_t i) {
    const ProgramOp& op = program_.ops[i];
    switch (op.kind) {
      case OpKind::Alloc:
        return alloc(i, op);
      case OpKind::Free:
      case OpKind::RecordStream:
        release(op);
        break;
      case OpKind::Kernel:
        if (resolve(op.reads, reads_, op) && resolve(op.writes, writes_, op)) {
          sim_.kernel(op.stream, op.duration, reads_, writes_, op.label);
        }
        break;
      case OpKind::Copy:
        reads_.clear();
        if (resolve_one(op.src, reads_, op) && resolve_one(op.dst, reads_, op)) {
          sim_.copy(op.stream, reads_[0], reads_[1], op.label);
        }
        break;
      case OpKind::HostRead:
        if (resolve(op.reads, reads_, op)) sim_.host_read(reads_, op.label);
        break;
      case OpKind::HostWrite:
        if (resolve(op.writes, writes_, op)) sim_.host_write(writes_, op.label);
        break;
      case OpKind::Record:
      case OpKind::Wait:
      case OpKind::SyncStream:
      case OpKind::SyncEvent:
      case OpKind::SyncDevice:
      case OpKind::Query:
      case OpKind::EmptyCache:
        synchronization(op);
        break;
    }
    return Ok{};
  }

  [[nodiscard]] const std::optional<Failure>& failure() const { return failure_; }

 private:
  Status alloc(std::size_t i, const ProgramOp& op) {
    const ProgramBuffer& b = program_.buffers[op.slot.value()];
    const BufferId held = slot_[op.slot.value()];
    if (held.valid() && sim_.buffers()[held.value()].live) {
      return Error{
          fmt::format("ops[{}]: alloc of buffer \"{}\", which already holds memory "
                      "(allocated by ops[{}]); free it first",
                      i, b.name, sim_.buffers()[held.value()].allocated_by.value())};
    }
    // The op's label names the call; reports name the buffer by its declared name.
    auto got = sim_.alloc(b.kind, b.device, b.bytes, op.stream, b.pool,
                          op.label.empty() ? b.name : op.label, b.name);
    if (!got) {
      failure_ = Failure{FailureKind::OutOfMemory,
                         fmt::format("ops[{}]: alloc of buffer \"{}\" failed: {}", i, b.name,
                                     got.error().message)};
      return Ok{};
    }
    slot_[op.slot.value()] = got.value();
    return Ok{};
  }

  // A free or a record_stream of the buffer in the op's slot.
  void release(const ProgramOp& op) {
    const BufferId id = slot_[op.slot.value()];
    const std::string& name = op.label.empty() ? program_.buffers[op.slot.value()].name : op.label;
    if (!id.valid()) {
      sim_.report_misuse(HazardKind::UseBeforeAlloc, op.kind, name);
    } else if (op.kind == OpKind::Free) {
      sim_.free(id, name);
    } else {
      sim_.record_stream(id, op.stream, name);
    }
  }

  // Events, waits, synchronizations, queries and empty_cache: no buffer of the program.
  void synchronization(const ProgramOp& op) {
    switch (op.kind) {
      case OpKind::Record:
        sim_.record(op.event, op.stream, op.label);
        break;
      case OpKind::Wait:
        sim_.wait(op.stream, op.event, op.label);
        break;
      case OpKind::SyncStream:
        sim_.sync_stream(op.stream, op.label);
        break;
      case OpKind::SyncEvent:
        sim_.sync_event(op.event, op.label);
        break;
      case OpKind::SyncDevice:
        sim_.sync_device(op.device, op.label);
        break;
      case OpKind::Query:
        (void)sim_.query(op.event, op.label);
        break;
      case OpKind::EmptyCache:
        sim_.empty_cache(op.device, op.label);
        break;
      default:
        FERRY_CHECK(false, "op kind {} is not a synchronization", static_cast<int>(op.kind));
    }
  }

  // Resolves one slot range; false (after reporting) when the slot holds no memory yet.
  bool resolve_one(const SlotRange& r, std::vector<Region>& out, const ProgramOp& op) {
    const BufferId id = slot_[r.slot.value()];
    if (!id.valid()) {
      sim_.report_misuse(HazardKind::UseBeforeAlloc, op.kind,
                         op.label.empty() ? program_.buffers[r.slot.value()].name : op.label);
      return false;
    }
    out.push_back(Region{id, r.offset, r.bytes});
    return true;
  }

  bool resolve(const std::vector<SlotRange>& ranges, std::vector<Region>& out,
               const ProgramOp& op) {
    out.clear();
    for (const SlotRange& r : ranges) {
      if (!resolve_one(r, out, op)) return false;
    }
    return true;
  }

  const Program& program_;
  Simulator& sim_;
  std::vector<BufferId> slot_;
  std::vector<Region> reads_;
  std::vector<Region> writes_;
  std::optional<Failure> failure_;
};

}  // namespace

Result<ProgramRun> run_program(const Program& program, SimOptions options, SimFaults faults,
                               SimObserver* observer) {
  if (program.devices.empty()) return Error{"program declares no devices"};
  ProgramRun run{Simulator(device_specs(program), program.links, options, faults), std::nullopt, 0};
  Simulator& sim = run.sim;
  if (observer != nullptr) sim.observe(*observer);
  for (const ProgramStream& s : program.streams) sim.add_stream(s.device, s.name);
  for (std::size_t e = 0; e < program.events.size(); ++e) sim.add_event();
  sim.reserve(program.ops.size());
  Issuer issuer(program, sim);
  for (std::size_t i = 0; i < program.ops.size(); ++i) {
    if (auto issued = issuer.issue(i); !issued) return issued.error();
    if (issuer.failure()) {
      run.failure = issuer.failure();
      run.issued = i + 1;
      sim.finish();
      return run;
    }
  }
  run.issued = program.ops.size();
  sim.finish();
  return run;
}

}  // namespace ferry::sim
