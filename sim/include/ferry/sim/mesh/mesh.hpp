#pragma once
/// The device mesh a step trains on: a Parallelism checked once against the device its runs
/// use (Mesh::make), and the process groups of rank 0 it implies, which FSDP, the rank cuts and
/// the reports read instead of working them out again.

#include <cstdint>

#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/collective_cost.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/mesh/axes.hpp"

namespace ferry::sim {

/// One process group of rank 0: its GPUs, the nodes they span and how far apart its members
/// are (in GPUs, laid out as Parallelism describes).
struct MeshGroup {
  std::int32_t size = 1;
  std::int32_t nodes = 1;
  std::int32_t stride = 1;
  /// Groups of its axis crossing a node's links at once (Note [Groups sharing a node's links]
  /// in collective_cost.cpp); 1 inside a node.
  std::int32_t sharing = 1;
  /// The group as the link model prices a collective over it.
  [[nodiscard]] GroupPlacement placement() const { return GroupPlacement{size, nodes, sharing}; }
  friend bool operator==(const MeshGroup&, const MeshGroup&) = default;
};

/// A Parallelism that Mesh::make accepted against the device its runs use, checked once where
/// it is chosen: the runs, each rank's FSDP and the cuts take it and do not check it again, as
/// the simulations take a CheckedModel. The default is one GPU, which needs no check.
class Mesh {
 public:
  /// rank 0's groups: FSDP's shard group (data-parallel times context-parallel GPUs, every
  /// tp-th), an HSDP replica group (one GPU of each shard group), the tensor-parallel group,
  /// the context-parallel group, the expert-parallel group, an expert's shard group (every
  /// ep-th GPU), and the pipeline group (rank 0 of each stage: pp GPUs, one stage's apart).
  enum class Axis : std::uint8_t {
    Shard,
    Replicate,
    Tensor,
    Context,
    Expert,
    ExpertShard,
    Pipeline
  };

  Mesh() = default;

  /// `p` checked once: its numbers against kMeshFields' bounds and needs, then against
  /// `device`'s links and node size; the error names the field as `names` spells it
  /// (&MeshFieldRule::flag at the command line). A request (parallelism_of) and a model file
  /// (read_parallelism) bound the numbers alike where they read them, so the first error is the
  /// same whichever checks.
  static Result<Mesh> make(const Parallelism& p, const DeviceProfile& device,
                           MeshNames names = &MeshFieldRule::name);

  [[nodiscard]] const Parallelism& parallelism() const { return p_; }
  operator const Parallelism&() const { return p_; }  // NOLINT(google-explicit-constructor)
  /// Whether FSDP runs.
  [[nodiscard]] bool on() const { return p_.on(); }
  /// Whether any axis cuts a rank's model (tensor, context or expert parallelism).
  [[nodiscard]] bool cuts() const { return p_.tp > 1 || p_.cp > 1 || p_.ep > 1; }
  /// The GPUs each node holds.
  [[nodiscard]] std::int32_t per_node() const { return per_node_; }
  /// rank 0's group along `axis`.
  [[nodiscard]] MeshGroup group(Axis axis) const;
  /// The node, counted from 0, that holds rank 0 of pipeline stage `stage` (0 without a
  /// pipeline): the stages fill nodes one after another.
  [[nodiscard]] std::int32_t node_of_stage(std::int32_t stage) const;
  /// The group a 1/K shard kept after forward spans (reshard_after_forward K), for a unit
  /// sharded along `shard` (Axis::Shard, or Axis::ExpertShard for a layer's experts).
  [[nodiscard]] MeshGroup kept_shard(Axis shard) const;
  /// The device as one rank sees it: with more than one GPU, its even part of the node's pinned
  /// host memory.
  [[nodiscard]] DeviceProfile rank_profile(DeviceProfile profile) const;

  friend bool operator==(const Mesh&, const Mesh&) = default;

 private:
  Mesh(const Parallelism& p, std::int32_t per_node, std::int32_t gpus_per_node);

  Parallelism p_{};
  std::int32_t per_node_ = 1;
  /// With pp 2 or more, the GPUs of a node as the stages fill it: a stage inside one node
  /// shares it with the next stages that fit; 1 without a pipeline.
  std::int32_t stages_per_node_ = 1;
};

}  // namespace ferry::sim
