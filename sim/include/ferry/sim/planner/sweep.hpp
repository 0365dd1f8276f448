#pragma once
/// `ferry plan --sweep N`: plans at evenly spaced budgets with one planner.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ferry/sim/planner/planner.hpp"

namespace ferry::sim {

/// One budget of a sweep: the plan, or why there is none.
struct SweepPoint {
  Bytes budget;
  std::optional<PlanOutcome> outcome;
  std::string failure;  ///< the planner's message when there is no plan
};

/// Plans at `points` (>= 2) budgets evenly spaced from the floor (the smallest peak reserved a
/// plan for a one-byte budget reached) to the no-offload peak reserved, each plan chosen as one
/// budget's is (SpacePlanners: with the paged stash where it is faster, and the floor the
/// smaller of the two spaces'). `progress` hears each budget before it is planned (index,
/// count, budget).
[[nodiscard]] std::vector<SweepPoint> plan_sweep(
    const CheckedModel& model, const DeviceProfile& device, const PlannerOptions& options,
    std::int32_t points, const std::function<void(std::size_t, std::size_t, Bytes)>& progress = {});

}  // namespace ferry::sim
