#pragma once
// Private to the planner's reports: the ratio they print, and the sweep's no-offload time.

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/sim/planner/sweep.hpp"

namespace ferry::sim::planning {

/// value / base as "1.234x" in integer thousandths, half up ("-" without a base).
inline std::string times(std::int64_t value, std::int64_t base) {
  if (base <= 0) return "-";
  const std::int64_t t = (value * 1000 + base / 2) / base;
  return fmt::format("{}.{:03}x", t / 1000, t % 1000);
}

/// The no-offload step time of the sweep (from any point's fixed rows), or 0.
inline SimTime none_time(const std::vector<SweepPoint>& points) {
  for (const SweepPoint& p : points) {
    if (p.outcome && !p.outcome->fixed.empty()) return p.outcome->fixed.front().step_time;
  }
  return SimTime(0);
}

}  // namespace ferry::sim::planning
