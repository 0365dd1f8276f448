#pragma once
/// `ferry plan`: the fastest plan (keep / offload / recompute per op, with the offload knobs)
/// whose simulated peak reserved device memory fits a budget, found with the simulator as the
/// cost model and checked end to end with the hazard checker on. Method: docs/plan.md.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/plan/plan.hpp"
#include "ferry/sim/analysis/compare.hpp"

namespace ferry::sim {

namespace planning {
struct PlannerState;  // planner.cpp
}  // namespace planning

/// What to plan for.
struct PlannerOptions {
  Bytes budget;                      ///< device: peak reserved bytes
  std::optional<Bytes> host_budget;  ///< pinned host bytes (unset: no limit but the pool's)
  std::int32_t steps = 2;            ///< training steps per simulation (the last is measured)
};

/// Bytes of one layer's saved activations by what the plan does with them.
struct LayerSummary {
  std::int32_t layer = -1;  ///< -1: ops outside the transformer stack
  Bytes kept;
  Bytes offloaded;
  Bytes recomputed;
};

/// A plan and what its checked simulation measured.
struct PlanOutcome {
  Plan plan;
  RowResult row;        ///< the final run: hazard checker and content checks on
  SimTime lower_bound;  ///< see step_lower_bound
  std::vector<LayerSummary> layers;
  std::int64_t simulations = 0;  ///< runs the search made for this budget (checked runs included)
  std::int64_t reused = 0;       ///< runs it took from earlier ones instead (same inputs)
  /// The fixed configurations of `ferry compare` the search started from, as measured.
  std::vector<RowResult> fixed;
};

/// The training options a plan stands for on `model` (its ops matched by index and name), on
/// top of `base` (simulator options, steps). The error names the plan's JSON path.
Result<TrainingOptions> plan_training_options(const Plan& plan, const Model& model,
                                              TrainingOptions base);

/// Checks that in every region the random ops a replay re-runs are the region's first random
/// ops for each generator (Note [Random ops in a replay] in plan_options.cpp); the error names
/// the op's JSON path. plan_training_options applies it.
Status check_random_ops(const Plan& plan, const Model& model);

/// Marks recomputed every random op that draws before a recomputed one in the same region, so
/// that the plan passes check_random_ops (the planner applies it to what it builds).
void recompute_random_prefix(Plan& plan, const Model& model);

/// The plan with every op kept and no region (no offload, no recompute).
[[nodiscard]] Plan keep_everything_plan(const Model& model, const DeviceProfile& device);

/// Per-layer bytes of saved activations kept, offloaded and recomputed under `plan` (each
/// storage counted once per layer, in the layer of the op that produces it).
[[nodiscard]] std::vector<LayerSummary> summarize_layers(const Plan& plan, const Model& model);

/// A lower bound on the step time of any plan whose peak fits `budget`: the no-offload step
/// time, plus the cheapest recompute (fractional, by bytes freed per nanosecond) of what the
/// device-to-host link cannot move out during the forward pass. `none` is the measured
/// no-offload run. See docs/plan.md for what it assumes and how loose it is.
[[nodiscard]] SimTime step_lower_bound(const Model& model, const DeviceProfile& device,
                                       const RowResult& none, Bytes budget);

/// Plans one model on one device, at one budget or several (a sweep): the fixed
/// configurations of `ferry compare` are simulated once, on the first plan, and every
/// simulation is kept by its inputs (the plan's decisions and knobs, and the device memory of a
/// checked run), so a plan for another budget reuses what an earlier one ran. `model` must have
/// durations assigned and outlive the planner.
class Planner {
 public:
  /// `steps`: training steps per simulation (the last is measured).
  Planner(const Model& model, const DeviceProfile& device, std::int32_t steps = 2);
  ~Planner();
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  /// Finds the fastest plan it can whose checked simulation has zero hazards, completes, and
  /// peaks within the budgets; never slower than the fastest fixed configuration of `ferry
  /// compare` that a plan can express and that fits. The error says the budget is infeasible
  /// and names the floor (the smallest peak reserved any run reached), which `floor` (when
  /// not null) also receives. `options.steps` is the planner's.
  Result<PlanOutcome> plan(const PlannerOptions& options, Bytes* floor = nullptr);

  /// The rows of `ferry compare` (default_rows, checker off) as measured on the device.
  [[nodiscard]] const std::vector<RowResult>& fixed();
  /// Simulations run so far, checked runs included.
  [[nodiscard]] std::int64_t simulations() const;

 private:
  std::unique_ptr<planning::PlannerState> state_;
};

/// Plans at one budget: `Planner(model, device, options.steps).plan(options, floor)`.
Result<PlanOutcome> make_plan(const Model& model, const DeviceProfile& device,
                              const PlannerOptions& options, Bytes* floor = nullptr);

/// One budget of a sweep: the plan, or why there is none.
struct SweepPoint {
  Bytes budget;
  std::optional<PlanOutcome> outcome;
  std::string failure;  ///< the planner's message when there is no plan
};

/// `ferry plan --sweep N`: plans at `points` (>= 2) budgets evenly spaced from the floor (the
/// smallest peak reserved a plan for a one-byte budget reached) to the no-offload peak reserved.
/// `progress` hears each budget before it is planned (index, count, budget).
[[nodiscard]] std::vector<SweepPoint> plan_sweep(
    const Model& model, const DeviceProfile& device, const PlannerOptions& options,
    std::int32_t points, const std::function<void(std::size_t, std::size_t, Bytes)>& progress = {});

/// The sweep as a text table (human units) and as JSON (`ferry.plan-sweep/1`): per budget the
/// plan's step time, its ratio to no offload, the lower bound, and the fastest fixed
/// configuration of `ferry compare` that fits.
[[nodiscard]] std::string sweep_text(const std::vector<SweepPoint>& points, const Model& model,
                                     const DeviceProfile& device);
[[nodiscard]] std::string sweep_json(const std::vector<SweepPoint>& points, const Model& model,
                                     const DeviceProfile& device);
/// The sweep as a self-contained SVG plot (`ferry plan --sweep N --plot FILE`): step time as a
/// ratio to no offload against peak reserved memory, the plans as a line, each fixed
/// configuration of `ferry compare` as a coloured square, axes, labels and a legend.
[[nodiscard]] std::string sweep_svg(const std::vector<SweepPoint>& points, const Model& model,
                                    const DeviceProfile& device);

/// Replays a plan (`ferry simulate --plan`): its checked run on `device`.
Result<RowResult> replay_plan(const Plan& plan, const Model& model, const DeviceProfile& device,
                              const TrainingOptions& base);

/// The fastest fixed configuration of `outcome.fixed` whose peaks fit the plan's budgets, or
/// null when none does.
[[nodiscard]] const RowResult* best_fixed(const PlanOutcome& outcome);

/// `ferry plan` output: text (human units) and JSON (`ferry.plan-report/1`).
[[nodiscard]] std::string plan_text(const PlanOutcome& outcome, const Model& model,
                                    const DeviceProfile& device);
[[nodiscard]] std::string plan_report_json(const PlanOutcome& outcome, const Model& model,
                                           const DeviceProfile& device);

}  // namespace ferry::sim
