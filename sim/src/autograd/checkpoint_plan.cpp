#include "ferry/sim/autograd/checkpoint_plan.hpp"

#include <algorithm>
#include <map>
#include <string>

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
  for (std::uint32_t start = 0;
       start + size < n && plan.regions.size() + 1 < static_cast<std::size_t>(segments);
       start += size) {
    plan.regions.push_back(CheckpointRegion{start, start + size, reentrant, std::nullopt});
  }
  return plan;  // the last segment runs without checkpointing
}

void apply_selective_policy(CheckpointPlan& plan, const Model& model) {
  plan.op_policy.assign(model.ops.size(), OpPolicy::MustSave);
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const std::string& name = model.ops[i].name;
    for (const char* core : {"qk", "score", "softmax", "attn_dropout", "attn_v", "attention"}) {
      if (name.find(core) != std::string::npos) plan.op_policy[i] = OpPolicy::PreferRecompute;
    }
  }
}

void apply_op_sac_policy(CheckpointPlan& plan, const Model& model) {
  plan.op_policy.assign(model.ops.size(), OpPolicy::PreferRecompute);
  std::map<std::int32_t, std::int32_t> matmuls;  // by layer: the count so far
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const ModelOp& op = model.ops[i];
    if (op.layer < 0) {
      plan.op_policy[i] = OpPolicy::MustSave;  // outside the regions
      continue;
    }
    const std::string& name = op.name;
    const bool attention = name.find("attn") != std::string::npos ||
                           name.find("attention") != std::string::npos ||
                           name.find("scaled_dot_product") != std::string::npos;
    std::int64_t elements = 0;
    for (const std::uint32_t t : op.outputs) {
      const ModelTensor& out = model.tensors[t];
      if (out.view_of < 0) elements += out.bytes.count() / dtype_size(out.dtype);
    }
    const bool matmul = !attention && elements > 0 && op.flops >= 64 * elements;
    if (attention && name.find("dropout") == std::string::npos) {
      plan.op_policy[i] = OpPolicy::MustSave;
    } else if (matmul && ++matmuls[op.layer] % 2 == 1) {
      plan.op_policy[i] = OpPolicy::MustSave;
    }
  }
}

}  // namespace ferry::sim
