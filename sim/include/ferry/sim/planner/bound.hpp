#pragma once
/// A lower bound on the step time of any plan that fits a budget.

#include <cstdint>
#include <vector>

#include "ferry/sim/planner/space.hpp"
#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

/// A lower bound on the step time of any plan whose peak fits `budget`: the no-offload step
/// time, plus the cheapest recompute (fractional, by bytes freed per nanosecond) of what the
/// device-to-host link cannot move out during the forward pass. `none` is the measured
/// no-offload run. See docs/plan.md for what it assumes and how loose it is.
[[nodiscard]] SimTime step_lower_bound(const Model& model, const DeviceProfile& device,
                                       const RowResult& none, Bytes budget);

/// The same bound over the layers `find_layers(model)` returned (the planner's, found once).
[[nodiscard]] SimTime step_lower_bound(const std::vector<planning::Layer>& layers,
                                       const Model& model, const DeviceProfile& device,
                                       const RowResult& none, Bytes budget);

/// The recomputed ops of each option of each layer of `space` (every level with every tail,
/// as PlanSpace::plan_of builds it, random ops included), per layer, distinct sets.
[[nodiscard]] std::vector<std::vector<std::vector<std::uint32_t>>> option_recompute_sets(
    const planning::PlanSpace& space);

/// A lower bound on the step time of any plan whose layers each recompute one of the sets of
/// option_recompute_sets (docs/plan.md, "The bound over per-layer options"): the accounting of
/// step_lower_bound, the bytes the link cannot carry freed by whole options, exactly (a
/// dynamic program over the layers), or by a forward made longer for the link. At least
/// step_lower_bound's.
[[nodiscard]] SimTime options_lower_bound(
    const planning::PlanSpace& space,
    const std::vector<std::vector<std::vector<std::uint32_t>>>& sets, const DeviceProfile& device,
    const RowResult& none, Bytes budget);

/// Whether every layer of `plan` recomputes one of `sets` (its layer's).
[[nodiscard]] bool in_option_space(const planning::PlanSpace& space,
                                   const std::vector<std::vector<std::vector<std::uint32_t>>>& sets,
                                   const Plan& plan);

}  // namespace ferry::sim
