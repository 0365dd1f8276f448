#include "step_hooks.hpp"

#include <algorithm>

#include "fsdp.hpp"
#include "mesh_collectives.hpp"

namespace ferry::sim::training {

Status HookChain::validate() const {
  for (const auto& unit : units_) {
    if (auto valid = unit->validate(); !valid) return valid;
  }
  return Ok{};
}

bool HookChain::holds(const ModelTensor& tensor) const {
  return std::ranges::any_of(units_, [&](const auto& unit) { return unit->holds(tensor); });
}

void HookChain::setup(std::vector<Region>& writes, std::vector<std::uint64_t>& values) {
  for (const auto& unit : units_) unit->setup(writes, values);
}

void HookChain::before_op(std::uint32_t op) {
  for (const auto& unit : units_) unit->before_op(op);
}

void HookChain::after_op(std::uint32_t op) {
  for (auto unit = units_.rbegin(); unit != units_.rend(); ++unit) (*unit)->after_op(op);
}

void HookChain::before_replay(std::uint32_t op) {
  for (const auto& unit : units_) unit->before_replay(op);
}

void HookChain::backward_begin(const std::vector<std::uint32_t>& order) {
  for (const auto& unit : units_) unit->backward_begin(order);
}

void HookChain::before_node(std::uint32_t node) {
  for (const auto& unit : units_) unit->before_node(node);
}

void HookChain::after_node(std::size_t k, std::uint32_t node) {
  for (auto unit = units_.rbegin(); unit != units_.rend(); ++unit) (*unit)->after_node(k, node);
}

void HookChain::backward_end() {
  for (auto unit = units_.rbegin(); unit != units_.rend(); ++unit) (*unit)->backward_end();
}

void HookChain::optimizer_step() {
  for (auto unit = units_.rbegin(); unit != units_.rend(); ++unit) (*unit)->optimizer_step();
}

bool HookChain::launch(const Launch& launch) {
  return std::ranges::any_of(units_, [&](const auto& unit) { return unit->launch(launch); });
}

std::unique_ptr<StepHooks> make_step_hooks(const Model& model, const Graph& graph,
                                           const TrainingOptions& options,
                                           const TrainingFaults& faults, RankContext& rank) {
  std::vector<std::unique_ptr<StepHooks>> units;
  if (options.parallel.on())
    units.push_back(std::make_unique<Fsdp2>(model, graph, options, faults, rank));
  if (MeshCollectives::needed(model)) {
    units.push_back(std::make_unique<MeshCollectives>(model, faults, rank));
  }
  if (units.empty()) return std::make_unique<StepHooks>();
  if (units.size() == 1) return std::move(units.front());
  return std::make_unique<HookChain>(std::move(units));
}

}  // namespace ferry::sim::training
