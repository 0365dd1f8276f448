#pragma once
/// Where and how a simulated training run checkpoints, and the builders of the usual plans.

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// What selective checkpointing does with one op inside a checkpointed region.
enum class OpPolicy : std::uint8_t {
  PreferRecompute,  ///< re-run it in backward (plain checkpointing)
  MustSave,         ///< keep its outputs from forward; recompute reads them instead
  Offload,          ///< keep its outputs on the host; recompute reloads them
  /// Neither keep its outputs nor re-run it: no backward reads them, directly or through a
  /// recomputed op (a compiled graph's saved op whose outputs only other saved ops read).
  Dropped,
};

/// A checkpointed range of ops [first_op, end_op).
struct CheckpointRegion {
  std::uint32_t first_op = 0;
  std::uint32_t end_op = 0;
  bool reentrant = false;          ///< the reentrant variant: no graph inside, full recompute
  std::optional<bool> early_stop;  ///< per call; unset: true
};

/// Where and how to checkpoint.
struct CheckpointPlan {
  std::vector<CheckpointRegion> regions;  ///< non-reentrant regions may nest; no overlaps
  std::optional<bool> global_early_stop;  ///< set_checkpoint_early_stop: overrides per call
  bool preserve_rng = true;
  bool determinism_check = true;
  bool content_check = false;       ///< also compare content hashes on recompute
  std::vector<OpPolicy> op_policy;  ///< by op index; missing: PreferRecompute
  bool lazy_device_rng = false;     ///< the device generator starts at its first draw
};

/// One region per `k` transformer layers (ops with layer >= 0), non-reentrant.
[[nodiscard]] CheckpointPlan checkpoint_every(const Model& model, std::int32_t k);
/// checkpoint_sequential: `segments` contiguous segments, every one but the last checkpointed.
/// A reentrant segment ends at an op with an output (the tensor it returns), so it may take a
/// few more ops than an even split.
[[nodiscard]] CheckpointPlan checkpoint_segments(const Model& model, std::int32_t segments,
                                                 bool reentrant);
/// Ops [first_op, end_op) of a model.
struct OpSpan {
  std::uint32_t first_op = 0;
  std::uint32_t end_op = 0;
};
/// The attention cores of a model's layers, in op order: a fused attention kernel, or in eager
/// attention the batched matmuls before and after a softmax and the ops between (scaling, mask,
/// softmax, its dropout). Ops are told apart by ModelOp::kind. See Note [Ops by what they are].
[[nodiscard]] std::vector<OpSpan> attention_cores(const Model& model);
/// A selective policy inside regions: the attention cores recomputed, everything else saved.
void apply_selective_policy(CheckpointPlan& plan, const Model& model);
/// What a compiled graph keeps of a selective policy: each saved op (MustSave) of a
/// non-reentrant region whose outputs no backward reads, neither as a saved tensor of a
/// region's op nor as an input of an op a replay re-runs, becomes OpPolicy::Dropped. See Note
/// [What a compiled graph keeps] in checkpoint_plan.cpp.
void drop_unread_saves(CheckpointPlan& plan, const Model& model);
/// Megatron-style selective recomputation (`--recompute-granularity selective`): each attention
/// core is a region of its own, and the rest of every layer is outside any region.
[[nodiscard]] CheckpointPlan checkpoint_attention_cores(const Model& model);

/// torchtitan's op-level selective activation checkpointing (`SelectiveAC`, the default
/// selective mode): in each region the outputs of the operators on torchtitan's save list
/// (matmuls, every attention kernel, `max`, `topk`, the collectives) are saved and every other
/// op is recomputed, except that of `aten.mm` and `aten.linear` only the first, third, fifth...
/// of the region are saved. Ops are told apart by ModelOp::kind; an op of a region without a
/// kind is an error naming it. docs/checkpoint.md lists the operators and the source.
/// `MatmulSaving::Every` is the default memory policy of torchtitan's compiled graph trainer:
/// every matmul on the list saved, and, as the partitioner of a joint graph saves only what
/// backward needs, a saved op whose outputs no backward reads, directly or through a
/// recomputed op, is neither kept nor recomputed (OpPolicy::Dropped; Note [What a compiled
/// graph keeps] in checkpoint_plan.cpp).
enum class MatmulSaving : std::uint8_t { Alternate, Every };
[[nodiscard]] Status apply_op_sac_policy(CheckpointPlan& plan, const Model& model,
                                         MatmulSaving matmuls = MatmulSaving::Alternate);

/// Whether op-level selective checkpointing counts `kind` among the matmuls of which it saves
/// every other one: `aten.mm.default` and `aten.linear.default`, the exact overloads torchtitan
/// compares.
[[nodiscard]] bool op_sac_alternates(std::string_view kind);

}  // namespace ferry::sim
