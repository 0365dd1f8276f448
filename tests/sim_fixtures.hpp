#pragma once
// Shared set-up for simulator tests: a device whose numbers make timings easy to check by hand.

#include <span>
#include <string>
#include <vector>

#include "ferry/sim/engine/simulator.hpp"

namespace ferry::sim::testing {

/// 1 byte per ns both ways (pageable at half), no latencies, no host overheads, 1 GiB memory.
inline DeviceProfile simple_profile() {
  DeviceProfile p;
  p.name = "simple";
  p.memory = Bytes(1LL << 30);
  p.flops_per_s = 1'000'000'000'000;
  p.memory_bandwidth = Bandwidth(1'000'000'000'000);
  p.h2d = CopyPath{Bandwidth(1'000'000'000), SimTime(0), 1000};
  p.d2h = CopyPath{Bandwidth(1'000'000'000), SimTime(0), 1000};
  p.pageable_h2d = Bandwidth(500'000'000);
  p.pageable_d2h = Bandwidth(500'000'000);
  p.d2d = CopyPath{Bandwidth(10'000'000'000), SimTime(0), 1000};
  p.peer = CopyPath{Bandwidth(2'000'000'000), SimTime(0), 1000};
  p.pinned_host_capacity = Bytes(1LL << 30);
  return p;
}

/// simple_profile on nodes of 8 GPUs, whose collectives take 100 GB/s and 1 us inside a node
/// and 10 GB/s and 5 us between nodes.
inline DeviceProfile node_profile() {
  DeviceProfile p = simple_profile();
  p.collectives.gpus_per_node = 8;
  p.collectives.intra_node = CollectiveLink{Bandwidth(100'000'000'000), SimTime(1000)};
  p.collectives.inter_node = CollectiveLink{Bandwidth(10'000'000'000), SimTime(5000)};
  return p;
}

inline Simulator simple_sim(int devices = 1, SimOptions options = {},
                            DeviceProfile profile = simple_profile(), SimFaults faults = {}) {
  std::vector<DeviceSpec> specs;
  for (int i = 0; i < devices; ++i) specs.push_back(DeviceSpec{"gpu" + std::to_string(i), profile});
  return Simulator(std::move(specs), {}, options, faults);
}

/// The hazards of `sim`, a line each ("kind/conflict: first op on stream | second op on
/// stream"), for failure messages.
inline std::string hazard_lines(const Simulator& sim) {
  const auto name = [&](OpId id) {
    const OpRecord& op = sim.ops()[id.value()];
    const std::string stream = op.stream.valid() ? sim.stream_name(op.stream) : "host";
    return std::string(sim.label(op.label)) + " on " + stream;
  };
  std::string out;
  for (const Hazard& h : sim.hazards()) {
    out += std::to_string(static_cast<int>(h.kind)) + "/" +
           std::to_string(static_cast<int>(h.conflict)) + ": " + name(h.first) + " | " +
           name(h.second) + "\n";
  }
  return out;
}

/// No regions: an op that reads or writes nothing.
inline constexpr std::span<const Region> kNone{};

/// The one region `r`.
inline std::vector<Region> one(Region r) { return {r}; }

inline Region whole(const Simulator& sim, BufferId id) {
  return Region{id, Bytes(0), sim.buffers()[id.value()].bytes};
}

inline BufferId device_buffer(Simulator& sim, StreamId stream, std::int64_t bytes,
                              const char* name = "buf") {
  return sim
      .alloc(MemoryKind::Device, sim.stream_device(stream), Bytes(bytes), stream,
             PinnedPool::Caching, name)
      .value();
}

inline BufferId pinned_buffer(Simulator& sim, std::int64_t bytes, const char* name = "host") {
  return sim
      .alloc(MemoryKind::Pinned, DeviceId(), Bytes(bytes), StreamId(), PinnedPool::Exact, name)
      .value();
}

}  // namespace ferry::sim::testing
