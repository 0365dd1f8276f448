#include <fmt/format.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/pipeline/schedule.hpp"
#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/planner/pipeline_plan.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/planner/sweep.hpp"
#include "ferry/sim/planner/variants.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/sim/runs/horizon.hpp"
#include "ferry/units.hpp"
#include "request_steps.hpp"

namespace ferry::sim {
namespace api {
namespace {

// What kept planners are kept under (PlannerCache): everything in `r` that the planner's runs
// depend on but the model itself, which the kept planners are told apart by, and not the
// budgets and margin, which each plan takes.
std::string planner_key(const PlanRequest& r) {
  const MeshRequest& f = r.mesh;
  return fmt::format("{}\n{}\n{}\n{} {} {} {} {} {} {} {} {} {} {} {}", r.target.model.name,
                     r.target.device, r.target.scenarios.string(), r.steps, f.ranks ? *f.ranks : 0,
                     f.nodes ? *f.nodes : 0, f.replicas, to_string(f.reshard_after_forward),
                     r.allocator ? static_cast<int>(*r.allocator) : -1, to_string(f.impl),
                     to_string(f.reduce), f.tp, f.cp, f.ep, f.expert_capacity);
}

// `ferry plan --for T`: every setting of the trainer's space run as `ferry simulate --for T
// --trainer-config FILE --keep-grads` runs it (on the rank's workload `w` of the plan's `mesh`,
// the request's steps and allocator), timing only; the fastest that fits `planned_budget` is run
// again with the checks on, as simulate runs it, for the figures the report prints. The
// gradients are held between steps, as the planner holds them for ferry's plan beside it.
Result<TrainerChoice> trainer_choice(const PlanRequest& r, const Workload& w, const Mesh& mesh,
                                     Bytes planned_budget, std::int32_t margin_permille) {
  RunKnobs k;
  k.set_to_none = false;
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
    trainer_grads(row.options, setting);
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

// What a plan runs on: the whole model's workload (its device), a rank's (what the planner
// plans), and the planner's options, their parallelism checked against the device.
struct PlanSetup {
  Workload whole;
  Workload rank;
  PlannerOptions options;
  /// The model file's pipeline ("pp" 2 or more) where the request asks none: the request's mesh
  /// with the file's, planned as a pipeline; `rank` is then the whole model, `options` unset.
  std::optional<MeshRequest> file_pipeline{};
};

// The planner's options `r` asks for, the model file's parallelism and allocator where it
// leaves them out, and the workload of one rank of their mesh.
Result<PlanSetup> plan_setup(const PlanRequest& r) {
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
  if (chosen.pp > 1) {
    MeshRequest mesh = r.mesh;
    adopt_parallelism(mesh, w.model->parallelism);
    return PlanSetup{w, std::move(workload).value(), {}, mesh};
  }
  options.allocator = allocator_of(r.allocator, *w.model);
  if (auto fsdp = choose_parallelism(options.parallel, chosen, w.device); !fsdp)
    return fsdp.error();
  auto ranked = rank_of(w, options.parallel.mesh, r.target.model.name);
  if (!ranked) return ranked.error();
  return PlanSetup{std::move(workload).value(), std::move(ranked).value(), std::move(options)};
}

// `ferry plan --sweep N`: a plan at each of N budgets, and with `plot` their curve.
Response sweep_response(const PlanRequest& r, PlannerOptions options, const Workload& rank,
                        const DeviceProfile& device) {
  // A sweep's budgets are the simulator's peaks, from the floor up: no margin below them.
  options.margin_permille = 0;
  const auto points = plan_sweep(rank.model, device, options, r.sweep, r.progress);
  Response out;
  out.document = sweep_json(points, *rank.model, device, options.parallel.mesh);
  if (r.text) out.text = sweep_text(points, *rank.model, device, options.parallel.mesh);
  if (r.plot) out.plot = sweep_svg(points, *rank.model, device);
  return out;
}

// No plan fits the budget (`outcome`'s error): the refusal, with the trainer's where its
// settings do not fit either.
Response no_plan(Response out, const Result<PlanOutcome>& outcome,
                 const std::optional<TrainerChoice>& choice, const PlannerOptions& options,
                 Bytes memory) {
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
        if (trainer_budget <= memory) {
          out.refusal +=
              fmt::format("; the smallest budget that plans both is {} ({} bytes)",
                          format_bytes(out.smallest_budget), out.smallest_budget.count());
        }
      }
    } else {
      out.smallest_budget = Bytes(0);
    }
  }
  return refused(std::move(out), options.margin_permille, memory);
}

// `ferry plan --for T` where ferry's plan fits and none of the trainer's settings does.
Response trainer_refused(Response out, const Result<PlanOutcome>& outcome,
                         const std::optional<TrainerChoice>& choice, const PlannerOptions& options,
                         Bytes memory) {
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
  return refused(std::move(out), options.margin_permille, memory);
}

// The plan's report, with the trainer's best setting beside it under `--for T`.
Response plan_response(const PlanRequest& r, Response out, PlanOutcome plan,
                       const std::optional<TrainerChoice>& choice, const Workload& rank,
                       const DeviceProfile& device) {
  out.document = plan_report_json(plan, *rank.model, device);
  if (r.text) out.text = plan_text(plan, *rank.model, device);
  if (choice) {
    const RowResult* none = plan.fixed.empty() ? nullptr : &plan.fixed.front();
    out.document["trainer"] = trainer_json(*choice, &plan.row, none);
    if (r.text) out.text += trainer_text(*choice, &plan.row, none);
    out.trainer_flags = shell_line(trainer_flags(choice->runs[*choice->best].setting));
  }
  out.plan = std::move(plan);
  return out;
}

// Whether `r` asks for a pipeline: more than one stage, or a pipeline's option.
bool asks_pipeline(const PlanRequest& r) {
  return r.mesh.pp != 1 || r.micro_batches != 4 || !r.schedule.empty() || r.virtual_stages != 1;
}

// The schedules `--schedule` names: one, every one torch runs for the counts ("auto"), or none
// given, torchtitan's default (1F1B); the first error of the counts, naming the option.
Result<std::vector<Schedule>> pipeline_schedules(const PlanRequest& r) {
  const auto counts_error = [&](Schedule s) {
    return pipeline::schedule_error(s, static_cast<std::uint32_t>(r.micro_batches),
                                    static_cast<std::uint32_t>(r.mesh.pp),
                                    static_cast<std::uint32_t>(r.virtual_stages));
  };
  if (r.schedule == "auto") {
    std::vector<Schedule> all = {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B,
                                 Schedule::InterleavedZeroBubble, Schedule::ZeroBubbleV};
    for (const Schedule s : all) {
      if (!counts_error(s)) return all;
    }
    return Error{
        fmt::format("--schedule auto: no schedule runs {} micro-batches over {} stages "
                    "({})",
                    r.micro_batches, r.mesh.pp, *counts_error(Schedule::OneFOneB))};
  }
  const std::string name = r.schedule.empty() ? std::string(kDefaultSchedule) : r.schedule;
  auto schedule = parse_schedule(name);
  if (!schedule) {
    return Error{fmt::format("--schedule: {} (or auto: each, the fastest that fits)",
                             schedule.error().message)};
  }
  if (const auto why = counts_error(schedule.value())) {
    return Error{
        fmt::format("--schedule {}{}: {}", name, r.schedule.empty() ? " (the default)" : "", *why)};
  }
  return std::vector<Schedule>{schedule.value()};
}

// What a pipeline's plan cannot honour, refused rather than silently dropped.
Status pipeline_plan_refusals(const PlanRequest& r, const Parallelism& p) {
  const auto refuse = [&](std::string_view what) { return Error{pipeline_refusal(what, p)}; };
  if (r.sweep != 0)
    return refuse("--sweep plans one device or rank; a pipeline plans at one budget");
  if (r.trainer) return refuse("--for plans one device's or one rank's step, not a pipeline's");
  if (r.memory_snapshot) {
    return refuse(
        "--memory-snapshot records a single-device run; a pipeline has no memory snapshot");
  }
  if (r.host_budget) {
    return refuse(
        "--host-budget applies to a single-device or FSDP plan; a pipeline's stages "
        "pin host memory as their offloaders do");
  }
  if (r.steps != 2) return refuse("--steps: a pipeline's plan simulates one training step");
  return Ok{};
}

// `ferry plan --pp N`: the fastest pipeline configuration whose every stage fits the budget
// (plan_pipeline), or the refusal that names the floor.
Result<Response> pipeline_plan_response(const PlanRequest& r) {
  auto parallelism = parallelism_of(r.mesh);
  if (!parallelism) return parallelism.error();
  if (auto bounded = first_error({in_bounds("--micro-batches", r.micro_batches, 1, 1024),
                                  in_bounds("--virtual-stages", r.virtual_stages, 1, 64)});
      !bounded) {
    return bounded.error();
  }
  if (r.mesh.pp == 1) {
    return Error{fmt::format(
        "--schedule, --micro-batches and --virtual-stages apply to a pipeline; give {} 2 or more",
        mesh_field(MeshField::Pp).flag)};
  }
  const auto refuse = [&](std::string_view what) {
    return Error{pipeline_refusal(what, parallelism.value())};
  };
  if (auto refused = pipeline_plan_refusals(r, parallelism.value()); !refused) {
    return refused.error();
  }
  if (auto allowed = pipeline_mesh_allowed(parallelism.value()); !allowed) {
    return allowed.error();
  }
  PipelinePlanOptions options;
  options.margin_permille = r.margin_permille.value_or(kDefaultPlanMarginPermille);
  if (auto margin = in_bounds("--margin", options.margin_permille, 0, kMaxPlanMarginPermille);
      !margin) {
    return margin.error();
  }
  if (auto jobs = in_bounds("--jobs", r.jobs, 0, 1024); !jobs) return jobs.error();
  auto schedules = pipeline_schedules(r);
  if (!schedules) return schedules.error();
  auto whole = load(r.target);
  if (!whole) return whole.error();
  if (allocator_of(r.allocator, *whole.value().model) != AllocatorMode::Default) {
    return refuse(
        "--allocator expandable applies to a single-device or FSDP run; a pipeline runs the "
        "default allocator");
  }
  // Each stage runs on the mesh: the rank's model, cut under it (Note [A pipeline on the mesh]).
  auto mesh = Mesh::make(stage_parallelism(parallelism.value()), whole.value().device, kMeshFlags);
  if (!mesh) return mesh.error();
  auto timed = rank_of(whole.value(), mesh.value(), r.target.model.name);
  if (!timed) return timed.error();
  Workload w = std::move(timed).value();
  const DeviceProfile device = w.device;
  w.device = mesh.value().rank_profile(device);
  options.mesh = mesh.value();
  options.devices = r.mesh.pp;
  options.micro_batches = r.micro_batches;
  options.virtual_stages = r.virtual_stages;
  auto split = parse_split(r.split);
  if (!split) return split.error();
  options.split = std::move(split).value();
  // A split the model cannot take is a bad request (exit 2), not a refusal of the budget.
  if (auto parts = partition_model(*w.model, r.mesh.pp * r.virtual_stages, options.split); !parts) {
    return parts.error();
  }
  options.schedules = std::move(schedules).value();
  options.schedule_defaulted = r.schedule.empty();
  options.budget = r.budget.value_or(w.device.memory);
  options.jobs = r.jobs;
  Response out;
  auto plan = plan_pipeline(w.model, w.device, options, &out.floor);
  if (!plan) {
    out.refusal = plan.error().message;
    if (out.floor.count() > 0) {
      out.smallest_budget = smallest_budget_for(out.floor, options.margin_permille);
    }
    return refused(std::move(out), options.margin_permille, w.device.memory);
  }
  const Parallelism& p = options.mesh;
  out.document =
      with_parallelism(pipeline_plan_json(plan.value(), *w.model, w.device), p, device, *w.model);
  if (r.text) {
    out.text = pipeline_plan_text(plan.value(), *w.model, w.device) +
               parallelism_text(p, device, *w.model) + stages_text(p);
  }
  return out;
}

}  // namespace
}  // namespace api

Result<Response> respond(const PlanRequest& asked) {
  PlanRequest r = asked;
  r.mesh = trainer_mesh(r.mesh, r.trainer);
  if (api::asks_pipeline(r)) return api::pipeline_plan_response(r);
  if (auto split = parse_split(r.split); !split) return split.error();
  auto setup = api::plan_setup(r);
  if (!setup) return setup.error();
  if (const auto& mesh = setup.value().file_pipeline) {
    PlanRequest pipelined = r;
    pipelined.mesh = *mesh;
    return api::pipeline_plan_response(pipelined);
  }
  if (r.split != "layers") {
    return Error{fmt::format("--split {} applies to a pipeline; give {} 2 or more", r.split,
                             mesh_field(MeshField::Pp).flag)};
  }
  PlannerOptions& options = setup.value().options;
  const Workload& w = setup.value().whole;
  const Workload& rank = setup.value().rank;
  if (r.sweep > 0) return api::sweep_response(r, options, rank, w.device);
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
    return r.planners->planner(api::planner_key(r) + (paged_stash ? " stash" : ""), rank, with)
        .plan(with, floor);
  };
  Response out;
  // The faster of the plans with and without the paged stash (plan_faster_space).
  auto outcome = plan_faster_space(rank.model, plan_with, &out.floor);
  std::optional<TrainerChoice> choice;
  if (r.trainer) {
    auto searched = api::trainer_choice(r, rank, options.parallel.mesh,
                                        budget_less_margin(options.budget, options.margin_permille),
                                        options.margin_permille);
    if (!searched) return searched.error();
    choice = std::move(searched).value();
  }
  if (!outcome) return api::no_plan(std::move(out), outcome, choice, options, w.device.memory);
  if (choice && !choice->best) {
    return api::trainer_refused(std::move(out), outcome, choice, options, w.device.memory);
  }
  return api::plan_response(r, std::move(out), std::move(outcome).value(), choice, rank, w.device);
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
  std::size_t kept = 0;
  for (const auto& [key, entries] : entries_) kept += entries.size();
  return kept;
}

std::int64_t PlannerCache::simulations() const {
  const std::scoped_lock lock(mutex_);
  std::int64_t runs = 0;
  for (const auto& [key, entries] : entries_) {
    for (const auto& entry : entries) runs += entry->planner.simulations();
  }
  return runs;
}

Planner& PlannerCache::planner(const std::string& key, const Workload& workload,
                               const PlannerOptions& options) {
  std::vector<std::unique_ptr<Entry>>& entries = entries_[key];
  for (const auto& entry : entries) {
    if (*entry->workload.model == *workload.model) return entry->planner;
  }
  entries.push_back(std::make_unique<Entry>(workload, options));
  return entries.back()->planner;
}

}  // namespace ferry::sim
