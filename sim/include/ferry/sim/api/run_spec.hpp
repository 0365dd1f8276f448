#pragma once
/// One simulated run as its options are written on a command line or passed from Python: the
/// offload policy, the knobs of the scheduler core, the checkpoint plan and the simulator's
/// checks, each as text or a number. `ferry simulate` / `ferry compare` and `ferry.simulate` /
/// `ferry.compare` read the same fields with the same defaults.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/api/load.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

/// The policies parse_policy knows, as errors name them.
inline constexpr std::string_view kPolicyNames = "none, trl, trl-seed, ferry";

// Note [One check for both edges]
// `ferry simulate / compare / plan` and `ferry.simulate / compare / plan` hand what they were
// given, unchecked, to the functions below, which check every number against its bounds before
// anything runs: steps 1..1000 (a plan's 1..100), stash 1..2^20, min_bytes 0..2^50, window_mib
// and prefetch_mib 0..2^30, host_cap_gib 0..2^20, fsdp, nodes and hsdp 1..1000000, and the
// allocator's name (`--allocator: "x" is not default or expandable`). The error
// names the option as the command line spells it, `--steps: 0 is not in 1..1000`; the CLI
// prints it after "ferry simulate: error: " and exits 2, Python raises it as a ValueError.
// The command line parses types only, so the two edges cannot refuse different values.

/// FSDP2 as an edge is given it, unchecked: the command line's `--fsdp N --nodes M --hsdp R
/// --reshard-after-forward true|false|K`, Python's fsdp, nodes, hsdp and reshard_after_forward.
/// Not a parallelism yet: parallelism_of checks it and gives the Parallelism it asks for.
struct FsdpSpec {
  std::optional<std::int32_t> ranks{};  ///< 1..1000000 when given; none: no FSDP
  std::optional<std::int32_t> nodes{};  ///< none: as few as the device's gpus_per_node allow
  std::int32_t replicas = 1;
  std::string reshard_after_forward = "true";  ///< as parse_reshard reads it
};

/// The flags' names, as validate_parallelism's errors at the edges name the fields.
inline constexpr ParallelismNames kFsdpFlags{.ranks = "--fsdp",
                                             .nodes = "--nodes",
                                             .replicas = "--hsdp",
                                             .reshard_after_forward = "--reshard-after-forward"};

/// `--reshard-after-forward`'s text: true, false or K (2 or more); the error names the option.
Result<Reshard> parse_reshard(std::string_view text);

/// The parallelism `spec` asks for, its numbers checked (Note [One check for both edges]);
/// errors name the option. Not against a device: validate_parallelism with kFsdpFlags does that.
Result<Parallelism> parallelism_of(const FsdpSpec& spec);

/// Fills what the command line left unsaid from a file's parallelism section: its ranks when
/// --fsdp is absent (and no pipeline runs over `devices` > 1), then its nodes, HSDP groups and
/// resharding where the command line kept the defaults.
void adopt_parallelism(FsdpSpec& spec, const Parallelism& file, std::int32_t devices = 1);
/// adopt_parallelism with the model file's section.
void adopt_model_parallelism(FsdpSpec& spec, const Model& model, std::int32_t devices = 1);

/// A report's JSON `document` with an "fsdp" member when `p` shards (parallelism_report_json).
/// Unchanged otherwise.
[[nodiscard]] std::string with_fsdp_json(std::string document, const Parallelism& p,
                                         const DeviceProfile& device);

struct RunSpec {
  std::string policy = "ferry";     ///< none, trl, trl-seed or ferry
  std::string checkpoint = "none";  ///< none, every:K, selective, segments:N, ...
  std::string side_streams = "none";
  std::string horizon = "auto";  ///< ferry: auto (derived), none, or a byte count
  std::int64_t min_bytes = 1024;
  std::int64_t window_mib = 512;
  std::int64_t prefetch_mib = 512;
  std::int64_t host_cap_gib = 1024;
  std::int32_t stash = 5;  ///< trl: forward stash size in tensors
  std::int32_t steps = 2;  ///< 1..1000; the last is reported
  bool no_prefetch = false;
  bool no_dedup = false;
  bool no_early_stop = false;
  bool no_checker = false;  ///< time only: no hazard and content checks
  FsdpSpec fsdp{};
  /// default or expandable (expandable_segments:True); none: the model file's, else default.
  std::optional<std::string> allocator;
};

/// Whether every number of `spec` (its FSDP's too) is in bounds, and its allocator a mode (Note
/// [One check for both edges]); the error names the first that is not.
Status validate(const RunSpec& spec);

/// The training options `spec` asks for on `model`, `spec` validated first; the checkpoint plan of
/// `spec.checkpoint` only when `with_checkpoint` (compare runs its own). Errors name the option as
/// the command line spells it (`--checkpoint: ...`).
Result<TrainingOptions> run_options(const RunSpec& spec, const Model& model, bool with_checkpoint);

/// `ferry simulate` on one device: the run `spec` asks for, under its policy, the ferry
/// policy's horizon derived where `spec` leaves it to the simulator. With `keep`, the run the
/// figures come from is moved there (for its trace); with `record_allocator` too, it records
/// its allocators' actions (for a memory snapshot).
Result<RowResult> simulate_one(const Workload& workload, const RunSpec& spec,
                               std::optional<TrainingRun>* keep = nullptr,
                               bool record_allocator = false);

/// `ferry plan`'s options as the command line writes them; `ferry.plan` takes the same.
struct PlanSpec {
  std::optional<std::string> budget;       ///< a byte count; none: the caller's default
  std::optional<std::string> host_budget;  ///< a byte count; none: no limit but the pool's
  std::int32_t steps = 2;                  ///< 1..100; per simulation, the last is measured
  FsdpSpec fsdp{};
  /// default or expandable (expandable_segments:True); none: the model file's, else default.
  std::optional<std::string> allocator;
  /// Percent of the budget kept free of the prediction: "6", "5.5 %" (0..50); none:
  /// kDefaultPlanMarginPermille (Note [The plan margin]).
  std::optional<std::string> margin;
};

/// The margin `text` gives, in thousandths of the budget: a percentage 0..50 with at most one
/// decimal, "%" optional ("6", "5.5%", "0"); the error names `--margin`.
Result<std::int32_t> margin_permille(const std::string& text);

/// The allocator mode `--allocator` names, default when none (Note [One check for both edges]);
/// the error names the option and the modes.
Result<AllocatorMode> allocator_mode(const std::optional<std::string>& name);

/// Takes the model file's "allocator" member where the command line gave no --allocator.
void adopt_model_allocator(std::optional<std::string>& allocator, const Model& model);

/// The planner options `spec` asks for, checked in the order budget, host budget, steps, FSDP,
/// allocator, margin (Note [One check for both edges]); the budget is 0 when `spec` gives none.
Result<PlannerOptions> planner_options(const PlanSpec& spec);

}  // namespace ferry::sim
