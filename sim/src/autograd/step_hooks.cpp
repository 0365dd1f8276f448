#include "step_hooks.hpp"

#include "ddp.hpp"
#include "fsdp.hpp"
#include "mesh_collectives.hpp"
#include "paged_stash.hpp"

namespace ferry::sim::training {

template <typename Hook>
void HookChain::outer_to_inner(Hook&& hook) const {
  for (const auto& unit : wrappers_) hook(*unit);
  for (const auto& unit : followers_) hook(*unit);
}

template <typename Hook>
void HookChain::inner_to_outer(Hook&& hook) const {
  for (auto unit = wrappers_.rbegin(); unit != wrappers_.rend(); ++unit) hook(**unit);
  for (const auto& unit : followers_) hook(*unit);
}

Status HookChain::validate() const {
  Status valid = Ok{};
  outer_to_inner([&](const StepHooks& unit) {
    if (valid) valid = unit.validate();
  });
  return valid;
}

bool HookChain::holds(const ModelTensor& tensor) const {
  bool held = false;
  outer_to_inner([&](const StepHooks& unit) { held = held || unit.holds(tensor); });
  return held;
}

void HookChain::setup(std::vector<Region>& writes, std::vector<std::uint64_t>& values) {
  outer_to_inner([&](StepHooks& unit) { unit.setup(writes, values); });
}

void HookChain::reserve() {
  outer_to_inner([](StepHooks& unit) { unit.reserve(); });
}

void HookChain::step_begin() {
  outer_to_inner([](StepHooks& unit) { unit.step_begin(); });
}

void HookChain::before_op(std::uint32_t op) {
  outer_to_inner([&](StepHooks& unit) { unit.before_op(op); });
}

void HookChain::after_op(std::uint32_t op) {
  inner_to_outer([&](StepHooks& unit) { unit.after_op(op); });
}

void HookChain::before_replay(std::uint32_t op) {
  outer_to_inner([&](StepHooks& unit) { unit.before_replay(op); });
}

void HookChain::backward_begin(const std::vector<std::uint32_t>& order) {
  outer_to_inner([&](StepHooks& unit) { unit.backward_begin(order); });
}

void HookChain::before_node(std::uint32_t node) {
  outer_to_inner([&](StepHooks& unit) { unit.before_node(node); });
}

void HookChain::grad_ready(std::uint32_t p) {
  outer_to_inner([&](StepHooks& unit) { unit.grad_ready(p); });
}

void HookChain::after_node(std::size_t k, std::uint32_t node) {
  inner_to_outer([&](StepHooks& unit) { unit.after_node(k, node); });
}

void HookChain::backward_end() {
  inner_to_outer([](StepHooks& unit) { unit.backward_end(); });
}

void HookChain::optimizer_step() {
  inner_to_outer([](StepHooks& unit) { unit.optimizer_step(); });
}

bool HookChain::launch(const Launch& launch) {
  bool taken = false;
  outer_to_inner([&](StepHooks& unit) { taken = taken || unit.launch(launch); });
  return taken;
}

void HookChain::report(TrainingRun& run) const {
  inner_to_outer([&](const StepHooks& unit) { unit.report(run); });
}

std::unique_ptr<StepHooks> make_step_hooks(const Model& model, const Graph& graph,
                                           const TrainingOptions& options,
                                           const TrainingFaults& faults, RankContext& rank) {
  std::vector<std::unique_ptr<StepHooks>> wrappers;
  if (options.side.all_reduce)
    wrappers.push_back(std::make_unique<Ddp>(model, options, faults, rank));
  if (options.parallel.on())
    wrappers.push_back(std::make_unique<Fsdp2>(model, graph, options, faults.fsdp, rank));
  if (MeshCollectives::needed(model)) {
    wrappers.push_back(std::make_unique<MeshCollectives>(model, faults.collectives, rank));
  }
  std::vector<std::unique_ptr<StepHooks>> followers;
  if (options.paged_stash.on) {
    followers.push_back(std::make_unique<PagedStash>(model, options, faults.paged_stash, rank));
  }
  if (wrappers.empty() && followers.empty()) return std::make_unique<StepHooks>();
  if (wrappers.size() + followers.size() == 1)
    return std::move(wrappers.empty() ? followers.front() : wrappers.front());
  return std::make_unique<HookChain>(std::move(wrappers), std::move(followers));
}

}  // namespace ferry::sim::training
