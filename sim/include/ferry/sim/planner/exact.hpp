#pragma once
/// The planner's exact stage (Note [Layer options] in exact.cpp): per class of alike layers, a
/// Pareto set of layer options measured by the cost model, and the choice of one option per
/// layer that is optimal under the additive model those measurements make.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "ferry/sim/planner/search.hpp"

namespace ferry::sim::planning {

/// One option of a layer, as measured against the plan that keeps everything: the step time
/// it adds, the peak reserved bytes it frees and the pinned bytes it moves to the host.
struct LayerOption {
  LayerConfig config;
  std::int64_t time_ns = 0;
  std::int64_t freed = 0;
  std::int64_t moved = 0;
  friend bool operator==(const LayerOption&, const LayerOption&) = default;
};

/// The choice the exact stage solves (Note [The option model]): one option per layer, freeing
/// at least `need` bytes in all, moving at most `host` bytes (unset: no limit); the bytes moved
/// beyond `link` (what the device-to-host link carries during forward) cost their time at
/// `bandwidth` bytes per second.
struct OptionProblem {
  std::vector<std::vector<LayerOption>> options;  ///< per layer; none empty
  std::int64_t need = 0;
  std::int64_t link = 0;
  std::int64_t bandwidth = 1;
  std::optional<std::int64_t> host;
};

/// The units the model counts in (Note [The option model]): bytes freed are rounded down to
/// `memory` bytes, bytes moved up to `moved` bytes.
struct OptionUnits {
  std::int64_t memory = 1;
  std::int64_t moved = 1;
};

/// The units `problem` is solved in (Note [The option model]): the greatest common divisor of
/// the options' freed bytes when `need` is at most 4096 of it, else `need` in 512 memory units;
/// the most any choice moves in at most 32 moved units.
[[nodiscard]] OptionUnits units_of(const OptionProblem& problem);

/// What choosing option `picked[l]` for every layer l costs under the model in `units`: the
/// time added, link time included, or none when it frees too little or moves too much.
[[nodiscard]] std::optional<std::int64_t> option_cost(const OptionProblem& problem,
                                                      const OptionUnits& units,
                                                      const std::vector<std::size_t>& picked);

/// A choice of one option per layer and its cost (option_cost).
struct OptionChoice {
  std::vector<std::size_t> picked;
  std::int64_t cost_ns = 0;
};

/// The cheapest choice under the model in units_of(problem) (a dynamic program over the layers,
/// exact for that model), or none when no choice frees `need` within `host`.
[[nodiscard]] std::optional<OptionChoice> solve_options(const OptionProblem& problem);

/// Layers that are alike (the same ops, durations and bytes, levels and tails), as classes of
/// layer indices in the order of their first layer.
[[nodiscard]] std::vector<std::vector<std::size_t>> layer_classes(const PlanSpace& space);

/// The options of a layer the exact stage measures: every level, and every tail without a
/// level, each kept and, when `offload`, offloaded.
[[nodiscard]] std::vector<LayerConfig> options_of(const Layer& layer, bool offload);

/// The options no other one beats (none frees as much or more, moves as little or less and
/// adds as little time or less, with one of them strictly; of equal ones the first), and the
/// option that changes nothing.
[[nodiscard]] std::vector<LayerOption> pareto(std::vector<LayerOption> options);

/// The exact stage on `search` (Note [Layer options]): measures each class's options once,
/// on its middle layer with every other layer as in `from` (where the search ended; everything
/// kept when that did not complete), solves, and has the cost model judge the choice, freeing
/// more where the measured peak is over the budget; returns the fastest choice that fits, or
/// none.
[[nodiscard]] std::optional<Position> exact_stage(Search& search, const Position& from);

}  // namespace ferry::sim::planning
