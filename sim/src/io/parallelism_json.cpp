#include "ferry/sim/io/parallelism_json.hpp"

namespace ferry::sim {

Result<Parallelism> read_parallelism(const JsonValue& value) {
  constexpr std::int64_t kMost = 1 << 20;
  FERRY_JSON_TRY(const auto object,
                 value.object({"fsdp", "nodes", "hsdp", "reshard_after_forward"}));
  Parallelism p;
  FERRY_JSON_TRY(const auto ranks, object.required_integer("fsdp", 1, kMost));
  FERRY_JSON_TRY(const auto nodes, object.optional_integer("nodes", 0, 1, kMost));
  FERRY_JSON_TRY(const auto hsdp, object.optional_integer("hsdp", 1, 1, kMost));
  p.fsdp = static_cast<std::int32_t>(ranks);
  p.nodes = static_cast<std::int32_t>(nodes);
  p.hsdp = static_cast<std::int32_t>(hsdp);
  if (auto reshard = object.optional("reshard_after_forward")) {
    if (reshard->json().is_boolean()) {
      p.reshard_after_forward = reshard->json().get<bool>() ? -1 : 0;
    } else {
      FERRY_JSON_TRY(const auto k, reshard->integer(2, kMost));
      p.reshard_after_forward = static_cast<std::int32_t>(k);
    }
  }
  return p;
}

nlohmann::ordered_json parallelism_json(const Parallelism& p) {
  nlohmann::ordered_json j;
  j["fsdp"] = p.fsdp;
  if (p.nodes > 0) j["nodes"] = p.nodes;
  if (p.hsdp > 1) j["hsdp"] = p.hsdp;
  if (p.reshard_after_forward >= 0) {
    j["reshard_after_forward"] = p.reshard_after_forward == 0
                                     ? nlohmann::ordered_json(false)
                                     : nlohmann::ordered_json(p.reshard_after_forward);
  }
  return j;
}

}  // namespace ferry::sim
