#pragma once
/// What `ferry plan` prints: a plan's report and a sweep's table, JSON and plot.

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/sweep.hpp"

namespace ferry::sim {

/// The fastest fixed configuration of `outcome.fixed` whose peaks fit the plan's budgets, or
/// null when none does.
[[nodiscard]] const RowResult* best_fixed(const PlanOutcome& outcome);

/// `ferry plan` output: text (human units) and JSON (`ferry.plan-report/1`, the plan under
/// "plan"), under FSDP of one rank of the plan's parallelism (Note [Reports under FSDP]).
[[nodiscard]] std::string plan_text(const PlanOutcome& outcome, const Model& model,
                                    const DeviceProfile& device);
[[nodiscard]] nlohmann::ordered_json plan_report_json(const PlanOutcome& outcome,
                                                      const Model& model,
                                                      const DeviceProfile& device);

/// The sweep as a text table (human units) and as JSON (`ferry.plan-sweep/1`): per budget the
/// plan's step time, its ratio to no offload, the lower bound, and the fastest fixed
/// configuration of `ferry compare` that fits; under FSDP of one rank of `parallelism`.
[[nodiscard]] std::string sweep_text(const std::vector<SweepPoint>& points, const Model& model,
                                     const DeviceProfile& device,
                                     const Parallelism& parallelism = {});
[[nodiscard]] nlohmann::ordered_json sweep_json(const std::vector<SweepPoint>& points,
                                                const Model& model, const DeviceProfile& device,
                                                const Parallelism& parallelism = {});
/// The sweep as a self-contained SVG plot (`ferry plan --sweep N --plot FILE`): step time as a
/// ratio to no offload against peak reserved memory, the plans as a line, each fixed
/// configuration of `ferry compare` as a coloured square, axes, labels and a legend.
[[nodiscard]] std::string sweep_svg(const std::vector<SweepPoint>& points, const Model& model,
                                    const DeviceProfile& device);

}  // namespace ferry::sim
