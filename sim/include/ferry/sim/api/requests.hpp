#pragma once
/// The simulator's commands as requests: `ferry simulate / compare / plan` parse their flags into
/// one (sim/cli/), `ferry.simulate / compare / plan` convert their arguments into one
/// (sim/python/), and the request's function does the rest, once for both edges: load the model
/// and the device, take the model file's parallelism and allocator where the request leaves
/// them, check every value, run, and report as a JSON document and as text.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/api/load.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/trainers.hpp"
#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

/// The pipeline schedule a request runs unless it names one: 1f1b, torchtitan's default
/// (JobConfig's parallelism.pipeline_parallel_schedule).
inline constexpr std::string_view kDefaultSchedule = "1f1b";

// Note [One check for both edges]
// Each edge turns what it was given into a request's values: the command line parses its text
// (`--reshard-after-forward 2`, `--budget 40GiB`, `--margin 5.5`), Python converts its ints,
// floats, bools and strings, with the same functions below where a value has a text form, so a
// text is refused with one message on both. The request's function then checks every number
// against its bounds before anything runs: steps 1..1000 (a plan's 1..100), stash 1..2^20,
// min_bytes 0..2^50, window_mib and prefetch_mib 0..2^30, host_cap_gib 0..2^20, fsdp, nodes and
// hsdp 1..1000000, pp 1..64, micro_batches 1..1024, virtual_stages 1..64. An error names the
// option as the command line spells it, `--steps: 0 is not in 1..1000`; the CLI prints it after
// "ferry simulate: error: " and exits 2, Python raises it as a ValueError.

/// A model as a request names it: a preset's name or a model file's path, or, with `text`, a
/// ferry.model/1 document (a traced model's) that errors name `name`.
struct ModelSource {
  std::string name;
  std::optional<std::string> text{};
};

/// What a request runs on: the model, the device profile (a bundled name or a file) and the
/// folder whose devices/ holds the bundled profiles.
struct Target {
  ModelSource model{};
  std::string device{kDefaultDevice};
  std::filesystem::path scenarios{};
};

/// The mesh as a request asks for it, each field named by kMeshFields (`--fsdp N --nodes M --hsdp
/// R --reshard-after-forward X --fsdp-impl I --reduce-dtype D --tp T --cp C --ep E
/// --expert-capacity F --pp P`, Python's fsdp, nodes, hsdp, reshard_after_forward, fsdp_impl,
/// reduce_dtype, tp, cp, ep, expert_capacity and pp). What it leaves out (none, or the defaults) is
/// the model file's.
struct MeshRequest {
  std::optional<std::int32_t> ranks{};  ///< 1..1000000; none: the model file's, else no FSDP
  std::optional<std::int32_t> nodes{};  ///< 1..1000000; none: as few as gpus_per_node allow
  std::int32_t replicas = 1;            ///< 1..1000000
  Reshard reshard_after_forward{};
  FsdpImpl impl = FsdpImpl::Fsdp2;
  ReduceDtype reduce = ReduceDtype::Param;
  /// Tensor parallelism over 1..1024 GPUs a rank (`--tp`, Python's tp): each runs its cut of the
  /// model (tensor_parallel_model); 1: none.
  std::int32_t tp = 1;
  /// Context parallelism over 1..1024 GPUs a rank (`--cp`, Python's cp): each holds 1/cp of the
  /// sequence (context_parallel_model), FSDP sharding over them too; 1: none.
  std::int32_t cp = 1;
  /// Expert parallelism over 1..1024 GPUs of the shard group (`--ep`, Python's ep): each holds
  /// 1/ep of a mixture of experts' experts (expert_parallel_model); 1: none.
  std::int32_t ep = 1;
  /// With ep 2 or more: a static dispatcher's capacity factor, 1..1024 (`--expert-capacity`;
  /// Parallelism::expert_capacity); 0: none.
  double expert_capacity = 0;
  /// A pipeline of 1..64 stages (`--pp`, Python's pp), each run by the mesh of the fields above
  /// (docs/pipeline.md); 1: none.
  std::int32_t pp = 1;
};

/// How errors at the edges name a mesh's fields: as the command line's flags.
inline constexpr MeshNames kMeshFlags = &MeshFieldRule::flag;

/// The parallelism `fsdp` asks for, its numbers in bounds (Note [One check for both edges]).
/// Not against a device: Mesh::make with kMeshFlags does that.
Result<Parallelism> parallelism_of(const MeshRequest& fsdp);

/// The "parallelism" section of a model file that records the mesh `fsdp` asks for (as
/// parallelism_json writes it), or null where it records none (no FSDP and no tensor
/// parallelism): its numbers checked as parallelism_of checks them, then the mesh's rules that
/// need no device (check_mesh_rules), the errors naming the flags. Python's tracer writes it
/// into the model it traces (`_simulator.parallelism_section`).
Result<nlohmann::ordered_json> parallelism_section(const MeshRequest& fsdp);

/// Fills what `fsdp` leaves out from a file's parallelism section (unless `fsdp` asks for a
/// pipeline, pp 2 or more, whose stages run the mesh asked): its pipeline stages, its tensor
/// parallelism where `fsdp` asks none, its ranks when none are asked, then its nodes, HSDP groups
/// and resharding where `fsdp` kept the defaults.
void adopt_parallelism(MeshRequest& fsdp, const Parallelism& file);
/// The same for a parallelism already read from a request (parallelism_of): a field left out
/// is 0 (ranks, nodes) or its default.
void adopt_parallelism(Parallelism& asked, const Parallelism& file);
/// `fsdp` as `--for trainer` runs it: torchtitan reduces gradients in float32 (its
/// `mixed_precision_reduce` default) where `fsdp` asks for FSDP and keeps the default reduce
/// dtype.
MeshRequest trainer_mesh(MeshRequest fsdp, const std::optional<Trainer>& trainer);

/// The options simulate and compare share: the offload knobs, the run's length and checks, FSDP2
/// and the allocator.
struct RunKnobs {
  std::int64_t min_bytes = 1024;
  std::int64_t window_mib = 512;
  std::int64_t prefetch_mib = 512;
  std::int64_t host_cap_gib = 1024;
  std::int32_t stash = 5;  ///< trl: forward stash size in tensors
  std::int32_t steps = 2;  ///< 1..1000; the last is reported
  bool prefetch = true;
  bool dedup = true;
  bool early_stop = true;
  bool check = true;  ///< hazard and content checks; off: time only
  /// ferry: bytes a forward may copy out before the rest stays on the device: auto (derived
  /// from the link), none, or a byte count.
  std::string horizon = "auto";
  /// What `optimizer.zero_grad()` does between steps (TrainingOptions::grads_set_to_none).
  /// None: torch's default since 2.0, set_to_none=True, where the run models it (single-device
  /// and FSDP runs; a pipeline keeps its gradients). True asks for it (a pipeline refuses);
  /// false keeps the gradients from set-up on (`set_to_none=False`, Megatron-Core's buffers).
  std::optional<bool> set_to_none;
  /// The paged stash of saved tensors in static-capacity buffers (PagedStashOptions; they come
  /// from --expert-capacity). A pipeline refuses it.
  bool paged_stash = false;
  MeshRequest mesh{};
  std::optional<AllocatorMode> allocator;  ///< none: the model file's, else default
  std::int32_t micro_batches = 4;          ///< the pipeline's (mesh.pp stages), 1..1024
  /// The pipeline's schedule: gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble or zbv
  /// (parse_schedule); 1f1b is torchtitan's default.
  std::string schedule{kDefaultSchedule};
  std::int32_t virtual_stages = 1;  ///< stages a device when interleaved, 1..64
  /// How the model is cut into stages (parse_split): layers, balanced or "L1,L2,...".
  std::string split = "layers";
};

/// `ferry simulate`: one run under one policy, on one device or a pipeline, or a plan replayed.
/// The policy, checkpoint plan and side streams are the option languages both edges take
/// ("ferry", "every:K", "0-3,recompute"): a checkpoint plan is read against the model, so each
/// is read where the model is known.
struct SimulateRequest {
  Target target;
  RunKnobs run;
  std::string policy = "ferry";  ///< none, trl, trl-seed, trl-1.7 or ferry
  std::string checkpoint = "none";
  std::string side_streams = "none";
  /// The pipeline's checkpoint mode; empty: the schedule's default, except_last under gpipe
  /// (torchgpipe's), never under 1f1b and interleaved-1f1b (torch.distributed.pipelining
  /// checkpoints nothing itself).
  std::string pipeline_checkpoint;
  std::optional<std::string> plan;  ///< a ferry.plan/1 file to replay instead
  /// A trainer's settings to run instead of `policy` and `checkpoint` (`--for T`): its
  /// command-line flags as `ferry plan --for T` writes them (`trainer_flags`), which errors
  /// name `trainer_source` (the file's path). Nothing is offloaded.
  std::optional<Trainer> trainer;
  std::string trainer_flags{};
  std::string trainer_source = "trainer config";
  bool trace = false;            ///< keep the run (Response::run) for its trace
  bool memory_snapshot = false;  ///< and record its allocators' actions
  bool text = true;              ///< report as text too (Response::text)
};

/// `ferry compare`: the fixed configurations side by side, and over `run.mesh.pp` > 1 stages the
/// pipeline configurations too.
struct CompareRequest {
  Target target{};
  RunKnobs run{};
  /// Called with each configuration's name before it runs (the CLI's progress lines); may be
  /// empty.
  std::function<void(const std::string&)> progress{};
  bool text = true;  ///< report as text too (Response::text)
};

class PlannerCache;

/// `ferry plan`: the fastest plan that fits a budget, or a sweep of plans over budgets.
struct PlanRequest {
  Target target;
  std::optional<Bytes> budget;       ///< none: the device's memory
  std::optional<Bytes> host_budget;  ///< none: no limit but the pool's
  std::int32_t steps = 2;            ///< 1..100; per simulation, the last is measured
  MeshRequest mesh{};
  std::optional<AllocatorMode> allocator;       ///< none: the model file's, else default
  std::optional<std::int32_t> margin_permille;  ///< 0..500; none: kDefaultPlanMarginPermille
  std::int32_t sweep = 0;                       ///< budgets of a sweep, 2..100; 0: one plan
  bool memory_snapshot = false;                 ///< keep the plan's checked run (recorded)
  bool plot = false;                            ///< draw the sweep (Response::plot)
  /// A sweep calls it before each budget with (index, count, budget); may be empty.
  std::function<void(std::size_t, std::size_t, Bytes)> progress;
  /// Hears each step of every plan's search (PlannerOptions::progress); may be empty.
  PlanProgressFn search_progress{};
  /// Simulations run at once (PlannerOptions::jobs): 0, one per hardware thread, or 1..1024.
  std::int32_t jobs = 0;
  /// `--for T`: also the fastest setting of the trainer's own space that fits, beside the plan
  /// (docs/plan.md, "A trainer's own settings"); not with a sweep.
  std::optional<Trainer> trainer;
  /// Planners kept from earlier requests (not owned; may be null): one plan of a model given
  /// as text (no sweep, no memory snapshot) is made by the planner kept for this target and
  /// these settings.
  PlannerCache* planners = nullptr;
  /// With mesh.pp 2 or more (`--pp`, Python's pp), the plan is the fastest pipeline
  /// configuration whose every stage fits the budget (plan_pipeline).
  std::int32_t micro_batches = 4;  ///< the pipeline's, 1..1024
  /// The pipeline's schedule (parse_schedule), or "auto": each torch runs for the counts, the
  /// fastest that fits kept. Empty: 1f1b, torchtitan's default.
  std::string schedule;
  std::int32_t virtual_stages = 1;  ///< stages a device when interleaved, 1..64
  bool text = true;                 ///< report as text too (Response::text)
  /// How the model is cut into stages (parse_split): layers, balanced or "L1,L2,...".
  std::string split = "layers";
};

/// How a request's run ended, as the exit codes tell it.
enum class Outcome : std::uint8_t {
  Ok,       ///< 0
  Failed,   ///< 1: hazards found, or a run failed (out of memory)
  Refused,  ///< 1: no plan fits the budget; `refusal` says why
};

/// What a request answers: the outcome, the report as a document (what `--json` prints) and, where
/// the request asks for it (its `text`, off where nothing prints it), as text, and what the edges
/// write to files.
struct Response {
  Outcome outcome = Outcome::Ok;
  nlohmann::ordered_json document;
  std::string text;
  /// Refused: the planner's error, the smallest peak reserved it reached (0: none known), and
  /// the smallest budget that plans, that peak with the margin added back (smallest_budget_for;
  /// 0: none known), which may be above the device's memory; `document` is then a
  /// `ferry.plan-refusal/1` document of them, whose floor is that budget where the device has
  /// it (Note [The floor is a budget]).
  std::string refusal;
  Bytes floor{0};
  Bytes smallest_budget{0};
  /// simulate: the run, when the request asked for its trace or memory snapshot and it ran.
  std::optional<TrainingRun> run;
  /// plan: the outcome (its plan, and with memory_snapshot its checked run).
  std::optional<PlanOutcome> plan;
  /// plan with a sweep and `plot`: the SVG plot of its curve.
  std::string plot;
  /// plan with a trainer: its best setting's command-line flags, one shell line (what
  /// `ferry simulate --for T --trainer-config FILE` reads).
  std::string trainer_flags;
};

/// Planners kept between plan requests, so that planning one model again at another budget
/// reuses the simulations the earlier budgets ran (Planner::plan) instead of running them
/// again: Python's `ferry.plan` and `ferry.auto` keep one per traced model. A request for a
/// model given as text plans with the planner kept for its target (the model's name and the
/// model its text reads to and its rank's cut, the device and the scenarios folder), steps,
/// parallelism and allocator, made by the first such request; a plan it makes is the one a fresh
/// planner makes, or one that reuses a faster plan an earlier, smaller budget found (never slower).
/// Requests from two threads that share it take turns.
class PlannerCache {
 public:
  PlannerCache();
  ~PlannerCache();
  PlannerCache(const PlannerCache&) = delete;
  PlannerCache& operator=(const PlannerCache&) = delete;

  /// Planners kept.
  [[nodiscard]] std::size_t size() const;
  /// Simulations the kept planners ran, all together.
  [[nodiscard]] std::int64_t simulations() const;

 private:
  friend Result<Response> respond(const PlanRequest& request);
  struct Entry;
  /// The planner kept under `key` for `workload`'s model, made for `workload` (copied) and
  /// `options` on first use.
  Planner& planner(const std::string& key, const Workload& workload, const PlannerOptions& options);

  mutable std::mutex mutex_;  // held while a request plans with a kept planner
  /// Under each key, the planners kept for the models planned with those settings.
  std::map<std::string, std::vector<std::unique_ptr<Entry>>> entries_;
};

/// The requests' functions; an error is bad input (exit 2), naming the option or the file.
Result<Response> respond(const SimulateRequest& request);
Result<Response> respond(const CompareRequest& request);
Result<Response> respond(const PlanRequest& request);

// The text forms both edges accept, with the errors they give (naming the option).

/// `--reshard-after-forward`'s text: true, false or K (2 or more).
Result<Reshard> parse_reshard(std::string_view text);
/// A number of ranks K as resharding (2 or more; the error is parse_reshard's).
Result<Reshard> reshard_ranks(std::int64_t k);
/// `--fsdp-impl`'s text: fsdp2, simple or fsdp2-torch2.4.
Result<FsdpImpl> fsdp_impl(std::string_view name);
/// `--reduce-dtype`'s text: param or float32.
Result<ReduceDtype> reduce_dtype(std::string_view name);
/// `--allocator`'s text: default or expandable.
Result<AllocatorMode> allocator_mode(std::string_view name);
/// A byte count's text for the option `option` ("--budget"); blank is an error, not "none"
/// (whose message suggests leaving the option out when it is `optional`).
Result<Bytes> byte_count(std::string_view text, std::string_view option, bool optional = true);
/// The largest byte count an option takes: 2^50 bytes (1 PiB).
inline constexpr std::int64_t kMaxByteCount = std::int64_t{1} << 50;
/// A number of bytes for `option`: 0..kMaxByteCount.
Result<Bytes> byte_count(std::int64_t count, std::string_view option);
/// `--margin`'s text: a percentage of the budget 0..50 with at most one decimal, "%" optional
/// ("6", "5.5%", "0"), in thousandths of the budget.
Result<std::int32_t> margin_permille(std::string_view text);
/// A margin as a number of percent, in thousandths of the budget; the errors are those of its
/// text ("--margin: 51 % is not in 0..50 %").
Result<std::int32_t> margin_permille(double percent);

}  // namespace ferry::sim
