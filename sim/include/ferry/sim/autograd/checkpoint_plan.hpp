#pragma once
/// Where and how a simulated training run checkpoints, and the builders of the usual plans.

#include <cstdint>
#include <optional>
#include <vector>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// What selective checkpointing does with one op inside a checkpointed region.
enum class OpPolicy : std::uint8_t {
  PreferRecompute,  ///< re-run it in backward (plain checkpointing)
  MustSave,         ///< keep its outputs from forward; recompute reads them instead
  Offload,          ///< keep its outputs on the host; recompute reloads them
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
[[nodiscard]] CheckpointPlan checkpoint_segments(const Model& model, std::int32_t segments,
                                                 bool reentrant);
/// Megatron-style selective policy inside regions: the attention core (scores, softmax and its
/// dropout, attention over values) is recomputed, everything else saved.
void apply_selective_policy(CheckpointPlan& plan, const Model& model);

/// torchtitan's op-level selective activation checkpointing (`--activation-checkpoint.mode
/// selective --selective-ac-option op`): in each layer's region the attention op's outputs
/// are saved, and of the matmuls (ops doing at least 64 FLOPs per output element) the first,
/// third, fifth... are saved and the others recomputed; every other op is recomputed. See
/// docs/fsdp.md for where this differs from torchtitan's (a fused QKV projection is one matmul).
void apply_op_sac_policy(CheckpointPlan& plan, const Model& model);

}  // namespace ferry::sim
