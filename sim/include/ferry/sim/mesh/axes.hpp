#pragma once
/// The mesh's fields as one table (Note [One table of axes]): each field's file key, flag,
/// Python name, bounds and what it needs. The request layer, the model file reader, Mesh::make
/// and the rank cuts read their rules from here, and the Python module serves them to the
/// tracer.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ferry::sim {

// Note [One table of axes]
// A mesh is asked for by data-parallel ranks and their options (--fsdp, --nodes, --hsdp,
// --reshard-after-forward, --fsdp-impl, --reduce-dtype), the axes' degrees (--tp, --cp, --ep), an
// axis's option (--expert-capacity) and the pipeline's stages (--pp). Every edge spells a field its
// own way (a file's "hsdp", the flag --hsdp, Python's hsdp, the field Parallelism::replicas),
// bounds it, and refuses it without the field it needs. Those are rows of kMeshFields, in the order
// every check visits them, so the first error is the same whoever checks; each place that checks
// writes its own sentence from the row. The pipeline axis (pp) is one more row, read by the same
// loops; how its stages cut the model is its cut's (the pipeline's stages, each a mesh of the other
// axes).

/// A field of the mesh, in kMeshFields' order.
enum class MeshField : std::uint8_t {
  Fsdp,                 ///< data-parallel ranks (Parallelism::ranks)
  Nodes,                ///< nodes the GPUs span
  Hsdp,                 ///< HSDP replica groups (Parallelism::replicas)
  ReshardAfterForward,  ///< FSDP2's reshard_after_forward: true, false or K ranks
  FsdpImpl,             ///< fsdp2, simple or fsdp2-torch2.4
  ReduceDtype,          ///< the gradients' reduce dtype: param or float32
  Tp,                   ///< tensor-parallel GPUs a rank
  Cp,                   ///< context-parallel GPUs a rank
  Ep,                   ///< expert-parallel GPUs of the shard group
  ExpertCapacity,       ///< a static dispatcher's capacity factor under expert parallelism
  Pp,                   ///< pipeline stages, each a mesh of the other fields
};

/// One row of the table: how each edge names a field, its bounds, and what it needs.
struct MeshFieldRule {
  MeshField field;
  std::string_view name;    ///< the field as the simulator's Parallelism names it
  std::string_view key;     ///< the key of a file's "parallelism" section
  std::string_view flag;    ///< the command line's flag
  std::string_view python;  ///< the keyword Python's functions take
  /// The bounds of a number (a factor for expert_capacity, K for reshard_after_forward); both
  /// 0 for a field that is not a number.
  std::int64_t least = 0;
  std::int64_t most = 0;
  /// Set (other than field): this field, set to other than its default, needs `needs` at
  /// `needs_least` or more; `why` says why, empty where the rule is the plain "needs --fsdp N"
  /// of FSDP's own options.
  MeshField needs;
  std::int64_t needs_least = 0;
  std::string_view why{};
  [[nodiscard]] constexpr bool has_need() const { return needs != field; }
  [[nodiscard]] constexpr bool is_number() const { return most > 0; }
  /// Whether `value` is within least..most.
  [[nodiscard]] constexpr bool in_bounds(double value) const {
    return value >= static_cast<double>(least) && value <= static_cast<double>(most);
  }
};

/// The most data-parallel ranks, nodes and replica groups a mesh takes.
inline constexpr std::int64_t kMaxMeshRanks = 1'000'000;
/// The most GPUs of one axis (tensor, context or expert parallelism).
inline constexpr std::int64_t kMaxAxisRanks = 1024;
/// The most stages of a pipeline.
inline constexpr std::int64_t kMaxPipelineStages = 64;

/// Every field, in MeshField's order.
inline constexpr std::array<MeshFieldRule, 11> kMeshFields{{
    {.field = MeshField::Fsdp,
     .name = "ranks",
     .key = "fsdp",
     .flag = "--fsdp",
     .python = "fsdp",
     .least = 1,
     .most = kMaxMeshRanks,
     .needs = MeshField::Fsdp},
    {.field = MeshField::Nodes,
     .name = "nodes",
     .key = "nodes",
     .flag = "--nodes",
     .python = "nodes",
     .least = 1,
     .most = kMaxMeshRanks,
     .needs = MeshField::Fsdp,
     .needs_least = 1},
    {.field = MeshField::Hsdp,
     .name = "replicas",
     .key = "hsdp",
     .flag = "--hsdp",
     .python = "hsdp",
     .least = 1,
     .most = kMaxMeshRanks,
     .needs = MeshField::Fsdp,
     .needs_least = 1},
    {.field = MeshField::ReshardAfterForward,
     .name = "reshard_after_forward",
     .key = "reshard_after_forward",
     .flag = "--reshard-after-forward",
     .python = "reshard_after_forward",
     .least = 2,
     .most = kMaxMeshRanks,
     .needs = MeshField::Fsdp,
     .needs_least = 1},
    {.field = MeshField::FsdpImpl,
     .name = "impl",
     .key = "fsdp_impl",
     .flag = "--fsdp-impl",
     .python = "fsdp_impl",
     .needs = MeshField::Fsdp,
     .needs_least = 1},
    {.field = MeshField::ReduceDtype,
     .name = "reduce",
     .key = "reduce_dtype",
     .flag = "--reduce-dtype",
     .python = "reduce_dtype",
     .needs = MeshField::Fsdp,
     .needs_least = 1},
    {.field = MeshField::Tp,
     .name = "tp",
     .key = "tp",
     .flag = "--tp",
     .python = "tp",
     .least = 1,
     .most = kMaxAxisRanks,
     .needs = MeshField::Tp},
    {.field = MeshField::Cp,
     .name = "cp",
     .key = "cp",
     .flag = "--cp",
     .python = "cp",
     .least = 1,
     .most = kMaxAxisRanks,
     .needs = MeshField::Fsdp,
     .needs_least = 1,
     .why = "FSDP2 shards the parameters and reduces the gradients over the data-parallel and "
            "context-parallel ranks together, as torchtitan's dp_shard_cp does"},
    {.field = MeshField::Ep,
     .name = "ep",
     .key = "ep",
     .flag = "--ep",
     .python = "ep",
     .least = 1,
     .most = kMaxAxisRanks,
     .needs = MeshField::Fsdp,
     .needs_least = 1,
     .why = "expert parallelism splits the experts among GPUs of FSDP2's shard group, which "
            "shards each expert over the rest"},
    {.field = MeshField::ExpertCapacity,
     .name = "expert_capacity",
     .key = "expert_capacity",
     .flag = "--expert-capacity",
     .python = "expert_capacity",
     .least = 1,
     .most = 1024,
     .needs = MeshField::Ep,
     .needs_least = 2,
     .why = "a static dispatcher pads the rows expert parallelism exchanges"},
    {.field = MeshField::Pp,
     .name = "pp",
     .key = "pp",
     .flag = "--pp",
     .python = "pp",
     .least = 1,
     .most = kMaxPipelineStages,
     .needs = MeshField::Pp},
}};

/// The row of `field`.
[[nodiscard]] constexpr const MeshFieldRule& mesh_field(MeshField field) {
  return kMeshFields[static_cast<std::size_t>(field)];
}

/// Which of a row's names errors use: `&MeshFieldRule::name` (the default), `::flag` at the
/// command line and in requests, `::key` in files, `::python` in the tracer.
using MeshNames = std::string_view MeshFieldRule::*;

/// The fields FSDP's own options are: those that need --fsdp and give no reason of their own,
/// as "--nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype" (in `names`).
[[nodiscard]] std::string fsdp_option_list(MeshNames names);

}  // namespace ferry::sim
