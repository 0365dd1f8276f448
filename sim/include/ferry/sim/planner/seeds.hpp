#pragma once
/// Where the planner's search starts: the fixed configurations of `ferry compare` that a plan
/// can express (configurations.hpp), and the knob variants it tries on what it found.

#include <cstddef>
#include <optional>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/planner/cost_model.hpp"
#include "ferry/sim/planner/space.hpp"

namespace ferry::sim::planning {

/// A fixed configuration as a plan, and as per-layer configurations when every layer is at one
/// of its levels, with what it costs.
struct Seed {
  std::size_t row = 0;  ///< its row among default_rows
  Plan plan;
  std::optional<std::vector<LayerConfig>> configs;
  Evaluation evaluation;
};

/// `options` (a row of default_rows) as a seed, without its evaluation, when a plan can
/// express it: not trl, no reentrant region, no region without early stop, and `cost` admits
/// it (CostModel::admits, which keeps its lowering for the seed's runs).
[[nodiscard]] std::optional<Seed> seed_of(const PlanSpace& space, const TrainingOptions& options,
                                          CostModel& cost);

/// The knobs of the ferry knob variants (ferry_knob_variants), in their order.
[[nodiscard]] std::vector<PlanKnobs> knob_variants();

}  // namespace ferry::sim::planning
