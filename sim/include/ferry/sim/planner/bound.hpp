#pragma once
/// A lower bound on the step time of any plan that fits a budget.

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

}  // namespace ferry::sim
