#include "ferry/sim/planner/trainers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <limits>
#include <map>
#include <utility>

#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/report/row_fields.hpp"
#include "ferry/units.hpp"
#include "trainer_model.hpp"

namespace ferry::sim {

using trainer_model::kMegatronExpressed;
using trainer_model::kMegatronModules;
using trainer_model::layer_count;
using trainer_model::megatron_modules_of;
using trainer_model::python_list;

namespace {

using Json = nlohmann::ordered_json;

// Note [A trainer's settings as checkpoint plans]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each trainer setting is the checkpoint regions the trainer's own code makes, run by the
// simulated autograd as it runs any plan, with nothing offloaded but where Hugging Face's offload
// flag asks ferry to:
// * Hugging Face (transformers 5.23, `PreTrainedModel._set_gradient_checkpointing`): every
//   decoder layer whose index is a multiple of `every_n_layers` is one non-reentrant region
//   (torch's checkpoint with `use_reentrant=False`, early stop on: the Trainer's default
//   keywords). `activation_checkpointing_kwargs={"offload": True}` is in the space as ferry
//   runs it after `ferry.enable_gradient_checkpointing(model)` (real/python/ferry/compat/hf.py):
//   each checkpointed layer's call runs inside the model's `ferry.offload` session, made with
//   its default options, which offloads what the checkpoint keeps for its recomputation, the
//   layer's inputs, on ferry's copy stream (Note [Checkpoint inputs offloaded] in
//   real/python/ferry/_checkpoint.py). The simulator runs the same regions under ferry's policy
//   with OffloadOptions' defaults, which are the session's (no horizon: the session's
//   horizon_bytes is unset), and an OffloadSelection that offers the offloader the regions'
//   inputs alone: the saved tensors of the layers left unchecked and of the ops outside the
//   layers stay on the device, as the session is entered around checkpointed calls only.
//   transformers' own flag (torch's save_on_cpu around the checkpoint, its copies on the
//   compute stream, without ferry) is no simulated policy and stays out of the space.
// * torchtitan (0.3.0, `torchtitan/distributed/activation_checkpoint.py`): `FullAC` and
//   `SelectiveAC` wrap every block in torch's checkpoint_wrapper with `early_stop=False`;
//   `SelectiveAC` adds its op-level policy (apply_op_sac_policy).
// * Megatron-Core (0.19.2, `megatron/core/recompute.py`, `transformer_layer.py`, `attention.py`,
//   `moe/moe_layer.py`): every recompute goes through `tensor_parallel.checkpoint`, an
//   autograd Function that runs its function under no_grad and re-runs it in backward: the
//   reentrant variant. Full `uniform` makes one region per `recompute_num_layers` consecutive
//   layers, `block` one region for each of the first `recompute_num_layers` layers;
//   selective checkpoints modules of each layer: `core_attn` the attention core
//   (attention_cores), `mlp` a dense layer's MLP from the pre-MLP norm's output on (with
//   Transformer Engine's layer spec the norm is fused into `linear_fc1` and inside the MLP)
//   and `moe` a mixture-of-experts layer from its router on. Where a layer's MLP starts is
//   found by what its ops are: after the residual sum that reads the layer's input (the first
//   `add` whose input was made before the layer), to the layer's last op, the second residual
//   sum; of an MoE layer (one with a grouped matmul or a `topk`), from the first matmul there
//   (the router), the norm before it outside.
// What the simulator does not express is left out of the spaces, not approximated (docs/plan.md
// lists it).

// The ops [first, end) of each transformer layer, by layer.
std::map<std::int32_t, OpSpan> layer_spans(const Model& model) {
  std::map<std::int32_t, OpSpan> spans;
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    const std::int32_t layer = model.ops[i].layer;
    if (layer < 0) continue;
    auto [it, added] = spans.try_emplace(layer, OpSpan{i, i + 1});
    if (!added) it->second.end_op = i + 1;
  }
  return spans;
}

// A layer's MLP block and whether it is a mixture of experts (Note [A trainer's settings as
// checkpoint plans]).
struct MlpBlock {
  OpSpan span;
  bool moe = false;
};

class LayerBlocks {
 public:
  explicit LayerBlocks(const Model& model) : model_(model), producer_(model.tensors.size(), -1) {
    for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
      for (const std::uint32_t t : model.ops[i].outputs) {
        if (producer_[t] < 0) producer_[t] = static_cast<std::int64_t>(i);
      }
    }
  }

  // The MLP block of the layer whose ops are `layer`, if its residual sums are found.
  [[nodiscard]] std::optional<MlpBlock> mlp(const OpSpan& layer) const {
    const std::uint32_t last = layer.end_op - 1;
    if (model_.ops[last].kind.family() != OpFamily::Add) return std::nullopt;
    std::optional<std::uint32_t> residual;
    for (std::uint32_t i = layer.first_op; i < last && !residual; ++i) {
      if (model_.ops[i].kind.family() != OpFamily::Add) continue;
      for (const std::uint32_t t : model_.ops[i].inputs) {
        const std::int64_t by = producer_[base(t)];
        if (by >= 0 && by < static_cast<std::int64_t>(layer.first_op)) residual = i;
      }
    }
    if (!residual || *residual + 1 >= last) return std::nullopt;
    MlpBlock block{.span = {*residual + 1, last}};
    for (std::uint32_t i = block.span.first_op; i < last; ++i) {
      const OpFamily family = model_.ops[i].kind.family();
      if (family == OpFamily::GroupedMatmul || family == OpFamily::TopK) block.moe = true;
    }
    if (block.moe) {
      std::uint32_t first = block.span.first_op;
      while (first < last && !is_matmul_kind(model_.ops[first].kind)) ++first;
      if (first == last) return std::nullopt;
      block.span.first_op = first;
    }
    return block;
  }

 private:
  [[nodiscard]] std::uint32_t base(std::uint32_t t) const {
    const std::int32_t of = model_.tensors[t].view_of;
    return of >= 0 ? static_cast<std::uint32_t>(of) : t;
  }

  const Model& model_;
  std::vector<std::int64_t> producer_;
};

// torchtitan's `force_recompute_mm_shapes_by_fqns` (SelectiveAC's default ["moe.router.gate"],
// its MoE router): every mm or linear whose weight has a router's (in, out) shape is recomputed
// and left out of the every-other-mm count. A router is found by what it is, the first matmul of
// a mixture-of-experts block (LayerBlocks), its shape by its product's (k, n); the count of the
// region's other matmuls is then made again, as SelectiveAC's policy counts them.
void recompute_router_matmuls(CheckpointPlan& plan, const Model& model) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  const LayerBlocks blocks(model);
  for (const auto& [layer, span] : layer_spans(model)) {
    const auto block = blocks.mlp(span);
    if (!block || !block->moe) continue;
    const GemmShape& g = model.ops[block->span.first_op].gemm;
    if (g.known() && std::ranges::find(shapes, std::pair{g.k, g.n}) == shapes.end()) {
      shapes.emplace_back(g.k, g.n);
    }
  }
  if (shapes.empty()) return;
  for (const CheckpointRegion& region : plan.regions) {
    std::int64_t matmuls = 0;
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
      const ModelOp& op = model.ops[i];
      if (!op_sac_alternates(op.kind)) continue;
      const bool router =
          op.gemm.known() &&
          std::ranges::find(shapes, std::pair{op.gemm.k, op.gemm.n}) != shapes.end();
      plan.op_policy[i] =
          !router && ++matmuls % 2 == 1 ? OpPolicy::MustSave : OpPolicy::PreferRecompute;
    }
  }
}

CheckpointPlan regions_of_layers(const Model& model, auto&& checkpointed, bool reentrant,
                                 std::optional<bool> early_stop) {
  CheckpointPlan plan;
  for (const auto& [layer, span] : layer_spans(model)) {
    if (!checkpointed(layer)) continue;
    plan.regions.push_back(CheckpointRegion{span.first_op, span.end_op, reentrant, early_stop});
  }
  return plan;
}

}  // namespace

namespace trainer_model {

std::int32_t layer_count(const Model& model) {
  const auto spans = layer_spans(model);
  return spans.empty() ? 0 : spans.rbegin()->first + 1;
}

// Which of Megatron's expressed modules `model` has: core_attn where a layer has an attention
// core, mlp where a layer is dense, moe where one is a mixture of experts.
std::vector<std::string> megatron_modules_of(const Model& model) {
  bool dense = false;
  bool moe = false;
  const LayerBlocks blocks(model);
  for (const auto& [layer, span] : layer_spans(model)) {
    if (const auto block = blocks.mlp(span)) (block->moe ? moe : dense) = true;
  }
  std::vector<std::string> out;
  if (!attention_cores(model).empty()) out.emplace_back("core_attn");
  if (dense) out.emplace_back("mlp");
  if (moe) out.emplace_back("moe");
  return out;
}

}  // namespace trainer_model

std::string_view trainer_name(Trainer trainer) {
  switch (trainer) {
    case Trainer::Hf:
      return "hf";
    case Trainer::Torchtitan:
      return "torchtitan";
    case Trainer::Megatron:
      return "megatron";
  }
  return "hf";
}

Result<Trainer> parse_trainer(std::string_view name, std::string_view option) {
  for (const Trainer t : {Trainer::Hf, Trainer::Torchtitan, Trainer::Megatron}) {
    if (name == trainer_name(t)) return t;
  }
  return Error{fmt::format("{}: \"{}\" is not a trainer ferry knows: hf, torchtitan or megatron",
                           option, name)};
}

std::vector<TrainerSetting> trainer_space(Trainer trainer, const Model& model) {
  std::vector<TrainerSetting> space{TrainerSetting{.trainer = trainer}};
  const std::int32_t layers = layer_count(model);
  switch (trainer) {
    case Trainer::Hf:
      for (std::int32_t n = 1; n <= layers; ++n) {
        for (const bool offload : {false, true}) {
          space.push_back(
              {.trainer = trainer, .mode = "checkpoint", .layers = n, .offload = offload});
        }
      }
      break;
    case Trainer::Torchtitan:
      if (layers > 0) {
        space.push_back({.trainer = trainer, .mode = "full"});
        space.push_back({.trainer = trainer, .mode = "selective"});
      }
      break;
    case Trainer::Megatron: {
      for (const char* method : {"uniform", "block"}) {
        for (std::int32_t n = 1; n <= layers; ++n) {
          space.push_back({.trainer = trainer, .mode = "full", .method = method, .layers = n});
        }
      }
      // Every non-empty subset of the modules the model has, in Megatron's order.
      const std::vector<std::string> present = megatron_modules_of(model);
      for (std::uint32_t mask = 1; mask < (1U << present.size()); ++mask) {
        TrainerSetting s{.trainer = trainer, .mode = "selective"};
        for (std::size_t i = 0; i < present.size(); ++i) {
          if ((mask >> i) & 1U) s.modules.push_back(present[i]);
        }
        space.push_back(std::move(s));
      }
      break;
    }
  }
  return space;
}

Result<CheckpointPlan> trainer_checkpoint(const TrainerSetting& s, const Model& model) {
  if (s.mode == "none") return CheckpointPlan{};
  switch (s.trainer) {
    case Trainer::Hf: {
      const std::int32_t n = std::max(1, s.layers);
      return regions_of_layers(
          model, [n](std::int32_t layer) { return layer % n == 0; }, false, std::nullopt);
    }
    case Trainer::Torchtitan: {
      CheckpointPlan plan = regions_of_layers(
          model, [](std::int32_t) { return true; }, false, false);
      if (s.mode == "selective") {
        if (auto applied = apply_op_sac_policy(plan, model); !applied) return applied.error();
        recompute_router_matmuls(plan, model);
      }
      return plan;
    }
    case Trainer::Megatron:
      break;
  }
  if (s.mode == "full") {
    const std::int32_t n = std::max(1, s.layers);
    if (s.method == "uniform") {
      CheckpointPlan plan = checkpoint_every(model, n);
      for (CheckpointRegion& r : plan.regions) r.reentrant = true;
      return plan;
    }
    return regions_of_layers(
        model, [n](std::int32_t layer) { return layer < n; }, true, std::nullopt);
  }
  CheckpointPlan plan;
  const auto has = [&](std::string_view m) {
    return std::ranges::find(s.modules, m) != s.modules.end();
  };
  std::vector<OpSpan> spans;
  if (has("core_attn")) spans = attention_cores(model);
  if (has("mlp") || has("moe")) {
    const LayerBlocks blocks(model);
    for (const auto& [layer, span] : layer_spans(model)) {
      const auto block = blocks.mlp(span);
      if (block && has(block->moe ? "moe" : "mlp")) spans.push_back(block->span);
    }
  }
  if (spans.empty()) {
    return Error{fmt::format("recompute modules {}: model \"{}\" has none of them",
                             python_list(s.modules), model.name)};
  }
  std::ranges::sort(spans, {}, &OpSpan::first_op);
  for (const OpSpan& span : spans) {
    plan.regions.push_back(CheckpointRegion{span.first_op, span.end_op, true, std::nullopt});
  }
  return plan;
}

void trainer_offload(TrainingOptions& options, const TrainerSetting& s, const Model& model) {
  if (s.trainer != Trainer::Hf || s.mode == "none" || !s.offload) {
    options.offload.policy = Policy::None;
    return;
  }
  // `ferry.offload()` with its defaults (Note [A trainer's settings as checkpoint plans]).
  options.offload = OffloadOptions{};
  options.offload.policy = Policy::Ferry;
  options.offload.horizon_bytes = Bytes(std::numeric_limits<std::int64_t>::max());
  options.offload_selection.ops.assign(model.ops.size(), false);
  options.offload_selection.region_inputs.assign(options.checkpoint.regions.size(), true);
}

void trainer_grads(TrainingOptions& options, const TrainerSetting& setting) {
  if (setting.trainer == Trainer::Megatron) options.grads_set_to_none = false;
}

}  // namespace ferry::sim
