#include "step_hooks.hpp"

#include "fsdp.hpp"

namespace ferry::sim::training {

std::unique_ptr<StepHooks> make_step_hooks(const Model& model, const Graph& graph,
                                           const TrainingOptions& options,
                                           const TrainingFaults& faults, RankContext& rank) {
  if (options.fsdp.on()) return std::make_unique<Fsdp2>(model, graph, options, faults, rank);
  return std::make_unique<StepHooks>();
}

}  // namespace ferry::sim::training
