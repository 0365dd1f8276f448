#pragma once
/// One rank's model under tensor, context or expert parallelism: the whole model cut as torch's
/// plans cut a transformer, with the collectives they run as ops of the model (Note [A rank's
/// model] in tensor_parallel_cut.hpp; each cut has its files beside rank_cut.hpp, what they share).

#include <cstdint>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/mesh/axes.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// The model one of `tp` tensor-parallel ranks runs, with sequence parallelism and a
/// vocabulary-parallel loss (torchtitan's default plan): projections into a layer's attention
/// and MLP cut by output features (colwise), the projections out of them by input features
/// (rowwise), the embedding table and the output head by vocabulary, the residual stream, its
/// norms and dropouts by tokens; an all-gather of a norm's output before the colwise
/// projections that read it and a reduce-scatter after each rowwise projection and after the
/// embedding (Model format, Collective ops), over a group of `tp` ranks inside one node.
/// Which projection is which follows from the dataflow and the shapes, never from names. With
/// `tp` 1, `whole` itself. Durations are left as they are: time the model on a device with
/// assign_roofline_durations (collective ops by their link). The error names the op or tensor
/// that does not split, with `--tp`.
Result<Model> tensor_parallel_model(const Model& whole, std::int32_t tp);

/// The model one of `cp` context-parallel ranks runs (Note [A context-parallel rank] in
/// context_parallel_cut.cpp): every activation computed from the inputs holds 1/cp of the tokens,
/// each op reading one does 1/cp of its work, and an all-gather of K and V over the context group
/// (a group spanning `nodes` nodes) runs before each fused attention kernel, which saves its local
/// K and V (torch's context_parallel with all-gather rotation). With `cp` 1, `whole` itself.
/// Durations are left as they are. Cuts a tensor-parallel rank's model as well as a whole one. The
/// error names the op or tensor that does not split, with `--cp`.
Result<Model> context_parallel_model(const Model& whole, std::int32_t cp, std::int32_t nodes = 1);

/// The model one of `ep` expert-parallel ranks runs (Note [An expert-parallel rank] in
/// expert_parallel_cut.cpp): each grouped expert matmul's weights hold 1/ep of the experts, and per
/// layer an all-to-all over the expert group (spanning `nodes` nodes) dispatches the routed rows
/// before the first grouped matmul and another combines them after the last. Where the trace gives
/// each expert's rows (ModelOp::group_rows), each layer is priced at the rank its routing loads
/// most; elsewhere routing is taken as balanced. With `ep` 1, `whole` itself. Durations are left as
/// they are. The error names the op or tensor that does not split, with `--ep`.
/// `capacity` (within kMeshFields' bounds; 0: none) is a static dispatcher's capacity factor: each
/// routed base activation is allocated for that many times its balanced rows (Note [Static
/// capacity] in expert_parallel_cut.cpp; ModelTensor::capacity); it needs `ep` 2 or more.
Result<Model> expert_parallel_model(const Model& whole, std::int32_t ep, std::int32_t nodes = 1,
                                    double capacity = 0);

/// How expert_parallel_model prices a model's routing.
enum class ExpertRouting : std::uint8_t {
  Balanced,     ///< every rank its even share of the routed rows
  BusiestRank,  ///< each layer at the rank its routing loads most (ModelOp::group_rows)
};

/// "balanced", "busiest_rank": the name the reports give it.
[[nodiscard]] std::string_view expert_routing_name(ExpertRouting routing);

/// How expert_parallel_model prices `model`'s routing: BusiestRank where a grouped matmul gives
/// its group rows, else Balanced.
[[nodiscard]] ExpertRouting expert_routing(const Model& model);

}  // namespace ferry::sim
