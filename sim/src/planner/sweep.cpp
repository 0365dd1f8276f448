#include "ferry/sim/planner/sweep.hpp"

#include <algorithm>
#include <utility>

#include "ferry/sim/planner/variants.hpp"

namespace ferry::sim {

std::vector<SweepPoint> plan_sweep(
    const CheckedModel& model, const DeviceProfile& device, const PlannerOptions& options,
    std::int32_t points, const std::function<void(std::size_t, std::size_t, Bytes)>& progress) {
  points = std::max(points, 2);
  // One planner per plan space for every budget: the fixed configurations run once, and a
  // simulation one budget made serves the others. Each budget's plan is the faster of the
  // spaces', as at one budget (plan_faster_space).
  SpacePlanners planner(model, device, options);
  PlannerOptions tiny = options;
  tiny.budget = Bytes(1);
  Bytes floor;
  (void)planner.plan(tiny, &floor);
  const RowResult& none = planner.fixed().front();
  const Bytes peak = std::max(none.peak_reserved, floor);
  std::vector<SweepPoint> out;
  const auto count = static_cast<std::size_t>(points);
  for (std::size_t i = 0; i < count; ++i) {
    SweepPoint point;
    point.budget = floor + Bytes((peak - floor).count() * static_cast<std::int64_t>(i) /
                                 static_cast<std::int64_t>(count - 1));
    if (progress) progress(i, count, point.budget);
    PlannerOptions o = options;
    o.budget = point.budget;
    auto outcome = planner.plan(o);
    if (outcome) {
      point.outcome = std::move(outcome).value();
    } else {
      point.failure = outcome.error().message;
    }
    out.push_back(std::move(point));
  }
  return out;
}

}  // namespace ferry::sim
