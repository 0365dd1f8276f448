#pragma once
// Private to the planner's reports: the sweep's no-offload time.

#include <vector>

#include "ferry/sim/planner/sweep.hpp"

namespace ferry::sim::planning {

/// The no-offload step time of the sweep (from any point's fixed rows), or 0.
inline SimTime none_time(const std::vector<SweepPoint>& points) {
  for (const SweepPoint& p : points) {
    if (p.outcome && !p.outcome->fixed.empty()) return p.outcome->fixed.front().step_time;
  }
  return SimTime(0);
}

}  // namespace ferry::sim::planning
