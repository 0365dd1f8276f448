#pragma once
/// The planner's search for the fastest plan that fits (Note [Planner search] in search.cpp),
/// against a cost model (Note [The cost model] in cost_model.hpp).

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/sim/planner/cost_model.hpp"
#include "ferry/sim/planner/progress.hpp"
#include "ferry/sim/planner/seeds.hpp"
#include "ferry/sim/planner/space.hpp"

namespace ferry::sim::planning {

/// The deepest stack the search treats as shallow: there each layer is a quarter or more of
/// what the layers save and moves the peak, so the exact stage measures coupled layers (Note
/// [Layers are coupled] in exact.cpp) and the last stage tries every layer's ops (Note [Single
/// ops kept] in search.cpp); on a deeper one each run costs more and one layer matters less.
inline constexpr std::size_t kShallowStack = 4;

/// The budgets a plan must fit.
struct Budgets {
  Bytes device;               ///< peak reserved bytes
  std::optional<Bytes> host;  ///< pinned host bytes (unset: no limit)
};

/// A plan that fits, with what it costs.
struct Candidate {
  Plan plan;
  Evaluation evaluation;
};

/// A point of the search: one configuration per layer, and what its plan costs.
struct Position {
  std::vector<LayerConfig> configs;
  Evaluation evaluation;
};

/// One search, for one pair of budgets: the candidates found and the floor reached.
class Search {
 public:
  /// `cost` and `space` must outlive the search.
  Search(CostModel& cost, const PlanSpace& space, const Budgets& budgets);

  [[nodiscard]] const std::vector<Layer>& layers() const { return space_->layers(); }
  [[nodiscard]] const PlanSpace& space() const { return *space_; }
  [[nodiscard]] const Budgets& budgets() const { return budgets_; }
  [[nodiscard]] CostModel& cost() { return *cost_; }
  /// The distinct plans this search has asked the cost model for, cached or not: what its
  /// stages spend (Note [Search effort]).
  [[nodiscard]] std::int64_t asked() const { return static_cast<std::int64_t>(asked_.size()); }

  /// The plan of `configs` under the search's budgets (PlanSpace::plan_of).
  [[nodiscard]] Plan plan_of(const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
                             bool offload_outside = false) const;
  /// What `plan` costs, taken as a candidate when it fits (see note).
  Evaluation evaluate(const Plan& plan);
  /// The plans the search evaluates next, in order (CostModel::ahead): `every` when it
  /// evaluates each of them, else it may stop at any.
  void ahead(std::span<const Plan> upcoming, bool every) { cost_->ahead(upcoming, every); }
  /// Reports each evaluation to `progress` (may be empty), as part of the stage named last.
  void observe(PlanProgressFn progress) { progress_ = std::move(progress); }
  /// Starts the stage `name` (a string that outlives the search), which asks about `total`
  /// plans where it knows (0: it does not), and reports it.
  void stage(std::string_view name, std::int64_t total = 0);
  /// Takes a measured plan: a candidate when it fits; its peak lowers the floor when its
  /// pinned memory is within the host budget (a plan over the host budget reached nothing a
  /// refusal may point to).
  void note(const Plan& plan, const Evaluation& evaluation);

  [[nodiscard]] bool within_host(const Evaluation& e) const;
  /// Completed, and within both budgets.
  [[nodiscard]] bool fits(const Evaluation& e) const;

  /// The candidates, fastest first (ties by key, for a stable choice).
  [[nodiscard]] std::vector<const Candidate*> ranked() const;
  /// The fastest candidate's time, or none.
  [[nodiscard]] std::optional<SimTime> best_time() const;
  /// The smallest peak reserved of the plans measured that completed within the host budget
  /// (the largest byte count when none did).
  [[nodiscard]] Bytes floor() const { return floor_; }

 private:
  CostModel* cost_;
  const PlanSpace* space_;
  Budgets budgets_;
  std::map<std::string, Candidate> candidates_;
  std::set<std::string> asked_;  // keys of the plans evaluate() was given

  // note() with the plan's key (key_of) already made.
  void note(const Plan& plan, const Evaluation& e, std::string key);
  Bytes floor_;
  PlanProgressFn progress_;
  std::string_view stage_;
  std::int64_t stage_total_ = 0;
  std::int64_t stage_evaluated_ = 0;  // evaluate() calls in the stage
  void report() const;
};

/// Runs the search's stages on `search` (Note [Planner search] in search.cpp): the seeds (with
/// their evaluations) as candidates, the greedy descent from everything kept, the local search
/// from where it ended, from the best uniform plan and from the fastest seed that fits, then
/// `knobs` (the knob variants) on the result. Afterwards `search.ranked()` lists what fits.
void run_search(Search& search, const std::vector<Seed>& seeds,
                const std::vector<PlanKnobs>& knobs);

}  // namespace ferry::sim::planning
