#pragma once
/// Where a plan's search is, for a progress line (PlannerOptions::progress).

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "ferry/units.hpp"

namespace ferry::sim {

/// One step of a plan's search: the stage it is in, the plans that stage has asked about, of
/// how many where the stage knows (0: it does not), and the fastest plan that fits so far.
struct PlanProgress {
  std::string_view stage;  ///< "fixed configurations", "descent", "local search", ...
  std::int64_t done = 0;
  std::int64_t total = 0;
  std::optional<SimTime> best;
};

/// Hears a plan's progress on the thread that called Planner::plan; may be empty.
using PlanProgressFn = std::function<void(const PlanProgress&)>;

}  // namespace ferry::sim
