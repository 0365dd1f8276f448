#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/sim/workload/rank_model.hpp"
#include "model_builder.hpp"
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
//     context_parallel parallelizes the fused kernel only.
//
// Not modelled: the second all-gather of K and V that torch's backward issues (overlapped with
// the first chunk's attention backward), and the float32 accumulation of their gradients, which
// doubles the reduce-scatter's bytes in a 16-bit model.

namespace {

using rank_cut_detail::kAllGatherKind;
using rank_cut_detail::RankCut;
using workload_detail::op_kind::kEmbedding;

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
  for (const ModelOp& o : whole_.ops) {
    if (!o.kind.starts_with(kEmbedding)) continue;
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
  Model out = whole_;
  out.ops.clear();
  out.ops.reserve(whole_.ops.size() * 9 / 8 + 8);
  std::vector<bool> split(whole_.tensors.size(), false);
  std::vector<bool> assigned(whole_.tensors.size(), false);  // an op's output or an input
  for (std::uint32_t t = 0; t < whole_.tensors.size(); ++t) {
    const ModelTensor& tensor = whole_.tensors[t];
    if (tensor.role == TensorRole::Input && tensor.view_of < 0 && elements(tensor) >= tokens) {
      split[t] = assigned[t] = true;
    }
  }
  // A view no op lists as an output is laid out as its base.
  const auto is_split = [&](std::uint32_t t) {
    if (t < whole_.tensors.size() && !assigned[t] && whole_.tensors[t].view_of >= 0) {
      return split[base(t)];
    }
    return split[t];
  };
  const auto activation_or_input = [&](std::uint32_t t) {
    const TensorRole role = out.tensors[t].role;
    return role == TensorRole::Activation || role == TensorRole::Input;
  };
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    ModelOp o = whole_.ops[i];
    const auto split_inputs = std::ranges::count_if(o.inputs, is_split);
    if (split_inputs == 0) {
      for (const std::uint32_t t : o.outputs) assigned[t] = true;
      out.ops.push_back(std::move(o));
      continue;
    }
    const bool params = std::ranges::any_of(o.inputs, [&](std::uint32_t t) {
      return out.tensors[t < whole_.tensors.size() ? base(t) : t].role == TensorRole::Param;
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
  for (std::uint32_t t = 0; t < whole_.tensors.size(); ++t) {
    const std::uint32_t b = base(t);
    if (!activation_or_input(t)) continue;
    if (b != t && is_split(b) != is_split(t)) {
      return refuse("view \"{}\" and its base \"{}\" are not split alike", whole_.tensors[t].name,
                    whole_.tensors[b].name);
    }
    if (!is_split(t)) continue;
    ModelTensor& tensor = out.tensors[t];
    const std::int64_t size = dtype_size(tensor.dtype);
    tensor.bytes = Bytes((tensor.bytes.count() / size + cp_ - 1) / cp_ * size);
    tensor.view_offset = Bytes(tensor.view_offset.count() / size / cp_ * size);
  }
  return checked(std::move(out));
}

}  // namespace

Result<Model> context_parallel_model(const Model& whole, std::int32_t cp, std::int32_t nodes) {
  if (cp < 1) return Error{fmt::format("--cp {}: use 1 or more ranks", cp)};
  if (cp == 1) return whole;
  return ContextParallelCut(whole, cp, std::max(1, nodes)).run();
}

}  // namespace ferry::sim
