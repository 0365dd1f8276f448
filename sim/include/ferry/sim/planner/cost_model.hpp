#pragma once
/// What the planner's search asks of a plan: its cost (Note [The cost model]).

#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/plan/plan.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::planning {

// Note [The cost model]
// The search (search.hpp) never runs the simulator itself: it asks a CostModel what each plan
// it builds costs, and measures its own effort in the runs the model made. The planner's cost
// model is the simulator (SimulatedCost in planner.cpp): an unchecked run on the roomy device,
// kept by the plan's key, so that a plan two paths of the search reach, or a later budget of a
// sweep reaches again, runs once; it counts only the runs it made. A test's cost model can be
// a table. The search decides from the evaluations alone, so a cost model that answers alike
// for plans with the same key (key_of) makes the search deterministic. It is a virtual
// interface rather than a concept: a call costs a simulation (milliseconds), and the search is
// compiled once, not once per cost model.

/// What one plan costs.
struct Evaluation {
  bool ok = false;  ///< the run completed without failure
  SimTime time;     ///< step time (of the last simulated step)
  Bytes reserved;   ///< peak reserved device memory
  Bytes pinned;     ///< peak pinned host memory
  /// Time the compute stream waited on copies (forward and backward), and the bytes copied to
  /// the host, in the measured step: what the exact stage's link model is calibrated on (Note
  /// [The option model] in exact.cpp). A cost model may leave them zero.
  SimTime stall{};
  Bytes d2h{};
};

/// A plan's cost, as the search needs it.
class CostModel {
 public:
  CostModel() = default;
  CostModel(const CostModel&) = delete;
  CostModel& operator=(const CostModel&) = delete;
  virtual ~CostModel() = default;

  /// What `plan` costs.
  virtual Evaluation evaluate(const Plan& plan) = 0;
  /// Whether `plan` is one the cost model can run: it lowers to training options for `model`,
  /// the search's (plan_training_options). The simulator's cost model, whose model that is,
  /// keeps the lowering for the plan's runs; the default lowers and forgets.
  virtual bool admits(const Plan& plan, const Model& model);
  /// The plans the search asks for next, in its order: a cost model may run those it has not
  /// run yet side by side before they are asked (Note [Parallel simulations] in
  /// planner/workers.hpp). `every`: the search asks for every one of them (unless a failure ends
  /// the stage); else it may stop at any, and only as many as run at once are run ahead, from the
  /// first not run, and nothing when the first has been. What evaluate() answers and what runs()
  /// counts do not change: a run made ahead counts when it is first asked for. The default runs
  /// nothing.
  virtual void ahead(std::span<const Plan> /*upcoming*/, bool /*every*/) {}
  /// How many runs ahead() makes at once (1: it runs none ahead).
  [[nodiscard]] virtual std::size_t width() const { return 1; }
  /// The evaluations made so far that ran something (not those answered from what an earlier
  /// one ran): the effort the search's bounded stages count.
  [[nodiscard]] virtual std::int64_t runs() const = 0;
};

}  // namespace ferry::sim::planning
