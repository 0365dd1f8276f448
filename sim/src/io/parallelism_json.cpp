#include "ferry/sim/io/parallelism_json.hpp"

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
  constexpr std::int64_t kMost = 1 << 20;
  FERRY_JSON_TRY(const auto object,
                 value.object({"fsdp", "nodes", "hsdp", "reshard_after_forward", "fsdp_impl", "tp",
                               "cp", "ep", "expert_capacity"}));
  Parallelism p;
  FERRY_JSON_TRY(const auto tp, object.optional_integer("tp", 1, 1, 1024));
  p.tp = static_cast<std::int32_t>(tp);
  FERRY_JSON_TRY(const auto cp, object.optional_integer("cp", 1, 1, 1024));
  p.cp = static_cast<std::int32_t>(cp);
  FERRY_JSON_TRY(const auto ep, object.optional_integer("ep", 1, 1, 1024));
  p.ep = static_cast<std::int32_t>(ep);
  if (const auto capacity = object.optional("expert_capacity")) {
    const auto& json = capacity->json();
    if (!json.is_number() || !(json.get<double>() >= 1 && json.get<double>() <= 1024)) {
      return capacity->error("expected a capacity factor from 1 to 1024");
    }
    if (p.ep < 2) return capacity->error("a capacity factor needs \"ep\" 2 or more");
    p.expert_capacity = json.get<double>();
  }
  // FSDP's ranks, which tensor parallelism alone leaves out.
  if (!object.has("fsdp") && object.has("tp")) return p;
  FERRY_JSON_TRY(const auto ranks, object.required_integer("fsdp", 1, kMost));
  FERRY_JSON_TRY(const auto nodes, object.optional_integer("nodes", 0, 1, kMost));
  FERRY_JSON_TRY(const auto hsdp, object.optional_integer("hsdp", 1, 1, kMost));
  p.ranks = static_cast<std::int32_t>(ranks);
  p.nodes = static_cast<std::int32_t>(nodes);
  p.replicas = static_cast<std::int32_t>(hsdp);
  if (auto reshard = object.optional("reshard_after_forward")) {
    if (reshard->json().is_boolean()) {
      p.reshard_after_forward = reshard->json().get<bool>() ? Reshard::True() : Reshard::False();
    } else {
      FERRY_JSON_TRY(const auto k, reshard->integer(2, kMost));
      p.reshard_after_forward = Reshard::K(static_cast<std::int32_t>(k));
    }
  }
  if (auto impl = object.optional("fsdp_impl")) {
    FERRY_JSON_TRY(const auto name, impl->string());
    const auto parsed = parse_fsdp_impl(name);
    if (!parsed) return impl->error("expected \"fsdp2\" or \"simple\", got \"{}\"", name);
    p.impl = *parsed;
  }
  return p;
}

nlohmann::ordered_json parallelism_json(const Parallelism& p) {
  nlohmann::ordered_json j;
  if (!p.on()) {
    j["tp"] = p.tp;
    return j;
  }
  j["fsdp"] = p.ranks;
  if (p.nodes > 0) j["nodes"] = p.nodes;
  if (p.replicas > 1) j["hsdp"] = p.replicas;
  if (p.reshard_after_forward != Reshard::True()) {
    j["reshard_after_forward"] = reshard_json(p.reshard_after_forward);
  }
  if (p.impl != FsdpImpl::Fsdp2) j["fsdp_impl"] = to_string(p.impl);
  if (p.tp > 1) j["tp"] = p.tp;
  if (p.cp > 1) j["cp"] = p.cp;
  if (p.ep > 1) j["ep"] = p.ep;
  if (p.expert_capacity > 0) j["expert_capacity"] = p.expert_capacity;
  return j;
}

nlohmann::ordered_json parallelism_report_json(const Parallelism& p, std::int32_t gpus_per_node) {
  nlohmann::ordered_json j;
  j["ranks"] = p.ranks;
  j["nodes"] = p.node_count(gpus_per_node);
  j["hsdp"] = p.replicas;
  j["reshard_after_forward"] = reshard_json(p.reshard_after_forward);
  if (p.impl != FsdpImpl::Fsdp2) j["fsdp_impl"] = to_string(p.impl);
  j["per_rank"] = true;
  return j;
}

nlohmann::ordered_json with_parallelism_report(nlohmann::ordered_json document,
                                               const Parallelism& p, std::int32_t gpus_per_node,
                                               std::string_view routing) {
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
  axis("ep", p.ep, "routing", routing);
  if (p.ep > 1 && p.expert_capacity > 0) document["ep"]["capacity"] = p.expert_capacity;
  return document;
}

}  // namespace ferry::sim
