#pragma once
/// Parallelism as JSON, read and written here only: the "parallelism" section of model and plan
/// files, {"fsdp": N, "nodes": M, "hsdp": R, "reshard_after_forward": true | false | K,
/// "fsdp_impl": I, "reduce_dtype": D, "tp": T, "cp": C, "pp": P} ("fsdp" may be left out when
/// "tp" or "pp" alone is given), and the "fsdp", "tp" and "cp" members of reports.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/rank_model.hpp"

namespace ferry::sim {

/// The section at `value`; errors name the member.
Result<Parallelism> read_parallelism(const JsonValue& value);

/// The section as written: only what differs from the defaults besides `fsdp` (`tp` alone
/// without FSDP; context parallelism needs FSDP).
[[nodiscard]] nlohmann::ordered_json parallelism_json(const Parallelism& p);

/// A report's "fsdp" member for `p` (on): ranks, the nodes they span on a device of
/// `gpus_per_node` GPUs a node, HSDP groups, resharding, and "per_rank": true (every figure is
/// one rank's).
[[nodiscard]] nlohmann::ordered_json parallelism_report_json(const Parallelism& p,
                                                             std::int32_t gpus_per_node);

/// `document` with its "fsdp" member under FSDP (parallelism_report_json), its "tp" member
/// under tensor parallelism: {"ranks": T, "sequence_parallel": true, "per_rank": true} (every
/// figure is one GPU's), and its "cp" member under context parallelism: {"ranks": C,
/// "rotation": "all_gather", "per_rank": true}, and its "ep" member under expert parallelism:
/// {"ranks": E, "routing": `routing`'s name (expert_routing_name), "per_rank": true}.
[[nodiscard]] nlohmann::ordered_json with_parallelism_report(nlohmann::ordered_json document,
                                                             const Parallelism& p,
                                                             std::int32_t gpus_per_node,
                                                             ExpertRouting routing);

}  // namespace ferry::sim
