#include "ferry/sim/api/requests.hpp"

#include <fmt/format.h>

#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/mesh/axes.hpp"
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
#include "request_steps.hpp"

namespace ferry::sim::api {
namespace {

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
  if (auto pipeline = first_error({in_bounds("--micro-batches", k.micro_batches, 1, 1024),
                                   in_bounds("--virtual-stages", k.virtual_stages, 1, 64)});
      !pipeline) {
    return pipeline.error();
  }
  const MeshFieldRule& stages = mesh_field(MeshField::Pp);
  if (k.mesh.pp == 1 && (k.schedule != kDefaultSchedule || k.virtual_stages != 1)) {
    return Error{
        fmt::format("--schedule {} --virtual-stages {} applies to a pipeline; give {} 2 or more",
                    k.schedule, k.virtual_stages, stages.flag)};
  }
  if (auto split = parse_split(k.split); !split) return split.error();
  if (k.mesh.pp == 1 && k.split != "layers") {
    return Error{
        fmt::format("--split {} applies to a pipeline; give {} 2 or more", k.split, stages.flag)};
  }
  if (k.mesh.pp > 1) {
    if (auto allowed = pipeline_mesh_allowed(parallelism.value()); !allowed) {
      return allowed.error();
    }
    return stage_parallelism(parallelism.value());
  }
  return parallelism;
}

}  // namespace

Status pipeline_mesh_allowed(const Parallelism& p) {
  const auto flag = [](MeshField field) { return mesh_field(field).flag; };
  // Each stage keeps its gathered parameters for the step.
  if (p.reshard_after_forward.kind() == Reshard::Kind::K) {
    return Error{fmt::format(
        "{} {} with {} {}: a pipeline's stages keep their gathered parameters for the step "
        "(torchtitan's default under pipelining); give true or false",
        flag(MeshField::ReshardAfterForward), p.reshard_after_forward.ranks(), flag(MeshField::Pp),
        p.pp)};
  }
  if (p.impl != FsdpImpl::Fsdp2) {
    return Error{fmt::format("{} {} with {} {}: a pipeline's stages run fsdp2",
                             flag(MeshField::FsdpImpl), to_string(p.impl), flag(MeshField::Pp),
                             p.pp)};
  }
  return Ok{};
}

std::string pipeline_refusal(std::string_view what, const Parallelism& p) {
  return fmt::format("{} ({} {})", what, mesh_field(MeshField::Pp).flag, p.pp);
}

Parallelism stage_parallelism(Parallelism p) {
  if (p.on()) p.reshard_after_forward = Reshard::False();
  return p;
}

std::string stages_text(const Parallelism& p) {
  if (!p.sharded()) return {};
  return fmt::format(
      "pipeline of {} stages, each run by the mesh above ({} GPUs): {} GPUs in all; a pipeline "
      "row's figures are one GPU of each stage\n",
      p.pp, p.world(), p.pp * p.world());
}

Result<Workload> load(const Target& target) {
  const ModelSource& m = target.model;
  return make_workload(m.text ? parse_checked_model(*m.text, m.name) : load_model(m.name),
                       target.device, target.scenarios);
}

// The allocator `asked`, else the model file's, else default.
AllocatorMode allocator_of(const std::optional<AllocatorMode>& asked, const Model& model) {
  return asked.value_or(model.allocator.value_or(AllocatorMode::Default));
}

// The workload one GPU of `mesh` runs (rank_workload: cut by `axes`, checked and timed once);
// with nothing cut, the whole model's timing errors name the model as `spec`, as its reading
// errors do.
Result<Workload> rank_of(const Workload& whole, const Mesh& mesh, std::string_view spec,
                         CutAxes axes) {
  auto rank = rank_workload(whole, mesh, axes);
  const Parallelism& p = mesh;
  const bool cut = (axes.tp && p.tp > 1) || (axes.cp && p.cp > 1) || (axes.ep && p.ep > 1);
  if (!rank && !cut) return Error{fmt::format("{}: {}", spec, rank.error().message)};
  return rank;
}

// The training options `k` asks for on `model` (the model file's parallelism and allocator
// where `k` leaves them), checked; with `simulate`, its checkpoint plan and side streams too.
Result<AskedRun> training_options(RunKnobs k, const Model& model, const SimulateRequest* simulate) {
  adopt_parallelism(k.mesh, model.parallelism);
  auto parallelism = checked_knobs(k);
  if (!parallelism) return parallelism.error();
  TrainingOptions o;
  o.steps = k.steps;
  o.sim.check_hazards = k.check;
  o.sim.track_content = k.check;
  o.sim.allocator = allocator_of(k.allocator, model);
  o.offload.min_bytes = Bytes(k.min_bytes);
  o.offload.window_bytes = k.window_mib * kMiB;
  o.offload.prefetch_bytes = k.prefetch_mib * kMiB;
  o.offload.host_cap = k.host_cap_gib * kGiB;
  o.offload.trl_stash_count = k.stash;
  o.offload.prefetch = k.prefetch;
  o.offload.dedup = k.dedup;
  o.grads_set_to_none = k.set_to_none.value_or(k.mesh.pp <= 1);
  o.paged_stash.on = k.paged_stash;
  if (k.horizon == "none") {
    o.offload.horizon_bytes = Bytes(std::numeric_limits<std::int64_t>::max());
  } else if (k.horizon != "auto") {
    auto horizon = parse_bytes(k.horizon, "--horizon");
    if (!horizon) return Error{fmt::format("{} (or auto, none)", horizon.error().message)};
    o.offload.horizon_bytes = horizon.value();
  }
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
  return AskedRun{std::move(o), parallelism.value(), std::nullopt, std::move(trainer)};
}

// `p` checked against the device, its errors naming the flags, as `fsdp`'s parallelism; taken
// as it is where the rank's cut was made under it (`cut_under`, checked then).
Status choose_parallelism(ParallelOptions& fsdp, const Parallelism& p, const DeviceProfile& device,
                          const std::optional<Mesh>& cut_under) {
  if (cut_under && static_cast<const Parallelism&>(*cut_under) == p) {
    fsdp.mesh = *cut_under;
    return Ok{};
  }
  auto checked = Mesh::make(p, device, kMeshFlags);
  if (!checked) return checked.error();
  fsdp.mesh = checked.value();
  return Ok{};
}

// A trainer setting's row, as `ferry simulate --for T` and `ferry plan --for T` name it.
std::string trainer_row_name(const TrainerSetting& setting) {
  return fmt::format("{}: {}", trainer_name(setting.trainer), trainer_label(setting));
}

namespace {

// A rank's workload, and the mesh it was cut under where a cut needed one: the run that uses
// that mesh takes it as checked.
struct RankWorkload {
  Workload workload;
  std::optional<Mesh> checked;
};

// The workload a rank runs under the tensor, context and expert parallelism `fsdp` asks for (the
// model file's where it asks none; adopted already), its mesh made first: what every option read
// against the model (a checkpoint plan's layers and ops) is read against.
Result<RankWorkload> rank_workload_of(const Workload& whole, const std::string& spec,
                                      const MeshRequest& fsdp) {
  if (fsdp.tp == 1 && fsdp.cp == 1 && fsdp.ep == 1) {
    auto timed = rank_of(whole, Mesh{}, spec);
    if (!timed) return timed.error();
    return RankWorkload{std::move(timed).value(), {}};
  }
  auto p = parallelism_of(fsdp);
  if (!p) return p.error();
  auto mesh =
      Mesh::make(fsdp.pp > 1 ? stage_parallelism(p.value()) : p.value(), whole.device, kMeshFlags);
  if (!mesh) return mesh.error();
  auto cut = rank_of(whole, mesh.value(), spec);
  if (!cut) return cut.error();
  return RankWorkload{std::move(cut).value(), mesh.value()};
}

Result<Policy> policy_of(const std::string& name) {
  if (const auto policy = parse_policy(name)) return *policy;
  return Error{fmt::format("unknown policy \"{}\" ({})", name, policy_names(", "))};
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
  adopt_parallelism(asked, w.model->parallelism);
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
  if (r.text) out.text = simulate_text(row.value(), *w.model, w.device, parallelism);
  return out;
}

// Why a pipeline refuses `base` (what simulate and compare both refuse over `--pp` > 1): an
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
  if (!base.checkpoint.regions.empty()) {
    return "--checkpoint (or a --for trainer's checkpointing) applies to a single-device or FSDP "
           "run; a pipeline checkpoints whole stages: use --pipeline-checkpoint always, "
           "except_last or never";
  }
  return std::nullopt;
}

// `ferry simulate --pp N`: one pipeline, each stage on `base`'s mesh.
Result<Response> pipeline(const SimulateRequest& r, const Workload& w,
                          const TrainingOptions& base) {
  const Parallelism& mesh = base.parallel.mesh;
  // What draws or replays one device's run is refused rather than silently missing.
  const auto refuse = [&](std::string_view what) { return Error{pipeline_refusal(what, mesh)}; };
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
  o.devices = mesh.pp;
  o.micro_batches = r.run.micro_batches;
  o.schedule = schedule.value();
  o.virtual_stages = r.run.virtual_stages;
  auto split = parse_split(r.run.split);
  if (!split) return split.error();
  o.split = std::move(split).value();
  o.checkpoint = mode.value();
  o.sim = base.sim;
  o.offload = base.offload;
  o.mesh = base.parallel.mesh;
  auto policy = policy_of(r.policy);
  if (!policy) return policy.error();
  o.offload.policy = policy.value();
  const DeviceProfile device = o.mesh.rank_profile(w.device);
  const PipelineRow row = run_pipeline_row(w.model, device, pipeline_row_name(o), o);
  if (row.failure && row.step_time.ns() == 0) return Error{row.failure->message};
  Response out;
  out.outcome = outcome_of(row.hazards == 0 && !row.failure);
  out.document = with_parallelism(pipeline_document({row}), mesh, w.device, *w.model);
  if (r.text) {
    out.text =
        pipeline_text({row}) + parallelism_text(mesh, w.device, *w.model) + stages_text(mesh);
  }
  return out;
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
  if (run.trainer) {
    trainer_offload(row.options, *run.trainer, *w.model);
    trainer_grads(row.options, *run.trainer);
  }
  Response out;
  const bool keep = r.trace || r.memory_snapshot;
  const RowResult result = run_row(w.model, w.device, row, keep ? &out.run : nullptr);
  out.outcome = outcome_of(result.hazards == 0 && !result.failure);
  out.document = simulate_json(result, *w.model, w.device, parallelism);
  if (r.text) out.text = simulate_text(result, *w.model, w.device, parallelism);
  return out;
}

}  // namespace
}  // namespace ferry::sim::api

namespace ferry::sim {

Result<Response> respond(const SimulateRequest& asked_request) {
  SimulateRequest r = asked_request;
  r.run.mesh = trainer_mesh(r.run.mesh, r.trainer);
  auto whole = api::load(r.target);
  if (!whole) return whole.error();
  MeshRequest mesh = r.run.mesh;
  adopt_parallelism(mesh, whole.value().model->parallelism);
  auto workload = api::rank_workload_of(whole.value(), r.target.model.name, mesh);
  if (!workload) return workload.error();
  const Workload& w = workload.value().workload;
  auto asked = api::training_options(r.run, *w.model, &r);
  if (!asked) return asked.error();
  asked.value().checked = workload.value().checked;
  if (r.trainer && (r.plan || mesh.pp > 1)) {
    return Error{fmt::format("--for {} runs one device's or one rank's step: not with --plan or {}",
                             trainer_name(*r.trainer), mesh_field(MeshField::Pp).flag)};
  }
  if (r.plan) return api::replay(r, w, std::move(asked).value());
  if (mesh.pp > 1) {
    api::AskedRun& run = asked.value();
    if (auto chosen =
            api::choose_parallelism(run.base.parallel, run.parallelism, w.device, run.checked);
        !chosen) {
      return chosen.error();
    }
    return api::pipeline(r, w, run.base);
  }
  return api::one_device(r, w, std::move(asked).value());
}

Result<Response> respond(const CompareRequest& r) {
  auto whole = api::load(r.target);
  if (!whole) return whole.error();
  MeshRequest mesh = r.run.mesh;
  adopt_parallelism(mesh, whole.value().model->parallelism);
  auto workload = api::rank_workload_of(whole.value(), r.target.model.name, mesh);
  if (!workload) return workload.error();
  const Workload& w = workload.value().workload;
  auto asked = api::training_options(r.run, *w.model, nullptr);
  if (!asked) return asked.error();
  TrainingOptions base = std::move(asked.value().base);
  if (auto chosen = api::choose_parallelism(base.parallel, asked.value().parallelism, w.device,
                                            workload.value().checked);
      !chosen) {
    return chosen.error();
  }
  const Parallelism& parallelism = base.parallel.mesh;
  const std::int32_t stages = parallelism.pp;
  if (const auto why = api::single_device_only(base); why && stages > 1) {
    return Error{api::pipeline_refusal(*why, parallelism)};
  }
  bool clean = true;
  std::vector<RowResult> rows;
  for (const PolicyRow& row : default_rows(base, *w.model, w.device)) {
    if (r.progress) r.progress(row.name);
    rows.push_back(run_row(w.model, w.device, row));
    clean = clean && rows.back().hazards == 0;
  }
  std::vector<PipelineRow> pipelines;
  if (stages > 1) {
    if (r.progress) r.progress("pipelines");
    auto schedule = parse_schedule(r.run.schedule);
    if (!schedule) return Error{fmt::format("--schedule: {}", schedule.error().message)};
    if (const auto why = pipeline::schedule_error(
            schedule.value(), static_cast<std::uint32_t>(r.run.micro_batches),
            static_cast<std::uint32_t>(stages), static_cast<std::uint32_t>(r.run.virtual_stages))) {
      return Error{fmt::format("--schedule {}: {}", r.run.schedule, *why)};
    }
    auto split = parse_split(r.run.split);
    if (!split) return split.error();
    // A split the model cannot take is the request's error, not every row's failure.
    if (auto parts = partition_model(*w.model, stages * r.run.virtual_stages, split.value());
        !parts) {
      return parts.error();
    }
    pipelines = pipeline_rows(w.model, base.parallel.mesh.rank_profile(w.device), stages,
                              r.run.micro_batches, schedule.value(), r.run.virtual_stages,
                              base.parallel.mesh, split.value());
    for (const PipelineRow& p : pipelines) clean = clean && p.hazards == 0;
  }
  Response out;
  out.outcome = api::outcome_of(clean);
  out.document = compare_json(rows, *w.model, w.device, pipelines, parallelism);
  if (r.text) {
    out.text = compare_text(rows, *w.model, w.device, pipelines, parallelism) +
               (pipelines.empty() ? std::string() : api::stages_text(parallelism));
  }
  return out;
}

}  // namespace ferry::sim
