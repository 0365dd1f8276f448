#include "ferry/sim/mesh/mesh.hpp"

#include "ferry/sim/mesh/rules.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>

namespace ferry::sim {

std::string fsdp_option_list(MeshNames names) {
  std::string list;
  std::string last;
  for (const MeshFieldRule& row : kMeshFields) {
    if (!row.has_need() || row.needs != MeshField::Fsdp || !row.why.empty()) continue;
    if (!last.empty()) list += list.empty() ? last : ", " + last;
    last = std::string(row.*names);
  }
  return list.empty() ? last : list + " and " + last;
}

namespace {

// `field`'s name as `names` spells it.
std::string_view named(MeshNames names, MeshField field) { return mesh_field(field).*names; }

// The ranks of `field` (a degree) out of its bounds, as a mesh's check words it.
Status ranks_in_bounds(MeshNames names, MeshField field, std::int64_t ranks) {
  const MeshFieldRule& row = mesh_field(field);
  if (row.in_bounds(static_cast<double>(ranks))) return Ok{};
  return Error{fmt::format("{}: {} ranks (use {} to {})", row.*names, ranks, row.least, row.most)};
}

// `field` set without the field it needs (kMeshFields' rule), in a mesh's words.
Status needs_met(MeshNames names, MeshField field, std::int64_t value, std::int64_t needed) {
  const MeshFieldRule& row = mesh_field(field);
  if (value <= 1 || needed >= row.needs_least) return Ok{};
  if (field == MeshField::Cp) {
    return Error{fmt::format("{} {} needs {} N: {} ({} 1 for context parallelism alone)",
                             row.*names, value, named(names, row.needs), row.why,
                             named(names, row.needs))};
  }
  return Error{
      fmt::format("{} {} needs {} N: {}", row.*names, value, named(names, row.needs), row.why)};
}

// A group of `span` consecutive GPUs' nodes, `per_node` to a node (make has checked that a
// context-parallel group fills a node evenly or whole nodes).
std::int32_t span_nodes(std::int32_t span, std::int32_t per_node) {
  return std::max(1, span / per_node);
}

// `p`'s numbers within kMeshFields' bounds and needs: the degrees, the ranks under FSDP and the
// expert capacity (parallelism_of and read_parallelism bound them alike where they read them).
Status bounds_met(const Parallelism& p, MeshNames names) {
  for (const MeshField field : {MeshField::Tp, MeshField::Cp, MeshField::Ep}) {
    const std::int32_t ranks = field == MeshField::Tp ? p.tp : field == MeshField::Cp ? p.cp : p.ep;
    if (auto bounded = ranks_in_bounds(names, field, ranks); !bounded) return bounded;
  }
  if (p.on()) {
    if (auto bounded = ranks_in_bounds(names, MeshField::Fsdp, p.ranks); !bounded) return bounded;
  }
  const MeshFieldRule& factor = mesh_field(MeshField::ExpertCapacity);
  if (p.expert_capacity != 0 && !factor.in_bounds(p.expert_capacity)) {
    return Error{fmt::format("{}: {} (use a factor from {} to {})", factor.*names,
                             p.expert_capacity, factor.least, factor.most)};
  }
  if (p.expert_capacity != 0 && p.ep < factor.needs_least) {
    return Error{fmt::format("{} needs {} {} or more: {}", factor.*names,
                             named(names, factor.needs), factor.needs_least, factor.why)};
  }
  if (const MeshFieldRule& stages = mesh_field(MeshField::Pp); !stages.in_bounds(p.pp)) {
    return Error{fmt::format("{}: {} stages (use {} to {})", stages.*names, p.pp, stages.least,
                             stages.most)};
  }
  return Ok{};
}

// A tensor-parallel group inside one node of `device`, over its intra-node links.
Status tensor_group_fits(const Parallelism& p, const DeviceProfile& device, MeshNames names) {
  const CollectiveLinks& links = device.collectives;
  if (p.tp <= 1) return Ok{};
  if (links.gpus_per_node % p.tp != 0) {
    return Error{fmt::format(
        "{}: {} ranks do not fit a node of {} GPUs (device {}): a tensor-parallel group lies "
        "inside one node, and the node's GPUs hold whole groups",
        named(names, MeshField::Tp), p.tp, links.gpus_per_node, device.name)};
  }
  if (!links.intra_node.known()) {
    return Error{
        fmt::format("device {} has no \"collectives\" links: {} {} needs the intra-node bandwidth "
                    "(docs/devices.md)",
                    device.name, named(names, MeshField::Tp), p.tp)};
  }
  return Ok{};
}

// Expert parallelism with the data-parallel ranks it needs, over whole tensor-parallel groups;
// context parallelism with the ranks it needs.
Status axes_needs_met(const Parallelism& p, MeshNames names) {
  const auto name = [names](MeshField field) { return named(names, field); };
  if (auto needs = needs_met(names, MeshField::Ep, p.ep, p.ranks); !needs) return needs;
  if (p.ep > 1 && p.ep % p.tp != 0) {
    return Error{fmt::format(
        "{} {} with {} {}: expert parallelism takes in the tensor-parallel GPUs (each computes "
        "the routed rows of its share of the tokens, torchtitan's expert tensor parallel degree "
        "1), so {} must be a multiple of {}",
        name(MeshField::Ep), p.ep, name(MeshField::Tp), p.tp, name(MeshField::Ep),
        name(MeshField::Tp))};
  }
  return needs_met(names, MeshField::Cp, p.cp, p.ranks);
}

// FSDP's ranks in whole HSDP replica groups.
Status replicas_divide(const Parallelism& p, MeshNames names) {
  if (p.replicas >= 1 && p.ranks % p.replicas == 0) return Ok{};
  return Error{fmt::format("{}: {} replica groups do not divide {} ranks",
                           named(names, MeshField::Hsdp), p.replicas, p.ranks)};
}

// The GPUs of a node under FSDP's `p` on `device`: the replica groups divide the ranks, the
// nodes hold them evenly, a context-parallel group fits them, expert parallelism divides the
// shard group and a kept shard's ranks divide it.
Result<std::int32_t> ranks_per_node(const Parallelism& p, const DeviceProfile& device,
                                    MeshNames names) {
  const auto name = [names](MeshField field) { return named(names, field); };
  if (auto divided = replicas_divide(p, names); !divided) return divided.error();
  const std::int32_t gpus_per_node = device.collectives.gpus_per_node;
  const std::int32_t nodes = p.node_count(gpus_per_node);
  const std::int32_t world = p.world();
  if (nodes < 1 || world % nodes != 0 || world / nodes > gpus_per_node ||
      (world / nodes) % p.tp != 0) {
    return Error{fmt::format(
        "{}: {} ranks over {} nodes of {} GPUs (device {}): the nodes must hold the ranks "
        "evenly",
        name(MeshField::Nodes), world, nodes, gpus_per_node, device.name)};
  }
  // A context-parallel group (every tp-th GPU of cp x tp consecutive ones) lies inside a node
  // or spans whole nodes.
  const std::int32_t per_node = world / nodes;
  const std::int32_t context_span = p.cp * p.tp;
  if (p.cp > 1 && per_node % context_span != 0 && context_span % per_node != 0) {
    return Error{fmt::format(
        "{}: {} ranks (times {} of tensor parallelism) neither fit a node's {} GPUs evenly nor "
        "span whole nodes (device {})",
        name(MeshField::Cp), p.cp, p.tp, per_node, device.name)};
  }
  if (p.ep > 1 && (p.shard_group() * p.tp) % p.ep != 0) {
    return Error{
        fmt::format("{}: {} ranks do not divide the shard group's {} GPUs (data-parallel times "
                    "context-parallel{}), among which expert parallelism splits the experts",
                    name(MeshField::Ep), p.ep, p.shard_group() * p.tp,
                    p.tp > 1 ? " times tensor-parallel" : "")};
  }
  const Reshard reshard = p.reshard_after_forward;
  if (reshard.kind() == Reshard::Kind::K &&
      (reshard.ranks() < 2 || p.shard_group() % reshard.ranks() != 0 ||
       p.expert_shard_group() % reshard.ranks() != 0)) {
    return Error{fmt::format(
        "{}: {} must be true, false or a number of ranks that divides the shard group ({}{})",
        name(MeshField::ReshardAfterForward), reshard.ranks(), p.shard_group(),
        p.ep > 1 ? fmt::format(", and the experts' {}", p.expert_shard_group()) : "")};
  }
  return per_node;
}

// The links FSDP's collectives run over: within a node, and across nodes where it spans more.
Status data_parallel_links(const Parallelism& p, const DeviceProfile& device, MeshNames names) {
  const CollectiveLinks& links = device.collectives;
  if (p.ranks * p.cp > 1 && !links.intra_node.known()) {
    return Error{fmt::format(
        "device {} has no \"collectives\" links: {} {} needs the intra-node (and, across "
        "nodes, the inter-node) bandwidth (docs/devices.md)",
        device.name, named(names, MeshField::Fsdp), p.ranks)};
  }
  const std::int32_t nodes = p.node_count(links.gpus_per_node);
  if (nodes > 1 && !links.inter_node.known()) {
    return Error{fmt::format("device {} has no inter-node link: {} {} spans {} nodes", device.name,
                             named(names, MeshField::Fsdp), p.ranks, nodes)};
  }
  return Ok{};
}

}  // namespace

Status check_mesh_rules(const Parallelism& p, MeshNames names) {
  if (auto bounded = bounds_met(p, names); !bounded) return bounded;
  if (auto needs = axes_needs_met(p, names); !needs) return needs;
  return p.on() ? replicas_divide(p, names) : Status{Ok{}};
}

Result<Mesh> Mesh::make(const Parallelism& p, const DeviceProfile& device, MeshNames names) {
  // Each step reads what the ones before it checked (a degree of 1 or more first).
  if (auto bounded = bounds_met(p, names); !bounded) return bounded.error();
  if (auto fits = tensor_group_fits(p, device, names); !fits) return fits.error();
  if (auto needs = axes_needs_met(p, names); !needs) return needs.error();
  if (!p.on()) {
    if (p.nodes > 1) {
      return Error{fmt::format("{}: {} GPUs of tensor parallelism lie inside one node, not {}",
                               named(names, MeshField::Nodes), p.tp, p.nodes)};
    }
    return Mesh(p, std::max(1, p.ranks_per_node(device.collectives.gpus_per_node)),
                device.collectives.gpus_per_node);
  }
  auto per_node = ranks_per_node(p, device, names);
  if (!per_node) return per_node.error();
  if (auto linked = data_parallel_links(p, device, names); !linked) return linked.error();
  return Mesh(p, per_node.value(), device.collectives.gpus_per_node);
}

Mesh::Mesh(const Parallelism& p, std::int32_t per_node, std::int32_t gpus_per_node)
    : p_(p), per_node_(per_node) {
  if (p.pp <= 1) return;
  // Stages are laid out one after another (the pipeline outermost): one that spans nodes fills
  // its own, one inside a node shares it with as many whole stages as fit.
  const std::int32_t world = p.world();
  stages_per_node_ = p.node_count(std::max(1, gpus_per_node)) > 1
                         ? per_node
                         : std::max(1, gpus_per_node / world) * world;
}

MeshGroup Mesh::group(Axis axis) const {
  // Rank 0's groups, GPUs laid out tensor-parallel group by group, then shard group by shard
  // group, then stage by stage (Parallelism): a shard group is every tp-th GPU of consecutive
  // ones, a replica group one member of each shard group, an expert's shard group every ep-th
  // GPU, the pipeline group one GPU of each stage.
  const auto placed = [this](std::int32_t size, std::int32_t stride) {
    if (size < 1) size = 1;
    const GroupPlacement at = place_group(size, stride, per_node_);
    return MeshGroup{size, at.nodes, stride, at.sharing};
  };
  switch (axis) {
    case Axis::Shard:
      return placed(p_.shard_group(), p_.tp);
    case Axis::Replicate:
      return placed(p_.replicas, std::max(1, p_.shard_group() * p_.tp));
    case Axis::Tensor:
      return MeshGroup{p_.tp, 1, 1};
    case Axis::Context: {
      const std::int32_t nodes = span_nodes(p_.cp * p_.tp, per_node_);
      return MeshGroup{p_.cp, nodes, p_.tp, groups_sharing_a_node(p_.tp, per_node_, nodes)};
    }
    case Axis::Expert:
      return MeshGroup{p_.ep, span_nodes(p_.ep, per_node_), 1};
    case Axis::Pipeline:
      return MeshGroup{p_.pp, place_group(p_.pp, p_.world(), stages_per_node_).nodes, p_.world()};
    case Axis::ExpertShard:
      break;
  }
  return placed(p_.expert_shard_group(), p_.ep);
}

std::int32_t Mesh::node_of_stage(std::int32_t stage) const {
  if (p_.pp <= 1) return 0;
  return static_cast<std::int32_t>(std::int64_t{stage} * p_.world() / stages_per_node_);
}

MeshGroup Mesh::kept_shard(Axis shard) const {
  const std::int32_t keep = std::max(1, p_.reshard_after_forward.ranks());
  const std::int32_t stride = group(shard).stride;
  const GroupPlacement at = place_group(keep, stride, per_node_);
  return MeshGroup{keep, at.nodes, stride, at.sharing};
}

DeviceProfile Mesh::rank_profile(DeviceProfile profile) const {
  if (!p_.sharded()) return profile;
  // The node's pinned host memory is shared by its GPUs: each gets an even part.
  const std::int32_t nodes = p_.node_count(profile.collectives.gpus_per_node);
  const std::int32_t per_node = std::max(1, p_.world() / std::max(1, nodes));
  profile.pinned_host_capacity = Bytes(profile.pinned_host_capacity.count() / per_node);
  return profile;
}

}  // namespace ferry::sim
