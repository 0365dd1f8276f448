#include "ferry/sim/io/parallelism_json.hpp"

#include <algorithm>
#include <array>
#include <string_view>

#include "ferry/sim/mesh/axes.hpp"

namespace ferry::sim {
namespace {

// torch's value: a bool, or the int K.
nlohmann::ordered_json reshard_json(Reshard r) {
  switch (r.kind()) {
    case Reshard::Kind::True:
      return true;
    case Reshard::Kind::False:
      return false;
    case Reshard::Kind::K:
      break;
  }
  return r.ranks();
}

}  // namespace

Result<Parallelism> read_parallelism(const JsonValue& value) {
  // The keys, bounds and needs are kMeshFields' (Note [One table of axes]).
  std::array<std::string_view, kMeshFields.size()> keys{};
  std::ranges::transform(kMeshFields, keys.begin(), &MeshFieldRule::key);
  FERRY_JSON_TRY(const auto object, value.object(keys));
  const auto key = [](MeshField field) { return mesh_field(field).key; };
  const auto optional = [&](MeshField field, std::int64_t fallback) {
    const MeshFieldRule& row = mesh_field(field);
    return object.optional_integer(row.key, fallback, row.least, row.most);
  };
  Parallelism p;
  FERRY_JSON_TRY(const auto tp, optional(MeshField::Tp, 1));
  p.tp = static_cast<std::int32_t>(tp);
  FERRY_JSON_TRY(const auto cp, optional(MeshField::Cp, 1));
  p.cp = static_cast<std::int32_t>(cp);
  FERRY_JSON_TRY(const auto ep, optional(MeshField::Ep, 1));
  p.ep = static_cast<std::int32_t>(ep);
  const MeshFieldRule& factor = mesh_field(MeshField::ExpertCapacity);
  if (const auto capacity = object.optional(factor.key)) {
    const auto& json = capacity->json();
    if (!json.is_number() || !factor.in_bounds(json.get<double>())) {
      return capacity->error("expected a capacity factor from {} to {}", factor.least, factor.most);
    }
    if (p.ep < factor.needs_least) {
      return capacity->error("a capacity factor needs \"{}\" {} or more", key(factor.needs),
                             factor.needs_least);
    }
    p.expert_capacity = json.get<double>();
  }
  FERRY_JSON_TRY(const auto pp, optional(MeshField::Pp, 1));
  p.pp = static_cast<std::int32_t>(pp);
  // FSDP's ranks, which tensor parallelism or a pipeline alone leaves out.
  if (!object.has(key(MeshField::Fsdp)) &&
      (object.has(key(MeshField::Tp)) || object.has(key(MeshField::Pp)))) {
    return p;
  }
  const MeshFieldRule& fsdp = mesh_field(MeshField::Fsdp);
  FERRY_JSON_TRY(const auto ranks, object.required_integer(fsdp.key, fsdp.least, fsdp.most));
  FERRY_JSON_TRY(const auto nodes, optional(MeshField::Nodes, 0));
  FERRY_JSON_TRY(const auto hsdp, optional(MeshField::Hsdp, 1));
  p.ranks = static_cast<std::int32_t>(ranks);
  p.nodes = static_cast<std::int32_t>(nodes);
  p.replicas = static_cast<std::int32_t>(hsdp);
  const MeshFieldRule& keep = mesh_field(MeshField::ReshardAfterForward);
  if (auto reshard = object.optional(keep.key)) {
    if (reshard->json().is_boolean()) {
      p.reshard_after_forward = reshard->json().get<bool>() ? Reshard::True() : Reshard::False();
    } else {
      FERRY_JSON_TRY(const auto k, reshard->integer(keep.least, keep.most));
      p.reshard_after_forward = Reshard::K(static_cast<std::int32_t>(k));
    }
  }
  if (auto impl = object.optional(key(MeshField::FsdpImpl))) {
    FERRY_JSON_TRY(const auto name, impl->string());
    const auto parsed = parse_fsdp_impl(name);
    if (!parsed) return impl->error("expected \"fsdp2\" or \"simple\", got \"{}\"", name);
    p.impl = *parsed;
  }
  if (auto reduce = object.optional(key(MeshField::ReduceDtype))) {
    FERRY_JSON_TRY(const auto name, reduce->string());
    const auto parsed = parse_reduce_dtype(name);
    if (!parsed) return reduce->error("expected \"param\" or \"float32\", got \"{}\"", name);
    p.reduce = *parsed;
  }
  return p;
}

nlohmann::ordered_json parallelism_json(const Parallelism& p) {
  nlohmann::ordered_json j;
  if (!p.on()) {
    if (p.tp > 1 || p.pp == 1) j["tp"] = p.tp;
    if (p.pp > 1) j["pp"] = p.pp;
    return j;
  }
  j["fsdp"] = p.ranks;
  if (p.nodes > 0) j["nodes"] = p.nodes;
  if (p.replicas > 1) j["hsdp"] = p.replicas;
  if (p.reshard_after_forward != Reshard::True()) {
    j["reshard_after_forward"] = reshard_json(p.reshard_after_forward);
  }
  if (p.impl != FsdpImpl::Fsdp2) j["fsdp_impl"] = to_string(p.impl);
  if (p.reduce != ReduceDtype::Param) j["reduce_dtype"] = to_string(p.reduce);
  if (p.tp > 1) j["tp"] = p.tp;
  if (p.cp > 1) j["cp"] = p.cp;
  if (p.ep > 1) j["ep"] = p.ep;
  if (p.expert_capacity > 0) j["expert_capacity"] = p.expert_capacity;
  if (p.pp > 1) j["pp"] = p.pp;
  return j;
}

nlohmann::ordered_json parallelism_report_json(const Parallelism& p, std::int32_t gpus_per_node) {
  nlohmann::ordered_json j;
  j["ranks"] = p.ranks;
  j["nodes"] = p.node_count(gpus_per_node);
  j["hsdp"] = p.replicas;
  j["reshard_after_forward"] = reshard_json(p.reshard_after_forward);
  if (p.impl != FsdpImpl::Fsdp2) j["fsdp_impl"] = to_string(p.impl);
  if (p.reduce != ReduceDtype::Param) j["reduce_dtype"] = to_string(p.reduce);
  j["per_rank"] = true;
  return j;
}

nlohmann::ordered_json with_parallelism_report(nlohmann::ordered_json document,
                                               const Parallelism& p, std::int32_t gpus_per_node,
                                               ExpertRouting routing) {
  if (p.on()) document["fsdp"] = parallelism_report_json(p, gpus_per_node);
  // Each mesh axis in use: its ranks, what the simulation assumes of it, and that every figure
  // is one GPU's.
  const auto axis = [&](const char* name, std::int32_t ranks, const char* key,
                        nlohmann::ordered_json assumed) {
    if (ranks <= 1) return;
    nlohmann::ordered_json member;
    member["ranks"] = ranks;
    member[key] = std::move(assumed);
    member["per_rank"] = true;
    document[name] = std::move(member);
  };
  axis("tp", p.tp, "sequence_parallel", true);
  axis("cp", p.cp, "rotation", "all_gather");
  axis("ep", p.ep, "routing", expert_routing_name(routing));
  if (p.ep > 1 && p.expert_capacity > 0) document["ep"]["capacity"] = p.expert_capacity;
  return document;
}

}  // namespace ferry::sim
