#pragma once
/// The "parallelism" section of model and plan files:
/// {"fsdp": N, "nodes": M, "hsdp": R, "reshard_after_forward": true | false | K}.

#include <nlohmann/json.hpp>

#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim {

/// The section at `value`; errors name the member.
Result<Parallelism> read_parallelism(const JsonValue& value);

/// The section as written: only what differs from the defaults besides `fsdp`.
[[nodiscard]] nlohmann::ordered_json parallelism_json(const Parallelism& p);

}  // namespace ferry::sim
