#pragma once
// Private to the tensor-parallel cut: the roles, their rules (kRoleRules), the plan that
// TensorParallelRoles finds (tensor_parallel_roles.cpp) and TensorParallelRewrite follows
// (tensor_parallel_cut.cpp).

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "ferry/result.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/model.hpp"
#include "rank_cut.hpp"

namespace ferry::sim::rank_cut_detail {

// Note [A rank's model]
// ~~~~~~~~~~~~~~~~~~~~~
// Under tensor parallelism each rank runs a smaller program than the whole model: its slices
// of the projections, and the collectives DTensor inserts between them. tensor_parallel_model
// writes that program as a model, so that checkpointing, offloading, planning and the hazard
// checker treat a rank's collectives as the ops they are (Note [Collective ops] in model_check.cpp;
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
// gathered tensor, as DTensor code saves it. A mixture-of-experts layer is cut as Note [Tensor
// parallelism of a mixture of experts] says. Not modelled yet: the all-reduce of the norms'
// weight gradients (h elements a norm) and the vocabulary-parallel loss's three all-reduces of
// per-token statistics, both a few hundred kilobytes; tensor parallelism without sequence
// parallelism. An optimizer's state (its moments, which no op reads) is cut when its size is
// that of the cut parameters, not of one read whole.
//
// Each role's rules (its outputs' layout, whether it does 1/tp of the work, the layouts its
// operands must have, which parameters it reads cut, which dimension of its product it cuts)
// are one row of kRoleRules; an op of no role takes its layout from what it reads.

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

// Whether a tensor of `type` holds indices (the routing's choices, offsets): an integer one.
inline bool is_index(DType type) { return type == DType::I64 || type == DType::U8; }

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

// Which parameters an op of a role reads cut: none, all, its weight or its table.
enum class ParamCut : std::uint8_t { None, All, Weight, Table };
// Which dimension of its product a scaled op of a role does 1/tp of: none, its n (colwise), its
// k (rowwise), its rows (m and each expert's group rows), or its batch (a product of split
// activations).
enum class GemmCut : std::uint8_t { None, N, K, Rows, Batch };

constexpr std::uint8_t layouts(std::initializer_list<Layout> of) {
  std::uint8_t mask = 0;
  for (const Layout l : of) mask |= static_cast<std::uint8_t>(1U << static_cast<unsigned>(l));
  return mask;
}
constexpr bool allows(std::uint8_t mask, Layout l) {
  return (mask & (1U << static_cast<unsigned>(l))) != 0;
}

// What an op of a role does, by role (Note [A rank's model], Note [Tensor parallelism of a
// mixture of experts]).
struct RoleRule {
  Role role;
  std::string_view name;         // as a refusal names an op of the role
  std::optional<Layout> output;  // its outputs' layout; none: from what it reads
  bool scaled;                   // 1/tp of its work
  bool gathers;                  // reads its token-split operands gathered whole
  std::uint8_t operands;         // the layouts its activation inputs may have; 0: any
  ParamCut params;
  GemmCut gemm;
};
constexpr std::array<RoleRule, 7> kRoleRules{{
    // Other: what it reads decides (TensorParallelRewrite::derive_layout).
    {Role::Other, "", std::nullopt, false, false, 0, ParamCut::None, GemmCut::Batch},
    {Role::Colwise, "a colwise projection", Layout::Features, true, true, layouts({Layout::Whole}),
     ParamCut::All, GemmCut::N},
    {Role::Rowwise, "a rowwise projection", Layout::Partial, true, false,
     layouts({Layout::Features}), ParamCut::Weight, GemmCut::K},
    {Role::Replicated, "a replicated projection", Layout::Whole, false, true,
     layouts({Layout::Whole}), ParamCut::None, GemmCut::None},
    {Role::Embedding, "an embedding", Layout::Partial, false, false, 0, ParamCut::Table,
     GemmCut::None},
    {Role::Dispatch, "the dispatch of routed rows", Layout::Routed, true, true, 0, ParamCut::None,
     GemmCut::None},
    {Role::Experts, "a grouped expert matmul", Layout::Routed, true, false,
     layouts({Layout::Whole, Layout::Routed}), ParamCut::None, GemmCut::Rows},
}};
constexpr bool rules_in_role_order() {
  for (std::size_t r = 0; r < kRoleRules.size(); ++r) {
    if (static_cast<std::size_t>(kRoleRules[r].role) != r) return false;
  }
  return true;
}
static_assert(rules_in_role_order(), "kRoleRules holds each role's rule at the role's index");

// What each op of the whole model is to the tensor-parallel cut, and the dataflow the rewrite
// follows: found by TensorParallelRoles (Note [A rank's model]), read by TensorParallelRewrite.
struct TensorParallelPlan {
  std::vector<Role> role;                            // by op
  std::vector<std::optional<std::uint32_t>> weight;  // by op: a weight matmul's weight
  std::vector<std::optional<std::uint32_t>> table;   // by op: an embedding's table
  std::vector<std::vector<std::size_t>> readers;     // by tensor: the ops reading it
  std::vector<std::int64_t> producer;                // by tensor: its op, or -1
  std::int64_t tokens = 0;                           // the embedding's token count
  // Mixture-of-experts layers -> the elements of their block's input (a token's features times
  // the tokens), and the bases of the block inputs, which the block reads whole.
  std::map<std::int32_t, std::int64_t> moe_layers;
  std::set<std::uint32_t> moe_inputs;
};

// What both halves of the tensor-parallel cut read of the whole model.
class TensorParallelBase : protected RankCut {
 protected:
  TensorParallelBase(const Model& whole, std::int32_t tp) : RankCut(whole, "--tp", tp), tp_(tp) {}

  bool is_param(std::uint32_t t) const { return whole_.tensors[base(t)].role == TensorRole::Param; }
  bool is_activation(std::uint32_t t) const {
    return whole_.tensors[t].role == TensorRole::Activation;
  }
  std::int64_t elements(std::uint32_t t) const {
    return whole_.tensors[t].bytes.count() / dtype_size(whole_.tensors[t].dtype);
  }
  const ModelOp& op(std::size_t i) const { return whole_.ops[i]; }

  std::int32_t tp_;
};

// Finds each op's role from the dataflow and the shapes (tensor_parallel_roles.cpp).
class TensorParallelRoles : TensorParallelBase {
 public:
  TensorParallelRoles(const Model& whole, std::int32_t tp) : TensorParallelBase(whole, tp) {}

  // The plan, or the refusal that names what does not split.
  Result<TensorParallelPlan> run();

 private:
  Status find_roles();
  void index_ops();      // weights, readers and producers
  void find_branches();  // the branch outputs
  // What each weight matmul's outputs reach: the weight matmuls, and the loss.
  struct Reached {
    std::vector<std::set<std::size_t>> matmuls;
    std::vector<bool> loss;
  };
  Reached find_rowwise();  // the embeddings, rowwise projections and routers
  Status find_colwise(const Reached& reached);
  Status check_heads() const;
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

  TensorParallelPlan plan_;
  std::set<std::uint32_t> branch_;  // branch outputs (tensors)
};

// Rewrites the whole model by a plan (tensor_parallel_cut.cpp), op by op in forward order:
// layouts, collectives, scaling, then sizes.
class TensorParallelRewrite : TensorParallelBase {
 public:
  TensorParallelRewrite(const Model& whole, std::int32_t tp, const TensorParallelPlan& plan)
      : TensorParallelBase(whole, tp), plan_(plan) {}
  using TensorParallelBase::skip_validation;

  // One rank's model, or the refusal that names what does not split.
  Result<Model> run();

 private:
  // Tensor parallelism's collectives, inside one node.
  static constexpr Exchange kGather{kAllGatherKind, CollectiveKind::AllGather,
                                    CollectiveKind::ReduceScatter, MeshAxis::Tensor, 1};
  static constexpr Exchange kScatter{kReduceScatterKind, CollectiveKind::ReduceScatter,
                                     CollectiveKind::AllGather, MeshAxis::Tensor, 1};

  Status rewrite_op(std::size_t i);
  // An op's outputs' layout; `reduced`: whole outputs of split inputs (the loss's reductions).
  struct OpLayout {
    Layout result;
    bool reduced;
    bool scaled;  // 1/tp of the work
  };
  Layout layout_of(std::uint32_t t) const;
  // The rewrite reads tensors of `out_`, which holds the ones it adds after the whole model's.
  bool activation(std::uint32_t t) const { return out_.tensors[t].role == TensorRole::Activation; }
  const std::string& name_of(std::uint32_t t) const { return out_.tensors[t].name; }
  std::uint32_t new_tensor(std::uint32_t like, std::string name, Layout l);
  std::uint32_t scatter(std::uint32_t t, const ModelOp& near);
  std::uint32_t as_read(std::uint32_t t) const;
  bool sums_partials(const ModelOp& o, Role role, bool in_moe) const;
  void scatter_inputs(ModelOp& o);
  void gather_inputs(ModelOp& o, bool whole_operand);
  Result<OpLayout> derive_layout(const ModelOp& o, std::optional<std::int64_t> block) const;
  Status check_operands(const ModelOp& o, const RoleRule& rule) const;
  void mark_params(const ModelOp& o, std::size_t i, const RoleRule& rule);
  void lay_outputs(const ModelOp& o, const OpLayout& l);
  Status scale_work(ModelOp& o, const RoleRule& rule, bool scaled) const;
  std::vector<bool> held_state() const;
  Status size_tensors();

  const TensorParallelPlan& plan_;
  Model out_;                             // the rank's model
  std::vector<Layout> layout_;            // by tensor of out_
  std::vector<bool> assigned_;            // by tensor: an op's output, with a layout
  std::vector<bool> cut_param_;           // by tensor: a parameter cut by tp
  std::vector<bool> whole_param_;         // by tensor: a parameter read whole
  std::vector<std::uint32_t> scattered_;  // by tensor: a partial sum's scattered tensor, or itself
  // Token-split bytes gathered once: the base, offset and size of a tensor (or of the views of
  // one region that a trace gives each projection) -> the gathered tensor.
  std::map<std::tuple<std::uint32_t, std::int64_t, std::int64_t>, std::uint32_t> gathered_;
};

}  // namespace ferry::sim::rank_cut_detail
