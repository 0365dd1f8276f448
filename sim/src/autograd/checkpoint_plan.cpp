#include "ferry/sim/autograd/checkpoint_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace ferry::sim {

CheckpointPlan checkpoint_every(const Model& model, std::int32_t k) {
  CheckpointPlan plan;
  if (k <= 0) return plan;
  std::int32_t current = -1;
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    const std::int32_t layer = model.ops[i].layer;
    if (layer < 0) continue;
    const std::int32_t group = layer / k;
    if (group != current || plan.regions.empty() || plan.regions.back().end_op != i) {
      plan.regions.push_back(CheckpointRegion{i, i + 1, false, std::nullopt});
      current = group;
    } else {
      plan.regions.back().end_op = i + 1;
    }
  }
  return plan;
}

CheckpointPlan checkpoint_segments(const Model& model, std::int32_t segments, bool reentrant) {
  CheckpointPlan plan;
  const auto n = static_cast<std::uint32_t>(model.ops.size());
  if (segments <= 1 || n < 2) return plan;
  const std::uint32_t size = std::max<std::uint32_t>(1, n / static_cast<std::uint32_t>(segments));
  std::uint32_t start = 0;
  while (start + size < n && plan.regions.size() + 1 < static_cast<std::size_t>(segments)) {
    std::uint32_t end = start + size;
    // A reentrant segment returns its last op's output, as checkpoint_sequential's segment
    // returns its last module's: a segment ends at an op that produces a tensor (in a traced
    // model, a view is metadata of its base and produces none).
    while (reentrant && end < n && model.ops[end - 1].outputs.empty()) ++end;
    if (end >= n) break;
    plan.regions.push_back(CheckpointRegion{start, end, reentrant, std::nullopt});
    start = end;
  }
  return plan;  // the last segment runs without checkpointing
}

namespace {

// Note [Ops by what they are]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The selective policies pick ops by the operator each runs (ModelOp::kind, "aten.mm.default"),
// never by its name: a traced model names ops after module paths, and "attn" in a path says
// nothing about which of the module's ops is the attention kernel (a trace of a Hugging Face
// `self_attn` also lists its projections, rotary products and views; `post_attention_layernorm`
// its float32 norm). docs/checkpoint.md describes both policies.

// The ops torchtitan's op-level selective AC saves: `_get_default_save_ops` in
// torchtitan/distributed/activation_checkpoint.py (pytorch/torchtitan, commit b5bcd76), which
// is torch's compute-intensive operators (torch._functorch.partitioners.get_default_op_list()
// in torch 2.11), the other SDPA kernels, `max` (the amax of float8 scaling), flex attention,
// `linear`, `topk` (MoE routing), and the collectives and expert-parallel exchanges. These
// stay exact overloads, not families (Note [Operator families] in op_family.cpp): torchtitan's
// policy compares each op with these OpOverload objects, so `aten.mm.out` is not saved.
constexpr std::array<std::string_view, 26> kOpSacSaved{
    // torch's compute_intensive_ops
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_mm.default",
    "aten.convolution.default",
    "aten.convolution_backward.default",
    "aten.upsample_bilinear2d.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    // torchtitan's own additions
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten.max.default",
    "higher_order.flex_attention",
    "aten.linear.default",
    "aten.topk.default",
    "higher_order.inductor_compiled_code",
    "torch_attn._varlen_attn.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "deepep.dispatch.default",
    "deepep.combine.default",
    "hybridep.dispatch.default",
    "hybridep.combine.default",
};

/// The matmuls torchtitan counts: of these it saves the first, third, fifth... of a block.
constexpr std::array<std::string_view, 2> kOpSacAlternating{"aten.mm.default",
                                                            "aten.linear.default"};

bool listed(std::string_view kind, std::span<const std::string_view> list) {
  return !kind.empty() && std::find(list.begin(), list.end(), kind) != list.end();
}

// An attention core is found by the ops' families (Note [Operator families] in op_family.cpp):
// attention in one kernel (OpFamilyTraits::fused_attention), or eager attention's batched
// matmuls (OpFamily::BatchedMatmul: the scores and the scores times the values) around a softmax
// as autograd records it (OpFamily::Softmax: `softmax` and `F.scaled_dot_product_attention`'s
// math path).

}  // namespace

bool op_sac_alternates(std::string_view kind) { return listed(kind, kOpSacAlternating); }

std::vector<OpSpan> attention_cores(const Model& model) {
  // A fused attention kernel, or in eager attention the ops from the batched matmul before a
  // softmax (the scores) to the one after it (times the values), with what lies between
  // (scaling, the mask, the softmax, its dropout), within one run of ops of one layer.
  std::vector<OpSpan> cores;
  const auto n = static_cast<std::uint32_t>(model.ops.size());
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::int32_t layer = model.ops[i].layer;
    if (layer >= 0 && is_fused_attention_kind(model.ops[i].kind)) {
      // The collective right before it that gathers its K and V (context parallelism: Note [A
      // context-parallel rank] in context_parallel_cut.cpp) is part of the core: recomputing the
      // kernel gathers them again, as torch's ring attention does.
      const ModelOp& before = model.ops[i > 0 ? i - 1 : i];
      const bool gathers =
          i > 0 && before.collective.any() && before.layer == layer &&
          std::ranges::all_of(before.outputs, [&](std::uint32_t t) {
            return std::ranges::find(model.ops[i].inputs, t) != model.ops[i].inputs.end();
          });
      cores.push_back({gathers ? i - 1 : i, i + 1});
    }
    if (layer < 0 || model.ops[i].kind.family() != OpFamily::Softmax) continue;
    std::optional<std::uint32_t> first;
    for (std::uint32_t j = i; j-- > 0 && model.ops[j].layer == layer;) {
      if (model.ops[j].kind.family() == OpFamily::BatchedMatmul) {
        first = j;
        break;
      }
    }
    std::optional<std::uint32_t> last;
    for (std::uint32_t j = i + 1; j < n && model.ops[j].layer == layer; ++j) {
      if (model.ops[j].kind.family() == OpFamily::BatchedMatmul) {
        last = j;
        break;
      }
    }
    if (!first || !last) continue;
    cores.push_back({*first, *last + 1});
  }
  // In op order, and a core inside one found already (two softmaxes in one) adds nothing.
  std::sort(cores.begin(), cores.end(),
            [](const OpSpan& a, const OpSpan& b) { return a.first_op < b.first_op; });
  std::vector<OpSpan> disjoint;
  for (const OpSpan& core : cores) {
    if (!disjoint.empty() && core.first_op < disjoint.back().end_op) {
      disjoint.back().end_op = std::max(disjoint.back().end_op, core.end_op);
    } else {
      disjoint.push_back(core);
    }
  }
  return disjoint;
}

void apply_selective_policy(CheckpointPlan& plan, const Model& model) {
  plan.op_policy.assign(model.ops.size(), OpPolicy::MustSave);
  for (const OpSpan& core : attention_cores(model)) {
    for (std::uint32_t j = core.first_op; j < core.end_op; ++j) {
      plan.op_policy[j] = OpPolicy::PreferRecompute;
    }
  }
}

CheckpointPlan checkpoint_attention_cores(const Model& model) {
  CheckpointPlan plan;
  for (const OpSpan& core : attention_cores(model)) {
    plan.regions.push_back(CheckpointRegion{core.first_op, core.end_op, false, std::nullopt});
  }
  return plan;
}

// Note [What a compiled graph keeps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Eager selective checkpointing caches the outputs of every op its policy saves, whether or
// not backward reads them. A compiled step's partitioner (torchtitan's graph trainer) saves a
// tagged node only where the backward graph needs it: as a tensor some op's backward reads, or
// as an input of an op the backward recomputes. So an op on the save list whose outputs only
// other saved ops read is neither kept nor recomputed. Under tensor parallelism that is a
// rowwise projection: its whole partial sum is read only by the reduce-scatter, which is on
// the list, so only the scattered tensor is kept. drop_unread_saves finds such ops: the tensors
// backward needs are what the ops of the (non-reentrant) regions save and what their
// recomputed ops read (every one a replay may run), over all regions at once so that nested
// ones agree; a saved op none of whose outputs (or their bases) is among them is Dropped.

void drop_unread_saves(CheckpointPlan& plan, const Model& model) {
  const auto base = [&](std::uint32_t t) {
    const std::int32_t of = model.tensors[t].view_of;
    return of >= 0 ? static_cast<std::uint32_t>(of) : t;
  };
  const auto policy = [&](std::uint32_t i) {
    return i < plan.op_policy.size() ? plan.op_policy[i] : OpPolicy::PreferRecompute;
  };
  std::vector<bool> needed(model.tensors.size(), false);
  std::vector<bool> droppable(model.ops.size(), false);
  for (const CheckpointRegion& region : plan.regions) {
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
      const ModelOp& op = model.ops[i];
      for (const std::uint32_t t : op.saved) needed[base(t)] = true;
      if (policy(i) == OpPolicy::PreferRecompute || region.reentrant) {
        for (const std::uint32_t t : op.inputs) needed[base(t)] = true;
      }
      droppable[i] = !region.reentrant && policy(i) == OpPolicy::MustSave;
    }
  }
  for (const CheckpointRegion& region : plan.regions) {
    if (region.reentrant) continue;
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
      const ModelOp& op = model.ops[i];
      if (!droppable[i] || op.outputs.empty()) continue;
      const bool read =
          std::ranges::any_of(op.outputs, [&](std::uint32_t t) { return needed[base(t)]; });
      if (!read) plan.op_policy[i] = OpPolicy::Dropped;
    }
  }
}

Status apply_op_sac_policy(CheckpointPlan& plan, const Model& model, MatmulSaving matmuls_saved) {
  plan.op_policy.assign(model.ops.size(), OpPolicy::MustSave);  // outside the regions
  for (const CheckpointRegion& region : plan.regions) {
    std::int64_t matmuls = 0;  // torchtitan counts per checkpointed block
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
      const ModelOp& op = model.ops[i];
      if (op.kind.empty()) {
        return Error{fmt::format(
            "ops[{}] \"{}\": op-sac decides by the operator each op runs, and this op has no "
            "\"kind\"; trace the model again (python -m ferry trace records every op's "
            "operator) or add one (docs/model-format.md)",
            i, op.name)};
      }
      const bool saved = listed(op.kind, kOpSacSaved) &&
                         (matmuls_saved == MatmulSaving::Every ||
                          !listed(op.kind, kOpSacAlternating) || ++matmuls % 2 == 1);
      plan.op_policy[i] = saved ? OpPolicy::MustSave : OpPolicy::PreferRecompute;
    }
  }
  if (matmuls_saved == MatmulSaving::Every) drop_unread_saves(plan, model);
  return Ok{};
}

}  // namespace ferry::sim
