#include "ferry/sim/planner/variants.hpp"

#include <algorithm>
#include <utility>

namespace ferry::sim {

Result<PlanOutcome> plan_faster_space(const CheckedModel& model, const PlanInSpace& plan,
                                      Bytes* floor) {
  Bytes plain_floor{0};
  auto plain = plan(false, &plain_floor);
  if (!has_static_capacity(*model)) {
    if (floor != nullptr) *floor = plain_floor;
    return plain;
  }
  // The paged stash is one more choice where static-capacity buffers pad the saved rows.
  Bytes stashed_floor{0};
  auto stashed = plan(true, &stashed_floor);
  if (!plain && !stashed) {
    // A floor of 0 is none named: any named floor is the smaller.
    const bool take =
        stashed_floor.count() > 0 && (plain_floor.count() == 0 || stashed_floor < plain_floor);
    if (floor != nullptr) *floor = take ? stashed_floor : plain_floor;
    return take ? std::move(stashed) : std::move(plain);
  }
  const bool take =
      stashed && (!plain || stashed.value().row.step_time < plain.value().row.step_time);
  if (stashed && plain) {
    // No plan of either space beats the smaller of their bounds.
    PlanOutcome& faster = take ? stashed.value() : plain.value();
    faster.lower_bound = std::min(stashed.value().lower_bound, plain.value().lower_bound);
    faster.options_bound = std::min(stashed.value().options_bound, plain.value().options_bound);
  }
  return take ? std::move(stashed) : std::move(plain);
}

SpacePlanners::SpacePlanners(const CheckedModel& model, const DeviceProfile& device,
                             const PlannerOptions& options)
    : model_(model),
      without_(model, device, options.steps, options.parallel, options.allocator, false) {
  if (has_static_capacity(*model)) {
    with_ = std::make_unique<Planner>(model, device, options.steps, options.parallel,
                                      options.allocator, true);
  }
}

SpacePlanners::~SpacePlanners() = default;

Result<PlanOutcome> SpacePlanners::plan(const PlannerOptions& options, Bytes* floor) {
  return plan_faster_space(
      model_,
      [&](bool paged_stash, Bytes* space_floor) {
        PlannerOptions in_space = options;
        in_space.paged_stash = paged_stash;
        return (paged_stash ? *with_ : without_).plan(in_space, space_floor);
      },
      floor);
}

const std::vector<RowResult>& SpacePlanners::fixed() { return without_.fixed(); }

}  // namespace ferry::sim
