#pragma once
/// How a step trains across GPUs: the whole device mesh, FSDP2 (`fully_shard` on every layer and
/// the root, or HSDP) over data-parallel ranks and, within each rank, tensor, context and expert
/// parallelism, as the simulator runs it and a model or plan file's "parallelism" section records
/// it (docs/fsdp.md, docs/parallelism.md). The one value for it: the command line, Python and the
/// files turn what they are given into a Parallelism, bounded by the simulator's table of the
/// mesh's fields (sim/mesh/axes.hpp), which the simulator's Mesh checks once against a device.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ferry {

/// FSDP2's `reshard_after_forward`: what a layer keeps of its parameters from its forward to its
/// backward. True: reshard them to the shard group, so backward all-gathers them again; False:
/// keep them unsharded; K: keep a 1/K shard, which backward all-gathers over K ranks (torch's
/// int, 2 or more).
class Reshard {
 public:
  enum class Kind : std::uint8_t { True, False, K };

  constexpr Reshard() = default;  ///< True, torch's default
  [[nodiscard]] static constexpr Reshard True() { return Reshard(Kind::True, 0); }
  [[nodiscard]] static constexpr Reshard False() { return Reshard(Kind::False, 0); }
  /// A 1/`ranks` shard. Any `ranks` can be held; Mesh::make (sim) refuses one below 2 or one
  /// that does not divide the shard group.
  [[nodiscard]] static constexpr Reshard K(std::int32_t ranks) { return Reshard(Kind::K, ranks); }

  [[nodiscard]] constexpr Kind kind() const { return kind_; }
  /// K: the ranks a kept shard spans; 0 for True and False.
  [[nodiscard]] constexpr std::int32_t ranks() const { return ranks_; }

  friend constexpr bool operator==(Reshard, Reshard) = default;

 private:
  constexpr Reshard(Kind kind, std::int32_t ranks) : kind_(kind), ranks_(ranks) {}

  Kind kind_ = Kind::True;
  std::int32_t ranks_ = 0;
};

/// `r` as `--reshard-after-forward` takes it and reports print it: "true", "false" or K.
[[nodiscard]] inline std::string to_string(Reshard r) {
  switch (r.kind()) {
    case Reshard::Kind::True:
      return "true";
    case Reshard::Kind::False:
      return "false";
    case Reshard::Kind::K:
      break;
  }
  return std::to_string(r.ranks());
}

/// An axis of the device mesh besides data parallelism: the process group a rank's collective
/// op runs over (tensor, context or expert parallelism).
enum class MeshAxis : std::uint8_t { Tensor, Context, Expert };

/// `axis` as files and the command line name it: "tp", "cp" or "ep".
[[nodiscard]] constexpr std::string_view mesh_axis_name(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::Tensor:
      return "tp";
    case MeshAxis::Context:
      return "cp";
    case MeshAxis::Expert:
      break;
  }
  return "ep";
}

/// Which implementation shards the parameters: the same collectives and prefetch, with the
/// buffers from different pools (docs/fsdp.md, SimpleFSDP).
enum class FsdpImpl : std::uint8_t {
  /// torch's FSDP2: the all-gather output is allocated on its copy-in stream and the gradient
  /// shard on the reduce-scatter stream, each stream's pool holding what it freed.
  Fsdp2,
  /// SimpleFSDP (torchtitan's compiler-based FSDP, which its graph trainer runs): functional
  /// collectives in the step's graph, whose copy-in runs and whose outputs are allocated on the
  /// compute stream, one pool for all.
  Simple,
  /// FSDP2 as torch 2.4 and earlier ran it: the reduce-scatter's copy-in on the reduce-scatter
  /// stream, its input allocated in that stream's pool (until pytorch/pytorch#129721).
  Fsdp2Torch24,
};

/// Every implementation, in the order `--fsdp-impl` lists them.
inline constexpr FsdpImpl kFsdpImpls[] = {FsdpImpl::Fsdp2, FsdpImpl::Simple,
                                          FsdpImpl::Fsdp2Torch24};

/// `impl` as `--fsdp-impl` takes it and the files spell it: "fsdp2", "simple" or
/// "fsdp2-torch2.4".
[[nodiscard]] inline std::string to_string(FsdpImpl impl) {
  switch (impl) {
    case FsdpImpl::Simple:
      return "simple";
    case FsdpImpl::Fsdp2Torch24:
      return "fsdp2-torch2.4";
    case FsdpImpl::Fsdp2:
      break;
  }
  return "fsdp2";
}

/// The implementation `name` spells ("fsdp2", "simple" or "fsdp2-torch2.4"); none for any
/// other text.
[[nodiscard]] inline std::optional<FsdpImpl> parse_fsdp_impl(std::string_view name) {
  for (const FsdpImpl impl : kFsdpImpls) {
    if (name == to_string(impl)) return impl;
  }
  return std::nullopt;
}

/// The dtype FSDP reduces gradients in (MixedPrecisionPolicy's reduce_dtype), with bf16 or
/// fp16 compute over float32 sharded parameters (docs/fsdp.md, The reduce dtype).
enum class ReduceDtype : std::uint8_t {
  /// The gradients' own dtype, the parameters' compute dtype: torch's when reduce_dtype is None
  /// or equals param_dtype (`_fsdp_collectives.py`, foreach_reduce), as accelerate's and the
  /// Hugging Face Trainer's bf16 policy set it. The reduced shard is cast to float32 after.
  Param,
  /// float32: the gradients are cast into a float32 reduce-scatter input (torchtitan's
  /// `mixed_precision_reduce = "float32"`, its default).
  Float32,
};

/// Every reduce dtype, in the order `--reduce-dtype` lists them.
inline constexpr ReduceDtype kReduceDtypes[] = {ReduceDtype::Param, ReduceDtype::Float32};

/// `dtype` as `--reduce-dtype` takes it and the files spell it: "param" or "float32".
[[nodiscard]] inline std::string to_string(ReduceDtype dtype) {
  return dtype == ReduceDtype::Float32 ? "float32" : "param";
}

/// The reduce dtype `name` spells ("param" or "float32"); none for any other text.
[[nodiscard]] inline std::optional<ReduceDtype> parse_reduce_dtype(std::string_view name) {
  for (const ReduceDtype dtype : kReduceDtypes) {
    if (name == to_string(dtype)) return dtype;
  }
  return std::nullopt;
}

/// FSDP2 (or HSDP) over `ranks` symmetric data-parallel ranks, each of them `cp` x `tp` GPUs of
/// context and tensor parallelism (torchtitan's mesh [dp_replicate, dp_shard, cp, tp], tp
/// innermost: a tensor-parallel group is `tp` consecutive GPUs, a context-parallel group every
/// tp-th GPU of `cp` x `tp` consecutive ones). FSDP shards over the shard group's data-parallel
/// and context-parallel ranks together (torchtitan's dp_shard_cp); expert parallelism splits
/// the experts among `ep` consecutive GPUs, a multiple of the tensor-parallel group (whose GPUs
/// each compute the routed rows of their share of the tokens: torchtitan's expert tensor
/// parallel degree 1). ranks == 0: no FSDP (and no context or expert parallelism); with tp 1
/// too, one GPU holds the model. A pipeline of `pp` stages runs each stage on such a mesh
/// (docs/pipeline.md): world() and what follows from it are one stage's.
struct Parallelism {
  std::int32_t ranks = 0;     ///< data-parallel ranks in all (replicas x shard group); 0: no FSDP
  std::int32_t nodes = 0;     ///< nodes the GPUs span; 0: as few as gpus_per_node allow
  std::int32_t replicas = 1;  ///< HSDP replica groups; parameters shard over ranks / replicas
  Reshard reshard_after_forward{};
  FsdpImpl impl = FsdpImpl::Fsdp2;
  ReduceDtype reduce = ReduceDtype::Param;  ///< the gradients' reduce-scatter dtype
  std::int32_t tp = 1;  ///< tensor-parallel GPUs per data-parallel rank (docs/parallelism.md)
  std::int32_t cp = 1;  ///< context-parallel GPUs per data-parallel rank (docs/parallelism.md)
  /// Expert-parallel GPUs: a mixture of experts' experts split among `ep` consecutive GPUs,
  /// which FSDP shards each expert over every ep-th of (docs/parallelism.md).
  std::int32_t ep = 1;
  /// A static dispatcher's capacity factor under expert parallelism: each GPU's routed rows are
  /// allocated for this many times a balanced routing's (docs/parallelism.md, Static capacity
  /// and the paged stash); 0: allocated as routed.
  double expert_capacity = 0;
  /// Pipeline stages (docs/pipeline.md), 1..64, each run by the mesh of the fields above, one
  /// stage's GPUs after another's; 1: no pipeline.
  std::int32_t pp = 1;

  /// Whether FSDP runs.
  [[nodiscard]] constexpr bool on() const { return ranks > 0; }
  /// Whether a stage runs on more than one GPU, by FSDP or tensor parallelism.
  [[nodiscard]] constexpr bool sharded() const { return ranks > 0 || tp > 1 || cp > 1; }
  /// The GPUs of one stage (of all, without a pipeline): data-parallel ranks times context- and
  /// tensor-parallel ones. The nodes and the node's share below are one stage's too, as a
  /// stage's collectives and its GPUs' pinned host memory see them.
  [[nodiscard]] constexpr std::int32_t world() const { return (ranks > 0 ? ranks : 1) * cp * tp; }
  /// The GPUs one parameter is sharded over by FSDP: a shard group's data-parallel ranks times
  /// their context-parallel ones.
  [[nodiscard]] constexpr std::int32_t shard_group() const { return ranks / replicas * cp; }
  /// The GPUs one expert's parameters are sharded over by FSDP: the shard group's GPUs and
  /// their tensor-parallel ones over the expert-parallel GPUs (torchtitan's efsdp).
  [[nodiscard]] constexpr std::int32_t expert_shard_group() const {
    return shard_group() * tp / ep;
  }
  /// The nodes the GPUs span on a device with `gpus_per_node` GPUs a node.
  [[nodiscard]] constexpr std::int32_t node_count(std::int32_t gpus_per_node) const {
    return nodes > 0 ? nodes : (world() + gpus_per_node - 1) / gpus_per_node;
  }
  /// The GPUs each node holds (laid out evenly over node_count nodes).
  [[nodiscard]] constexpr std::int32_t ranks_per_node(std::int32_t gpus_per_node) const {
    return world() / node_count(gpus_per_node);
  }

  friend bool operator==(const Parallelism&, const Parallelism&) = default;
};

}  // namespace ferry
