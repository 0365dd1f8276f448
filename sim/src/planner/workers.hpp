#pragma once
// Private to the planner: the threads its independent simulations run on.

#include <cstddef>
#include <cstdint>
#include <functional>

namespace ferry::sim::planning {

// Note [Parallel simulations]
// A simulation reads its model, device and options and writes only its own run: nothing in
// the simulator is shared between runs (no static or global state; a run's scratch vectors
// are its Trainer's, Note [Scratch]), so runs of one planner can go on threads side by side.
// The planner's own state (its caches of evaluations, lowerings and checked runs, the
// search's candidates) is touched on the calling thread alone: the runs a stage hands out are
// lowered first, run on the workers, each into its own slot, and taken in the stage's order.
// So every evaluation, every cache entry and the order the search sees them in are what one
// worker makes, and the plan, the reports and their simulation counts do not depend on how
// many workers ran them (PlanParallel tests compare the bytes).

/// How many simulations run at once for `jobs` (PlannerOptions::jobs): `jobs`, or for 0 one per
/// hardware thread (at least one).
[[nodiscard]] std::size_t workers_for(std::int32_t jobs);

/// Calls `task(i)` for each i in [0, n) on up to `workers` threads, the calling one included;
/// each call writes only what is its own. Returns once every call has; the exception of the
/// call with the smallest index among those that threw is rethrown.
void for_each_parallel(std::size_t n, std::size_t workers,
                       const std::function<void(std::size_t)>& task);

}  // namespace ferry::sim::planning
