#pragma once
/// `ferry plan --pp N`: the fastest pipeline configuration whose every stage's simulated
/// peak reserved memory fits the budget, with its per-stage peaks, among the uniform
/// configurations the pipeline simulator runs and a per-stage mix of them (docs/plan.md, "A
/// pipeline"). Each stage is a device: the budget is
/// each device's, and the stage with the largest peak is the one that binds.

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ferry/failure.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/autograd/pipeline.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

// Note [A pipeline's plan space]
// The pipeline simulator runs a checkpoint mode (always, except_last, never: which micro-batches
// recompute their stage) and an offload policy with its knobs on each device, under one
// schedule; it takes no per-op plan. So a pipeline's plan is a choice among those. The uniform
// configurations, one mode and policy on every stage: each schedule asked for (one, or with
// `--schedule auto` every one torch runs for the counts) times the checkpoint modes times the
// policies none, trl and ferry, and ferry with a 2 GiB prefetch (the single-device fixed row
// "ferry prefetch=2GiB"); zero bubble offloads nothing (pipeline_rows). The fixed pipeline rows
// of `ferry compare` are among them, with the knobs they run with, so the plan is never slower
// than the fastest fixed row whose stages all fit. Then one per-stage plan a schedule (Note
// [Per-stage plans]). Every candidate runs with the checks off; the fastest that fits runs again
// with the hazard checker and content checks on, and one with a hazard is passed over for the
// next.
//
// Note [Per-stage plans]
// Under 1F1B the first stages hold the most micro-batches in flight, so they bind; PipeOffload
// (Wan et al., ICML 2025, "PipeOffload: Improving Scalability of Pipeline Parallelism with
// Memory Optimization") offloads only where memory binds. The per-stage plan
// (PipelineOptions::stages) starts from the fastest uniform configuration, fitting or not: by
// its step, or by its probe's where it ran out of memory (a probe runs it again with four times
// the device's and pinned host's memory, for its per-stage peaks and step; it is never a plan).
// Each stage over the budget takes the fastest uniform configuration whose peak on that stage
// fits: a stage's peak is taken as independent of the other stages' configurations. The mix runs
// whole (the slowest stage sets the step); a stage still over the budget takes its next fitting
// configuration, until every stage fits or none is left. The mix counts as fitting when its step
// is no slower than the fastest uniform configuration that fits (or none fits), so the plan is
// never slower than the best fixed row. Every mix tried is a candidate in the report.

/// What to plan a pipeline for.
struct PipelinePlanOptions {
  std::int32_t devices = 2;        ///< stages, one a device (times virtual_stages)
  std::int32_t micro_batches = 4;  ///< the model describes one
  std::int32_t virtual_stages = 1;
  PipelineSplit split;  ///< how the model is cut into stages, the same for every candidate
  /// The schedules to plan: one, or several (`--schedule auto`) to choose among.
  std::vector<Schedule> schedules{Schedule::OneFOneB};
  /// The request named no schedule: the report says which one the plan used and why.
  bool schedule_defaulted = false;
  Bytes budget;  ///< each device's peak reserved bytes
  /// Every stage fits the budget less this (Note [The plan margin]).
  std::int32_t margin_permille = 0;
  /// Simulations run at once (PlannerOptions::jobs); the plan is the same for any count.
  std::int32_t jobs = 0;
  /// Each stage's mesh (the model is then its rank's): every candidate runs on it.
  Mesh mesh;
  /// Test-only: planted faults every run (checked or not) is simulated with.
  PipelineFaults faults{};
};

/// One configuration the planner ran.
struct PipelineCandidate {
  std::string name;  ///< pipeline_row_name, and " prefetch=2GiB" for that knob
  PipelineOptions options;
  /// A per-stage plan (options.stages set): each stage's configuration, a uniform candidate's
  /// name less its schedule and counts ("always ferry"); empty for a uniform configuration.
  std::vector<std::string> stage_configs;
  /// A per-stage plan within the budget but slower than the fastest uniform one that fits.
  bool slower = false;
  /// Out of memory: its per-stage peaks and step with four times the memory (Note [Per-stage
  /// plans]); empty otherwise.
  std::vector<Bytes> probe_reserved;
  SimTime probe_step;
  bool fixed = false;  ///< one of `ferry compare`'s pipeline rows
  std::optional<Failure> failure;
  SimTime step_time;
  std::vector<Bytes> peak_reserved;   ///< per stage (device)
  std::vector<Bytes> peak_allocated;  ///< per stage (device)
  Bytes max_reserved;                 ///< the binding stage's
  std::size_t binding = 0;            ///< the stage with the largest peak reserved
  SimTime recompute_time;
  Bytes d2h;  ///< offloaded by every stage
  SimTime span;
  std::vector<SimTime> busy;
  std::vector<std::int32_t> peak_in_flight;
  bool fits = false;     ///< completed, and every stage within the planned budget
  bool checked = false;  ///< ran again with the checks on
  std::size_t hazards = 0;
};

/// A schedule `--schedule auto` could not plan for the counts: torch's reason.
struct SkippedSchedule {
  Schedule schedule = Schedule::GPipe;
  std::string why;
};

/// The planner's answer: every candidate as measured, and the chosen one.
struct PipelinePlan {
  PipelinePlanOptions options;
  Bytes planned_budget;  ///< budget less the margin
  std::vector<PipelineCandidate> candidates;
  std::vector<SkippedSchedule> skipped;
  std::size_t chosen = 0;
  std::optional<std::size_t> best_fixed;  ///< the fastest fixed row that fits
  std::int64_t simulations = 0;
  std::vector<StageSpan> stages;  ///< what each stage holds (partition_model)
  std::string split;              ///< Partitions::split
};

/// The fastest candidate that fits every stage and is hazard-free when checked. The error (a
/// refusal) names the smallest budget that plans where a candidate completed (`floor` receives
/// its binding stage's peak reserved, else 0), or says that every candidate ran out of memory
/// on the device; bad counts (schedule_error) are errors too, naming `--schedule`.
Result<PipelinePlan> plan_pipeline(const CheckedModel& model, const DeviceProfile& device,
                                   const PipelinePlanOptions& options, Bytes* floor = nullptr);

/// The report `ferry plan --pp N` prints, and its `--json` document
/// (`ferry.pipeline-plan/1`).
[[nodiscard]] std::string pipeline_plan_text(const PipelinePlan& plan, const Model& model,
                                             const DeviceProfile& device);
[[nodiscard]] nlohmann::ordered_json pipeline_plan_json(const PipelinePlan& plan,
                                                        const Model& model,
                                                        const DeviceProfile& device);

}  // namespace ferry::sim
