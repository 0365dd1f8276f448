#include "mesh_collectives.hpp"

#include <algorithm>
#include <string>

namespace ferry::sim::training {

// Note [Mesh collectives]
// A rank's model under tensor, context or expert parallelism holds the collectives as ops
// (Note [Collective ops] in model_check.cpp), issued as torch issues a functional collective
// (`_c10d_functional.all_gather_into_tensor` and the like, which DTensor dispatches): its
// output is allocated by the current stream; the process group's stream first waits for the
// current stream (W1: the collective reads inputs the current stream wrote, and writes a block
// the current stream's pool handed out); the collective runs there, on the device's lane for
// that group (Note [Collectives] in simulator.cpp), so it queues behind that group's earlier
// collectives only; then `wait_tensor` makes the current stream wait for it (W2) before any
// later op reads its output. Since the current stream waits at once, the input and output are
// freed later on the current stream only after the collective is done with them. Each wait has
// a planted fault that drops it (TrainingFaults::skip_collective_launch_wait and
// skip_collective_output_wait), which the hazard checker reports as a race
// (CollectiveOps.PlantedFaultsAreCaught).
//
// A direction of a collective op that runs none (tensor parallelism's identity forward) is left
// to the Trainer, a kernel of the op's 1 ns on the current stream. Eager DTensor waits at once,
// as here; asynchronous tensor parallelism (micro-pipelined matmuls) is not modelled.

namespace {

constexpr std::array<MeshAxis, 3> kAxes = {MeshAxis::Tensor, MeshAxis::Context, MeshAxis::Expert};

}  // namespace

CollectiveLane lane_of(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::Tensor:
      return CollectiveLane::Tensor;
    case MeshAxis::Context:
      return CollectiveLane::Context;
    case MeshAxis::Expert:
      break;
  }
  return CollectiveLane::Expert;
}

bool MeshCollectives::needed(const Model& model) {
  return std::ranges::any_of(model.ops, [](const ModelOp& op) { return op.collective.any(); });
}

MeshCollectives::MeshCollectives(const Model& model, const CollectiveFaults& faults,
                                 RankContext& rank)
    : model_(model), faults_(faults), rank_(rank) {}

void MeshCollectives::setup(std::vector<Region>& /*writes*/,
                            std::vector<std::uint64_t>& /*values*/) {
  for (const MeshAxis axis : kAxes) {
    const bool used = std::ranges::any_of(model_.ops, [axis](const ModelOp& op) {
      return op.collective.any() && op.collective.axis == axis;
    });
    if (used) {
      streams_[static_cast<std::size_t>(axis)] =
          rank_.sim().add_stream(rank_.device_id(), std::string(mesh_axis_name(axis)) + " comm");
    }
  }
}

bool MeshCollectives::launch(const Launch& launch) {
  const ModelOp& op = model_.ops[launch.op];
  if (!op.collective.any()) return false;
  const bool backward = launch.phase == Launch::Phase::Backward;
  if (!(backward ? op.collective.backward : op.collective.forward)) return false;
  const StreamId comm = streams_[static_cast<std::size_t>(op.collective.axis)];
  const StreamId current = rank_.current_stream();
  Device& device = rank_.device();
  if (!faults_.skip_collective_launch_wait) {
    const Device::Event e = device.make_event();
    device.record(e, Device::Stream{current});
    device.wait(Device::Stream{comm}, e);
  }
  rank_.sim().collective(comm, backward ? op.backward_duration : op.duration, launch.reads,
                         launch.writes, launch.label, launch.values, lane_of(op.collective.axis));
  if (!faults_.skip_collective_output_wait) {
    const Device::Event done = device.make_event();
    device.record(done, Device::Stream{comm});
    device.wait(Device::Stream{current}, done);
  }
  return true;
}

}  // namespace ferry::sim::training
