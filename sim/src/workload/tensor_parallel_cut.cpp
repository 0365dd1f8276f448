#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "model_builder.hpp"
#include "rank_cut.hpp"

namespace ferry::sim {

// Note [A rank's model]
// ~~~~~~~~~~~~~~~~~~~~~
// Under tensor parallelism each rank runs a smaller program than the whole model: its slices
// of the projections, and the collectives DTensor inserts between them. tensor_parallel_model
// writes that program as a model, so that checkpointing, offloading, planning and the hazard
// checker treat a rank's collectives as the ops they are (Note [Collective ops] in model.cpp;
// Note [Mesh collectives] issues them). It cuts the model as torchtitan's plan for a decoder
// does (ColwiseParallel, RowwiseParallel, SequenceParallel, a vocabulary-parallel embedding and
// loss), and finds what each op is from the dataflow and the shapes:
//
//   * A weight matmul is a matrix product (is_matmul_kind) that reads a parameter (or a view of
//     one, as a trace's transposed weight): the weight is its largest parameter input, any
//     other one its bias; its activation operand is its activation input.
//   * A layer's residual stream is the activation its ops read that an op outside the layer
//     produced, of the size and type of the layer's output (so not a rotary table or a mask),
//     and each output of an `aten.add.Tensor` that reads a stream tensor. The add's other input
//     is a branch output: what attention or the MLP adds to the stream.
//   * A weight matmul in a layer is rowwise when its output reaches a branch output through
//     ops that are not weight matmuls (o_proj, down, GPT's proj through its dropout); colwise
//     when it reaches only rowwise matmuls' operands that way (q, k, v, gate, up); otherwise
//     replicated, every rank computing all of it.
//   * Outside the layers, an embedding of a parameter table is cut by vocabulary, and a weight
//     matmul whose output reaches the loss is the head, colwise; the ops from it to the loss
//     work on vocabulary slices, all but their per-token (or smaller) results, which the
//     vocabulary-parallel loss reduces across the ranks.
//
// Each activation then gets a layout in forward order: split by features (a colwise output and
// whatever is computed from it), a partial sum (a rowwise or embedding output, reduce-scattered
// at once), split by tokens (the residual stream, its norms and adds), or whole. A split tensor
// has 1/tp of the bytes (its views 1/tp of their offsets); a colwise product 1/tp of its n, a
// rowwise one of its k; an op with a split output 1/tp of its FLOPs and bytes; an op with a
// whole output (a replicated projection, the masks, the rotary tables) all of them, as on a
// real rank. Before a colwise or replicated matmul reads a tensor split by tokens, an
// all-gather makes it whole (backward: a reduce-scatter of its gradient); the matmul saves the
// gathered tensor, as DTensor code saves it. Not modelled yet: the all-reduce of the norms'
// weight gradients (h elements a norm) and the vocabulary-parallel loss's three all-reduces of
// per-token statistics, both a few hundred kilobytes; tensor parallelism without sequence
// parallelism; mixture-of-experts layers (refused). State no op reads (a trace's optimizer
// moments) is cut when its size is that of the cut parameters, not of one read whole.

namespace {

using rank_cut_detail::kAllGatherKind;
using rank_cut_detail::kReduceScatterKind;
using rank_cut_detail::RankCut;
using workload_detail::op_kind::kAdd;
using workload_detail::op_kind::kEmbedding;

constexpr std::string_view kTopk = "aten.topk.";  // the choice of experts, any overload

// Whether an op of `kind` that reads only partial sums writes one: it is linear in them (an add,
// a sum over a dimension, a copy or a change of dtype, a reshape).
bool keeps_sums(std::string_view kind) {
  constexpr std::array<std::string_view, 7> kLinear{
      kAdd,         "aten.sum.",          "aten._to_copy.", "aten.clone.",
      "aten.view.", "aten._unsafe_view.", "aten.reshape."};
  return std::ranges::any_of(kLinear,
                             [&](std::string_view linear) { return kind.starts_with(linear); });
}

// Whether a tensor of `type` holds indices (the routing's choices, offsets): an integer one.
bool is_index(DType type) { return type == DType::I64 || type == DType::U8; }

enum class Layout : std::uint8_t { Whole, Features, Partial, Tokens, Routed };
enum class Role : std::uint8_t {
  Other,
  Colwise,
  Rowwise,
  Replicated,
  Embedding,
  Dispatch,
  Experts
};

class TensorParallelCut : RankCut {
 public:
  TensorParallelCut(const Model& whole, std::int32_t tp) : RankCut(whole, "--tp", tp), tp_(tp) {}

  Result<Model> run() {
    FERRY_JSON_RETURN_IF_ERROR(find_roles());
    FERRY_JSON_RETURN_IF_ERROR(check_heads());
    return rewrite();
  }

 private:
  bool is_param(std::uint32_t t) const { return whole_.tensors[base(t)].role == TensorRole::Param; }
  bool is_activation(std::uint32_t t) const {
    return whole_.tensors[t].role == TensorRole::Activation;
  }
  std::int64_t elements(std::uint32_t t) const {
    return whole_.tensors[t].bytes.count() / dtype_size(whole_.tensors[t].dtype);
  }
  const ModelOp& op(std::size_t i) const { return whole_.ops[i]; }

  Status find_roles();
  Status check_heads() const;
  Result<Model> rewrite();
  // What reaches from op `i`'s outputs through ops other than weight matmuls: whether a branch
  // output, the loss or a choice of experts (a topk), and the weight matmuls whose operand it is.
  struct Reach {
    bool branch = false;
    bool loss = false;
    bool routes = false;
    std::set<std::size_t> matmuls;
  };
  Reach reach(std::size_t i) const;
  // The mixture-of-experts layers: their grouped matmuls' routed rows and what gathers them.
  Status find_experts();

  std::int32_t tp_;
  std::vector<std::optional<std::uint32_t>> weight_;  // by op: a weight matmul's weight
  std::vector<std::optional<std::uint32_t>> table_;   // by op: an embedding's table
  std::vector<std::vector<std::size_t>> readers_;     // by tensor: the ops reading it
  std::vector<std::int64_t> producer_;                // by tensor: its op, or -1
  std::set<std::uint32_t> branch_;                    // branch outputs (tensors)
  std::vector<Role> role_;                            // by op
  std::int64_t tokens_ = 0;                           // the embedding's token count
  // Mixture-of-experts layers -> the elements of their block's input (a token's features times
  // the tokens), and the bases of the block inputs, which the block reads whole.
  std::map<std::int32_t, std::int64_t> moe_layers_;
  std::set<std::uint32_t> moe_inputs_;
};

TensorParallelCut::Reach TensorParallelCut::reach(std::size_t i) const {
  Reach found;
  std::deque<std::uint32_t> queue(op(i).outputs.begin(), op(i).outputs.end());
  std::set<std::uint32_t> seen(queue.begin(), queue.end());
  while (!queue.empty()) {
    const std::uint32_t t = queue.front();
    queue.pop_front();
    if (branch_.contains(t)) found.branch = true;
    if (t == whole_.loss) found.loss = true;
    for (const std::size_t r : readers_[t]) {
      if (weight_[r]) {
        found.matmuls.insert(r);
        continue;
      }
      if (op(r).kind.starts_with(kTopk)) found.routes = true;
      for (const std::uint32_t out : op(r).outputs) {
        if (seen.insert(out).second) queue.push_back(out);
      }
    }
  }
  return found;
}

// Note [Tensor parallelism of a mixture of experts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchtitan cuts a mixture-of-experts block with its experts whole on every tensor-parallel
// rank (expert tensor parallel degree 1, the default): the block's input is all-gathered once
// (Shard(1) to Replicate), the router runs on every token on each rank (NoParallel), the shared
// experts are cut as a dense MLP, and each rank computes the routed rows of 1/tp of the tokens
// (ReordererSequenceParallel), expert parallelism exchanging them; the block's output is a
// partial sum, reduce-scattered once (Partial to Shard(1)). The cut finds the block by what it
// runs, never by names:
//
//   * a grouped matmul (is_grouped_matmul_kind) is the experts: its weights stay whole, it does
//     1/tp of its rows (gemm m, each expert's group_rows) and of its FLOPs;
//   * the op that produces its routed rows (the first grouped matmul's largest activation
//     input) is the dispatch: it reads the block's input (its largest floating input) whole,
//     gathered, and writes 1/tp of the rows; every op of the layer that reads the block's input
//     reads the one gathered tensor (the router, the shared experts);
//   * a weight matmul whose output reaches a topk (the choice of experts) is the router,
//     replicated;
//   * what is computed from routed rows is routed rows (1/tp of the bytes and work), until an
//     op turns them back into one row a token (the elements of the block's input) by summing
//     a token's picks or by indexing with an integer tensor: its output is a partial sum, whole;
//   * in such a layer a partial sum (the shared experts' down projection's too) stays one
//     through the linear ops that read only partial sums (keeps_sums: their add, a change of
//     dtype) and is reduce-scattered before the first other op that reads it (the residual
//     add; a norm would read it reduce-scattered too).
//
// Not modelled: the all-reduce of the router's weight gradient over the tensor-parallel ranks
// (a few kilobytes), and each rank's own counts of tokens per expert (the trace's offsets are
// read whole).

Status TensorParallelCut::find_experts() {
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    if (!is_grouped_matmul_kind(op(i).kind)) continue;
    const std::int32_t layer = op(i).layer;
    if (!weight_[i] || layer < 0 || !op(i).gemm.known()) {
      return refuse(
          "op \"{}\" is a grouped expert matmul outside the layers or without weights or a "
          "\"gemm\" shape",
          op(i).name);
    }
    role_[i] = Role::Experts;
    if (moe_layers_.contains(layer)) continue;
    // The first grouped matmul of the layer: its routed rows, and the op that gathers them.
    std::optional<std::uint32_t> rows;
    for (const std::uint32_t t : op(i).inputs) {
      if (is_activation(t) && (!rows || whole_.tensors[t].bytes > whole_.tensors[*rows].bytes))
        rows = t;
    }
    const std::int64_t dispatch = rows ? producer_[base(*rows)] : -1;
    if (dispatch < 0 || op(static_cast<std::size_t>(dispatch)).layer != layer ||
        weight_[static_cast<std::size_t>(dispatch)]) {
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
    role_[static_cast<std::size_t>(dispatch)] = Role::Dispatch;
    moe_layers_.emplace(layer, elements(*input));
    moe_inputs_.insert(base(*input));
  }
  return Ok{};
}

Status TensorParallelCut::find_roles() {
  const std::size_t n = whole_.ops.size();
  weight_.assign(n, std::nullopt);
  table_.assign(n, std::nullopt);
  readers_.assign(whole_.tensors.size(), {});
  producer_.assign(whole_.tensors.size(), -1);
  role_.assign(n, Role::Other);
  for (std::size_t i = 0; i < n; ++i) {
    for (const std::uint32_t t : op(i).inputs) readers_[t].push_back(i);
    for (const std::uint32_t t : op(i).outputs) producer_[t] = static_cast<std::int64_t>(i);
    if (!is_matmul_kind(op(i).kind)) continue;
    for (const std::uint32_t t : op(i).inputs) {
      if (is_param(t) &&
          (!weight_[i] || whole_.tensors[t].bytes > whole_.tensors[*weight_[i]].bytes)) {
        weight_[i] = t;
      }
    }
  }
  // The residual stream of each layer, and the branch outputs added to it.
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
      const std::int64_t p = producer_[t];
      if (is_activation(t) && p >= 0 && op(static_cast<std::size_t>(p)).layer != layer &&
          whole_.tensors[t].bytes == out.bytes && whole_.tensors[t].dtype == out.dtype) {
        stream.insert(t);
      }
    }
    if (op(i).kind != kAdd || op(i).outputs.empty()) continue;
    const bool on_stream =
        std::ranges::any_of(op(i).inputs, [&](std::uint32_t t) { return stream.contains(t); });
    if (!on_stream) continue;
    stream.insert(op(i).outputs[0]);
    for (const std::uint32_t t : op(i).inputs) {
      if (!stream.contains(t) && is_activation(t)) branch_.insert(t);
    }
  }
  FERRY_JSON_RETURN_IF_ERROR(find_experts());
  // Roles, first rowwise and the routers (colwise depends on them).
  std::vector<std::set<std::size_t>> reached(n);
  std::vector<bool> reaches_loss(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    if (role_[i] != Role::Other) continue;  // the experts and their dispatch
    if (op(i).kind.starts_with(kEmbedding)) {
      // The table: its largest parameter (GPT's position table is read whole).
      for (const std::uint32_t t : op(i).inputs) {
        if (is_param(t) &&
            (!table_[i] || whole_.tensors[t].bytes > whole_.tensors[*table_[i]].bytes)) {
          table_[i] = t;
        }
      }
      if (table_[i]) role_[i] = Role::Embedding;
      continue;
    }
    if (!weight_[i]) continue;
    Reach found = reach(i);
    reached[i] = std::move(found.matmuls);
    reaches_loss[i] = found.loss;
    if (op(i).layer >= 0 && found.routes) {
      role_[i] = Role::Replicated;  // a router: every rank scores every token
    } else if (op(i).layer >= 0 && found.branch) {
      role_[i] = Role::Rowwise;
    }
  }
  bool layers = false;
  for (std::size_t i = 0; i < n; ++i) {
    if (!weight_[i] || role_[i] != Role::Other) continue;
    if (op(i).layer < 0) {
      role_[i] = reaches_loss[i] ? Role::Colwise : Role::Replicated;
      continue;
    }
    layers = true;
    const bool into_rowwise =
        !reached[i].empty() &&
        std::ranges::all_of(reached[i], [&](std::size_t r) { return role_[r] == Role::Rowwise; });
    role_[i] = into_rowwise ? Role::Colwise : Role::Replicated;
  }
  if (!layers || branch_.empty()) {
    return refuse(
        "tensor parallelism cuts the projections of transformer layers, and model "
        "\"{}\" has no layer whose projections add to a residual stream",
        whole_.name);
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (role_[i] != Role::Embedding) continue;
    for (const std::uint32_t t : op(i).inputs) {
      if (!is_param(t) && whole_.tensors[t].role == TensorRole::Input) tokens_ = elements(t);
    }
  }
  return Ok{};
}

// Attention splits by heads: each rank's share of the query and of the key/value heads must be
// whole. A fused attention kernel's log-sum-exp holds one float per head and token, its output
// head size values per head and token, and its key that many per key/value head and token.
Status TensorParallelCut::check_heads() const {
  if (tokens_ <= 0) return Ok{};
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    const ModelOp& o = op(i);
    if (!is_fused_attention_kind(o.kind) || o.inputs.size() < 3 || o.outputs.size() < 2) continue;
    const std::int64_t lse = elements(o.outputs[1]);
    const std::int64_t values = elements(o.outputs[0]);
    if (whole_.tensors[o.outputs[1]].dtype != DType::F32 || lse <= 0 || lse % tokens_ != 0 ||
        values % lse != 0) {
      continue;
    }
    const std::int64_t heads = lse / tokens_;
    const std::int64_t head_size = values / lse;
    const std::int64_t kv = elements(o.inputs[1]) / (tokens_ * head_size);
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

Result<Model> TensorParallelCut::rewrite() {
  Model out = whole_;
  out.ops.clear();
  out.ops.reserve(whole_.ops.size() * 5 / 4 + 8);
  std::vector<Layout> layout(whole_.tensors.size(), Layout::Whole);
  std::vector<bool> assigned(whole_.tensors.size(), false);  // an op's output, with a layout
  // A view no op lists as an output (a trace's reshapes) is laid out as its base.
  const auto lay = [&](std::uint32_t t) {
    if (t < whole_.tensors.size() && !assigned[t] && whole_.tensors[t].view_of >= 0) {
      return layout[base(t)];
    }
    return layout[t];
  };
  std::vector<bool> cut_param(whole_.tensors.size(), false);    // a parameter cut by tp
  std::vector<bool> whole_param(whole_.tensors.size(), false);  // a parameter read whole
  std::vector<std::uint32_t> now(whole_.tensors.size());        // a partial sum's scattered tensor
  for (std::uint32_t t = 0; t < now.size(); ++t) now[t] = t;
  // Token-split bytes gathered once: the base, offset and size of a tensor (or of the views
  // of one region that a trace gives each projection) -> the gathered tensor.
  std::map<std::tuple<std::uint32_t, std::int64_t, std::int64_t>, std::uint32_t> gathered;

  // Tensor parallelism's collectives, inside one node.
  constexpr Exchange kGather{kAllGatherKind, CollectiveKind::AllGather,
                             CollectiveKind::ReduceScatter, MeshAxis::Tensor, 1};
  constexpr Exchange kScatter{kReduceScatterKind, CollectiveKind::ReduceScatter,
                              CollectiveKind::AllGather, MeshAxis::Tensor, 1};
  // The rewrite reads tensors of `out`, which holds the ones it adds after the whole model's.
  const auto activation = [&](std::uint32_t t) {
    return out.tensors[t].role == TensorRole::Activation;
  };
  const auto name_of = [&](std::uint32_t t) -> const std::string& { return out.tensors[t].name; };
  const auto new_tensor = [&](std::uint32_t like, std::string name, Layout l) {
    layout.push_back(l);
    assigned.push_back(true);
    return add_tensor(out, like, std::move(name));
  };
  // The partial sum `t` (or a view of all of it) as its tensor reduce-scattered over the
  // tokens, the reduce-scatter added once, named by the op that made the sum, in `near`'s layer.
  // Any other view of a partial sum is itself.
  const auto scatter = [&](std::uint32_t t, const ModelOp& near) {
    const ModelTensor& read = out.tensors[t];
    const std::uint32_t b = base_in(out, t);
    if (b != t && (read.view_offset.count() != 0 || read.bytes != out.tensors[b].bytes)) return t;
    if (b >= now.size() || producer_[b] < 0) return t;
    if (now[b] == b) {
      const std::uint32_t s = new_tensor(b, name_of(b) + "/tp.scattered", Layout::Tokens);
      const std::string& by = op(static_cast<std::size_t>(producer_[b])).name;
      out.ops.push_back(collective_op(by + "/tp.reduce_scatter", kScatter, {b}, {s}, near));
      now[b] = s;
    }
    return now[b];
  };

  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    ModelOp o = op(i);
    // A partial sum is read as its scattered tensor, and so is a view of all of it (a trace's
    // reshape of a projection's output).
    const auto current = [&](std::uint32_t t) {
      const std::uint32_t b = base(t);
      const ModelTensor& v = whole_.tensors[t];
      if (b != t && now[b] != b && v.view_offset.count() == 0 &&
          v.bytes == whole_.tensors[b].bytes) {
        return now[b];
      }
      return now[t];
    };
    for (std::uint32_t& t : o.inputs) t = current(t);
    for (std::uint32_t& t : o.saved) t = current(t);
    const Role role = role_[i];
    const auto moe = moe_layers_.find(o.layer);
    const bool in_moe = moe != moe_layers_.end();
    // In a mixture-of-experts layer a partial sum stays one through the linear ops that read
    // only partial sums, and is reduce-scattered before any other op reads it (Note [Tensor
    // parallelism of a mixture of experts]).
    const bool sums =
        in_moe && role == Role::Other && keeps_sums(o.kind) &&
        std::ranges::any_of(
            o.inputs,
            [&](std::uint32_t t) { return activation(t) && lay(t) == Layout::Partial; }) &&
        std::ranges::all_of(
            o.inputs, [&](std::uint32_t t) { return !activation(t) || lay(t) == Layout::Partial; });
    if (!sums) {
      for (std::uint32_t& t : o.inputs) {
        if (!activation(t) || lay(t) != Layout::Partial) continue;
        const std::uint32_t was = t;
        t = scatter(t, o);
        std::ranges::replace(o.saved, was, t);
      }
    }
    // A projection that reads its operand whole, or an op of a mixture of experts' block that
    // reads the block's input: gather a token-split operand first.
    const bool whole_operand =
        role == Role::Colwise || role == Role::Replicated || role == Role::Dispatch;
    if (whole_operand || in_moe) {
      for (std::uint32_t& t : o.inputs) {
        if (!activation(t) || lay(t) != Layout::Tokens) continue;
        const ModelTensor& read = out.tensors[t];
        const std::uint32_t b = base_in(out, t);
        if (!whole_operand && !moe_inputs_.contains(b)) continue;
        auto [at, fresh] =
            gathered.try_emplace({b, read.view_offset.count(), read.bytes.count()}, 0);
        if (fresh) {
          at->second = new_tensor(t, name_of(t) + "/tp.gathered", Layout::Whole);
          out.ops.push_back(
              collective_op(o.name + "/tp.all_gather", kGather, {t}, {at->second}, o));
        }
        const std::uint32_t g = at->second;
        std::ranges::replace(o.saved, t, g);
        t = g;
      }
    }
    Layout result = Layout::Whole;
    bool reduced = false;  // whole outputs of split inputs: the loss's reductions
    // 1/tp of the work
    bool scaled = role == Role::Colwise || role == Role::Rowwise || role == Role::Dispatch ||
                  role == Role::Experts;
    switch (role) {
      case Role::Colwise:
        result = Layout::Features;
        break;
      case Role::Dispatch:
      case Role::Experts:
        result = Layout::Routed;
        break;
      case Role::Rowwise:
      case Role::Embedding:
        result = Layout::Partial;
        break;
      case Role::Replicated:
        result = Layout::Whole;
        break;
      case Role::Other: {
        if (sums) {
          result = Layout::Partial;
          break;
        }
        bool features = false;
        bool tokens = false;
        bool routed = false;
        bool indexed = false;              // reads an integer tensor
        std::int64_t routed_elements = 0;  // the most a routed input holds
        for (const std::uint32_t t : o.inputs) {
          if (!activation(t)) continue;
          if (lay(t) == Layout::Partial) {
            return refuse("op \"{}\" reads \"{}\", a partial sum", o.name, name_of(t));
          }
          features |= lay(t) == Layout::Features;
          tokens |= lay(t) == Layout::Tokens;
          routed |= lay(t) == Layout::Routed;
          indexed |= is_index(out.tensors[t].dtype);
          if (lay(t) == Layout::Routed && t < whole_.tensors.size()) {
            routed_elements = std::max(routed_elements, elements(t));
          }
        }
        if (features && tokens) {
          return refuse("op \"{}\" reads tensors split by features and by tokens", o.name);
        }
        if (routed && (features || tokens)) {
          return refuse("op \"{}\" reads routed rows and tensors split by {}", o.name,
                        features ? "features" : "tokens");
        }
        if (routed) {
          // Routed rows back to one row a token: a partial sum of the block's output.
          const std::int64_t out_elements = o.outputs.empty() ? 0 : elements(o.outputs.front());
          const bool combines =
              in_moe && out_elements == moe->second && (indexed || routed_elements > out_elements);
          result = combines ? Layout::Partial : Layout::Routed;
          scaled = !combines;
          break;
        }
        result = features ? Layout::Features : tokens ? Layout::Tokens : Layout::Whole;
        reduced = features && o.layer < 0;
        scaled = features || tokens;
        break;
      }
    }
    if (role == Role::Experts) {
      for (const std::uint32_t t : o.inputs) {
        if (activation(t) && lay(t) != Layout::Whole && lay(t) != Layout::Routed) {
          return refuse("op \"{}\", a grouped expert matmul, reads \"{}\" split among the ranks",
                        o.name, name_of(t));
        }
      }
    }
    // A projection's operand: whole (gathered above) into a colwise or replicated one, split
    // by features into a rowwise one.
    if (role == Role::Colwise || role == Role::Replicated || role == Role::Rowwise) {
      const Layout want = role == Role::Rowwise ? Layout::Features : Layout::Whole;
      for (const std::uint32_t t : o.inputs) {
        if (activation(t) && lay(t) != want) {
          return refuse("op \"{}\", a {} projection, reads \"{}\" {}", o.name,
                        role == Role::Rowwise   ? "rowwise"
                        : role == Role::Colwise ? "colwise"
                                                : "replicated",
                        name_of(t), want == Layout::Whole ? "split among the ranks" : "whole");
        }
      }
    }
    // The weights: cut as the role says, or read whole. An op that makes nothing but views of a
    // parameter (a trace's transposed weight, listed with no outputs) reads nothing.
    const bool viewing = std::ranges::all_of(
        o.outputs, [&](std::uint32_t t) { return out.tensors[t].role == TensorRole::Param; });
    for (const std::uint32_t t : o.inputs) {
      if (t >= whole_.tensors.size() || !is_param(t) || viewing) continue;
      const bool cut = (role == Role::Embedding && t == *table_[i]) || role == Role::Colwise ||
                       (role == Role::Rowwise && t == *weight_[i]);
      (cut ? cut_param : whole_param)[t] = true;
      (cut ? cut_param : whole_param)[base(t)] = true;
    }
    // Outputs.
    for (const std::uint32_t t : o.outputs) {
      Layout l = result;
      if (reduced && (t == whole_.loss || (tokens_ > 0 && elements(t) <= tokens_)))
        l = Layout::Whole;
      if (t == whole_.loss) l = Layout::Whole;
      layout[t] = l;
      assigned[t] = true;
    }
    if (role == Role::Colwise || role == Role::Rowwise) {
      if (o.gemm.known()) {
        std::int64_t& dim = role == Role::Colwise ? o.gemm.n : o.gemm.k;
        if (dim % tp_ != 0) {
          return refuse("the {} features of op \"{}\" do not split among {} ranks", dim, o.name,
                        tp_);
        }
        dim /= tp_;
      }
    }
    if (role == Role::Experts) {
      // Each rank computes the routed rows of 1/tp of the tokens.
      if (o.gemm.m % tp_ != 0) {
        return refuse("the {} routed rows of op \"{}\" do not split among {} ranks", o.gemm.m,
                      o.name, tp_);
      }
      o.gemm.m /= tp_;
      for (std::int64_t& rows : o.group_rows) rows /= tp_;
    }
    if (role == Role::Other && scaled && o.gemm.known()) {
      // A product of activations split by features (attention's, over its heads) is split by
      // its batch.
      if (o.gemm.batch % tp_ != 0) {
        return refuse("the {} products of op \"{}\" do not split among {} ranks", o.gemm.batch,
                      o.name, tp_);
      }
      o.gemm.batch /= tp_;
    }
    if (scaled) {
      o.flops /= tp_;
      o.backward_flops /= tp_;
      o.bytes = Bytes(o.bytes.count() / tp_);
      o.backward_bytes = Bytes(o.backward_bytes.count() / tp_);
    }
    const ModelOp& kept = out.ops.emplace_back(std::move(o));
    // A partial sum is reduce-scattered over the tokens before anything reads it (in a mixture
    // of experts' layer, before anything but a sum of partial sums reads it). The whole model's
    // op stands for `kept` (same layer and region), which the new op's push may move.
    if (result == Layout::Partial && !in_moe) scatter(kept.outputs.front(), op(i));
  }
  // State held for the step that no op reads (an optimizer's moments, as a trace lists them)
  // belongs to a parameter of its size: cut with the parameters of that size, when no
  // parameter read whole has it.
  std::set<std::int64_t> cut_sizes;
  std::set<std::int64_t> whole_sizes;
  for (std::uint32_t t = 0; t < whole_.tensors.size(); ++t) {
    if (!is_param(t) || base(t) != t) continue;
    if (cut_param[t]) cut_sizes.insert(elements(t));
    if (whole_param[t]) whole_sizes.insert(elements(t));
  }
  const auto held_state = [&](std::uint32_t t) {
    return t < whole_.tensors.size() && whole_.tensors[t].role == TensorRole::Buffer &&
           whole_.tensors[t].view_of < 0 && readers_[t].empty() &&
           cut_sizes.contains(elements(t)) && !whole_sizes.contains(elements(t));
  };
  // Sizes: split tensors and cut parameters hold 1/tp of the bytes (views of the offsets).
  for (std::uint32_t t = 0; t < out.tensors.size(); ++t) {
    const std::uint32_t b = t < whole_.tensors.size() ? base(t) : t;
    bool cut = false;
    const auto split = [&](std::uint32_t u) {
      return lay(u) == Layout::Features || lay(u) == Layout::Tokens || lay(u) == Layout::Routed;
    };
    if (t < whole_.tensors.size() && is_param(t)) {
      if ((cut_param[t] || cut_param[b]) && (whole_param[t] || whole_param[b])) {
        return refuse("parameter \"{}\" is cut by one op and read whole by another",
                      whole_.tensors[b].name);
      }
      cut = cut_param[t] || cut_param[b];
    } else if (held_state(t)) {
      cut = true;
    } else {
      cut = split(t);
      if (b != t && split(b) != cut) {
        return refuse("view \"{}\" and its base \"{}\" are not split alike", whole_.tensors[t].name,
                      whole_.tensors[b].name);
      }
    }
    if (!cut) continue;
    ModelTensor& tensor = out.tensors[t];
    const std::int64_t size = dtype_size(tensor.dtype);
    const std::int64_t n = tensor.bytes.count() / size;
    if (n % tp_ != 0 || (tensor.view_offset.count() / size) % tp_ != 0) {
      return refuse("tensor \"{}\" of {} elements does not split among {} ranks", tensor.name, n,
                    tp_);
    }
    tensor.bytes = Bytes(tensor.bytes.count() / tp_);
    tensor.view_offset = Bytes(tensor.view_offset.count() / tp_);
  }
  return checked(std::move(out));
}

}  // namespace

Result<Model> tensor_parallel_model(const Model& whole, std::int32_t tp) {
  if (tp < 1) return Error{fmt::format("--tp {}: use 1 or more ranks", tp)};
  if (tp == 1) return whole;
  return TensorParallelCut(whole, tp).run();
}

}  // namespace ferry::sim
