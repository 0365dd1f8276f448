#include "ferry/sim/planner/space.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <utility>

#include "ferry/sim/planner/lower.hpp"
#include "tensors.hpp"

namespace ferry::sim::planning {

namespace {

// Whether an op of [first, end) names tensor `t` (a base) in its `list` (inputs or saved), as
// itself or through a view of it. A layer's ops list a few tensors each: a scan, not a set.
bool lists(const Model& model, std::uint32_t t, std::uint32_t first, std::uint32_t end,
           std::vector<std::uint32_t> ModelOp::*list) {
  for (std::uint32_t j = first; j < end; ++j) {
    for (const std::uint32_t u : model.ops[j].*list) {
      if (base_of(model, u) == t) return true;
    }
  }
  return false;
}

// Bytes a region over [first, end) holds for op `p` when it serves the op from forward: its
// outputs that ops of the region read or save (an output only later layers read, the layer's
// output, is the next region's input and held there anyway).
Bytes held_by(const Model& model, std::uint32_t p, std::uint32_t first, std::uint32_t end) {
  Bytes bytes;
  for (const std::uint32_t t : model.ops[p].outputs) {
    if (model.tensors[t].view_of < 0 && (lists(model, t, p + 1, end, &ModelOp::inputs) ||
                                         lists(model, t, first, end, &ModelOp::saved))) {
      bytes += model.tensors[t].bytes;
    }
  }
  return bytes;
}

// Orders `ops` by bytes per ns of forward time, most first (compared exactly); ties by order.
void rank(const Model& model, std::vector<std::pair<std::uint32_t, Bytes>>& scored) {
  std::stable_sort(scored.begin(), scored.end(), [&](const auto& a, const auto& b) {
    const Wide lhs = static_cast<Wide>(a.second.count()) *
                     std::max<std::int64_t>(1, model.ops[b.first].duration.ns());
    const Wide rhs = static_cast<Wide>(b.second.count()) *
                     std::max<std::int64_t>(1, model.ops[a.first].duration.ns());
    return lhs > rhs;
  });
}

// The most levels a layer has (Note [Planner search] in search.cpp).
constexpr std::size_t kMaxLevels = 16;

// What a layer's activations weigh: the distinct storages its ops save (what it holds without a
// region), and the activation storages it reads that it did not make (a region's inputs).
struct LayerBytes {
  std::int64_t saved = 0;
  std::int64_t inputs = 0;
};

LayerBytes layer_bytes(const Model& model, const Layer& layer) {
  std::set<std::uint32_t> saved;
  std::set<std::uint32_t> produced;
  std::set<std::uint32_t> inputs;
  for (std::uint32_t j = layer.first; j < layer.end; ++j) {
    for (const std::uint32_t t : model.ops[j].saved) {
      if (is_activation(model, t)) saved.insert(base_of(model, t));
    }
    for (const std::uint32_t t : model.ops[j].inputs) {
      const std::uint32_t b = base_of(model, t);
      if (is_activation(model, t) && !produced.contains(b)) inputs.insert(b);
    }
    for (const std::uint32_t t : model.ops[j].outputs) produced.insert(base_of(model, t));
  }
  LayerBytes bytes;
  for (const std::uint32_t t : saved) bytes.saved += model.tensors[t].bytes.count();
  for (const std::uint32_t t : inputs) bytes.inputs += model.tensors[t].bytes.count();
  return bytes;
}

// The levels of a layer (Note [Planner search] in search.cpp).
std::vector<std::size_t> levels_of(const Model& model, const Layer& layer) {
  // Without a region: the distinct activation storages its ops save. With a region at level
  // k: its inputs, and the outputs of the ops it serves from forward.
  const LayerBytes bytes = layer_bytes(model, layer);
  const std::int64_t without = bytes.saved;
  std::int64_t held = bytes.inputs;
  for (const std::uint32_t p : layer.ranking)
    held += held_by(model, p, layer.first, layer.end).count();
  // Every point below `without` where the held bytes fall; when there are more than
  // kMaxLevels of them, those at least 1/kMaxLevels of `without` below the last, and those
  // just before an op that takes at least 1/kMaxLevels of the layer's forward time (stopping
  // there spares its recompute: a mixture of experts' expert matmuls, after attention).
  std::int64_t forward_ns = 0;
  for (std::uint32_t i = layer.first; i < layer.end; ++i) forward_ns += model.ops[i].duration.ns();
  const auto before_costly = [&](std::size_t k) {
    return k < layer.ranking.size() &&
           model.ops[layer.ranking[k]].duration.ns() * static_cast<std::int64_t>(kMaxLevels) >=
               forward_ns;
  };
  std::vector<std::pair<std::size_t, std::int64_t>> falls;
  for (std::size_t k = 1; k < layer.ranking.size(); ++k) {
    const std::int64_t freed = held_by(model, layer.ranking[k - 1], layer.first, layer.end).count();
    held -= freed;
    if (freed > 0 && held < without) falls.emplace_back(k, held);
  }
  const std::int64_t step =
      falls.size() + 1 < kMaxLevels
          ? 1
          : std::max<std::int64_t>(1, without / static_cast<std::int64_t>(kMaxLevels));
  std::vector<std::size_t> levels{0};
  std::int64_t last = without;
  for (const auto& [k, h] : falls) {
    if (last - h < step && !before_costly(k)) continue;
    levels.push_back(k);
    last = h;
  }
  if (!layer.ranking.empty()) levels.push_back(layer.ranking.size());
  return levels;
}

// The most tails a layer offers besides none (Note [Layer options] in exact.cpp).
constexpr std::size_t kMaxTails = 6;

// Where a layer's tail may start (Note [Layer options] in exact.cpp): with the head [first, t)
// served from forward and the tail [t, end) recomputed, a region holds its inputs and what
// the head's ops hold; the starts are the latest t at which that is below what the layer
// saves without a region, and earlier ones each at least a kMaxTails-th of it lower, at most
// kMaxTails of them, none at `first` (that is plain checkpointing, the top level).
std::vector<std::uint32_t> tails_of(const Model& model, const Layer& layer) {
  std::vector<std::uint32_t> tails{layer.end};
  const LayerBytes bytes = layer_bytes(model, layer);
  const std::int64_t without = bytes.saved;
  const std::int64_t held_inputs = bytes.inputs;
  // held[t - first]: what the region holds with the head [first, t).
  std::vector<std::int64_t> held(layer.end - layer.first + 1, held_inputs);
  for (std::uint32_t p = layer.first; p < layer.end; ++p) {
    held[p - layer.first + 1] =
        held[p - layer.first] + held_by(model, p, layer.first, layer.end).count();
  }
  const std::int64_t step = std::max<std::int64_t>(1, without / std::int64_t{kMaxTails});
  std::int64_t last = without;
  for (std::uint32_t t = layer.end - 1; t > layer.first && tails.size() <= kMaxTails; --t) {
    const std::int64_t h = held[t - layer.first];
    if (h >= without || (tails.size() > 1 && last - h < step)) continue;
    tails.push_back(t);
    last = h;
  }
  return tails;
}

}  // namespace

Bytes freed_by(const Model& model, std::uint32_t p, std::uint32_t first, std::uint32_t end) {
  Bytes bytes;
  for (const std::uint32_t t : model.ops[p].outputs) {
    if (model.tensors[t].view_of < 0 && lists(model, t, first, end, &ModelOp::saved)) {
      bytes += model.tensors[t].bytes;
    }
  }
  return bytes;
}

std::uint32_t replay_end(const Model& model, std::uint32_t first, std::uint32_t end) {
  for (std::uint32_t i = end; i-- > first;) {
    const ModelOp& op = model.ops[i];
    if (op.saved.empty()) continue;
    return saved_before_running(op) == op.saved.size() ? i : i + 1;
  }
  return first;
}

std::vector<Layer> find_layers(const Model& model) {
  std::vector<Layer> layers;
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    const std::int32_t l = model.ops[i].layer;
    if (l < 0 || model.ops[i].no_offload) continue;
    if (layers.empty() || layers.back().layer != l || layers.back().end != i) {
      layers.push_back(Layer{l, i, i + 1, {}, {}, {}});
    } else {
      layers.back().end = i + 1;
    }
  }
  for (Layer& layer : layers) {
    // Note [What a replay never reaches ranks first]
    // The op a region's replay never reaches (it saves its inputs alone) frees what it saves at
    // no recompute: it ranks first. The ops after it save nothing: recomputing them frees
    // nothing saved, and serving them caches their outputs with the region (SAC's must-save),
    // the layer's output among them. So they are not ranked but follow the layer
    // (configure_layer): served and offloaded with an offloaded layer, whose output then leaves
    // with the layer's copies; recomputed, which costs nothing and caches nothing, with a kept
    // one. Recomputed at every level instead, an offloaded layer's output is left to the next
    // region's input pack (31 record-stream fallbacks against 1): on llama3-8b-s8192
    // (h100-sxm-pcie5) with every layer offloaded at one partial level, 1.8 GB more reserved at
    // the same step time, and at checkpointing's peak a plan of 1,006 ms against 905 ms.
    layer.replayed_end = replay_end(model, layer.first, layer.end);
    std::vector<std::pair<std::uint32_t, Bytes>> scored;
    for (std::uint32_t p = layer.first; p < layer.end; ++p) {
      if (p < layer.replayed_end) {
        scored.emplace_back(p, held_by(model, p, layer.first, layer.end));
      } else if (!model.ops[p].saved.empty()) {
        layer.ranking.push_back(p);
      }
    }
    rank(model, scored);
    for (const auto& [p, bytes] : scored) layer.ranking.push_back(p);
    layer.levels = levels_of(model, layer);
    layer.tails = tails_of(model, layer);
  }
  return layers;
}

namespace {

// The ops' decisions and the regions of `plan`, as key_of writes them.
std::string decisions_key(const Plan& plan) {
  std::string key;
  key.reserve(plan.ops.size() + 16 * plan.regions.size() + 64);
  for (const PlanOp& op : plan.ops)
    key.push_back(static_cast<char>('0' + static_cast<int>(op.saved)));
  for (const PlanRegion& r : plan.regions) {
    key += fmt::format("|{},{},{}", r.first_op, r.end_op, static_cast<int>(r.inputs));
  }
  return key;
}

}  // namespace

std::string key_of(const Plan& plan) {
  std::string key = decisions_key(plan);
  const PlanKnobs& k = plan.knobs;
  key += fmt::format("|{},{},{},{},{}", k.min_bytes.count(), k.window_bytes.count(),
                     k.prefetch_bytes.count(), k.prefetch ? 1 : 0,
                     k.horizon_bytes ? k.horizon_bytes->count() : -1);
  key += fmt::format("|{}", plan.host_budget ? plan.host_budget->count() : -1);
  return key;
}

// Note [Runs of plans that offload nothing]
// A plan that offloads nothing lowers to Policy::None (plan_offload_options), and under it the
// offloader keeps every saved tensor by rule (Tracker::stays) before any knob is read: no
// window, prefetch, minimum size or horizon decides anything, no copy stream is made, and the
// pinned pool, capped by the plan's pinned budget, is never drawn from. So such a plan's run
// is the same whatever its knobs and pinned budget, and the planner's cost model runs it once
// for all of them (a knob variant of a plan that offloads nothing, the seed of `ferry
// compare`'s "none" row and the search's plan of everything kept). The search still counts
// and keeps its plans by key_of.
std::string run_key_of(const Plan& plan) {
  return plan_offloads(plan) ? key_of(plan) : decisions_key(plan) + "|none";
}

PlanSpace::PlanSpace(const Model& model, const DeviceProfile& device)
    : model_(&model),
      kept_(keep_everything_plan(model, device)),
      d2h_bandwidth_(std::max<std::int64_t>(1, device.d2h.bandwidth.bytes_per_s())),
      layers_(find_layers(model)) {}

Plan PlanSpace::plan_of(const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
                        std::optional<Bytes> host_budget, bool offload_outside) const {
  Plan plan = kept_;
  plan.host_budget = host_budget;
  plan.knobs = knobs;
  if (offload_outside) {
    for (PlanOp& op : plan.ops) op.saved = SavedDecision::Offload;
  }
  for (std::size_t l = 0; l < layers_.size(); ++l) configure_layer(plan, l, configs[l]);
  recompute_random_prefix(plan, *model_);
  return plan;
}

bool PlanSpace::configure_layer(Plan& plan, std::size_t l, const LayerConfig& config) const {
  const Layer& layer = layers_[l];
  const SavedDecision stored = config.offload ? SavedDecision::Offload : SavedDecision::Keep;
  for (std::uint32_t i = layer.first; i < layer.end; ++i) plan.ops[i].saved = stored;
  const std::size_t k = layer.levels[config.level];
  const std::uint32_t tail = layer.tails[config.tail];
  if (k == 0 && tail == layer.end) return false;
  for (std::size_t r = 0; r < k; ++r) plan.ops[layer.ranking[r]].saved = SavedDecision::Recompute;
  for (std::uint32_t i = tail; i < layer.end; ++i) plan.ops[i].saved = SavedDecision::Recompute;
  // Note [What a replay never reaches ranks first]
  for (std::uint32_t i = layer.replayed_end; i < layer.end; ++i) {
    if (model_->ops[i].saved.empty()) {
      plan.ops[i].saved = config.offload ? SavedDecision::Offload : SavedDecision::Recompute;
    }
  }
  plan.regions.push_back(PlanRegion{layer.first, layer.end, stored});
  return true;
}

}  // namespace ferry::sim::planning
