#pragma once
/// The plan spaces `ferry plan` searches for one model: plans without the paged stash and,
/// where the model has static-capacity buffers, plans with it (docs/parallelism.md, Static
/// capacity and the paged stash). A plan is the faster of the two spaces' plans, at one budget
/// and at each budget of a sweep alike.

#include <functional>
#include <memory>
#include <vector>

#include "ferry/sim/planner/planner.hpp"

namespace ferry::sim {

/// Plans in one space, with the paged stash or without it; `floor` as Planner::plan gives it.
using PlanInSpace = std::function<Result<PlanOutcome>(bool paged_stash, Bytes* floor)>;

/// The plan without the paged stash, or where `model` has static-capacity buffers the faster of
/// the plans with and without it (a plan that fits beats one that does not; a tie keeps the
/// plan without), its bounds the smaller of the two spaces'. Refused in both spaces: the
/// refusal with the smaller floor (the one without on a tie), and that floor in `floor`.
Result<PlanOutcome> plan_faster_space(const CheckedModel& model, const PlanInSpace& plan,
                                      Bytes* floor = nullptr);

/// One Planner for each space of one model (the one with the paged stash only where the model
/// has static-capacity buffers), kept between budgets: `ferry plan --sweep` plans with it.
class SpacePlanners {
 public:
  SpacePlanners(const CheckedModel& model, const DeviceProfile& device,
                const PlannerOptions& options);
  ~SpacePlanners();
  SpacePlanners(const SpacePlanners&) = delete;
  SpacePlanners& operator=(const SpacePlanners&) = delete;

  /// plan_faster_space over the two planners; `options.paged_stash` is each planner's own.
  Result<PlanOutcome> plan(const PlannerOptions& options, Bytes* floor = nullptr);
  /// The fixed configurations of `ferry compare`, measured without the paged stash.
  [[nodiscard]] const std::vector<RowResult>& fixed();

 private:
  CheckedModel model_;
  Planner without_;
  std::unique_ptr<Planner> with_;  // null: the model has no static-capacity buffers
};

}  // namespace ferry::sim
