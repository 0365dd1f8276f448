#pragma once
/// Parallelism as JSON, read and written here only: the "parallelism" section of model and plan
/// files, {"fsdp": N, "nodes": M, "hsdp": R, "reshard_after_forward": true | false | K}, and the
/// "fsdp" member of reports.

#include <cstdint>
#include <nlohmann/json.hpp>

#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim {

/// The section at `value`; errors name the member.
Result<Parallelism> read_parallelism(const JsonValue& value);

/// The section as written: only what differs from the defaults besides `fsdp`.
[[nodiscard]] nlohmann::ordered_json parallelism_json(const Parallelism& p);

/// A report's "fsdp" member for `p` (on): ranks, the nodes they span on a device of
/// `gpus_per_node` GPUs a node, HSDP groups, resharding, and "per_rank": true (every figure is
/// one rank's).
[[nodiscard]] nlohmann::ordered_json parallelism_report_json(const Parallelism& p,
                                                             std::int32_t gpus_per_node);

}  // namespace ferry::sim
