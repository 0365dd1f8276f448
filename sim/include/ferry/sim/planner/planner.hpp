#pragma once
/// `ferry plan`: the fastest plan (keep / offload / recompute per op, with the offload knobs)
/// whose simulated peak reserved device memory fits a budget, found with the simulator as the
/// cost model and checked end to end with the hazard checker on. Method: docs/plan.md.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/plan/plan.hpp"
#include "ferry/sim/planner/lower.hpp"
#include "ferry/sim/planner/progress.hpp"
#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

namespace planning {
struct PlannerState;  // planner.cpp
}  // namespace planning

// Note [The plan margin]
// A plan is made on the simulator's peak reserved memory, and the simulator is not the GPU:
// docs/validation.md's table of published measurements finds its peaks between 6.8 % below
// and 9.0 % above what the real runs reserved. Below is what hurts: a plan predicted at the
// budget would reserve up to 1 / (1 - 0.068) of it on the GPU and could fail there. So a plan
// for budget B is made to fit B less a margin, a share of B no smaller than the table's largest
// underestimate: then the run's real peak stays within B wherever the table's rows are the
// guide. `ferry plan --margin` and `margin=` choose it (0 plans to B itself); the report prints
// the band, from the same table, in which the GPU's peak is expected.
// tests/python/test_published_rows.py recomputes every reserved row and fails where the band
// or the margin no longer follows them.

/// How far the simulator's peak reserved was from real GPUs in docs/validation.md's table of
/// published measurements, in thousandths of the measured peak: `under` the largest
/// underestimate (the GPU reserved more), `over` the largest overestimate.
struct PeakErrorBand {
  std::int32_t under_permille;
  std::int32_t over_permille;
};
inline constexpr PeakErrorBand kPeakReservedErrorBand{.under_permille = 68, .over_permille = 90};

/// The margin `ferry plan` and `ferry.plan` / `ferry.auto` keep below a budget unless told
/// otherwise (Note [The plan margin]): the table's largest underestimate (6.77 %), rounded up
/// to whole percent.
inline constexpr std::int32_t kDefaultPlanMarginPermille = 70;
/// The largest margin one may ask for: half the budget.
inline constexpr std::int32_t kMaxPlanMarginPermille = 500;

/// `budget` less `margin_permille` thousandths of it, the margin rounded up to whole bytes.
[[nodiscard]] Bytes budget_less_margin(Bytes budget, std::int32_t margin_permille);
/// The smallest budget whose budget less `margin_permille` thousandths (as budget_less_margin
/// rounds it) holds `peak`: what a refusal names as the floor (Note [The floor is a budget]).
[[nodiscard]] Bytes smallest_budget_for(Bytes peak, std::int32_t margin_permille);
/// The largest margin, at most `margin_permille`, at which a budget of `memory` holds `peak`;
/// -1 when none does (`peak` is above `memory`).
[[nodiscard]] std::int32_t largest_margin_within(Bytes peak, Bytes memory,
                                                 std::int32_t margin_permille);
/// A refusal's words when the smallest budget that plans for `peak` at `margin_permille` is
/// above `device`'s `memory`: no budget on it plans (`space`: " in hf's space" or empty), and
/// what would: a device with that much memory, more GPUs, or a smaller margin where the peak
/// fits the device.
[[nodiscard]] std::string no_budget_on_device(Bytes peak, std::int32_t margin_permille,
                                              std::string_view device, Bytes memory,
                                              std::string_view space);

// Note [The floor is a budget]
// A refusal names the floor as the budget to ask for: the smallest peak reserved the search
// reached with the margin added back (smallest_budget_for), the smallest budget whose part
// below the margin holds that peak, so that asking for it plans and one byte less is refused
// again. The peak itself is named beside it (`peak_floor_bytes`, PlanError.peak_floor). Where
// that budget is above the device's memory no budget on the device plans, and the refusal says
// so and what would (no_budget_on_device) instead of naming a budget the device cannot give.

/// A margin as the reports print it: "6 %", "5.5 %".
[[nodiscard]] std::string margin_text(std::int32_t margin_permille);

/// The peak reserved a real GPU is expected to reach when the simulator predicts `predicted`
/// (kPeakReservedErrorBand): {low, high}.
[[nodiscard]] std::pair<Bytes, Bytes> expected_peak_band(Bytes predicted);

/// What to plan for.
struct PlannerOptions {
  Bytes budget;                      ///< device: peak reserved bytes
  std::optional<Bytes> host_budget;  ///< pinned host bytes (unset: no limit but the pool's)
  std::int32_t steps = 2;            ///< training steps per simulation (the last is measured)
  /// FSDP2 over ranks: `budget` is each rank's, `host_budget` each node's (its ranks share it).
  ParallelOptions parallel{};
  /// How every run's caching allocator obtains memory (Note [Expandable segments]).
  AllocatorMode allocator = AllocatorMode::Default;
  /// The plan fits `budget` less this many thousandths of it (Note [The plan margin]); 0..500.
  std::int32_t margin_permille = 0;
  /// Record the checked runs' allocator actions and keep the plan's checked run in
  /// PlanOutcome::run (for its memory snapshot). A checked run made earlier by the same Planner
  /// without it is reused as it is, and leaves PlanOutcome::run null.
  bool keep_run = false;
  /// Every run trains with the paged stash (PagedStashOptions); the plan says so (Plan::
  /// paged_stash). `ferry plan` plans with and without it where the model has static-capacity
  /// buffers, and keeps the faster (plan_faster_space, planner/variants.hpp).
  bool paged_stash = false;
  /// Simulations run at once, on worker threads (Note [Parallel simulations] in
  /// planner/workers.hpp); 0: one per hardware thread. The plan and every report are the same
  /// for any count.
  std::int32_t jobs = 0;
  /// Hears each step of the search (a progress line); may be empty.
  PlanProgressFn progress{};
};

/// A plan and what its checked simulation measured.
struct PlanOutcome {
  Plan plan;  ///< its `budget` is the one asked for
  /// What the plan was made to fit: the budget less the margin (Note [The plan margin]).
  Bytes planned_budget;
  std::int32_t margin_permille = 0;
  RowResult row;  ///< the final run: hazard checker and content checks on
  /// The offload options the plan was lowered to for that run (plan_offload_options): what
  /// ferry.offload applies for it.
  OffloadOptions offload;
  /// That run itself, with PlannerOptions::keep_run; else null.
  std::shared_ptr<const TrainingRun> run;
  /// Under FSDP, the ranks of a node the final run was also checked with side by side
  /// (simulate_node: no bytes shared, their pinned memory included); 0 when not.
  std::int32_t node_ranks = 0;
  SimTime lower_bound;  ///< see step_lower_bound
  /// The bound over plans of per-layer options (options_lower_bound), and whether the plan is
  /// one of them (in_option_space): only then does it bound the plan.
  SimTime options_bound;
  bool in_option_space = false;
  std::vector<LayerSummary> layers;
  std::int64_t simulations = 0;  ///< runs the search made for this budget (checked runs included)
  std::int64_t reused = 0;       ///< runs it took from earlier ones instead (same inputs)
  /// The fixed configurations of `ferry compare` the search started from, as measured.
  std::vector<RowResult> fixed;
};

/// Plans one model on one device, at one budget or several (a sweep): the fixed
/// configurations of `ferry compare` are simulated once, on the first plan, and every
/// simulation is kept by its inputs (the plan's decisions and knobs, and the device memory of a
/// checked run), so a plan for another budget reuses what an earlier one ran. `model` must have
/// durations assigned; it was checked once, and no simulation checks it again.
class Planner {
 public:
  /// `steps`: training steps per simulation (the last is measured); `fsdp`: the parallelism
  /// every run has; `allocator`: how every run's caching allocator obtains memory.
  Planner(const CheckedModel& model, const DeviceProfile& device, std::int32_t steps = 2,
          const ParallelOptions& fsdp = {}, AllocatorMode allocator = AllocatorMode::Default,
          bool paged_stash = false);
  ~Planner();
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  /// Finds the fastest plan it can whose checked simulation has zero hazards, completes, and
  /// peaks within the budgets; never slower than the fastest fixed configuration of `ferry
  /// compare` that a plan can express and that fits. The error says the budget is infeasible
  /// and names the floor, the smallest budget that plans (smallest_budget_for the smallest peak
  /// reserved any run reached, at the margin; Note [The floor is a budget]), or that no budget
  /// on the device plans; `floor` (when not null) receives that smallest peak (without the
  /// margin), or 0 where the error names none (plans reached the budget and every one failed
  /// its checked run: the error says why). `options.steps` is the planner's.
  Result<PlanOutcome> plan(const PlannerOptions& options, Bytes* floor = nullptr);

  /// The rows of `ferry compare` (default_rows, checker off) as measured on the device.
  [[nodiscard]] const std::vector<RowResult>& fixed();
  /// Simulations run so far, checked runs included.
  [[nodiscard]] std::int64_t simulations() const;

 private:
  std::unique_ptr<planning::PlannerState> state_;
};

/// Plans at one budget: `Planner(model, device, options.steps).plan(options, floor)`.
Result<PlanOutcome> make_plan(const CheckedModel& model, const DeviceProfile& device,
                              const PlannerOptions& options, Bytes* floor = nullptr);
/// check_model(model), then the plan above: for a model planned once (tests, examples).
Result<PlanOutcome> make_plan(const Model& model, const DeviceProfile& device,
                              const PlannerOptions& options, Bytes* floor = nullptr);

}  // namespace ferry::sim
