#pragma once
// Private to the simulated autograd: the collective ops of a rank's model, issued on their
// process groups' streams (Note [Mesh collectives] in mesh_collectives.cpp).

#include <array>
#include <cstdint>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "step_hooks.hpp"

namespace ferry::sim::training {

/// The collective lane that runs a mesh axis's process group.
[[nodiscard]] CollectiveLane lane_of(MeshAxis axis);

/// Issues each collective op of the model (ModelOp::collective) on a stream of its mesh
/// axis's process group, run by that group's collective lane, between the two waits torch
/// puts around a functional collective (Note [Mesh collectives]).
class MeshCollectives final : public StepHooks {
 public:
  /// Whether `model` has a collective op.
  [[nodiscard]] static bool needed(const Model& model);

  // Keeps references to every argument; adds its streams at setup.
  MeshCollectives(const Model& model, const CollectiveFaults& faults, RankContext& rank);

  void setup(std::vector<Region>& writes, std::vector<std::uint64_t>& values) override;
  bool launch(const Launch& launch) override;

 private:
  const Model& model_;
  const CollectiveFaults& faults_;
  RankContext& rank_;
  std::array<StreamId, 3> streams_{};  // by MeshAxis: the axes the model's ops use
};

}  // namespace ferry::sim::training
