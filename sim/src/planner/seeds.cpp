#include "ferry/sim/planner/seeds.hpp"

#include <algorithm>

#include "ferry/sim/planner/lower.hpp"
#include "ferry/sim/runs/configurations.hpp"

namespace ferry::sim::planning {

namespace {

// The knobs of a row's offload options.
PlanKnobs knobs_of(const OffloadOptions& o) {
  PlanKnobs k;
  k.min_bytes = o.min_bytes;
  k.window_bytes = o.window_bytes;
  k.prefetch_bytes = o.prefetch_bytes;
  k.prefetch = o.prefetch;
  k.horizon_bytes = o.horizon_bytes;
  return k;
}

// The row's per-op decisions and regions, as a plan over every op kept.
std::optional<Plan> plan_of_row(const PlanSpace& space, const TrainingOptions& o) {
  const bool ferry = o.offload.policy == Policy::Ferry;
  Plan plan = space.kept();
  plan.knobs = knobs_of(o.offload);
  const SavedDecision stored = ferry ? SavedDecision::Offload : SavedDecision::Keep;
  const auto& chosen = o.offload_selection.ops;
  for (std::size_t i = 0; i < plan.ops.size(); ++i) {
    const bool selected = i >= chosen.size() || chosen[i];
    plan.ops[i].saved = selected ? stored : SavedDecision::Keep;
  }
  const auto& policy = o.checkpoint.op_policy;
  for (std::size_t r = 0; r < o.checkpoint.regions.size(); ++r) {
    const CheckpointRegion& region = o.checkpoint.regions[r];
    if (region.reentrant || region.early_stop == false) return std::nullopt;
    const auto& inputs = o.offload_selection.region_inputs;
    const bool offload_inputs = ferry && (r >= inputs.size() || inputs[r]);
    plan.regions.push_back(
        PlanRegion{region.first_op, region.end_op,
                   offload_inputs ? SavedDecision::Offload : SavedDecision::Keep});
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
      const OpPolicy p = i < policy.size() ? policy[i] : OpPolicy::PreferRecompute;
      if (p == OpPolicy::Dropped) return std::nullopt;  // the plan space has no such decision
      plan.ops[i].saved = p == OpPolicy::PreferRecompute ? SavedDecision::Recompute
                          : p == OpPolicy::MustSave      ? SavedDecision::Keep
                                                         : SavedDecision::Offload;
    }
  }
  return plan;
}

// The plan as layer configurations, when it is one: each layer with no region or a full one.
std::optional<std::vector<LayerConfig>> configs_of(const PlanSpace& space, const Plan& plan) {
  const std::vector<Layer>& layers = space.layers();
  std::vector<LayerConfig> configs(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const Layer& layer = layers[l];
    const SavedDecision first = plan.ops[layer.first].saved;
    const auto region = std::find_if(
        plan.regions.begin(), plan.regions.end(),
        [&](const PlanRegion& r) { return r.first_op == layer.first && r.end_op == layer.end; });
    LayerConfig c;
    if (region != plan.regions.end()) {
      c.level = layer.levels.size() - 1;
      c.offload = region->inputs == SavedDecision::Offload;
    } else {
      c.offload = first == SavedDecision::Offload;
    }
    configs[l] = c;
  }
  const std::string key = key_of(plan);
  if (key_of(space.plan_of(configs, plan.knobs, std::nullopt, false)) == key ||
      key_of(space.plan_of(configs, plan.knobs, std::nullopt, true)) == key) {
    return configs;
  }
  return std::nullopt;
}

}  // namespace

std::optional<Seed> seed_of(const PlanSpace& space, const TrainingOptions& options,
                            CostModel& cost) {
  if (is_trl(options.offload.policy)) return std::nullopt;
  std::optional<Plan> plan = plan_of_row(space, options);
  if (!plan || !cost.admits(*plan, space.model())) {
    return std::nullopt;
  }
  // A plan's region is applied by checkpointing a module's call (ferry.offload(plan=...)), and
  // the calls the plan space knows are its layers: a row whose regions are not whole layers
  // (`checkpoint selective`'s attention cores, which run inside an attention module's call
  // with its projections) is compared with the plan but does not seed it.
  const std::vector<Layer>& layers = space.layers();
  for (const PlanRegion& region : plan->regions) {
    const bool whole =
        std::any_of(layers.begin(), layers.end(),
                    [&](const Layer& layer) { return layer.first == region.first_op; }) &&
        std::any_of(layers.begin(), layers.end(),
                    [&](const Layer& layer) { return layer.end == region.end_op; });
    if (!whole) return std::nullopt;
  }
  Seed seed;
  seed.configs = configs_of(space, *plan);
  seed.plan = std::move(*plan);
  return seed;
}

std::vector<PlanKnobs> knob_variants() {
  std::vector<PlanKnobs> out;
  for (const KnobVariant& variant : ferry_knob_variants()) {
    OffloadOptions o;
    variant.apply(o);
    out.push_back(knobs_of(o));
  }
  return out;
}

}  // namespace ferry::sim::planning
