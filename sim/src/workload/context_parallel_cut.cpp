#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "rank_cut.hpp"

namespace ferry::sim {

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
//     context_parallel parallelizes the fused kernel only. So is a fused kernel that reads a
//     tensor beyond Q, K and V, a mask or bias (T5's relative position bias): torch's ring
//     kernels raise on an attention bias (only causal masking, or none).
//
// Not modelled: the second all-gather of K and V that torch's backward issues (overlapped with
// the first chunk's attention backward), and the float32 accumulation of their gradients, which
// doubles the reduce-scatter's bytes in a 16-bit model.

namespace {

using rank_cut_detail::kAllGatherKind;
using rank_cut_detail::RankCut;

class ContextParallelCut : RankCut {
 public:
  ContextParallelCut(const Model& whole, std::int32_t cp, GroupPlacement group)
      : RankCut(whole, "--cp", cp), cp_(cp), group_(group) {}
  using RankCut::skip_validation;

  Result<Model> run();

 private:
  static std::int64_t elements(const ModelTensor& t) {
    return t.bytes.count() / dtype_size(t.dtype);
  }
  // The tokens of a micro-batch: the embedding's index input (one per token).
  Result<std::int64_t> count_tokens() const;
  bool is_split(std::uint32_t t) const;
  Status cut_op(ModelOp o);
  Status share_work(ModelOp& o, bool params) const;
  void gather_kv(ModelOp& o);
  Status size_tensors();

  std::int32_t cp_;
  GroupPlacement group_;  // the context-parallel group's nodes and sharing
  std::int64_t tokens_ = 0;
  Model out_;                   // the rank's model
  std::vector<bool> split_;     // by tensor of out_: split by tokens
  std::vector<bool> assigned_;  // by tensor: an op's output or an input
};

Result<std::int64_t> ContextParallelCut::count_tokens() const {
  std::int64_t tokens = 0;
  for (const ModelOp& o : whole_.ops) {
    if (o.kind.family() != OpFamily::Embedding) continue;
    for (const std::uint32_t t : o.inputs) {
      if (whole_.tensors[t].role == TensorRole::Input) tokens = elements(whole_.tensors[t]);
    }
    if (tokens > 0) break;
  }
  if (tokens <= 0) {
    return refuse(
        "context parallelism cuts a sequence of tokens, and model \"{}\" embeds no token "
        "ids",
        whole_.name);
  }
  if (tokens % cp_ != 0) {
    return refuse("the {} tokens of a micro-batch do not split among {} ranks", tokens, cp_);
  }
  return tokens;
}

// A view no op lists as an output is laid out as its base.
bool ContextParallelCut::is_split(std::uint32_t t) const {
  if (t < whole_.tensors.size() && !assigned_[t] && whole_.tensors[t].view_of >= 0) {
    return split_[base(t)];
  }
  return split_[t];
}

// An op that reads a split tensor: 1/cp of its FLOPs, of its split tensors' bytes and of its
// product's rows (`params`: a product of a weight; any other is a fused kernel's).
Status ContextParallelCut::share_work(ModelOp& o, bool params) const {
  std::int64_t whole_bytes = 0;
  for (const std::uint32_t t : o.inputs) {
    if (!is_split(t)) whole_bytes += out_.tensors[t].bytes.count();
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
      return refuse("the {} rows of op \"{}\" do not split among {} ranks", o.gemm.m, o.name, cp_);
    }
    o.gemm.m /= cp_;
    // Each expert's rows: 1/cp of its tokens' (rounded down, within the product's m).
    for (std::int64_t& rows : o.group_rows) rows /= cp_;
  } else if (o.gemm.known()) {
    o.gemm = GemmShape{};  // a fused kernel's product, timed by its FLOPs
  }
  return Ok{};
}

// Gather the whole K and V of fused attention `o` over the context group; the kernel reads them
// and saves its local ones (read too, so that it may save them).
void ContextParallelCut::gather_kv(ModelOp& o) {
  const std::uint32_t k = o.inputs[1];
  const std::uint32_t v = o.inputs[2];
  // Named by the kernel (names unique among ops): two kernels may read one K, or K be V.
  std::vector<std::uint32_t> whole;
  for (const auto& [t, which] : {std::pair{k, "k"}, std::pair{v, "v"}}) {
    whole.push_back(add_tensor(out_, t, fmt::format("{}/cp.gathered.{}", o.name, which)));
    split_.push_back(false);
    assigned_.push_back(true);
  }
  const Exchange gathers{kAllGatherKind,
                         CollectiveKind::AllGather,
                         CollectiveKind::ReduceScatter,
                         MeshAxis::Context,
                         group_.nodes,
                         group_.sharing};
  ModelOp gather = collective_op(o.name + "/cp.all_gather", gathers, {k, v}, whole, o);
  o.inputs[1] = whole[0];
  o.inputs[2] = whole[1];
  o.inputs.insert(o.inputs.end(), {k, v});
  out_.ops.push_back(std::move(gather));
}

Status ContextParallelCut::cut_op(ModelOp o) {
  const auto split_inputs =
      std::ranges::count_if(o.inputs, [&](std::uint32_t t) { return is_split(t); });
  if (split_inputs == 0) {
    for (const std::uint32_t t : o.outputs) assigned_[t] = true;
    out_.ops.push_back(std::move(o));
    return Ok{};
  }
  const bool params = std::ranges::any_of(o.inputs, [&](std::uint32_t t) {
    return out_.tensors[t < whole_.tensors.size() ? base(t) : t].role == TensorRole::Param;
  });
  if (is_matmul_kind(o.kind) && !params && split_inputs >= 2) {
    return refuse(
        "op \"{}\" multiplies two tensors split by tokens (attention written as matrix "
        "products); context parallelism runs attention as one fused kernel "
        "(scaled_dot_product_attention), as torch's context_parallel does",
        o.name);
  }
  if (is_fused_attention_kind(o.kind)) {
    for (std::size_t i = 3; i < o.inputs.size(); ++i) {
      if (out_.tensors[base(o.inputs[i])].role == TensorRole::Param) continue;
      return refuse(
          "op \"{}\" attends with a mask or bias (\"{}\"); context parallelism runs fused "
          "attention causal or unmasked, as torch's context_parallel does",
          o.name, out_.tensors[o.inputs[i]].name);
    }
  }
  FERRY_JSON_RETURN_IF_ERROR(share_work(o, params));
  for (const std::uint32_t t : o.outputs) {
    split_[t] = elements(out_.tensors[t]) >= tokens_;
    assigned_[t] = true;
  }
  if (is_fused_attention_kind(o.kind) && o.inputs.size() >= 3) gather_kv(o);
  out_.ops.push_back(std::move(o));
  return Ok{};
}

// Sizes: a split tensor holds 1/cp of its elements, rounded up (a per-token tensor padded by a
// few, as a trace's shifted labels), and a view starts at 1/cp of its offset, rounded down, so
// that it stays inside its base.
Status ContextParallelCut::size_tensors() {
  for (std::uint32_t t = 0; t < whole_.tensors.size(); ++t) {
    const std::uint32_t b = base(t);
    const TensorRole role = out_.tensors[t].role;
    if (role != TensorRole::Activation && role != TensorRole::Input) continue;
    if (b != t && is_split(b) != is_split(t)) {
      return refuse("view \"{}\" and its base \"{}\" are not split alike", whole_.tensors[t].name,
                    whole_.tensors[b].name);
    }
    if (!is_split(t)) continue;
    ModelTensor& tensor = out_.tensors[t];
    const std::int64_t size = dtype_size(tensor.dtype);
    tensor.bytes = Bytes((tensor.bytes.count() / size + cp_ - 1) / cp_ * size);
    tensor.view_offset = Bytes(tensor.view_offset.count() / size / cp_ * size);
  }
  return Ok{};
}

Result<Model> ContextParallelCut::run() {
  auto tokens = count_tokens();
  if (!tokens) return tokens.error();
  tokens_ = tokens.value();
  out_ = whole_;
  out_.ops.clear();
  out_.ops.reserve(whole_.ops.size() * 9 / 8 + 8);
  split_.assign(whole_.tensors.size(), false);
  assigned_.assign(whole_.tensors.size(), false);
  for (std::uint32_t t = 0; t < whole_.tensors.size(); ++t) {
    const ModelTensor& tensor = whole_.tensors[t];
    if (tensor.role == TensorRole::Input && tensor.view_of < 0 && elements(tensor) >= tokens_) {
      split_[t] = assigned_[t] = true;
    }
  }
  for (const ModelOp& o : whole_.ops) FERRY_JSON_RETURN_IF_ERROR(cut_op(o));
  FERRY_JSON_RETURN_IF_ERROR(size_tensors());
  return checked(std::move(out_));
}

}  // namespace

Result<Model> context_parallel_model(const Model& whole, std::int32_t cp, std::int32_t nodes) {
  if (const MeshFieldRule& degree = mesh_field(MeshField::Cp); cp < degree.least) {
    return Error{fmt::format("{} {}: use {} or more ranks", degree.flag, cp, degree.least)};
  }
  if (cp == 1) return whole;
  return rank_cut_detail::context_parallel_cut(whole, cp, GroupPlacement{cp, nodes, 1}, true);
}

Result<Model> rank_cut_detail::context_parallel_cut(const Model& whole, std::int32_t cp,
                                                    GroupPlacement group, bool validate) {
  group.nodes = std::max(1, group.nodes);
  group.sharing = std::max(1, group.sharing);
  ContextParallelCut cut(whole, cp, group);
  if (!validate) cut.skip_validation();
  return cut.run();
}

}  // namespace ferry::sim
