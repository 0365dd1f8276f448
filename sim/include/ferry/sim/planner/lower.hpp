#pragma once
/// Plans lowered to what a run does: the training options a plan stands for, the random-op
/// rule a replay needs, and what a plan does per layer.

#include <cstdint>
#include <vector>

#include "ferry/plan/plan.hpp"
#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

/// Bytes of one layer's saved activations by what the plan does with them.
struct LayerSummary {
  std::int32_t layer = -1;  ///< -1: ops outside the transformer stack
  Bytes kept;
  Bytes offloaded;
  Bytes recomputed;
};

/// The training options a plan stands for on `model` (its ops matched by index and name), on
/// top of `base` (simulator options, steps). The error names the plan's JSON path.
Result<TrainingOptions> plan_training_options(const Plan& plan, const Model& model,
                                              TrainingOptions base);

/// Checks that in every region the random ops a replay re-runs are the region's first random
/// ops for each generator (Note [Random ops in a replay] in lower.cpp); the error names the
/// op's JSON path. plan_training_options applies it.
Status check_random_ops(const Plan& plan, const Model& model);

/// Marks recomputed every random op that draws before a recomputed one in the same region, so
/// that the plan passes check_random_ops (the planner applies it to what it builds).
void recompute_random_prefix(Plan& plan, const Model& model);
/// The same in `region` alone.
void recompute_random_prefix(Plan& plan, const Model& model, const PlanRegion& region);

/// The plan with every op kept and no region (no offload, no recompute).
[[nodiscard]] Plan keep_everything_plan(const Model& model, const DeviceProfile& device);

/// Per-layer bytes of saved activations kept, offloaded and recomputed under `plan` (each
/// storage counted once per layer, in the layer of the op that produces it).
[[nodiscard]] std::vector<LayerSummary> summarize_layers(const Plan& plan, const Model& model);

/// Replays a plan (`ferry simulate --plan`): its checked run on `device`.
Result<RowResult> replay_plan(const Plan& plan, const CheckedModel& model,
                              const DeviceProfile& device, const TrainingOptions& base);

}  // namespace ferry::sim
