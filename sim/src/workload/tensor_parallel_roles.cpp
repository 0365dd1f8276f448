#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "tensor_parallel_cut.hpp"

namespace ferry::sim::rank_cut_detail {

TensorParallelRoles::Reach TensorParallelRoles::reach(std::size_t i) const {
  Reach found;
  std::deque<std::uint32_t> queue(op(i).outputs.begin(), op(i).outputs.end());
  std::set<std::uint32_t> seen(queue.begin(), queue.end());
  while (!queue.empty()) {
    const std::uint32_t t = queue.front();
    queue.pop_front();
    if (branch_.contains(t)) found.branch = true;
    if (t == whole_.loss) found.loss = true;
    for (const std::size_t r : plan_.readers[t]) {
      if (plan_.weight[r]) {
        found.matmuls.insert(r);
        continue;
      }
      if (op(r).kind.family() == OpFamily::TopK) found.routes = true;
      for (const std::uint32_t out : op(r).outputs) {
        if (seen.insert(out).second) queue.push_back(out);
      }
    }
  }
  return found;
}

Status TensorParallelRoles::find_experts() {
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    if (!is_grouped_matmul_kind(op(i).kind)) continue;
    const std::int32_t layer = op(i).layer;
    if (!plan_.weight[i] || layer < 0 || !op(i).gemm.known()) {
      return refuse(
          "op \"{}\" is a grouped expert matmul outside the layers or without weights or a "
          "\"gemm\" shape",
          op(i).name);
    }
    plan_.role[i] = Role::Experts;
    if (plan_.moe_layers.contains(layer)) continue;
    // The first grouped matmul of the layer: its routed rows, and the op that gathers them.
    std::optional<std::uint32_t> rows;
    for (const std::uint32_t t : op(i).inputs) {
      if (is_activation(t) && (!rows || whole_.tensors[t].bytes > whole_.tensors[*rows].bytes))
        rows = t;
    }
    const std::int64_t dispatch = rows ? plan_.producer[base(*rows)] : -1;
    if (dispatch < 0 || op(static_cast<std::size_t>(dispatch)).layer != layer ||
        plan_.weight[static_cast<std::size_t>(dispatch)]) {
      return refuse("op \"{}\", a grouped expert matmul, reads no rows an op of its layer routes",
                    op(i).name);
    }
    const ModelOp& d = op(static_cast<std::size_t>(dispatch));
    std::optional<std::uint32_t> input;
    for (const std::uint32_t t : d.inputs) {
      if (!is_activation(t) || is_index(whole_.tensors[t].dtype)) continue;
      if (!input || whole_.tensors[t].bytes > whole_.tensors[*input].bytes) input = t;
    }
    if (!input) {
      return refuse("op \"{}\" routes the rows of op \"{}\" from no activation", d.name,
                    op(i).name);
    }
    plan_.role[static_cast<std::size_t>(dispatch)] = Role::Dispatch;
    plan_.moe_layers.emplace(layer, elements(*input));
    plan_.moe_inputs.insert(base(*input));
  }
  return Ok{};
}

void TensorParallelRoles::index_ops() {
  const std::size_t n = whole_.ops.size();
  plan_.weight.assign(n, std::nullopt);
  plan_.table.assign(n, std::nullopt);
  plan_.readers.assign(whole_.tensors.size(), {});
  plan_.producer.assign(whole_.tensors.size(), -1);
  plan_.role.assign(n, Role::Other);
  for (std::size_t i = 0; i < n; ++i) {
    for (const std::uint32_t t : op(i).inputs) plan_.readers[t].push_back(i);
    for (const std::uint32_t t : op(i).outputs) plan_.producer[t] = static_cast<std::int64_t>(i);
    if (!is_matmul_kind(op(i).kind)) continue;
    for (const std::uint32_t t : op(i).inputs) {
      if (is_param(t) &&
          (!plan_.weight[i] || whole_.tensors[t].bytes > whole_.tensors[*plan_.weight[i]].bytes)) {
        plan_.weight[i] = t;
      }
    }
  }
}

void TensorParallelRoles::find_branches() {
  const std::size_t n = whole_.ops.size();
  std::map<std::int32_t, std::uint32_t> output_of_layer;  // a layer's last op's first output
  for (std::size_t i = 0; i < n; ++i) {
    if (op(i).layer >= 0 && !op(i).outputs.empty()) output_of_layer[op(i).layer] = op(i).outputs[0];
  }
  std::set<std::uint32_t> stream;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int32_t layer = op(i).layer;
    if (layer < 0) continue;
    const ModelTensor& out = whole_.tensors[output_of_layer.at(layer)];
    for (const std::uint32_t t : op(i).inputs) {
      const std::int64_t p = plan_.producer[t];
      if (is_activation(t) && p >= 0 && op(static_cast<std::size_t>(p)).layer != layer &&
          whole_.tensors[t].bytes == out.bytes && whole_.tensors[t].dtype == out.dtype) {
        stream.insert(t);
      }
    }
    if (op(i).kind.family() != OpFamily::Add || op(i).outputs.empty()) continue;
    const bool on_stream =
        std::ranges::any_of(op(i).inputs, [&](std::uint32_t t) { return stream.contains(t); });
    if (!on_stream) continue;
    stream.insert(op(i).outputs[0]);
    for (const std::uint32_t t : op(i).inputs) {
      if (!stream.contains(t) && is_activation(t)) branch_.insert(t);
    }
  }
}

TensorParallelRoles::Reached TensorParallelRoles::find_rowwise() {
  const std::size_t n = whole_.ops.size();
  Reached reached{std::vector<std::set<std::size_t>>(n), std::vector<bool>(n, false)};
  for (std::size_t i = 0; i < n; ++i) {
    if (plan_.role[i] != Role::Other) continue;  // the experts and their dispatch
    if (op(i).kind.family() == OpFamily::Embedding) {
      // The table: its largest parameter (GPT's position table is read whole).
      for (const std::uint32_t t : op(i).inputs) {
        if (is_param(t) &&
            (!plan_.table[i] || whole_.tensors[t].bytes > whole_.tensors[*plan_.table[i]].bytes)) {
          plan_.table[i] = t;
        }
      }
      if (plan_.table[i]) plan_.role[i] = Role::Embedding;
      continue;
    }
    if (!plan_.weight[i]) continue;
    Reach found = reach(i);
    reached.matmuls[i] = std::move(found.matmuls);
    reached.loss[i] = found.loss;
    if (op(i).layer >= 0 && found.routes) {
      plan_.role[i] = Role::Replicated;  // a router: every rank scores every token
    } else if (op(i).layer >= 0 && found.branch) {
      plan_.role[i] = Role::Rowwise;
    }
  }
  return reached;
}

Status TensorParallelRoles::find_colwise(const Reached& reached) {
  bool layers = false;
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    if (!plan_.weight[i] || plan_.role[i] != Role::Other) continue;
    if (op(i).layer < 0) {
      plan_.role[i] = reached.loss[i] ? Role::Colwise : Role::Replicated;
      continue;
    }
    layers = true;
    const bool into_rowwise =
        !reached.matmuls[i].empty() && std::ranges::all_of(reached.matmuls[i], [&](std::size_t r) {
          return plan_.role[r] == Role::Rowwise;
        });
    plan_.role[i] = into_rowwise ? Role::Colwise : Role::Replicated;
  }
  if (!layers || branch_.empty()) {
    return refuse(
        "tensor parallelism cuts the projections of transformer layers, and model "
        "\"{}\" has no layer whose projections add to a residual stream",
        whole_.name);
  }
  return Ok{};
}

Status TensorParallelRoles::find_roles() {
  index_ops();
  find_branches();  // the residual stream of each layer, and the branch outputs added to it
  FERRY_JSON_RETURN_IF_ERROR(find_experts());
  // Roles, first rowwise and the routers (colwise depends on them).
  const Reached reached = find_rowwise();
  FERRY_JSON_RETURN_IF_ERROR(find_colwise(reached));
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    if (plan_.role[i] != Role::Embedding) continue;
    for (const std::uint32_t t : op(i).inputs) {
      if (!is_param(t) && whole_.tensors[t].role == TensorRole::Input) plan_.tokens = elements(t);
    }
  }
  return Ok{};
}

// Attention splits by heads: each rank's share of the query and of the key/value heads must be
// whole. A fused attention kernel's log-sum-exp holds one float per head and token, its output
// head size values per head and token, and its key that many per key/value head and token.
Status TensorParallelRoles::check_heads() const {
  if (plan_.tokens <= 0) return Ok{};
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    const ModelOp& o = op(i);
    if (!is_fused_attention_kind(o.kind) || o.inputs.size() < 3 || o.outputs.size() < 2) continue;
    const std::int64_t lse = elements(o.outputs[1]);
    const std::int64_t values = elements(o.outputs[0]);
    if (whole_.tensors[o.outputs[1]].dtype != DType::F32 || lse <= 0 || lse % plan_.tokens != 0 ||
        values % lse != 0) {
      continue;
    }
    const std::int64_t heads = lse / plan_.tokens;
    const std::int64_t head_size = values / lse;
    const std::int64_t kv = elements(o.inputs[1]) / (plan_.tokens * head_size);
    if (heads % tp_ != 0) {
      return refuse("{} attention heads (op \"{}\") do not split among {} ranks", heads, o.name,
                    tp_);
    }
    if (kv > 0 && kv % tp_ != 0) {
      return refuse("{} key/value heads (op \"{}\") do not split among {} ranks", kv, o.name, tp_);
    }
  }
  return Ok{};
}

Result<TensorParallelPlan> TensorParallelRoles::run() {
  FERRY_JSON_RETURN_IF_ERROR(find_roles());
  FERRY_JSON_RETURN_IF_ERROR(check_heads());
  return std::move(plan_);
}

}  // namespace ferry::sim::rank_cut_detail
