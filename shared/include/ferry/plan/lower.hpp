#pragma once
/// A plan lowered to the offload scheduler's options: the one rule both backends apply (the
/// simulator's replay of a plan, and `ferry.offload(plan=...)` on the real one).

#include "ferry/offload/options.hpp"
#include "ferry/plan/plan.hpp"

namespace ferry {

/// The options the plan fixes, on top of `base`: its knobs, its host budget (when it has one) as
/// the pinned cap, and the ferry policy when anything offloads (plan_offloads), else none.
/// The rest of `base` (trl's stash, dedup, streams) stays as it is.
[[nodiscard]] OffloadOptions plan_offload_options(const Plan& plan, OffloadOptions base = {});

}  // namespace ferry
