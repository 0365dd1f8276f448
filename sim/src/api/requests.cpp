#include "ferry/sim/api/requests.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/planner/lower.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/planner/sweep.hpp"
#include "ferry/sim/planner/variants.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/runs/horizon.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {
namespace {

// `option`'s `value` within lo..hi, or the error that says it is not (Note [One check for both
// edges]).
Status in_bounds(std::string_view option, std::int64_t value, std::int64_t lo, std::int64_t hi) {
  if (value >= lo && value <= hi) return Ok{};
  return Error{fmt::format("{}: {} is not in {}..{}", option, value, lo, hi)};
}

// The first error of `checks`, or Ok.
Status first_error(std::initializer_list<Status> checks) {
  for (const Status& check : checks) {
    if (!check) return check;
  }
  return Ok{};
}

// What a kept planner is kept under (PlannerCache): everything in `r` that the planner's runs
// depend on, and not the budgets and margin, which each plan takes.
std::string planner_key(const PlanRequest& r) {
  const ModelSource& m = r.target.model;
  const MeshRequest& f = r.mesh;
  return fmt::format("{}\n{}\n{}\n{}\n{} {} {} {} {} {} {} {} {} {} {}", m.name,
                     m.text.value_or(""), r.target.device, r.target.scenarios.string(), r.steps,
                     f.ranks ? *f.ranks : 0, f.nodes ? *f.nodes : 0, f.replicas,
                     to_string(f.reshard_after_forward),
                     r.allocator ? static_cast<int>(*r.allocator) : -1, to_string(f.impl), f.tp,
                     f.cp, f.ep, f.expert_capacity);
}

Result<Workload> load(const Target& target) {
  const ModelSource& m = target.model;
  return make_workload(m.text ? parse_checked_model(*m.text, m.name) : load_model(m.name),
                       target.device, target.scenarios);
}

// The allocator `asked`, else the model file's, else default.
Result<AllocatorMode> allocator_of(const std::optional<AllocatorMode>& asked, const Model& model) {
  if (asked) return *asked;
  if (model.allocator.empty()) return AllocatorMode::Default;
  return allocator_mode(model.allocator);
}

// The knobs' numbers in bounds, then their parallelism's (Note [One check for both edges]).
Result<Parallelism> checked_knobs(const RunKnobs& k) {
  if (auto bounded = first_error({
          in_bounds("--steps", k.steps, 1, 1000),
          in_bounds("--stash", k.stash, 1, std::int64_t{1} << 20),
          in_bounds("--min-bytes", k.min_bytes, 0, std::int64_t{1} << 50),
          in_bounds("--window-mib", k.window_mib, 0, std::int64_t{1} << 30),
          in_bounds("--prefetch-mib", k.prefetch_mib, 0, std::int64_t{1} << 30),
          in_bounds("--host-cap-gib", k.host_cap_gib, 0, std::int64_t{1} << 20),
      });
      !bounded) {
    return bounded.error();
  }
  auto parallelism = parallelism_of(k.mesh);
  if (!parallelism) return parallelism;
  if (auto pipeline = first_error({in_bounds("--devices", k.devices, 1, 64),
                                   in_bounds("--micro-batches", k.micro_batches, 1, 1024),
                                   in_bounds("--virtual-stages", k.virtual_stages, 1, 64)});
      !pipeline) {
    return pipeline.error();
  }
  if (k.devices == 1 && (k.schedule != "gpipe" || k.virtual_stages != 1)) {
    return Error{fmt::format(
        "--schedule {} --virtual-stages {} applies to a pipeline; give --devices 2 or more",
        k.schedule, k.virtual_stages)};
  }
  if (k.devices > 1) {
    // A pipeline runs one whole model a device: no parallelism across GPUs beside it.
    const Parallelism& p = parallelism.value();
    for (const auto& [flag, asked] : {std::pair{"--fsdp", p.on()}, std::pair{"--tp", p.tp > 1},
                                      std::pair{"--cp", p.cp > 1}, std::pair{"--ep", p.ep > 1}}) {
      if (asked) return Error{fmt::format("{} excludes --devices", flag)};
    }
  }
  return parallelism;
}

// The workload one GPU of `mesh` runs (rank_workload: cut by `axes`, checked and timed once);
// with nothing cut, the whole model's timing errors name the model as `spec`, as its reading
// errors do.
Result<Workload> rank_of(const Workload& whole, const Mesh& mesh, std::string_view spec,
                         CutAxes axes = {}) {
  auto rank = rank_workload(whole, mesh, axes);
  const Parallelism& p = mesh;
  const bool cut = (axes.tp && p.tp > 1) || (axes.cp && p.cp > 1) || (axes.ep && p.ep > 1);
  if (!rank && !cut) return Error{fmt::format("{}: {}", spec, rank.error().message)};
  return rank;
}

// A rank's workload, and the mesh it was cut under where a cut needed one: the run that uses
// that mesh takes it as checked.
struct RankWorkload {
  Workload workload;
  std::optional<Mesh> checked;
};

// The workload a rank runs under the tensor, context and expert parallelism `fsdp` asks for (the
// model file's where it asks none), its mesh made first: what every option read against the
// model (a checkpoint plan's layers and ops) is read against.
Result<RankWorkload> rank_workload_of(const Workload& whole, const std::string& spec,
                                      MeshRequest fsdp, std::int32_t devices) {
  adopt_parallelism(fsdp, whole.model->parallelism, devices);
  if ((fsdp.tp == 1 && fsdp.cp == 1 && fsdp.ep == 1) || devices > 1) {
    auto timed = rank_of(whole, Mesh{}, spec);
    if (!timed) return timed.error();
    return RankWorkload{std::move(timed).value(), {}};
  }
  auto p = parallelism_of(fsdp);
  if (!p) return p.error();
  auto mesh = Mesh::make_within_bounds(p.value(), whole.device, kMeshFlags);
  if (!mesh) return mesh.error();
  auto cut = rank_of(whole, mesh.value(), spec);
  if (!cut) return cut.error();
  return RankWorkload{std::move(cut).value(), mesh.value()};
}

// The training options a request asks for, with its parallelism apart: that is checked
// against the device once, where the run that uses it is chosen (Mesh::make), and the runs
// take it as checked.
struct AskedRun {
  TrainingOptions base;  // its parallelism off
  Parallelism parallelism;
  std::optional<Mesh> checked{};            // the rank's cut was made under, if any
  std::optional<TrainerSetting> trainer{};  // `--for T`: the setting its flags ask for
};

// The training options `k` asks for on `model` (the model file's parallelism and allocator
// where `k` leaves them), checked; with `simulate`, its checkpoint plan, side streams and
// horizon too.
Result<AskedRun> training_options(RunKnobs k, const Model& model, const SimulateRequest* simulate) {
  adopt_parallelism(k.mesh, model.parallelism, k.devices);
  auto parallelism = checked_knobs(k);
  if (!parallelism) return parallelism.error();
  auto allocator = allocator_of(k.allocator, model);
  if (!allocator) return allocator.error();
  TrainingOptions o;
  o.steps = k.steps;
  o.sim.check_hazards = k.check;
  o.sim.track_content = k.check;
  o.sim.allocator = allocator.value();
  o.offload.min_bytes = Bytes(k.min_bytes);
  o.offload.window_bytes = k.window_mib * kMiB;
  o.offload.prefetch_bytes = k.prefetch_mib * kMiB;
  o.offload.host_cap = k.host_cap_gib * kGiB;
  o.offload.trl_stash_count = k.stash;
  o.offload.prefetch = k.prefetch;
  o.offload.dedup = k.dedup;
  o.grads_set_to_none = k.set_to_none;
  o.paged_stash.on = k.paged_stash;
  if (simulate == nullptr) {
    if (!k.early_stop) o.checkpoint.global_early_stop = false;
    return AskedRun{std::move(o), parallelism.value()};
  }
  std::optional<TrainerSetting> trainer;
  if (simulate->trainer) {
    // The trainer's flags say how it checkpoints, early stop included.
    if (simulate->checkpoint != "none" || !k.early_stop) {
      return Error{
          fmt::format("--for {} runs the trainer's own checkpointing: it takes no "
                      "--checkpoint or --no-early-stop",
                      trainer_name(*simulate->trainer))};
    }
    auto setting = parse_trainer_flags(*simulate->trainer, simulate->trainer_flags, model,
                                       simulate->trainer_source);
    if (!setting) return setting.error();
    auto plan = trainer_checkpoint(setting.value(), model);
    if (!plan) return Error{fmt::format("{}: {}", simulate->trainer_source, plan.error().message)};
    o.checkpoint = std::move(plan).value();
    trainer = std::move(setting).value();
  } else {
    auto plan = parse_checkpoint_spec(simulate->checkpoint, model);
    if (!plan) return Error{fmt::format("--checkpoint: {}", plan.error().message)};
    o.checkpoint = std::move(plan).value();
  }
  if (!k.early_stop) o.checkpoint.global_early_stop = false;
  auto side = parse_side_streams(simulate->side_streams);
  if (!side) return Error{fmt::format("--side-streams: {}", side.error().message)};
  o.side = std::move(side).value();
  if (simulate->horizon == "none") {
    o.offload.horizon_bytes = Bytes(std::numeric_limits<std::int64_t>::max());
  } else if (simulate->horizon != "auto") {
    auto horizon = parse_bytes(simulate->horizon, "--horizon");
    if (!horizon) return Error{fmt::format("{} (or auto, none)", horizon.error().message)};
    o.offload.horizon_bytes = horizon.value();
  }
  return AskedRun{std::move(o), parallelism.value(), std::nullopt, std::move(trainer)};
}

// `p` checked against the device, its errors naming the flags, as `fsdp`'s parallelism; taken
// as it is where the rank's cut was made under it (`cut_under`, checked then).
Status choose_parallelism(ParallelOptions& fsdp, const Parallelism& p, const DeviceProfile& device,
                          const std::optional<Mesh>& cut_under = std::nullopt) {
  if (cut_under && static_cast<const Parallelism&>(*cut_under) == p) {
    fsdp.mesh = *cut_under;
    return Ok{};
  }
  auto checked = Mesh::make_within_bounds(p, device, kMeshFlags);
  if (!checked) return checked.error();
  fsdp.mesh = checked.value();
  return Ok{};
}

Result<Policy> policy_of(const std::string& name) {
  if (const auto policy = parse_policy(name)) return *policy;
  return Error{fmt::format("unknown policy \"{}\" ({})", name, kPolicyNames)};
}

Outcome outcome_of(bool clean) { return clean ? Outcome::Ok : Outcome::Failed; }

// `ferry simulate --plan FILE`: the plan replayed under `base`, with the plan's parallelism
// where neither the request nor the model file gave one.
Result<Response> replay(const SimulateRequest& r, const Workload& w, AskedRun run) {
  const std::string& path = *r.plan;
  auto text = read_input(path, "plan");
  if (!text) return text.error();
  auto plan = parse_plan(text.value(), path);
  if (!plan) return plan.error();
  MeshRequest asked = r.run.mesh;
  adopt_parallelism(asked, w.model->parallelism, r.run.devices);
  MeshRequest adopted = asked;
  adopt_parallelism(adopted, plan.value().parallelism);
  TrainingOptions& base = run.base;
  if (adopted.ranks != asked.ranks || adopted.tp != asked.tp || adopted.cp != asked.cp ||
      adopted.ep != asked.ep) {
    auto fsdp = parallelism_of(adopted);
    const Status chosen =
        fsdp ? choose_parallelism(base.parallel, fsdp.value(), w.device) : Status(fsdp.error());
    if (!chosen) return Error{fmt::format("{}: parallelism: {}", path, chosen.error().message)};
  } else if (auto chosen =
                 choose_parallelism(base.parallel, run.parallelism, w.device, run.checked);
             !chosen) {
    return chosen.error();
  }
  // A plan made under tensor, context or expert parallelism the request and the model leave out
  // is replayed on the cut it was made on.
  const CutAxes remaining{
      .tp = adopted.tp != asked.tp, .cp = adopted.cp != asked.cp, .ep = adopted.ep != asked.ep};
  auto ranked = remaining.tp || remaining.cp || remaining.ep
                    ? rank_workload(w, base.parallel.mesh, remaining)
                    : Result<Workload>(w);
  if (!ranked) return Error{fmt::format("{}: parallelism: {}", path, ranked.error().message)};
  auto row = replay_plan(plan.value(), ranked.value().model, w.device, base);
  if (!row) return Error{fmt::format("{}: {}", path, row.error().message)};
  row.value().name = "plan " + path;
  // The report names the request's parallelism over the plan's.
  const auto named = parallelism_of(adopted);
  const Parallelism parallelism = named ? named.value() : Parallelism{};
  Response out;
  out.outcome = outcome_of(row.value().hazards == 0 && !row.value().failure);
  out.document = simulate_json(row.value(), *w.model, w.device, parallelism);
  out.text = simulate_text(row.value(), *w.model, w.device, parallelism);
  return out;
}

// Why a pipeline refuses `base` (what simulate and compare both refuse over `--devices` > 1): an
// option of single-device and FSDP runs only. None: a pipeline takes it.
std::optional<std::string_view> single_device_only(const TrainingOptions& base) {
  if (base.sim.allocator != AllocatorMode::Default) {
    return "--allocator expandable applies to a single-device or FSDP run; a pipeline runs the "
           "default allocator";
  }
  if (base.grads_set_to_none) {
    return "--set-to-none applies to a single-device or FSDP run; a pipeline keeps its "
           "gradients between steps";
  }
  if (base.paged_stash.on) {
    return "--paged-stash applies to a single-device or FSDP run: a pipeline has no expert "
           "parallelism to pad";
  }
  return std::nullopt;
}

// `ferry simulate --devices N`: one GPipe pipeline.
Result<Response> pipeline(const SimulateRequest& r, const Workload& w,
                          const TrainingOptions& base) {
  // What draws or replays one device's run is refused rather than silently missing.
  const auto refuse = [&](std::string_view what) {
    return Error{fmt::format("{} (--devices {})", what, r.run.devices)};
  };
  if (base.side.any()) {
    return refuse(
        "--side-streams applies to a single-device run; a pipeline runs one compute stream per "
        "device");
  }
  if (const auto why = single_device_only(base)) return refuse(*why);
  if (r.trace) return refuse("--trace draws a single-device run; a pipeline has no trace yet");
  if (r.memory_snapshot) {
    return refuse(
        "--memory-snapshot records a single-device run; a pipeline has no memory snapshot yet");
  }
  auto schedule = parse_schedule(r.run.schedule);
  if (!schedule) return Error{fmt::format("--schedule: {}", schedule.error().message)};
  const std::string_view checkpoint =
      !r.pipeline_checkpoint.empty()        ? std::string_view(r.pipeline_checkpoint)
      : schedule.value() == Schedule::GPipe ? std::string_view("except_last")
                                            : std::string_view("never");
  auto mode = parse_checkpoint_mode(checkpoint);
  if (!mode) return Error{fmt::format("--pipeline-checkpoint: {}", mode.error().message)};
  PipelineOptions o;
  o.devices = r.run.devices;
  o.micro_batches = r.run.micro_batches;
  o.schedule = schedule.value();
  o.virtual_stages = r.run.virtual_stages;
  o.checkpoint = mode.value();
  o.sim = base.sim;
  o.offload = base.offload;
  auto policy = policy_of(r.policy);
  if (!policy) return policy.error();
  o.offload.policy = policy.value();
  const PipelineRow row = run_pipeline_row(w.model, w.device, pipeline_row_name(o), o);
  if (row.failure && row.step_time.ns() == 0) return Error{row.failure->message};
  Response out;
  out.outcome = outcome_of(row.hazards == 0 && !row.failure);
  out.document = pipeline_document({row});
  out.text = pipeline_text({row});
  return out;
}

// A trainer setting's row, as `ferry simulate --for T` and `ferry plan --for T` name it.
std::string trainer_row_name(const TrainerSetting& setting) {
  return fmt::format("{}: {}", trainer_name(setting.trainer), trainer_label(setting));
}

// One device: the run under its policy, the ferry policy's horizon derived where the request
// leaves it to the simulator.
Result<Response> one_device(const SimulateRequest& r, const Workload& w, AskedRun run) {
  auto policy = policy_of(r.policy);
  if (!policy) return policy.error();
  TrainingOptions& base = run.base;
  if (auto chosen = choose_parallelism(base.parallel, run.parallelism, w.device, run.checked);
      !chosen) {
    return chosen.error();
  }
  const Parallelism parallelism = base.parallel.mesh;
  PolicyRow row{r.policy, std::move(base)};
  row.options.offload.policy = policy.value();
  if (run.trainer) {
    row.name = trainer_row_name(*run.trainer);
    row.options.offload.policy = Policy::None;
  }
  row.options.sim.record_allocator = r.memory_snapshot;
  if (!row.options.offload.horizon_bytes) {
    row.options.offload.horizon_bytes = offload_horizon(*w.model, w.device, row.options);
  }
  if (run.trainer) trainer_offload(row.options, *run.trainer, *w.model);
  Response out;
  const bool keep = r.trace || r.memory_snapshot;
  const RowResult result = run_row(w.model, w.device, row, keep ? &out.run : nullptr);
  out.outcome = outcome_of(result.hazards == 0 && !result.failure);
  out.document = simulate_json(result, *w.model, w.device, parallelism);
  out.text = simulate_text(result, *w.model, w.device, parallelism);
  return out;
}

// `ferry plan --for T`: every setting of the trainer's space run as `ferry simulate --for T
// --trainer-config FILE` runs it (on the rank's workload `w` of the plan's `mesh`, the
// request's steps and allocator), timing only; the fastest that fits `planned_budget` is run again
// with the checks on, as simulate runs it, for the figures the report prints.
Result<TrainerChoice> trainer_choice(const PlanRequest& r, const Workload& w, const Mesh& mesh,
                                     Bytes planned_budget, std::int32_t margin_permille) {
  RunKnobs k;
  k.steps = r.steps;
  k.mesh = r.mesh;
  k.allocator = r.allocator;
  k.check = false;
  auto asked = training_options(k, *w.model, nullptr);
  if (!asked) return asked.error();
  TrainingOptions base = std::move(asked.value().base);
  if (auto chosen = choose_parallelism(base.parallel, asked.value().parallelism, w.device, mesh);
      !chosen) {
    return chosen.error();
  }
  const auto run_setting = [&](const TrainerSetting& setting, bool check) -> Result<RowResult> {
    auto plan = trainer_checkpoint(setting, *w.model);
    if (!plan) return plan.error();
    PolicyRow row{trainer_row_name(setting), base};
    row.options.checkpoint = std::move(plan).value();
    row.options.offload.policy = Policy::None;
    row.options.sim.check_hazards = check;
    row.options.sim.track_content = check;
    row.options.offload.horizon_bytes = offload_horizon(*w.model, w.device, row.options);
    trainer_offload(row.options, setting, *w.model);
    return run_row(w.model, w.device, row);
  };
  TrainerChoice c{
      .trainer = *r.trainer, .planned_budget = planned_budget, .margin_permille = margin_permille};
  c.device = w.device.name;
  c.device_memory = w.device.memory;
  for (TrainerSetting& setting : trainer_space(*r.trainer, *w.model)) {
    auto row = run_setting(setting, false);
    if (!row) return row.error();
    const bool fits =
        row.value().completed_within_memory() && row.value().peak_reserved <= planned_budget;
    if (fits && (!c.best || row.value().step_time < c.runs[*c.best].row.step_time)) {
      c.best = c.runs.size();
    }
    c.runs.push_back(TrainerRun{std::move(setting), std::move(row).value(), fits});
  }
  if (c.best) {
    auto checked = run_setting(c.runs[*c.best].setting, true);
    if (!checked) return checked.error();
    c.checked = std::move(checked).value();
  }
  return c;
}

// The planner's options `r` asks for, before the model is read, with its parallelism apart (as
// AskedRun's): its numbers and the parallelism's checked, the budget 0 when it gives none.
struct AskedPlan {
  PlannerOptions options;  // its parallelism off
  Parallelism parallelism;
};

Result<AskedPlan> planner_options(const PlanRequest& r) {
  if (r.sweep != 0) {
    if (auto bounded = in_bounds("--sweep", r.sweep, 2, 100); !bounded) return bounded.error();
    if (r.budget || r.margin_permille) {
      return Error{"--sweep plans its own budgets; it takes no --budget, --margin or --out"};
    }
    if (r.trainer) {
      return Error{
          fmt::format("--for {} plans at one budget: not with --sweep", trainer_name(*r.trainer))};
    }
  }
  PlannerOptions options;
  options.budget = r.budget.value_or(Bytes(0));
  options.host_budget = r.host_budget;
  if (auto steps = in_bounds("--steps", r.steps, 1, 100); !steps) return steps.error();
  options.steps = r.steps;
  auto fsdp = parallelism_of(r.mesh);
  if (!fsdp) return fsdp.error();
  options.allocator = r.allocator.value_or(AllocatorMode::Default);
  options.margin_permille = r.margin_permille.value_or(kDefaultPlanMarginPermille);
  if (auto margin = in_bounds("--margin", options.margin_permille, 0, kMaxPlanMarginPermille);
      !margin) {
    return margin.error();
  }
  options.keep_run = r.memory_snapshot;
  if (auto jobs = in_bounds("--jobs", r.jobs, 0, 1024); !jobs) return jobs.error();
  options.jobs = r.jobs;
  options.progress = r.search_progress;
  return AskedPlan{std::move(options), fsdp.value()};
}

// The request's parallelism as asked, unchecked: a field left out is 0.
Parallelism as_asked(const MeshRequest& fsdp) {
  return Parallelism{.ranks = fsdp.ranks.value_or(0),
                     .nodes = fsdp.nodes.value_or(0),
                     .replicas = fsdp.replicas,
                     .reshard_after_forward = fsdp.reshard_after_forward,
                     .impl = fsdp.impl,
                     .tp = fsdp.tp,
                     .cp = fsdp.cp,
                     .ep = fsdp.ep,
                     .expert_capacity = fsdp.expert_capacity};
}

}  // namespace

Result<Parallelism> parallelism_of(const MeshRequest& fsdp) {
  // The numbers in kMeshFields' bounds, in its order (Note [One table of axes]).
  const auto bounded = [](MeshField field, std::int64_t value) {
    const MeshFieldRule& row = mesh_field(field);
    return in_bounds(row.flag, value, row.least, row.most);
  };
  const auto bounded_if = [&](MeshField field, const std::optional<std::int32_t>& value) {
    return value ? bounded(field, *value) : Status{Ok{}};
  };
  if (auto in = first_error(
          {bounded_if(MeshField::Fsdp, fsdp.ranks), bounded_if(MeshField::Nodes, fsdp.nodes),
           bounded(MeshField::Hsdp, fsdp.replicas), bounded(MeshField::Tp, fsdp.tp),
           bounded(MeshField::Cp, fsdp.cp), bounded(MeshField::Ep, fsdp.ep)});
      !in) {
    return in.error();
  }
  if (fsdp.expert_capacity != 0) {
    const MeshFieldRule& capacity = mesh_field(MeshField::ExpertCapacity);
    if (!capacity.in_bounds(fsdp.expert_capacity)) {
      return Error{fmt::format("{} {}: use a factor from {} to {}", capacity.flag,
                               fsdp.expert_capacity, capacity.least, capacity.most)};
    }
    if (fsdp.ep < capacity.needs_least) {
      return Error{fmt::format("{} needs {} {} or more: {}", capacity.flag,
                               mesh_field(capacity.needs).flag, capacity.needs_least,
                               capacity.why)};
    }
  }
  const Parallelism p = as_asked(fsdp);
  if (!p.on() && (fsdp.nodes || p.replicas != 1 || p.reshard_after_forward != Reshard::True() ||
                  p.impl != FsdpImpl::Fsdp2)) {
    return Error{fmt::format("{} need {} N", fsdp_option_list(&MeshFieldRule::flag),
                             mesh_field(MeshField::Fsdp).flag)};
  }
  return p;
}

void adopt_parallelism(Parallelism& asked, const Parallelism& file, std::int32_t devices) {
  if (!file.sharded() || devices > 1) return;
  if (asked.tp == 1) asked.tp = file.tp;
  if (asked.cp == 1) asked.cp = file.cp;
  if (asked.ep == 1) asked.ep = file.ep;
  if (asked.expert_capacity == 0) asked.expert_capacity = file.expert_capacity;
  if (!file.on()) return;
  if (asked.ranks == 0) asked.ranks = file.ranks;
  if (asked.nodes == 0 && file.nodes > 0) asked.nodes = file.nodes;
  if (asked.replicas == 1) asked.replicas = file.replicas;
  if (asked.reshard_after_forward == Reshard::True()) {
    asked.reshard_after_forward = file.reshard_after_forward;
  }
  if (asked.impl == FsdpImpl::Fsdp2) asked.impl = file.impl;
}

void adopt_parallelism(MeshRequest& fsdp, const Parallelism& file, std::int32_t devices) {
  Parallelism asked = as_asked(fsdp);
  adopt_parallelism(asked, file, devices);
  if (!fsdp.ranks && asked.ranks != 0) fsdp.ranks = asked.ranks;
  if (!fsdp.nodes && asked.nodes != 0) fsdp.nodes = asked.nodes;
  fsdp.replicas = asked.replicas;
  fsdp.reshard_after_forward = asked.reshard_after_forward;
  fsdp.impl = asked.impl;
  fsdp.tp = asked.tp;
  fsdp.cp = asked.cp;
  fsdp.ep = asked.ep;
  fsdp.expert_capacity = asked.expert_capacity;
}

Result<Response> respond(const SimulateRequest& r) {
  auto whole = load(r.target);
  if (!whole) return whole.error();
  auto workload = rank_workload_of(whole.value(), r.target.model.name, r.run.mesh, r.run.devices);
  if (!workload) return workload.error();
  const Workload& w = workload.value().workload;
  auto asked = training_options(r.run, *w.model, &r);
  if (!asked) return asked.error();
  asked.value().checked = workload.value().checked;
  if (r.trainer && (r.plan || r.run.devices > 1)) {
    return Error{
        fmt::format("--for {} runs one device's or one rank's step: not with --plan or "
                    "--devices",
                    trainer_name(*r.trainer))};
  }
  if (r.plan) return replay(r, w, std::move(asked).value());
  if (r.run.devices > 1) return pipeline(r, w, asked.value().base);
  return one_device(r, w, std::move(asked).value());
}

Result<Response> respond(const CompareRequest& r) {
  auto whole = load(r.target);
  if (!whole) return whole.error();
  auto workload = rank_workload_of(whole.value(), r.target.model.name, r.run.mesh, r.run.devices);
  if (!workload) return workload.error();
  const Workload& w = workload.value().workload;
  auto asked = training_options(r.run, *w.model, nullptr);
  if (!asked) return asked.error();
  TrainingOptions base = std::move(asked.value().base);
  if (auto chosen = choose_parallelism(base.parallel, asked.value().parallelism, w.device,
                                       workload.value().checked);
      !chosen) {
    return chosen.error();
  }
  const Parallelism& parallelism = base.parallel.mesh;
  if (const auto why = single_device_only(base); why && r.run.devices > 1) {
    return Error{fmt::format("{} (--devices {})", *why, r.run.devices)};
  }
  bool clean = true;
  std::vector<RowResult> rows;
  for (const PolicyRow& row : default_rows(base, *w.model, w.device)) {
    if (r.progress) r.progress(row.name);
    rows.push_back(run_row(w.model, w.device, row));
    clean = clean && rows.back().hazards == 0;
  }
  std::vector<PipelineRow> pipelines;
  if (r.run.devices > 1) {
    if (r.progress) r.progress("pipelines");
    auto schedule = parse_schedule(r.run.schedule);
    if (!schedule) return Error{fmt::format("--schedule: {}", schedule.error().message)};
    if (const auto why = pipeline::schedule_error(
            schedule.value(), static_cast<std::uint32_t>(r.run.micro_batches),
            static_cast<std::uint32_t>(r.run.devices),
            static_cast<std::uint32_t>(r.run.virtual_stages))) {
      return Error{fmt::format("--schedule {}: {}", r.run.schedule, *why)};
    }
    pipelines = pipeline_rows(w.model, w.device, r.run.devices, r.run.micro_batches,
                              schedule.value(), r.run.virtual_stages);
    for (const PipelineRow& p : pipelines) clean = clean && p.hazards == 0;
  }
  Response out;
  out.outcome = outcome_of(clean);
  out.document = compare_json(rows, *w.model, w.device, pipelines, parallelism);
  out.text = compare_text(rows, *w.model, w.device, pipelines, parallelism);
  return out;
}

namespace {

// `out` refused: its refusal and floor as a `ferry.plan-refusal/1` document too (what `ferry
// plan --json` prints for it). The floor is the smallest budget that plans (Note [The floor is a
// budget]), null where none is known or none on the device's `memory` plans; the smallest peak
// is `peak_floor_bytes`, and a budget above the device `device_memory_needed_bytes`.
Response refused(Response out, std::int32_t margin_permille, Bytes memory) {
  out.outcome = Outcome::Refused;
  const auto bytes = [](Bytes b) {
    return b.count() > 0 ? nlohmann::ordered_json(b.count()) : nlohmann::ordered_json(nullptr);
  };
  const bool above = out.smallest_budget > memory;
  nlohmann::ordered_json j;
  j["format"] = "ferry.plan-refusal/1";
  j["refusal"] = out.refusal;
  j["floor_bytes"] = bytes(above ? Bytes(0) : out.smallest_budget);
  j["margin_permille"] = margin_permille;
  j["smallest_budget_bytes"] = j["floor_bytes"];
  j["peak_floor_bytes"] = bytes(out.floor);
  j["device_memory_needed_bytes"] = bytes(above ? out.smallest_budget : Bytes(0));
  out.document = std::move(j);
  return out;
}

}  // namespace

Result<Response> respond(const PlanRequest& r) {
  // The request's own values, checked before any file is read.
  auto asked = planner_options(r);
  if (!asked) return asked.error();
  auto workload = load(r.target);
  if (!workload) return workload.error();
  const Workload& w = workload.value();
  PlannerOptions options = std::move(asked.value().options);
  Parallelism chosen = asked.value().parallelism;
  // What the request left out is the model file's, whose reader bounded it as parallelism_of
  // bounded the request's (kMeshFields).
  adopt_parallelism(chosen, w.model->parallelism);
  auto allocator = allocator_of(r.allocator, *w.model);
  if (!allocator) {
    return Error{
        fmt::format("{}: parallelism: {}", r.target.model.name, allocator.error().message)};
  }
  options.allocator = allocator.value();
  if (auto fsdp = choose_parallelism(options.parallel, chosen, w.device); !fsdp)
    return fsdp.error();
  auto ranked = rank_of(w, options.parallel.mesh, r.target.model.name);
  if (!ranked) return ranked.error();
  const Workload& rank = ranked.value();
  Response out;
  if (r.sweep > 0) {
    // A sweep's budgets are the simulator's peaks, from the floor up: no margin below them.
    options.margin_permille = 0;
    const auto points = plan_sweep(rank.model, w.device, options, r.sweep, r.progress);
    out.document = sweep_json(points, *rank.model, w.device, options.parallel.mesh);
    out.text = sweep_text(points, *rank.model, w.device, options.parallel.mesh);
    if (r.plot) out.plot = sweep_svg(points, *rank.model, w.device);
    return out;
  }
  // No budget: the device's whole memory, the question "what is fastest that fits at all?".
  if (!r.budget) options.budget = w.device.memory;
  // A memory snapshot needs the plan's checked run recorded, which a kept planner may have run
  // unrecorded, and a model file may change between requests: such requests plan alone.
  const auto plan_with = [&](bool paged_stash, Bytes* floor) -> Result<PlanOutcome> {
    PlannerOptions with = options;
    with.paged_stash = paged_stash;
    if (r.planners == nullptr || r.memory_snapshot || !r.target.model.text) {
      return make_plan(rank.model, w.device, with, floor);
    }
    const std::scoped_lock lock(r.planners->mutex_);
    return r.planners->planner(planner_key(r) + (paged_stash ? " stash" : ""), rank, with)
        .plan(with, floor);
  };
  // The faster of the plans with and without the paged stash (plan_faster_space).
  auto outcome = plan_faster_space(rank.model, plan_with, &out.floor);
  std::optional<TrainerChoice> choice;
  if (r.trainer) {
    auto searched = trainer_choice(r, rank, options.parallel.mesh,
                                   budget_less_margin(options.budget, options.margin_permille),
                                   options.margin_permille);
    if (!searched) return searched.error();
    choice = std::move(searched).value();
  }
  if (!outcome) {
    out.refusal = outcome.error().message;
    if (out.floor.count() > 0) {
      out.smallest_budget = smallest_budget_for(out.floor, options.margin_permille);
    }
    if (choice && !choice->best) {
      out.refusal += "; " + trainer_refusal(*choice);
      // Both must fit: the larger of the two budgets that plan.
      const Bytes trainer_budget = trainer_smallest_budget(*choice);
      if (out.smallest_budget.count() > 0 && trainer_budget.count() > 0) {
        if (trainer_budget > out.smallest_budget) {
          out.smallest_budget = trainer_budget;
          if (trainer_budget <= w.device.memory) {
            out.refusal +=
                fmt::format("; the smallest budget that plans both is {} ({} bytes)",
                            format_bytes(out.smallest_budget), out.smallest_budget.count());
          }
        }
      } else {
        out.smallest_budget = Bytes(0);
      }
    }
    return refused(std::move(out), options.margin_permille, w.device.memory);
  }
  if (choice && !choice->best) {
    // The question was the trainer's: ferry's own plan fitting does not answer it.
    out.refusal = fmt::format("{} (ferry's own plan fits: {}, peak reserved {})",
                              trainer_refusal(*choice), format_time(outcome.value().row.step_time),
                              format_bytes(outcome.value().row.peak_reserved));
    out.floor = Bytes(0);
    for (const TrainerRun& run : choice->runs) {
      if (!run.row.completed_within_memory()) continue;
      if (out.floor.count() == 0 || run.row.peak_reserved < out.floor) {
        out.floor = run.row.peak_reserved;
      }
    }
    out.smallest_budget = trainer_smallest_budget(*choice);
    return refused(std::move(out), options.margin_permille, w.device.memory);
  }
  out.document = plan_report_json(outcome.value(), *rank.model, w.device);
  out.text = plan_text(outcome.value(), *rank.model, w.device);
  if (choice) {
    const PlanOutcome& o = outcome.value();
    const RowResult* none = o.fixed.empty() ? nullptr : &o.fixed.front();
    out.document["trainer"] = trainer_json(*choice, &o.row, none);
    out.text += trainer_text(*choice, &o.row, none);
    out.trainer_flags = shell_line(trainer_flags(choice->runs[*choice->best].setting));
  }
  out.plan = std::move(outcome).value();
  return out;
}

struct PlannerCache::Entry {
  Workload workload;
  Planner planner;

  Entry(const Workload& w, const PlannerOptions& options)
      : workload(w),
        planner(workload.model, workload.device, options.steps, options.parallel, options.allocator,
                options.paged_stash) {}
};

PlannerCache::PlannerCache() = default;
PlannerCache::~PlannerCache() = default;

std::size_t PlannerCache::size() const {
  const std::scoped_lock lock(mutex_);
  return entries_.size();
}

std::int64_t PlannerCache::simulations() const {
  const std::scoped_lock lock(mutex_);
  std::int64_t runs = 0;
  for (const auto& [key, entry] : entries_) runs += entry->planner.simulations();
  return runs;
}

Planner& PlannerCache::planner(const std::string& key, const Workload& workload,
                               const PlannerOptions& options) {
  auto [it, added] = entries_.try_emplace(key);
  if (added) it->second = std::make_unique<Entry>(workload, options);
  return it->second->planner;
}

Result<Reshard> parse_reshard(std::string_view text) {
  if (text == "true") return Reshard::True();
  if (text == "false") return Reshard::False();
  std::int64_t k = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), k);
  if (ec != std::errc() || end != text.data() + text.size()) {
    return Error{fmt::format(
        "--reshard-after-forward: \"{}\" is not true, false or a number of ranks (2 or more)",
        text)};
  }
  return reshard_ranks(k);
}

Result<Reshard> reshard_ranks(std::int64_t k) {
  if (!mesh_field(MeshField::ReshardAfterForward).in_bounds(static_cast<double>(k))) {
    return Error{fmt::format(
        "--reshard-after-forward: \"{}\" is not true, false or a number of ranks (2 or more)", k)};
  }
  return Reshard::K(static_cast<std::int32_t>(k));
}

Result<FsdpImpl> fsdp_impl(std::string_view name) {
  if (const auto impl = parse_fsdp_impl(name)) return *impl;
  return Error{fmt::format("--fsdp-impl: \"{}\" is not fsdp2 or simple", name)};
}

Result<AllocatorMode> allocator_mode(std::string_view name) {
  if (const auto mode = parse_allocator_mode(name)) return *mode;
  return Error{fmt::format("--allocator: \"{}\" is not default or expandable", name)};
}

Result<Bytes> byte_count(std::string_view text, std::string_view option, bool optional) {
  if (text.find_first_not_of(" \t") == std::string_view::npos) {
    return Error{fmt::format("{}: empty; give a byte count such as 40GiB{}", option,
                             optional ? ", or leave the option out" : "")};
  }
  return parse_bytes(text, option);
}

Result<Bytes> byte_count(std::int64_t count, std::string_view option) {
  if (auto bounded = in_bounds(option, count, 0, kMaxByteCount); !bounded) {
    return bounded.error();
  }
  return Bytes(count);
}

Result<std::int32_t> margin_permille(std::string_view text) {
  const auto refused = [&] {
    return Error{fmt::format(
        "--margin: \"{}\" is not a percentage of the budget such as 6, 5.5 or 6%", text)};
  };
  std::string_view s = text;
  const auto trim = [&s] {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  };
  trim();
  if (!s.empty() && s.back() == '%') {
    s.remove_suffix(1);
    trim();
  }
  // Whole percent, then at most one decimal: at most "50.0".
  std::int64_t whole = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), whole);
  if (ec != std::errc{} || end == s.data()) return refused();
  std::int64_t tenths = 0;
  std::string_view rest(end, static_cast<std::size_t>(s.data() + s.size() - end));
  if (!rest.empty()) {
    if (rest.size() != 2 || rest[0] != '.' || rest[1] < '0' || rest[1] > '9') return refused();
    tenths = rest[1] - '0';
  }
  if (s.front() == '-' || whole > kMaxPlanMarginPermille / 10 ||
      whole * 10 + tenths > kMaxPlanMarginPermille) {
    return Error{fmt::format("--margin: {} % is not in 0..{} %", s, kMaxPlanMarginPermille / 10)};
  }
  return static_cast<std::int32_t>(whole * 10 + tenths);
}

Result<std::int32_t> margin_permille(double percent) {
  // As its text: a whole number as itself ("51"), else with the shortest decimals ("50.5").
  const double tenths = percent * 10;
  const bool whole =
      std::isfinite(percent) && percent == std::trunc(percent) && std::fabs(percent) < 1e15;
  const std::string text =
      whole ? fmt::format("{}", static_cast<std::int64_t>(percent)) : fmt::format("{}", percent);
  if (!std::isfinite(percent) ||
      std::fabs(tenths - std::round(tenths)) > 1e-6 * std::fabs(tenths)) {
    return Error{fmt::format(
        "--margin: \"{}\" is not a percentage of the budget such as 6, 5.5 or 6%", text)};
  }
  if (percent < 0 || std::round(tenths) > kMaxPlanMarginPermille) {
    return Error{
        fmt::format("--margin: {} % is not in 0..{} %", text, kMaxPlanMarginPermille / 10)};
  }
  return static_cast<std::int32_t>(std::round(tenths));
}

}  // namespace ferry::sim
