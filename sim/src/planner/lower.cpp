#include "ferry/sim/planner/lower.hpp"

#include <fmt/format.h>

#include <map>
#include <set>
#include <utility>

#include "ferry/plan/lower.hpp"
#include "tensors.hpp"

namespace ferry::sim {

using planning::base_of;
using planning::is_activation;

Plan keep_everything_plan(const Model& model, const DeviceProfile& device) {
  Plan plan;
  plan.model = model.name;
  plan.device = device.name;
  for (const ModelOp& op : model.ops) plan.ops.push_back(PlanOp{op.name, SavedDecision::Keep});
  return plan;
}

namespace {

// Note [Random ops in a replay]
// A region's replay starts from the generators' state at the region's start, and only the ops
// it re-runs draw from them; an op served from forward (kept or offloaded) draws nothing. So
// the random ops a replay re-runs must be the first ones of the region, in forward order, for
// each generator: re-running a later one while an earlier one is served from forward would
// hand it the earlier one's numbers, and the gradients would differ from plain training.

// Whether op `i` draws from generator `g` (0: the device's, 1: the CPU's).
bool draws(const Model& model, std::uint32_t i, int g) {
  return g == 0 ? model.ops[i].draws_rng : model.ops[i].draws_cpu_rng;
}

}  // namespace

Status check_random_ops(const Plan& plan, const Model& model) {
  for (std::size_t r = 0; r < plan.regions.size(); ++r) {
    const PlanRegion& region = plan.regions[r];
    for (int g = 0; g < 2; ++g) {
      std::int64_t served = -1;  // the first random op served from forward
      for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
        if (!draws(model, i, g)) continue;
        if (plan.ops[i].saved != SavedDecision::Recompute) {
          if (served < 0) served = i;
        } else if (served >= 0) {
          const auto j = static_cast<std::size_t>(served);
          return Error{fmt::format(
              "ops[{}].saved: op \"{}\" draws random numbers and is recomputed, but op \"{}\" "
              "(ops[{}]), which draws before it in regions[{}], is served from forward: the replay "
              "would hand it other numbers; recompute ops[{}] too, or save ops[{}]",
              i, plan.ops[i].name, plan.ops[j].name, j, r, j, i)};
        }
      }
    }
  }
  return Ok{};
}

void recompute_random_prefix(Plan& plan, const Model& model, const PlanRegion& region) {
  for (int g = 0; g < 2; ++g) {
    std::int64_t last = -1;  // the last recomputed random op
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
      if (draws(model, i, g) && plan.ops[i].saved == SavedDecision::Recompute) last = i;
    }
    for (std::int64_t i = region.first_op; i < last; ++i) {
      const auto op = static_cast<std::uint32_t>(i);
      if (draws(model, op, g)) plan.ops[op].saved = SavedDecision::Recompute;
    }
  }
}

void recompute_random_prefix(Plan& plan, const Model& model) {
  for (const PlanRegion& region : plan.regions) recompute_random_prefix(plan, model, region);
}

Result<TrainingOptions> plan_training_options(const Plan& plan, const Model& model,
                                              TrainingOptions base) {
  if (auto valid = validate_plan(plan); !valid) return valid.error();
  if (plan.ops.size() != model.ops.size()) {
    return Error{fmt::format("ops: the plan has {} ops, model \"{}\" has {}", plan.ops.size(),
                             model.name, model.ops.size())};
  }
  for (std::size_t i = 0; i < plan.ops.size(); ++i) {
    if (plan.ops[i].name != model.ops[i].name) {
      return Error{fmt::format("ops[{}].name: \"{}\", but op {} of model \"{}\" is \"{}\"", i,
                               plan.ops[i].name, i, model.name, model.ops[i].name)};
    }
  }
  if (auto random = check_random_ops(plan, model); !random) return random.error();
  TrainingOptions o = std::move(base);
  if (plan.paged_stash) o.paged_stash.on = true;
  o.offload = plan_offload_options(plan, o.offload);
  o.checkpoint = CheckpointPlan{};
  o.checkpoint.op_policy.assign(model.ops.size(), OpPolicy::MustSave);
  o.offload_selection.ops.assign(model.ops.size(), false);
  for (std::size_t i = 0; i < plan.ops.size(); ++i) {
    switch (plan.ops[i].saved) {
      case SavedDecision::Keep:
        break;
      case SavedDecision::Offload:
        o.checkpoint.op_policy[i] = OpPolicy::Offload;
        o.offload_selection.ops[i] = true;
        break;
      case SavedDecision::Recompute:
        o.checkpoint.op_policy[i] = OpPolicy::PreferRecompute;
        break;
    }
  }
  for (const PlanRegion& r : plan.regions) {
    o.checkpoint.regions.push_back(CheckpointRegion{r.first_op, r.end_op, false, std::nullopt});
    o.offload_selection.region_inputs.push_back(r.inputs == SavedDecision::Offload);
  }
  return o;
}

std::vector<LayerSummary> summarize_layers(const Plan& plan, const Model& model) {
  std::map<std::int32_t, LayerSummary> by_layer;
  std::vector<std::int32_t> region_of(model.ops.size(), -1);
  for (std::size_t r = 0; r < plan.regions.size(); ++r) {
    for (std::uint32_t i = plan.regions[r].first_op; i < plan.regions[r].end_op; ++i) {
      region_of[i] = static_cast<std::int32_t>(r);
    }
  }
  std::vector<std::int32_t> producer(model.tensors.size(), -1);
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    for (const std::uint32_t t : model.ops[i].outputs) {
      if (producer[t] < 0) producer[t] = static_cast<std::int32_t>(i);
    }
  }
  std::set<std::uint32_t> counted;
  for (std::uint32_t j = 0; j < model.ops.size(); ++j) {
    for (const std::uint32_t t : model.ops[j].saved) {
      if (!is_activation(model, t)) continue;
      const std::uint32_t b = base_of(model, t);
      if (!counted.insert(b).second) continue;
      const std::int32_t p = producer[b];
      const std::int32_t layer = p >= 0 ? model.ops[static_cast<std::size_t>(p)].layer : -1;
      SavedDecision d = plan.ops[j].saved;
      if (region_of[j] >= 0) {
        const PlanRegion& r = plan.regions[static_cast<std::size_t>(region_of[j])];
        const bool inside = p >= 0 && static_cast<std::uint32_t>(p) >= r.first_op &&
                            static_cast<std::uint32_t>(p) < r.end_op;
        d = inside ? plan.ops[static_cast<std::size_t>(p)].saved : r.inputs;
      }
      const Bytes bytes = model.tensors[b].bytes;
      if (d == SavedDecision::Offload && bytes < plan.knobs.min_bytes) d = SavedDecision::Keep;
      if (model.ops[j].no_offload && d == SavedDecision::Offload) d = SavedDecision::Keep;
      LayerSummary& s = by_layer[layer];
      s.layer = layer;
      (d == SavedDecision::Keep      ? s.kept
       : d == SavedDecision::Offload ? s.offloaded
                                     : s.recomputed) += bytes;
    }
  }
  std::vector<LayerSummary> out;
  out.reserve(by_layer.size());
  for (const auto& [layer, s] : by_layer) out.push_back(s);
  return out;
}

Result<RowResult> replay_plan(const Plan& plan, const CheckedModel& model,
                              const DeviceProfile& device, const TrainingOptions& base) {
  auto options = plan_training_options(plan, *model, base);
  if (!options) return options.error();
  return run_row(model, device, PolicyRow{"plan", std::move(options).value()});
}

}  // namespace ferry::sim
