#include "ferry/sim/planner/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "ferry/check.hpp"
#include "ferry/sim/planner/bound.hpp"
#include "ferry/sim/planner/search.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/runs/metrics.hpp"
#include "tensors.hpp"
#include "workers.hpp"

namespace ferry::sim {

namespace planning {

/// The simulator as the planner's cost model (Note [The cost model]): unchecked runs on the
/// roomy device, and the checked runs that decide which candidate becomes the plan, each kept
/// by its inputs.
class SimulatedCost final : public CostModel {
 public:
  SimulatedCost(const CheckedModel& model, const DeviceProfile& device, std::int32_t steps,
                const ParallelOptions& fsdp, AllocatorMode allocator, bool paged_stash)
      : model_(model),
        device_(device),
        roomy_(roomy(device)),
        base_(timing_only(steps)),
        steps_(steps) {
    base_.parallel = fsdp;
    base_.sim.allocator = allocator;
    base_.paged_stash.on = paged_stash;
  }

  /// The unchecked run of `plan` on the roomy device (once per run key: run_key_of).
  Evaluation evaluate(const Plan& plan) override {
    std::string key = run_key_of(plan);
    if (auto it = evaluations_.find(key); it != evaluations_.end()) {
      ++reused_;
      return it->second;
    }
    ++simulations_;
    Evaluation e;
    if (auto it = ahead_.find(key); it != ahead_.end()) {
      e = it->second;
      ahead_.erase(it);
    } else {
      e = run_unchecked(lowering(plan, key_of(plan)));
    }
    evaluations_.emplace(std::move(key), e);
    return e;
  }

  /// Runs the plans of `upcoming` not run yet on the workers (CostModel::ahead); a plan that
  /// does not lower is left to evaluate(), which says so.
  void ahead(std::span<const Plan> upcoming, bool every) override {
    if (workers_ <= 1) return;
    std::vector<std::pair<std::string, const Lowering*>> todo;
    for (std::size_t i = 0; i < upcoming.size() && (every || todo.size() < workers_); ++i) {
      std::string key = run_key_of(upcoming[i]);
      const bool known = evaluations_.contains(key) || ahead_.contains(key);
      if (known && i == 0 && !every) return;
      if (known ||
          std::any_of(todo.begin(), todo.end(), [&](const auto& t) { return t.first == key; })) {
        continue;
      }
      const Lowering& l = lowering(upcoming[i], key_of(upcoming[i]));
      if (l.ok()) todo.emplace_back(std::move(key), &l);
    }
    // One run gains nothing from running ahead: evaluate() makes it when it is asked for.
    if (todo.size() < 2) return;
    std::vector<Evaluation> out(todo.size());
    for_each_parallel(todo.size(), workers_,
                      [&](std::size_t i) { out[i] = run_unchecked(*todo[i].second); });
    for (std::size_t i = 0; i < todo.size(); ++i) ahead_.emplace(std::move(todo[i].first), out[i]);
  }

  /// How many runs go on at once (workers_for).
  void set_workers(std::size_t workers) { workers_ = std::max<std::size_t>(1, workers); }
  [[nodiscard]] std::size_t workers() const { return workers_; }
  [[nodiscard]] std::size_t width() const override { return workers_; }

  /// Whether `plan` lowers to training options (plan_training_options), lowered once per
  /// distinct plan: its runs take that lowering rather than lowering the plan again.
  bool admits(const Plan& plan, const Model& /*model: model_'s*/) override {
    return lowering(plan, key_of(plan)).ok();
  }

  [[nodiscard]] std::int64_t runs() const override { return simulations_; }
  [[nodiscard]] std::int64_t reused() const { return reused_; }

  /// Keeps what a run made elsewhere measured as `plan`'s evaluation (unless it has one).
  void remember(const Plan& plan, const Evaluation& e) {
    evaluations_.emplace(run_key_of(plan), e);
  }

  /// Whether the checked runs made from now on record their allocators' actions, and those
  /// that pass are kept (PlannerOptions::keep_run).
  void keep_runs(bool keep) { keep_runs_ = keep; }

  /// The run checked(plan, memory) kept, or null.
  [[nodiscard]] std::shared_ptr<const TrainingRun> kept_run(const Plan& plan, Bytes memory) const {
    const auto it = kept_.find(fmt::format("{}|{}", key_of(plan), memory.count()));
    return it == kept_.end() ? nullptr : it->second;
  }

  /// The checked run of `plan` (hazard checker and content tracking on) on a device with
  /// `memory`; the row's failure says why it cannot be the plan (hazards and content
  /// mismatches included).
  const RowResult& checked(const Plan& plan, Bytes memory) {
    const std::string plan_key = key_of(plan);
    std::string key = fmt::format("{}|{}", plan_key, memory.count());
    if (auto it = checked_.find(key); it != checked_.end()) {
      ++reused_;
      return it->second;
    }
    ++simulations_;
    DeviceProfile capped = device_;
    capped.memory = memory;
    TrainingOptions training;
    training.steps = steps_;
    training.parallel = base_.parallel;
    training.sim.allocator = base_.sim.allocator;
    training.paged_stash = base_.paged_stash;
    training.sim.record_allocator = keep_runs_;
    lowering(plan, plan_key).apply(training);
    std::optional<TrainingRun> run;
    RowResult row = run_row(model_, capped, PolicyRow{"plan", training}, &run);
    if (!row.failure && run && !run->sim.content_mismatches().empty()) {
      row.failure =
          Failure{FailureKind::Infeasible,
                  fmt::format("{} content mismatches", run->sim.content_mismatches().size())};
    }
    if (!run && !row.failure) row.failure = Failure{FailureKind::Infeasible, "no run"};
    if (!row.failure && node_ranks() >= 2) {
      if (auto why = node_check(capped, training); !why.empty()) {
        row.failure = Failure{FailureKind::Infeasible, std::move(why)};
      }
    }
    if (keep_runs_ && run && !row.failure) {
      kept_.emplace(key, std::make_shared<const TrainingRun>(std::move(*run)));
    }
    return checked_.emplace(std::move(key), std::move(row)).first->second;
  }

  /// The offload options `plan` was lowered to for its runs, which must have been made.
  [[nodiscard]] const OffloadOptions& lowered(const Plan& plan) const {
    const auto it = lowerings_.find(key_of(plan));
    FERRY_CHECK(it != lowerings_.end() && it->second.ok(), "the plan was never lowered");
    return it->second.offload;
  }

  /// Ranks of a node the checked runs also train side by side (Note [Node run]): 2 under FSDP
  /// with two or more ranks per node, else 0.
  [[nodiscard]] std::int32_t node_ranks() const {
    const Parallelism& p = base_.parallel.mesh;
    if (!p.on()) return 0;
    return p.ranks_per_node(device_.collectives.gpus_per_node) >= 2 ? 2 : 0;
  }

  /// Two ranks of a node running `options` side by side, each offloading into its part of the
  /// node's pinned memory: why they cannot, or empty when they share no bytes.
  std::string node_check(const DeviceProfile& device, TrainingOptions options) const {
    options.steps = 1;
    auto node = simulate_node(model_, device, options, node_ranks());
    if (!node) return "node check: " + node.error().message;
    const NodeRun& n = node.value();
    for (const auto& failure : n.failures) {
      if (failure) return "node check: " + failure->message;
    }
    if (!n.sim.hazards().empty() || !n.sim.content_mismatches().empty()) {
      return fmt::format("node check: {} hazards, {} content mismatches between two ranks",
                         n.sim.hazards().size(), n.sim.content_mismatches().size());
    }
    return {};
  }

 private:
  /// What a plan lowers to: the parts of TrainingOptions plan_training_options sets, which do
  /// not depend on the run's other options (steps, checker, allocator, FSDP).
  struct Lowering {
    std::string error;  // why the plan does not lower; empty when it does
    OffloadOptions offload;
    CheckpointPlan checkpoint;
    OffloadSelection selection;
    [[nodiscard]] bool ok() const { return error.empty(); }
    /// `options` running the plan; the planner's own plans always lower (FERRY_CHECK).
    void apply(TrainingOptions& options) const {
      FERRY_CHECK(ok(), "planner built an invalid plan: {}", error);
      options.offload = offload;
      options.checkpoint = checkpoint;
      options.offload_selection = selection;
    }
  };

  // The unchecked run of a lowered plan on the roomy device: reads only what the runs share,
  // so runs go side by side (Note [Parallel simulations] in workers.hpp).
  [[nodiscard]] Evaluation run_unchecked(const Lowering& lowered) const {
    TrainingOptions options = base_;
    options.sim.timeline = false;
    lowered.apply(options);
    // Nothing here reads a value: times and memory are the same without them.
    options.content_values = options.sim.track_content || options.checkpoint.content_check;
    auto run = simulate_training(model_, roomy_, options);
    Evaluation e;
    if (run.ok() && !run.value().failure && !run.value().steps.empty()) {
      const TrainingRun& r = run.value();
      e.ok = true;
      e.time = r.steps.back().end - r.steps.back().start;
      e.reserved = r.sim.device_allocator(r.device).stats().reserved_peak;
      e.pinned = r.sim.pinned_allocator().stats().reserved_peak;
      const StepTimes& last = r.steps.back();
      const StepFigures figures = step_figures(r.sim, r.compute, last.start, last.end);
      e.stall = figures.stall;
      e.d2h = figures.d2h;
    }
    return e;
  }

  // `plan`'s lowering (its key is `key`), lowered the first time it is asked for.
  const Lowering& lowering(const Plan& plan, const std::string& key) {
    if (auto it = lowerings_.find(key); it != lowerings_.end()) return it->second;
    Lowering l;
    if (auto options = plan_training_options(plan, *model_, TrainingOptions{}); !options) {
      l.error = options.error().message;
    } else {
      l.offload = std::move(options.value().offload);
      l.checkpoint = std::move(options.value().checkpoint);
      l.selection = std::move(options.value().offload_selection);
    }
    return lowerings_.emplace(key, std::move(l)).first->second;
  }

  CheckedModel model_;
  DeviceProfile device_;
  DeviceProfile roomy_;   // plans are measured here: a plan that does not fit still says its peak
  TrainingOptions base_;  // of the unchecked runs
  std::int32_t steps_;
  std::map<std::string, Evaluation> evaluations_;
  std::map<std::string, Evaluation> ahead_;   // run ahead (ahead()), not asked for yet
  std::map<std::string, RowResult> checked_;  // key and device memory -> the checked run
  std::map<std::string, std::shared_ptr<const TrainingRun>> kept_;  // the runs keep_runs kept
  std::map<std::string, Lowering> lowerings_;  // key -> what the plan lowered to
  bool keep_runs_ = false;
  std::size_t workers_ = 1;
  std::int64_t simulations_ = 0;
  std::int64_t reused_ = 0;
};

/// What a Planner keeps from one budget to the next.
struct PlannerState {
  PlannerState(const CheckedModel& m, const DeviceProfile& d, std::int32_t s,
               const ParallelOptions& f, AllocatorMode a, bool stash)
      : model(m),
        device(d),
        steps(s),
        parallel(f),
        allocator(a),
        paged_stash(stash),
        space(*m, d),
        cost(m, d, s, f, a, stash),
        knobs(knob_variants()) {}

  CheckedModel model;
  DeviceProfile device;
  std::int32_t steps;
  ParallelOptions parallel;
  AllocatorMode allocator;
  bool paged_stash;  // every run with the paged stash (PlannerOptions::paged_stash)
  PlanSpace space;
  SimulatedCost cost;
  std::vector<PlanKnobs> knobs;                // the knob variants
  std::optional<std::vector<RowResult>> rows;  // the rows of `ferry compare`, once measured
  std::vector<Seed> seeds;
  /// The recomputed ops of every layer option (option_recompute_sets), once made.
  std::optional<std::vector<std::vector<std::vector<std::uint32_t>>>> option_sets;
  /// The plans earlier budgets returned, with their checked step times (Note [Monotone in
  /// the budget]).
  std::vector<Candidate> picked;

  /// Measures the rows of `ferry compare`, and takes those a plan can express as seeds.
  void ensure_fixed() {
    if (rows) return;
    TrainingOptions base = timing_only(steps);
    base.parallel = parallel;
    base.sim.allocator = allocator;
    base.paged_stash.on = paged_stash;
    const std::vector<PolicyRow> policy_rows = default_rows(base, *model, device);
    std::vector<RowResult> measured(policy_rows.size());
    for_each_parallel(policy_rows.size(), cost.workers(),
                      [&](std::size_t i) { measured[i] = run_row(model, device, policy_rows[i]); });
    rows = std::move(measured);
    std::vector<Seed> made;
    for (std::size_t i = 0; i < policy_rows.size(); ++i) {
      std::optional<Seed> seed = seed_of(space, policy_rows[i].options, cost);
      if (!seed) continue;
      seed->row = i;
      made.push_back(std::move(*seed));
    }
    // The seeds whose rows did not fit are measured on the roomy device.
    std::vector<Plan> unfit;
    for (const Seed& seed : made) {
      if (!(*rows)[seed.row].fits) unfit.push_back(seed.plan);
    }
    cost.ahead(unfit, true);
    for (Seed& seed : made) {
      const RowResult& r = (*rows)[seed.row];
      if (r.fits) {
        // The row is this plan's run: keep it as the plan's evaluation.
        seed.evaluation = Evaluation{!r.failure,
                                     r.step_time,
                                     r.peak_reserved,
                                     r.pinned_peak,
                                     r.forward_stall + r.backward_stall,
                                     r.d2h};
        cost.remember(seed.plan, seed.evaluation);
      } else {
        seed.evaluation = cost.evaluate(seed.plan);
      }
      seeds.push_back(std::move(seed));
    }
  }
};

}  // namespace planning

Bytes budget_less_margin(Bytes budget, std::int32_t margin_permille) {
  // Rounded up: 128-bit so that no budget overflows.
  const auto margin = static_cast<std::int64_t>(
      (static_cast<planning::Wide>(budget.count()) * margin_permille + 999) / 1000);
  return budget - Bytes(margin);
}

Bytes smallest_budget_for(Bytes peak, std::int32_t margin_permille) {
  // The estimate peak / (1 - margin), then the few bytes budget_less_margin's rounding moves.
  const std::int64_t keep = 1000 - margin_permille;
  std::int64_t b = keep > 0
                       ? static_cast<std::int64_t>(
                             (static_cast<planning::Wide>(peak.count()) * 1000 + keep - 1) / keep)
                       : peak.count();
  while (b > 0 && budget_less_margin(Bytes(b - 1), margin_permille) >= peak) --b;
  while (budget_less_margin(Bytes(b), margin_permille) < peak) ++b;
  return Bytes(b);
}

std::pair<Bytes, Bytes> expected_peak_band(Bytes predicted) {
  // The prediction's error e = (predicted - real) / real lies in [-under, +over], so the real
  // peak is predicted / (1 + e).
  const auto scaled = [&](std::int32_t permille) {
    return Bytes(static_cast<std::int64_t>(static_cast<planning::Wide>(predicted.count()) * 1000 /
                                           (1000 + permille)));
  };
  return {scaled(kPeakReservedErrorBand.over_permille),
          scaled(-kPeakReservedErrorBand.under_permille)};
}

std::string margin_text(std::int32_t margin_permille) {
  return margin_permille % 10 == 0
             ? fmt::format("{} %", margin_permille / 10)
             : fmt::format("{}.{} %", margin_permille / 10, margin_permille % 10);
}

std::int32_t largest_margin_within(Bytes peak, Bytes memory, std::int32_t margin_permille) {
  for (std::int32_t m = margin_permille; m >= 0; --m) {
    if (budget_less_margin(memory, m) >= peak) return m;
  }
  return -1;
}

std::string no_budget_on_device(Bytes peak, std::int32_t margin_permille, std::string_view device,
                                Bytes memory, std::string_view space) {
  const Bytes budget = smallest_budget_for(peak, margin_permille);
  std::string out = fmt::format(
      "no budget on {} plans{}: the smallest peak reserved reached is {} ({} bytes), so the "
      "floor (the smallest budget that plans) would be {} ({} bytes{}), above the device's {} of "
      "memory; it "
      "plans on a device with at least {} of memory, or over more GPUs, each holding less "
      "(--fsdp N, --tp N)",
      device, space, format_bytes(peak), peak.count(), format_bytes(budget), budget.count(),
      margin_permille > 0 ? fmt::format(", margin {}", margin_text(margin_permille))
                          : std::string(),
      format_bytes(memory), format_bytes(budget));
  const std::int32_t smaller = largest_margin_within(peak, memory, margin_permille);
  if (smaller >= 0) {
    // The peak fits the device, the margin does not: a smaller one plans at its whole memory.
    const std::string percent = margin_text(smaller);  // "5.3 %"
    out += fmt::format(
        ", or on {} at its whole memory ({} bytes) with a margin of at most {} "
        "(--margin {})",
        device, memory.count(), percent, percent.substr(0, percent.size() - 2));
  }
  return out;
}

namespace {

// Why `row`, the checked run of a candidate, cannot be the plan; empty when it can.
std::string refusal(const RowResult& row, const PlannerOptions& options) {
  if (row.failure) return row.failure->message;
  if (!row.fits) return "out of device memory";
  if (row.hazards > 0) return fmt::format("{} hazards", row.hazards);
  if (row.peak_reserved > options.budget) {
    return fmt::format("peak reserved {}", format_bytes(row.peak_reserved));
  }
  if (options.host_budget && row.pinned_peak > *options.host_budget) {
    return fmt::format("pinned peak {}", format_bytes(row.pinned_peak));
  }
  return {};
}

// The first candidate, fastest first, whose checked run on a device with `memory` passes.
struct Pick {
  const planning::Candidate* candidate = nullptr;
  const RowResult* row = nullptr;
  std::string refused;  // why the fastest candidate's checked run was refused
};

Pick pick_checked(planning::SimulatedCost& cost,
                  const std::vector<const planning::Candidate*>& ranked,
                  const PlannerOptions& options, Bytes memory) {
  Pick pick;
  for (const planning::Candidate* c : ranked) {
    const RowResult& row = cost.checked(c->plan, memory);
    std::string why = refusal(row, options);
    if (why.empty()) {
      pick.candidate = c;
      pick.row = &row;
      return pick;
    }
    if (pick.refused.empty()) pick.refused = std::move(why);
  }
  return pick;
}

// Note [Monotone in the budget]
// A larger budget admits every plan a smaller one does, so its plan should be no slower; the
// search, started afresh from the seeds, does not always find it (its moves are local). So a
// Planner keeps the plans it returned, and a later budget takes the fastest of them that beats
// its own pick and passes the checked run on its device (the run is redone: a device with more
// memory is another run), with the same pinned host budget. Within one Planner, as in a
// `ferry plan --sweep` or any sequence of budgets, a larger budget then never gives a slower
// plan; PlanProp.ALargerBudgetNeverGivesASlowerPlan checks it.
Pick earlier_if_faster(planning::PlannerState& p, Pick pick, const PlannerOptions& options,
                       Bytes memory) {
  for (const planning::Candidate& earlier : p.picked) {
    if (pick.candidate != nullptr && earlier.evaluation.time >= pick.row->step_time) continue;
    if (earlier.plan.host_budget != options.host_budget) continue;
    const RowResult& row = p.cost.checked(earlier.plan, memory);
    if (!refusal(row, options).empty()) continue;
    if (pick.candidate == nullptr || row.step_time < pick.row->step_time) {
      pick.candidate = &earlier;
      pick.row = &row;
    }
  }
  return pick;
}

// The outcome of the picked plan: its checked run, per-layer bytes, lower bound and prediction.
PlanOutcome describe(planning::PlannerState& p, const Pick& pick, const PlannerOptions& options) {
  PlanOutcome outcome;
  outcome.plan = pick.candidate->plan;
  outcome.row = *pick.row;
  outcome.row.name = "plan";
  outcome.layers = summarize_layers(outcome.plan, *p.model);
  outcome.fixed = *p.rows;
  outcome.lower_bound =
      step_lower_bound(p.space.layers(), *p.model, p.device, outcome.fixed.front(), options.budget);
  if (!p.option_sets) p.option_sets = option_recompute_sets(p.space);
  outcome.options_bound =
      options_lower_bound(p.space, *p.option_sets, p.device, outcome.fixed.front(), options.budget);
  outcome.in_option_space = in_option_space(p.space, *p.option_sets, outcome.plan);
  const RowResult& r = outcome.row;
  outcome.plan.predicted = PlanPrediction{.step_time = r.step_time,
                                          .lower_bound = outcome.lower_bound,
                                          .recompute_time = r.recompute_time,
                                          .stall = r.forward_stall + r.backward_stall,
                                          .peak_reserved = r.peak_reserved,
                                          .peak_allocated = r.peak_allocated,
                                          .pinned_peak = r.pinned_peak,
                                          .d2h = r.d2h,
                                          .h2d = r.h2d};
  return outcome;
}

// The error for a budget no plan fits: why the checked runs were refused when some plans'
// unchecked runs fit, else the floor.
Error infeasible(const planning::PlannerState& p, const planning::Search& search,
                 std::size_t candidates, const std::string& refused, const PlannerOptions& options,
                 Bytes memory, Bytes asked) {
  std::string host = options.host_budget ? fmt::format(" and {} of pinned host memory",
                                                       format_bytes(*options.host_budget))
                                         : std::string();
  if (options.margin_permille > 0) {
    host += fmt::format(" (the budget {} less its {} margin)", format_bytes(asked),
                        margin_text(options.margin_permille));
  }
  if (candidates > 0) {
    // Plans reached the budget, and every one failed its checked run: the floor would not
    // say why.
    return Error{fmt::format(
        "infeasible budget: no plan fits {} of peak reserved device memory{} on {}: the {} "
        "plans whose unchecked runs fit failed their checked run on a device with {} (the "
        "fastest: {})",
        format_bytes(options.budget), host, p.device.name, candidates, format_bytes(memory),
        refused)};
  }
  const Bytes floor = search.floor();
  if (floor.count() == std::numeric_limits<std::int64_t>::max()) {
    return Error{fmt::format(
        "infeasible budget: no plan fits {} of peak reserved device memory{} on {}, and no run "
        "of the search completed, so no floor is known",
        format_bytes(options.budget), host, p.device.name)};
  }
  // The floor a refusal names is a budget: the smallest peak with the margin added back, which
  // asked for plans (Note [The floor is a budget]).
  const Bytes budget = smallest_budget_for(floor, options.margin_permille);
  if (budget > p.device.memory) {
    return Error{fmt::format(
        "infeasible budget: no plan fits {} of peak reserved device memory{} on {}; {}",
        format_bytes(options.budget), host, p.device.name,
        no_budget_on_device(floor, options.margin_permille, p.device.name, p.device.memory, ""))};
  }
  const std::string floor_is = fmt::format(
      "infeasible budget: no plan fits {} of peak reserved device memory{} on {}; the floor (the "
      "smallest budget that plans) is {} ({} bytes)",
      format_bytes(options.budget), host, p.device.name, format_bytes(budget), budget.count());
  if (options.margin_permille == 0) {
    return Error{floor_is + ", the smallest peak reserved the planner reached"};
  }
  return Error{fmt::format(
      "{}: the smallest peak reserved the planner reached, {} ({} bytes), with the {} margin "
      "added back",
      floor_is, format_bytes(floor), floor.count(), margin_text(options.margin_permille))};
}

}  // namespace

Planner::Planner(const CheckedModel& model, const DeviceProfile& device, std::int32_t steps,
                 const ParallelOptions& fsdp, AllocatorMode allocator, bool paged_stash)
    : state_(std::make_unique<planning::PlannerState>(model, device, steps, fsdp, allocator,
                                                      paged_stash)) {}

Planner::~Planner() = default;

const std::vector<RowResult>& Planner::fixed() {
  state_->ensure_fixed();
  return *state_->rows;
}

std::int64_t Planner::simulations() const { return state_->cost.runs(); }

Result<PlanOutcome> Planner::plan(const PlannerOptions& node_options, Bytes* floor) {
  planning::PlannerState& p = *state_;
  // A node's pinned host memory is shared by its ranks: the run of one rank gets its part.
  PlannerOptions options = node_options;
  if (options.host_budget) {
    DeviceProfile node = p.device;
    node.pinned_host_capacity = *options.host_budget;
    options.host_budget = p.parallel.mesh.rank_profile(node).pinned_host_capacity;
  }
  // The search, the checked runs and the lower bound see the budget less the margin.
  const Bytes asked = options.budget;
  options.budget = budget_less_margin(asked, options.margin_permille);
  const std::int64_t simulations_before = p.cost.runs();
  const std::int64_t reused_before = p.cost.reused();
  p.cost.set_workers(planning::workers_for(options.jobs));
  if (options.progress && !p.rows)
    options.progress(PlanProgress{.stage = "fixed configurations", .best = std::nullopt});
  p.ensure_fixed();
  p.cost.keep_runs(options.keep_run);
  planning::Search search(p.cost, p.space, planning::Budgets{options.budget, options.host_budget});
  search.observe(options.progress);
  planning::run_search(search, p.seeds, p.knobs);
  search.stage("checked runs");
  const Bytes memory = std::min(p.device.memory, options.budget);
  const std::vector<const planning::Candidate*> ranked = search.ranked();
  const Pick pick =
      earlier_if_faster(p, pick_checked(p.cost, ranked, options, memory), options, memory);
  if (pick.candidate != nullptr) {
    PlanOutcome outcome = describe(p, pick, options);
    outcome.offload = p.cost.lowered(pick.candidate->plan);
    p.picked.push_back(planning::Candidate{
        pick.candidate->plan,
        planning::Evaluation{true, pick.row->step_time, pick.row->peak_reserved,
                             pick.row->pinned_peak,
                             pick.row->forward_stall + pick.row->backward_stall, pick.row->d2h}});
    outcome.plan.budget = asked;
    outcome.planned_budget = options.budget;
    outcome.margin_permille = options.margin_permille;
    outcome.node_ranks = p.cost.node_ranks();
    if (options.keep_run) outcome.run = p.cost.kept_run(pick.candidate->plan, memory);
    // FSDP's ranks, or tensor parallelism alone: the plan records what it was made under.
    const Parallelism& parallelism = p.parallel.mesh;
    if (parallelism.sharded()) outcome.plan.parallelism = parallelism;
    outcome.plan.paged_stash = p.paged_stash;
    outcome.simulations = p.cost.runs() - simulations_before;
    outcome.reused = p.cost.reused() - reused_before;
    return outcome;
  }
  if (floor != nullptr) {
    // The floor the refusal names: none where plans reached the budget and failed their checks.
    const Bytes reached = search.floor();
    const bool named =
        ranked.empty() && reached.count() != std::numeric_limits<std::int64_t>::max();
    *floor = named ? reached : Bytes(0);
  }
  return infeasible(p, search, ranked.size(), pick.refused, options, memory, asked);
}

Result<PlanOutcome> make_plan(const CheckedModel& model, const DeviceProfile& device,
                              const PlannerOptions& options, Bytes* floor) {
  Planner planner(model, device, options.steps, options.parallel, options.allocator,
                  options.paged_stash);
  return planner.plan(options, floor);
}

Result<PlanOutcome> make_plan(const Model& model, const DeviceProfile& device,
                              const PlannerOptions& options, Bytes* floor) {
  auto checked = check_model(model);
  if (!checked) return checked.error();
  return make_plan(checked.value(), device, options, floor);
}

}  // namespace ferry::sim
