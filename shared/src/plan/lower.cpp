#include "ferry/plan/lower.hpp"

namespace ferry {

OffloadOptions plan_offload_options(const Plan& plan, OffloadOptions base) {
  base.policy = plan_offloads(plan) ? Policy::Ferry : Policy::None;
  base.min_bytes = plan.knobs.min_bytes;
  base.window_bytes = plan.knobs.window_bytes;
  base.prefetch_bytes = plan.knobs.prefetch_bytes;
  base.prefetch = plan.knobs.prefetch;
  base.horizon_bytes = plan.knobs.horizon_bytes;
  if (plan.host_budget) base.host_cap = *plan.host_budget;
  return base;
}

}  // namespace ferry
