#include "ferry/sim/workload/rank_model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/sim/json/json_reader.hpp"
#include "model_builder.hpp"

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

using workload_detail::op_kind::kAdd;
using workload_detail::op_kind::kEmbedding;

constexpr std::string_view kAllGatherKind = "_c10d_functional.all_gather_into_tensor.default";
constexpr std::string_view kReduceScatterKind = "_c10d_functional.reduce_scatter_tensor.default";
constexpr std::string_view kAllToAllKind = "_c10d_functional.all_to_all_single.default";
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

// What the cuts share: the whole model, and the flag and degree their errors name.
class RankCut {
 protected:
  RankCut(const Model& whole, std::string_view flag, std::int32_t degree)
      : m_(whole), flag_(flag), degree_(degree) {}

  // The tensor `t` of `model` is a view of, or `t`.
  static std::uint32_t base_in(const Model& model, std::uint32_t t) {
    const ModelTensor& tensor = model.tensors[t];
    return tensor.view_of >= 0 ? static_cast<std::uint32_t>(tensor.view_of) : t;
  }
  // The same in the whole model.
  std::uint32_t base(std::uint32_t t) const { return base_in(m_, t); }
  template <class... Args>
  Error refuse(fmt::format_string<Args...> format, Args&&... args) const {
    return Error{
        fmt::format("{} {}: {}", flag_, degree_, fmt::format(format, std::forward<Args>(args)...))};
  }

  // A tensor added to `out` with `like`'s size, type and role, a storage of its own.
  static std::uint32_t add_tensor(Model& out, std::uint32_t like, std::string name) {
    ModelTensor t = out.tensors[like];
    t.name = std::move(name);
    t.view_of = -1;
    t.view_offset = Bytes(0);
    out.tensors.push_back(std::move(t));
    return static_cast<std::uint32_t>(out.tensors.size() - 1);
  }
  // A collective op over `axis` that moves `inputs` into `outputs`, in `near`'s layer and
  // no-offload region (Note [Collective ops] in model.cpp).
  struct Exchange {
    std::string_view kind;  // the functional collective's operator
    CollectiveKind forward;
    CollectiveKind backward;
    MeshAxis axis;
    std::int32_t nodes;
  };
  ModelOp collective_op(std::string name, const Exchange& x, std::vector<std::uint32_t> inputs,
                        std::vector<std::uint32_t> outputs, const ModelOp& near) const {
    ModelOp c;
    c.name = std::move(name);
    c.kind = x.kind;
    c.layer = near.layer;
    c.no_offload = near.no_offload;
    c.inputs = std::move(inputs);
    c.outputs = std::move(outputs);
    c.collective.forward = x.forward;
    c.collective.backward = x.backward;
    c.collective.axis = x.axis;
    c.collective.ranks = degree_;
    c.collective.nodes = x.nodes;
    return c;
  }
  // `out`, or the refusal that says why the cut is not a valid model.
  Result<Model> checked(Model out) const {
    if (auto valid = validate_model(out); !valid) {
      return refuse("the cut model is not valid ({})", valid.error().message);
    }
    return out;
  }

  const Model& m_;

 private:
  std::string_view flag_;
  std::int32_t degree_;
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
  bool is_param(std::uint32_t t) const { return m_.tensors[base(t)].role == TensorRole::Param; }
  bool is_activation(std::uint32_t t) const { return m_.tensors[t].role == TensorRole::Activation; }
  std::int64_t elements(std::uint32_t t) const {
    return m_.tensors[t].bytes.count() / dtype_size(m_.tensors[t].dtype);
  }
  const ModelOp& op(std::size_t i) const { return m_.ops[i]; }

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
    if (t == m_.loss) found.loss = true;
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
  for (std::size_t i = 0; i < m_.ops.size(); ++i) {
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
      if (is_activation(t) && (!rows || m_.tensors[t].bytes > m_.tensors[*rows].bytes)) rows = t;
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
      if (!is_activation(t) || is_index(m_.tensors[t].dtype)) continue;
      if (!input || m_.tensors[t].bytes > m_.tensors[*input].bytes) input = t;
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
  const std::size_t n = m_.ops.size();
  weight_.assign(n, std::nullopt);
  table_.assign(n, std::nullopt);
  readers_.assign(m_.tensors.size(), {});
  producer_.assign(m_.tensors.size(), -1);
  role_.assign(n, Role::Other);
  for (std::size_t i = 0; i < n; ++i) {
    for (const std::uint32_t t : op(i).inputs) readers_[t].push_back(i);
    for (const std::uint32_t t : op(i).outputs) producer_[t] = static_cast<std::int64_t>(i);
    if (!is_matmul_kind(op(i).kind)) continue;
    for (const std::uint32_t t : op(i).inputs) {
      if (is_param(t) && (!weight_[i] || m_.tensors[t].bytes > m_.tensors[*weight_[i]].bytes)) {
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
    const ModelTensor& out = m_.tensors[output_of_layer.at(layer)];
    for (const std::uint32_t t : op(i).inputs) {
      const std::int64_t p = producer_[t];
      if (is_activation(t) && p >= 0 && op(static_cast<std::size_t>(p)).layer != layer &&
          m_.tensors[t].bytes == out.bytes && m_.tensors[t].dtype == out.dtype) {
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
        if (is_param(t) && (!table_[i] || m_.tensors[t].bytes > m_.tensors[*table_[i]].bytes)) {
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
        m_.name);
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (role_[i] != Role::Embedding) continue;
    for (const std::uint32_t t : op(i).inputs) {
      if (!is_param(t) && m_.tensors[t].role == TensorRole::Input) tokens_ = elements(t);
    }
  }
  return Ok{};
}

// Attention splits by heads: each rank's share of the query and of the key/value heads must be
// whole. A fused attention kernel's log-sum-exp holds one float per head and token, its output
// head size values per head and token, and its key that many per key/value head and token.
Status TensorParallelCut::check_heads() const {
  if (tokens_ <= 0) return Ok{};
  for (std::size_t i = 0; i < m_.ops.size(); ++i) {
    const ModelOp& o = op(i);
    if (!is_fused_attention_kind(o.kind) || o.inputs.size() < 3 || o.outputs.size() < 2) continue;
    const std::int64_t lse = elements(o.outputs[1]);
    const std::int64_t values = elements(o.outputs[0]);
    if (m_.tensors[o.outputs[1]].dtype != DType::F32 || lse <= 0 || lse % tokens_ != 0 ||
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
  Model out = m_;
  out.ops.clear();
  out.ops.reserve(m_.ops.size() * 5 / 4 + 8);
  std::vector<Layout> layout(m_.tensors.size(), Layout::Whole);
  std::vector<bool> assigned(m_.tensors.size(), false);  // an op's output, with a layout
  // A view no op lists as an output (a trace's reshapes) is laid out as its base.
  const auto lay = [&](std::uint32_t t) {
    if (t < m_.tensors.size() && !assigned[t] && m_.tensors[t].view_of >= 0) {
      return layout[base(t)];
    }
    return layout[t];
  };
  std::vector<bool> cut_param(m_.tensors.size(), false);    // a parameter cut by tp
  std::vector<bool> whole_param(m_.tensors.size(), false);  // a parameter read whole
  std::vector<std::uint32_t> now(m_.tensors.size());        // a partial sum's scattered tensor
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

  for (std::size_t i = 0; i < m_.ops.size(); ++i) {
    ModelOp o = op(i);
    // A partial sum is read as its scattered tensor, and so is a view of all of it (a trace's
    // reshape of a projection's output).
    const auto current = [&](std::uint32_t t) {
      const std::uint32_t b = base(t);
      const ModelTensor& v = m_.tensors[t];
      if (b != t && now[b] != b && v.view_offset.count() == 0 && v.bytes == m_.tensors[b].bytes) {
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
          if (lay(t) == Layout::Routed && t < m_.tensors.size()) {
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
      if (t >= m_.tensors.size() || !is_param(t) || viewing) continue;
      const bool cut = (role == Role::Embedding && t == *table_[i]) || role == Role::Colwise ||
                       (role == Role::Rowwise && t == *weight_[i]);
      (cut ? cut_param : whole_param)[t] = true;
      (cut ? cut_param : whole_param)[base(t)] = true;
    }
    // Outputs.
    for (const std::uint32_t t : o.outputs) {
      Layout l = result;
      if (reduced && (t == m_.loss || (tokens_ > 0 && elements(t) <= tokens_))) l = Layout::Whole;
      if (t == m_.loss) l = Layout::Whole;
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
  for (std::uint32_t t = 0; t < m_.tensors.size(); ++t) {
    if (!is_param(t) || base(t) != t) continue;
    if (cut_param[t]) cut_sizes.insert(elements(t));
    if (whole_param[t]) whole_sizes.insert(elements(t));
  }
  const auto held_state = [&](std::uint32_t t) {
    return t < m_.tensors.size() && m_.tensors[t].role == TensorRole::Buffer &&
           m_.tensors[t].view_of < 0 && readers_[t].empty() && cut_sizes.contains(elements(t)) &&
           !whole_sizes.contains(elements(t));
  };
  // Sizes: split tensors and cut parameters hold 1/tp of the bytes (views of the offsets).
  for (std::uint32_t t = 0; t < out.tensors.size(); ++t) {
    const std::uint32_t b = t < m_.tensors.size() ? base(t) : t;
    bool cut = false;
    const auto split = [&](std::uint32_t u) {
      return lay(u) == Layout::Features || lay(u) == Layout::Tokens || lay(u) == Layout::Routed;
    };
    if (t < m_.tensors.size() && is_param(t)) {
      if ((cut_param[t] || cut_param[b]) && (whole_param[t] || whole_param[b])) {
        return refuse("parameter \"{}\" is cut by one op and read whole by another",
                      m_.tensors[b].name);
      }
      cut = cut_param[t] || cut_param[b];
    } else if (held_state(t)) {
      cut = true;
    } else {
      cut = split(t);
      if (b != t && split(b) != cut) {
        return refuse("view \"{}\" and its base \"{}\" are not split alike", m_.tensors[t].name,
                      m_.tensors[b].name);
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

// Note [A context-parallel rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under context parallelism each rank holds 1/cp of the sequence: torchtitan shards the inputs
// and labels along it (context_parallel's buffers) and every activation computed from them is
// the rank's tokens only. context_parallel_model cuts the model so, by dataflow:
//
//   * A model input (the token ids, the labels) is split by tokens; so is every output of an op
//     that reads a split tensor, except one with fewer elements than there are tokens (the
//     loss, a per-sequence statistic), which each rank holds whole. What no split tensor
//     reaches stays whole: parameters, buffers, tables computed from positions alone (a trace's
//     rotary cos and sin), which torchtitan also shards; they are a few hundred kilobytes.
//   * An op that reads a split tensor does 1/cp of its FLOPs, and reads and writes 1/cp of the
//     bytes of its split tensors and all of its whole ones (its weights); a matrix product's m
//     (its rows: the tokens) is 1/cp.
//   * A fused attention kernel (scaled_dot_product_attention) keeps its local queries and
//     attends to every key: an all-gather over the context group brings the whole K and V
//     before it (torch's context_parallel with its default all-gather rotation), and its
//     backward reduce-scatters their gradients, which torch's ring of all-to-alls moves in the
//     same volume. The kernel saves the local K and V, not the gathered ones, as torch's
//     does, and does 1/cp of the whole attention's FLOPs (the load-balanced causal layout).
//   * Attention written as matrix products of two split activations is refused: torch's
//     context_parallel parallelizes the fused kernel only.
//
// Not modelled: the second all-gather of K and V that torch's backward issues (overlapped with
// the first chunk's attention backward), and the float32 accumulation of their gradients, which
// doubles the reduce-scatter's bytes in a 16-bit model.

class ContextParallelCut : RankCut {
 public:
  ContextParallelCut(const Model& whole, std::int32_t cp, std::int32_t nodes)
      : RankCut(whole, "--cp", cp), cp_(cp), nodes_(nodes) {}

  Result<Model> run();

 private:
  static std::int64_t elements(const ModelTensor& t) {
    return t.bytes.count() / dtype_size(t.dtype);
  }

  std::int32_t cp_;
  std::int32_t nodes_;
};

Result<Model> ContextParallelCut::run() {
  // The tokens: the embedding's index input (one per token of the micro-batch).
  std::int64_t tokens = 0;
  for (const ModelOp& o : m_.ops) {
    if (!o.kind.starts_with(kEmbedding)) continue;
    for (const std::uint32_t t : o.inputs) {
      if (m_.tensors[t].role == TensorRole::Input) tokens = elements(m_.tensors[t]);
    }
    if (tokens > 0) break;
  }
  if (tokens <= 0) {
    return refuse(
        "context parallelism cuts a sequence of tokens, and model \"{}\" embeds no token "
        "ids",
        m_.name);
  }
  if (tokens % cp_ != 0) {
    return refuse("the {} tokens of a micro-batch do not split among {} ranks", tokens, cp_);
  }
  Model out = m_;
  out.ops.clear();
  out.ops.reserve(m_.ops.size() * 9 / 8 + 8);
  std::vector<bool> split(m_.tensors.size(), false);
  std::vector<bool> assigned(m_.tensors.size(), false);  // an op's output or an input
  for (std::uint32_t t = 0; t < m_.tensors.size(); ++t) {
    const ModelTensor& tensor = m_.tensors[t];
    if (tensor.role == TensorRole::Input && tensor.view_of < 0 && elements(tensor) >= tokens) {
      split[t] = assigned[t] = true;
    }
  }
  // A view no op lists as an output is laid out as its base.
  const auto is_split = [&](std::uint32_t t) {
    if (t < m_.tensors.size() && !assigned[t] && m_.tensors[t].view_of >= 0) {
      return split[base(t)];
    }
    return split[t];
  };
  const auto activation_or_input = [&](std::uint32_t t) {
    const TensorRole role = out.tensors[t].role;
    return role == TensorRole::Activation || role == TensorRole::Input;
  };
  for (std::size_t i = 0; i < m_.ops.size(); ++i) {
    ModelOp o = m_.ops[i];
    const auto split_inputs = std::ranges::count_if(o.inputs, is_split);
    if (split_inputs == 0) {
      for (const std::uint32_t t : o.outputs) assigned[t] = true;
      out.ops.push_back(std::move(o));
      continue;
    }
    const bool params = std::ranges::any_of(o.inputs, [&](std::uint32_t t) {
      return out.tensors[t < m_.tensors.size() ? base(t) : t].role == TensorRole::Param;
    });
    if (is_matmul_kind(o.kind) && !params && split_inputs >= 2) {
      return refuse(
          "op \"{}\" multiplies two tensors split by tokens (attention written as matrix "
          "products); context parallelism runs attention as one fused kernel "
          "(scaled_dot_product_attention), as torch's context_parallel does",
          o.name);
    }
    // The op's bytes: its split tensors' share, and all of its whole ones.
    std::int64_t whole_bytes = 0;
    for (const std::uint32_t t : o.inputs) {
      if (!is_split(t)) whole_bytes += out.tensors[t].bytes.count();
    }
    const auto share = [&](Bytes b) {
      const std::int64_t whole = std::min(whole_bytes, b.count());
      return Bytes(whole + (b.count() - whole) / cp_);
    };
    o.bytes = share(o.bytes);
    o.backward_bytes = share(o.backward_bytes);
    o.flops /= cp_;
    o.backward_flops /= cp_;
    if (o.gemm.known() && params) {
      if (o.gemm.m % cp_ != 0) {
        return refuse("the {} rows of op \"{}\" do not split among {} ranks", o.gemm.m, o.name,
                      cp_);
      }
      o.gemm.m /= cp_;
      // Each expert's rows: 1/cp of its tokens' (rounded down, within the product's m).
      for (std::int64_t& rows : o.group_rows) rows /= cp_;
    } else if (o.gemm.known()) {
      o.gemm = GemmShape{};  // a fused kernel's product, timed by its FLOPs
    }
    for (const std::uint32_t t : o.outputs) {
      split[t] = elements(out.tensors[t]) >= tokens;
      assigned[t] = true;
    }
    if (is_fused_attention_kind(o.kind) && o.inputs.size() >= 3) {
      // Gather the whole K and V over the context group; the kernel reads them and saves its
      // local ones (read too, so that it may save them).
      const std::uint32_t k = o.inputs[1];
      const std::uint32_t v = o.inputs[2];
      // Named by the kernel (names unique among ops): two kernels may read one K, or K be V.
      std::vector<std::uint32_t> whole;
      for (const auto& [t, which] : {std::pair{k, "k"}, std::pair{v, "v"}}) {
        whole.push_back(add_tensor(out, t, fmt::format("{}/cp.gathered.{}", o.name, which)));
        split.push_back(false);
        assigned.push_back(true);
      }
      const Exchange gathers{kAllGatherKind, CollectiveKind::AllGather,
                             CollectiveKind::ReduceScatter, MeshAxis::Context, nodes_};
      ModelOp gather = collective_op(o.name + "/cp.all_gather", gathers, {k, v}, whole, o);
      o.inputs[1] = whole[0];
      o.inputs[2] = whole[1];
      o.inputs.insert(o.inputs.end(), {k, v});
      out.ops.push_back(std::move(gather));
    }
    out.ops.push_back(std::move(o));
  }
  // Sizes: a split tensor holds 1/cp of its elements, rounded up (a per-token tensor padded by
  // a few, as a trace's shifted labels), and a view starts at 1/cp of its offset, rounded down,
  // so that it stays inside its base.
  for (std::uint32_t t = 0; t < m_.tensors.size(); ++t) {
    const std::uint32_t b = base(t);
    if (!activation_or_input(t)) continue;
    if (b != t && is_split(b) != is_split(t)) {
      return refuse("view \"{}\" and its base \"{}\" are not split alike", m_.tensors[t].name,
                    m_.tensors[b].name);
    }
    if (!is_split(t)) continue;
    ModelTensor& tensor = out.tensors[t];
    const std::int64_t size = dtype_size(tensor.dtype);
    tensor.bytes = Bytes((tensor.bytes.count() / size + cp_ - 1) / cp_ * size);
    tensor.view_offset = Bytes(tensor.view_offset.count() / size / cp_ * size);
  }
  return checked(std::move(out));
}

// Note [An expert-parallel rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under expert parallelism a mixture of experts' experts are split among `ep` GPUs: each holds
// 1/ep of them and computes their rows for every GPU of the group, as torchtitan's expert-
// parallel MoE does. expert_parallel_model finds the experts by what they run: a grouped
// matrix product (is_grouped_matmul_kind) reads the routed rows (its largest activation input),
// the experts' stacked weights (its largest parameter, or a view of one: one k x n matrix per
// expert, so their number follows from the product's shape) and the offsets. Per layer:
//
//   * each grouped matmul's weights hold 1/ep of the experts (their number must split among
//     the ranks);
//   * before the layer's first grouped matmul, an all-to-all dispatches its routed rows to the
//     ranks that hold their experts; the grouped matmuls (and the ops between them) read the
//     dispatched rows; after the last one, an all-to-all combines its output back to the ranks
//     the tokens came from (backward: the same exchanges of the gradients);
//   * each rank receives the rows routed to its experts. Where the trace gives each expert's
//     rows (ModelOp::group_rows, from the offsets its routing assumption gave), every rank of
//     the group is taken to route its own rows as the traced batch did, so rank r receives
//     ep x (the rows of its experts), rank r holding experts [r E/ep, (r+1) E/ep) as
//     torchtitan's Shard(0) of the experts places them. The layer is priced at its busiest
//     rank: the dispatched rows and everything the experts compute from them (the grouped
//     matmuls' FLOPs and m, the ops between them, their saved tensors) grow by its received
//     rows over the traced ones, and so does the dispatch's all-to-all, which the collective
//     model times by the larger of what a rank sends and receives. The combine waits for that
//     rank, so each layer goes at its busiest rank's pace, and the memory figured is a bound
//     above every rank's. Without group rows (or with balanced ones) each rank receives as
//     many rows as it sends and every op keeps its counts.
//
// The rest of the model (attention, shared experts, the router) is every GPU's own: expert
// parallelism borrows its GPUs from the data-parallel ones.

class ExpertParallelCut : RankCut {
 public:
  ExpertParallelCut(const Model& whole, std::int32_t ep, std::int32_t nodes, double capacity)
      : RankCut(whole, "--ep", ep), ep_(ep), nodes_(nodes), capacity_(capacity) {}

  Result<Model> run();

 private:
  // A layer's rows: those its busiest rank receives and those the trace routed.
  struct Load {
    std::int64_t busiest = 1;
    std::int64_t traced = 1;
    // n x busiest / traced, rounded; past 2^63 - 1 (a hostile file's counts) it stays there,
    // for the cut's check to refuse as above its limit.
    [[nodiscard]] std::int64_t scaled(std::int64_t n) const { return scale(n, traced / 2); }
    // Rounded down: a tensor's elements and a view's offset, so that views that lie inside
    // their base (halves of it) still do.
    [[nodiscard]] std::int64_t scaled_down(std::int64_t n) const { return scale(n, 0); }

   private:
    [[nodiscard]] std::int64_t scale(std::int64_t n, std::int64_t round) const {
      __extension__ using Signed = __int128;
      const Signed v = (Signed{n} * busiest + round) / traced;
      return static_cast<std::int64_t>(
          std::min<Signed>(v, std::numeric_limits<std::int64_t>::max()));
    }
  };
  Result<Load> load_of(const ModelOp& o, std::int64_t experts) const;
  // Whether `o` reads routed rows; if so its outputs are routed rows too.
  static bool route(const Model& out, const ModelOp& o, std::vector<bool>& routed);
  static void price(Model& out, ModelOp& o, const Load& load, const std::vector<bool>& routed);
  // The layer's routed rows, `traced` of them in the whole model, as its busiest rank holds
  // them (`load`, where the trace gives one), in static-capacity buffers where capacity_ asks.
  Status size_routed(Model& out, const std::vector<bool>& routed, const Load* load,
                     std::int64_t traced) const;

  std::int32_t ep_;
  std::int32_t nodes_;
  double capacity_;  // Note [Static capacity]; 0: the rows as routed
};

Result<ExpertParallelCut::Load> ExpertParallelCut::load_of(const ModelOp& o,
                                                           std::int64_t experts) const {
  if (o.group_rows.empty()) return Load{};
  if (std::cmp_not_equal(o.group_rows.size(), experts)) {
    return refuse("op \"{}\" gives the rows of {} groups, but its weights hold {} experts", o.name,
                  o.group_rows.size(), experts);
  }
  Load load{0, 0};
  const std::int64_t each = experts / ep_;
  for (std::int64_t r = 0; r < ep_; ++r) {
    std::int64_t rows = 0;
    for (std::int64_t e = r * each; e < (r + 1) * each; ++e) rows += o.group_rows[e];
    load.traced += rows;
    load.busiest = std::max(load.busiest, rows * ep_);
  }
  if (load.traced == 0) return Load{};
  return load;
}

bool ExpertParallelCut::route(const Model& out, const ModelOp& o, std::vector<bool>& routed) {
  const auto is_routed = [&](std::uint32_t t) {
    const std::int32_t b = out.tensors[t].view_of;
    return routed[t] || (b >= 0 && routed[static_cast<std::size_t>(b)]);
  };
  if (std::ranges::none_of(o.inputs, is_routed)) return false;
  for (const std::uint32_t t : o.outputs) routed[t] = true;
  return true;
}

// An op of the experts that reads routed rows (route) at its rank's load: its FLOPs, m and bytes
// grow with the rows (its weights' bytes do not).
void ExpertParallelCut::price(Model& out, ModelOp& o, const Load& load,
                              const std::vector<bool>& routed) {
  const auto is_routed = [&](std::uint32_t t) {
    const std::int32_t b = out.tensors[t].view_of;
    return routed[t] || (b >= 0 && routed[static_cast<std::size_t>(b)]);
  };
  std::int64_t rows_bytes = 0;
  for (const std::uint32_t t : o.inputs) {
    if (is_routed(t)) rows_bytes += out.tensors[t].bytes.count();
  }
  for (const std::uint32_t t : o.outputs) rows_bytes += out.tensors[t].bytes.count();
  const std::int64_t before = o.bytes.count();
  if (before > 0) {  // a view moves nothing
    o.bytes = Bytes(before + load.scaled(rows_bytes) - rows_bytes);
    o.backward_bytes = Bytes(Load{o.bytes.count(), before}.scaled(o.backward_bytes.count()));
  }
  o.backward_flops = load.scaled(o.backward_flops);
  if (o.gemm.known()) {
    // 2 m n k batch, so that the shape stays the FLOPs' product (check_gemm); past 2^63 - 1 it
    // stays there, for the cut's check to refuse.
    __extension__ using Signed = __int128;
    o.gemm.m = std::max<std::int64_t>(1, load.scaled(o.gemm.m));
    Signed flops = 2;
    for (const std::int64_t dim : {o.gemm.m, o.gemm.n, o.gemm.k, o.gemm.batch}) {
      flops = std::min<Signed>(flops * dim, std::numeric_limits<std::int64_t>::max());
    }
    o.flops = static_cast<std::int64_t>(flops);
  } else {
    o.flops = load.scaled(o.flops);
  }
}

// Note [Static capacity]
// ~~~~~~~~~~~~~~~~~~~~~~
// A dispatcher with a static capacity factor F (HybridEP's non_blocking_capacity_factor, which
// CUDA-graphed expert parallelism needs: shapes may not follow the routing) allocates each
// rank's routed rows for F times the rows a balanced routing gives it, whatever the routing
// gives: F x (the rows the trace routed) rows a tensor, of which the rows the rank receives
// hold data. The experts compute only those (their grouped matmuls take the rows each expert
// got), so the cut keeps every op's counts and each routed tensor's bytes, and gives each
// routed base activation a capacity (ModelTensor::capacity): its allocation, padded to F
// times its traced elements, with its rows of data (ModelTensor::rows). Its gradient is
// padded the same. A rank that receives more rows than its capacity would drop tokens; the
// cut refuses it, naming the layer and the factor that would hold them. The paged stash
// (paged_stash.hpp) is what takes the padding back out of the step's saved tensors.

Status ExpertParallelCut::size_routed(Model& out, const std::vector<bool>& routed, const Load* load,
                                      std::int64_t traced) const {
  for (std::uint32_t t = 0; t < out.tensors.size(); ++t) {
    ModelTensor& tensor = out.tensors[t];
    const bool of_routed = tensor.view_of >= 0 && routed[static_cast<std::size_t>(tensor.view_of)];
    if (!routed[t] && !of_routed) continue;
    const std::int64_t size = dtype_size(tensor.dtype);
    const std::int64_t elements = tensor.bytes.count() / size;
    if (load != nullptr) {
      // The routed rows, and their views, at the busiest rank's load.
      tensor.bytes = Bytes(load->scaled_down(elements) * size);
      tensor.view_offset = Bytes(load->scaled_down(tensor.view_offset.count() / size) * size);
    }
    if (capacity_ <= 0 || tensor.view_of >= 0 || tensor.role != TensorRole::Activation) continue;
    __extension__ using Signed = __int128;
    const auto padded = static_cast<Signed>(std::ceil(capacity_ * static_cast<double>(elements)));
    if (padded * size > kMaxJsonBytes) {
      return refuse("--expert-capacity {}: tensor \"{}\" would take more than {} bytes", capacity_,
                    tensor.name, kMaxJsonBytes);
    }
    const Bytes capacity(static_cast<std::int64_t>(padded) * size);
    if (tensor.bytes > capacity) {
      return refuse(
          "--expert-capacity {}: the busiest rank receives {} bytes of routed rows into \"{}\", "
          "more than its capacity of {} (a static dispatcher would drop tokens); a factor of "
          "{:.2f} "
          "holds them",
          capacity_, tensor.bytes.count(), tensor.name, capacity.count(),
          std::ceil(100.0 * static_cast<double>(tensor.bytes.count()) /
                    static_cast<double>(elements * size)) /
              100.0);
    }
    tensor.capacity = capacity;
    tensor.rows = std::max<std::int64_t>(1, load != nullptr ? load->scaled_down(traced) : traced);
  }
  return Ok{};
}

Result<Model> ExpertParallelCut::run() {
  // The grouped matmuls of each layer, the first and the last.
  std::map<std::int32_t, std::pair<std::size_t, std::size_t>> span;
  std::set<std::uint32_t> experts;     // the experts' weights and their views
  std::map<std::int32_t, Load> loads;  // of the layers whose trace gives each expert's rows
  for (std::size_t i = 0; i < m_.ops.size(); ++i) {
    const ModelOp& o = m_.ops[i];
    if (!is_grouped_matmul_kind(o.kind)) continue;
    // The experts' weights: its largest parameter, one (k x n) matrix per expert.
    std::optional<std::uint32_t> weights;
    for (const std::uint32_t t : o.inputs) {
      if (m_.tensors[base(t)].role != TensorRole::Param) continue;
      experts.insert({t, base(t)});
      if (!weights || m_.tensors[t].bytes > m_.tensors[*weights].bytes) weights = t;
    }
    if (!weights || !o.gemm.known() || o.gemm.n * o.gemm.k <= 0) {
      return refuse(
          "op \"{}\", a grouped matmul, has no weights or no \"gemm\" shape to count its "
          "experts by",
          o.name);
    }
    const ModelTensor& w = m_.tensors[*weights];
    const std::int64_t count = w.bytes.count() / dtype_size(w.dtype) / (o.gemm.n * o.gemm.k);
    if (count < 1 || count % ep_ != 0) {
      return refuse("{} experts (op \"{}\") do not split among {} ranks", count, o.name, ep_);
    }
    const auto [at, fresh] = span.try_emplace(o.layer, i, i);
    if (!fresh) at->second.second = i;
    if (!o.group_rows.empty() && !loads.contains(o.layer)) {
      auto load = load_of(o, count);
      if (!load) return load.error();
      loads.emplace(o.layer, load.value());
    }
  }
  if (span.empty()) {
    return refuse(
        "model \"{}\" has no grouped expert matmul: expert parallelism splits a mixture of "
        "experts' experts, run as grouped matmuls (python -m ferry trace with transformers' "
        "grouped_mm experts)",
        m_.name);
  }
  Model out = m_;
  out.ops.clear();
  out.ops.reserve(m_.ops.size() + 2 * span.size());
  std::vector<std::uint32_t> now(m_.tensors.size());  // a tensor as later ops read it
  for (std::uint32_t t = 0; t < now.size(); ++t) now[t] = t;
  std::map<std::uint32_t, std::uint32_t> dispatched;  // within a layer's experts
  // Tensors of the layer's routed rows, where its load is given; the cut adds two a layer.
  std::vector<bool> routed(m_.tensors.size() + 2 * span.size(), false);
  const Exchange all_to_all{kAllToAllKind, CollectiveKind::AllToAll, CollectiveKind::AllToAll,
                            MeshAxis::Expert, nodes_};
  // Routed rows moved over the expert group into a tensor of their own, named by the exchange
  // (names unique among ops: two layers' experts may read one tensor).
  const auto exchange = [&](std::string name, std::uint32_t from, const ModelOp& near) {
    const std::uint32_t to = add_tensor(out, from, name + ".out");
    ModelOp a2a = collective_op(std::move(name), all_to_all, {from}, {to}, near);
    out.ops.push_back(std::move(a2a));
    return to;
  };
  for (std::size_t i = 0; i < m_.ops.size(); ++i) {
    ModelOp o = m_.ops[i];
    const auto layer = span.find(o.layer);
    const bool in_experts =
        layer != span.end() && i >= layer->second.first && i <= layer->second.second;
    const auto read = [&](std::uint32_t t) {
      // A view of all of a combined output reads the combined tensor.
      const std::uint32_t b = base(t);
      if (b != t && now[b] != b && m_.tensors[t].view_offset.count() == 0 &&
          m_.tensors[t].bytes == m_.tensors[b].bytes) {
        return now[b];
      }
      if (in_experts) {
        if (const auto d = dispatched.find(t); d != dispatched.end()) return d->second;
      }
      return now[t];
    };
    for (std::uint32_t& t : o.inputs) t = read(t);
    for (std::uint32_t& t : o.saved) t = read(t);
    if (in_experts && i == layer->second.first) {
      // The routed rows: its largest activation input (the other is the offsets).
      dispatched.clear();
      std::uint32_t* rows = nullptr;
      for (std::uint32_t& t : o.inputs) {
        if (out.tensors[t].role != TensorRole::Activation) continue;
        if (rows == nullptr || out.tensors[t].bytes > out.tensors[*rows].bytes) rows = &t;
      }
      if (rows != nullptr) {
        const std::uint32_t t = *rows;
        const std::uint32_t d = exchange(o.name + "/ep.dispatch", t, o);
        dispatched[t] = d;
        std::ranges::replace(o.saved, t, d);
        *rows = d;
        routed[d] = true;
      }
    }
    const auto load = in_experts ? loads.find(o.layer) : loads.end();
    if (in_experts && route(out, o, routed) && load != loads.end()) {
      price(out, o, load->second, routed);
    }
    const bool last = in_experts && i == layer->second.second;
    const std::string name = o.name;
    const ModelOp& kept = out.ops.emplace_back(std::move(o));
    if (last && !kept.outputs.empty()) {
      const std::uint32_t t = kept.outputs.front();
      now[t] = exchange(name + "/ep.combine", t, out.ops.back());
    }
    if (last) {
      const std::int64_t traced = m_.ops[layer->second.first].gemm.m;
      FERRY_JSON_RETURN_IF_ERROR(
          size_routed(out, routed, load != loads.end() ? &load->second : nullptr, traced));
      std::fill(routed.begin(), routed.end(), false);
    }
  }
  // Sizes: each rank holds 1/ep of the experts' weights (a view 1/ep of its offset).
  for (const std::uint32_t t : experts) {
    ModelTensor& tensor = out.tensors[t];
    const std::int64_t size = dtype_size(tensor.dtype);
    const std::int64_t n = tensor.bytes.count() / size;
    if (n % ep_ != 0 || (tensor.view_offset.count() / size) % ep_ != 0) {
      return refuse("the experts' weights \"{}\" of {} elements do not split among {} ranks",
                    tensor.name, n, ep_);
    }
    tensor.bytes = Bytes(tensor.bytes.count() / ep_);
    tensor.view_offset = Bytes(tensor.view_offset.count() / ep_);
  }
  return checked(std::move(out));
}

}  // namespace

Result<Model> expert_parallel_model(const Model& whole, std::int32_t ep, std::int32_t nodes,
                                    double capacity) {
  if (ep < 1) return Error{fmt::format("--ep {}: use 1 or more ranks", ep)};
  if (capacity != 0 && !(capacity >= 1 && capacity <= kMaxExpertCapacity)) {
    return Error{fmt::format("--expert-capacity {}: use a factor from 1 to {}", capacity,
                             kMaxExpertCapacity)};
  }
  if (capacity != 0 && ep == 1) {
    return Error{fmt::format(
        "--expert-capacity {} needs --ep 2 or more: one GPU's routed rows are static without "
        "padding",
        capacity)};
  }
  if (ep == 1) return whole;
  return ExpertParallelCut(whole, ep, std::max(1, nodes), capacity).run();
}

std::string_view expert_routing(const Model& model) {
  const bool given = std::ranges::any_of(model.ops, [](const ModelOp& o) {
    return is_grouped_matmul_kind(o.kind) && !o.group_rows.empty();
  });
  return given ? "busiest_rank" : "balanced";
}

Result<Model> context_parallel_model(const Model& whole, std::int32_t cp, std::int32_t nodes) {
  if (cp < 1) return Error{fmt::format("--cp {}: use 1 or more ranks", cp)};
  if (cp == 1) return whole;
  return ContextParallelCut(whole, cp, std::max(1, nodes)).run();
}

Result<Model> tensor_parallel_model(const Model& whole, std::int32_t tp) {
  if (tp < 1) return Error{fmt::format("--tp {}: use 1 or more ranks", tp)};
  if (tp == 1) return whole;
  return TensorParallelCut(whole, tp).run();
}

}  // namespace ferry::sim
