#pragma once
/// Metrics read from a simulated timeline after the run.

#include <cstdint>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// Time the compute stream spent blocked in waits between `from` and `to` (stall).
[[nodiscard]] SimTime compute_stall(const Simulator& sim, StreamId compute, SimTime from,
                                    SimTime to);
/// Thousandths of copy time that overlapped kernel time.
[[nodiscard]] std::int64_t copy_overlap_permille(const Simulator& sim);

}  // namespace ferry::sim
