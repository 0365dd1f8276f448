#include "ferry/sim/analysis/run_program.hpp"

#include <fmt/format.h>

#include <vector>

namespace ferry::sim {

namespace {

std::vector<DeviceSpec> device_specs(const Program& program) {
  std::vector<DeviceSpec> specs;
  specs.reserve(program.devices.size());
  for (const ProgramDevice& d : program.devices) specs.push_back(DeviceSpec{d.name, d.profile});
  return specs;
}

}  // namespace

Result<ProgramRun> run_program(const Program& program, SimOptions options, SimFaults faults,
                               SimObserver* observer) {
  if (program.devices.empty()) return Error{"program declares no devices"};
  ProgramRun run{Simulator(device_specs(program), program.links, options, faults), std::nullopt, 0};
  Simulator& sim = run.sim;
  if (observer != nullptr) sim.observe(*observer);
  for (const ProgramStream& s : program.streams) sim.add_stream(s.device, s.name);
  for (const ProgramEvent& e : program.events) sim.add_event(e.name);

  sim.reserve(program.ops.size());
  std::vector<BufferId> slot(program.buffers.size());
  std::vector<Region> reads;
  std::vector<Region> writes;

  // Resolves one slot range; false (after reporting) when the slot holds no memory yet.
  auto resolve_one = [&](const SlotRange& r, std::vector<Region>& out, const ProgramOp& op) {
    const BufferId id = slot[r.slot.value()];
    if (!id.valid()) {
      sim.report_misuse(HazardKind::UseBeforeAlloc, op.kind,
                        op.label.empty() ? program.buffers[r.slot.value()].name : op.label);
      return false;
    }
    out.push_back(Region{id, r.offset, r.bytes});
    return true;
  };
  auto resolve = [&](const std::vector<SlotRange>& ranges, std::vector<Region>& out,
                     const ProgramOp& op) {
    out.clear();
    for (const SlotRange& r : ranges) {
      if (!resolve_one(r, out, op)) return false;
    }
    return true;
  };

  for (std::size_t i = 0; i < program.ops.size(); ++i) {
    const ProgramOp& op = program.ops[i];
    switch (op.kind) {
      case OpKind::Alloc: {
        const ProgramBuffer& b = program.buffers[op.slot.value()];
        const BufferId held = slot[op.slot.value()];
        if (held.valid() && sim.buffers()[held.value()].live) {
          return Error{
              fmt::format("ops[{}]: alloc of buffer \"{}\", which already holds memory "
                          "(allocated by ops[{}]); free it first",
                          i, b.name, sim.buffers()[held.value()].allocated_by.value())};
        }
        // The op's label names the call; reports name the buffer by its declared name.
        auto got = sim.alloc(b.kind, b.device, b.bytes, op.stream, b.pool,
                             op.label.empty() ? b.name : op.label, b.name);
        if (!got) {
          run.failure = Failure{FailureKind::OutOfMemory,
                                fmt::format("ops[{}]: alloc of buffer \"{}\" failed: {}", i, b.name,
                                            got.error().message)};
          run.issued = i + 1;
          sim.finish();
          return run;
        }
        slot[op.slot.value()] = got.value();
        break;
      }
      case OpKind::Free:
      case OpKind::RecordStream: {
        const BufferId id = slot[op.slot.value()];
        const std::string& name =
            op.label.empty() ? program.buffers[op.slot.value()].name : op.label;
        if (!id.valid()) {
          sim.report_misuse(HazardKind::UseBeforeAlloc, op.kind, name);
        } else if (op.kind == OpKind::Free) {
          sim.free(id, name);
        } else {
          sim.record_stream(id, op.stream, name);
        }
        break;
      }
      case OpKind::Kernel:
        if (resolve(op.reads, reads, op) && resolve(op.writes, writes, op)) {
          sim.kernel(op.stream, op.duration, reads, writes, op.label);
        }
        break;
      case OpKind::Copy:
        reads.clear();
        if (resolve_one(op.src, reads, op) && resolve_one(op.dst, reads, op)) {
          sim.copy(op.stream, reads[0], reads[1], op.label);
        }
        break;
      case OpKind::Record:
        sim.record(op.event, op.stream, op.label);
        break;
      case OpKind::Wait:
        sim.wait(op.stream, op.event, op.label);
        break;
      case OpKind::SyncStream:
        sim.sync_stream(op.stream, op.label);
        break;
      case OpKind::SyncEvent:
        sim.sync_event(op.event, op.label);
        break;
      case OpKind::SyncDevice:
        sim.sync_device(op.device, op.label);
        break;
      case OpKind::Query:
        (void)sim.query(op.event, op.label);
        break;
      case OpKind::HostRead:
        if (resolve(op.reads, reads, op)) sim.host_read(reads, op.label);
        break;
      case OpKind::HostWrite:
        if (resolve(op.writes, writes, op)) sim.host_write(writes, op.label);
        break;
      case OpKind::EmptyCache:
        sim.empty_cache(op.device, op.label);
        break;
    }
  }
  run.issued = program.ops.size();
  sim.finish();
  return run;
}

}  // namespace ferry::sim
