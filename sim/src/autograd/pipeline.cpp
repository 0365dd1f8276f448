#include "ferry/sim/autograd/pipeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>

#include "executor.hpp"
#include "pipeline_plan.hpp"

namespace ferry::sim {

namespace {

using pipelining::check_skips;
using pipelining::check_views;
using pipelining::Executor;
using pipelining::make_plan;

/// Each stage has its own random generator: op k draws from its partition's. (A torch rank has
/// one generator for its stages; with one per stage, the draws do not depend on the order the
/// schedule runs the stages in, and the reference draws the same numbers.)
std::vector<std::uint32_t> generators_by_partition(const std::vector<std::uint32_t>& starts) {
  std::vector<std::uint32_t> generator_of(starts.back(), 0);
  for (std::uint32_t j = 0; j + 1 < starts.size(); ++j) {
    for (std::uint32_t k = starts[j]; k < starts[j + 1]; ++k) generator_of[k] = j;
  }
  return generator_of;
}

Status check_options(const Model& model, const PipelineOptions& options) {
  if (options.micro_batches < 1) {
    return Error{fmt::format("micro_batches is {}; use at least 1", options.micro_batches)};
  }
  if (options.devices < 1) {
    return Error{fmt::format("devices is {}; use at least 1", options.devices)};
  }
  if (options.virtual_stages < 1) {
    return Error{fmt::format("virtual_stages is {}; use at least 1", options.virtual_stages)};
  }
  if (options.schedule == Schedule::Sequential) {
    return Error{"the sequential schedule is the reference's; use gpipe, 1f1b or interleaved-1f1b"};
  }
  if (const auto why = pipeline::schedule_error(
          options.schedule, static_cast<std::uint32_t>(options.micro_batches),
          static_cast<std::uint32_t>(options.devices),
          static_cast<std::uint32_t>(options.virtual_stages))) {
    return Error{*why};
  }
  if (!options.stages.empty() &&
      options.stages.size() != static_cast<std::size_t>(options.devices)) {
    return Error{fmt::format(
        "stages gives {} per-stage policies for {} devices; give one a device, or none for the "
        "pipeline-wide checkpoint and offload",
        options.stages.size(), options.devices)};
  }
  if (pipeline::splits_backward(options.schedule) && any_offload(options)) {
    return Error{fmt::format(
        "offload in stages under {} is not simulated (its weight steps read saved tensors after "
        "their backward); use policy none or another schedule",
        pipeline::schedule_name(options.schedule))};
  }
  if (options.schedule != Schedule::GPipe && !options.skips.empty()) {
    return Error{fmt::format(
        "skip connections (portals) are torchgpipe's; under {} every tensor crossing stages is "
        "sent stage to stage, so give no skips or use gpipe",
        pipeline::schedule_name(options.schedule))};
  }
  Status valid = check_views(model);
  if (!valid.ok()) return valid;
  return check_skips(model, options.skips);
}

// The first micro-batches that run checkpointed on each device (the rest keep what they save).
std::vector<std::int32_t> checkpoint_stops(const PipelineOptions& options) {
  std::vector<std::int32_t> stops;
  const std::int32_t m = options.micro_batches;
  for (std::int32_t d = 0; d < options.devices; ++d) {
    const CheckpointMode mode = stage_policy(options, static_cast<std::size_t>(d)).checkpoint;
    stops.push_back(mode == CheckpointMode::Always       ? m
                    : mode == CheckpointMode::ExceptLast ? m - 1
                                                         : 0);
  }
  return stops;
}

}  // namespace

// Note [Per-stage policies]
// PipelineOptions::stages gives each device its own checkpoint mode and offload policy, as
// PipeOffload (Wan et al., ICML 2025, "PipeOffload: Improving Scalability of Pipeline
// Parallelism with Memory Optimization") offloads only where memory binds: under 1F1B, stage s
// of p holds up to p - s micro-batches in flight, so the first stages bind. Nothing crosses
// devices differently: a stage's checkpoint mode decides only how its own tasks run and how many
// holds a received chain tensor gets on its side (the receive's waits are the same), and a
// stage's offloader packs only tensors its own partition produced, on its own device's copy
// streams, so stages with and without an offloader need no new wait between them. The hazard
// checker runs over every mix the planner chooses (plan_pipeline reruns it checked).

StagePolicy stage_policy(const PipelineOptions& options, std::size_t device) {
  if (device < options.stages.size()) return options.stages[device];
  return StagePolicy{.checkpoint = options.checkpoint, .offload = options.offload};
}

bool any_offload(const PipelineOptions& options) {
  if (options.stages.empty()) return options.offload.policy != Policy::None;
  return std::any_of(options.stages.begin(), options.stages.end(),
                     [](const StagePolicy& s) { return s.offload.policy != Policy::None; });
}

double device_bubble(const PipelineRun& run, std::size_t device) {
  if (run.pipeline_span.ns() <= 0 || device >= run.busy.size()) return 0.0;
  return 1.0 -
         static_cast<double>(run.busy[device].ns()) / static_cast<double>(run.pipeline_span.ns());
}

double step_bubble(const PipelineRun& run) {
  if (run.pipeline_span.ns() <= 0 || run.busy.empty()) return 0.0;
  std::int64_t busy = 0;
  for (const SimTime b : run.busy) busy += b.ns();
  return 1.0 - static_cast<double>(busy) / (static_cast<double>(run.pipeline_span.ns()) *
                                            static_cast<double>(run.busy.size()));
}

Result<PipelineRun> simulate_pipeline(const Model& model, const DeviceProfile& device,
                                      const PipelineOptions& options,
                                      const PipelineFaults& faults) {
  auto checked = check_model(model);
  if (!checked) return checked.error();
  return simulate_pipeline(checked.value(), device, options, faults);
}

Result<PipelineRun> simulate_pipeline(const CheckedModel& checked, const DeviceProfile& device,
                                      const PipelineOptions& options,
                                      const PipelineFaults& faults) {
  const Model& model = *checked;
  Status valid = check_options(model, options);
  if (!valid.ok()) return valid.error();
  auto parts = partition_model(model, options.devices * options.virtual_stages, options.split);
  if (!parts.ok()) return parts.error();
  std::string split = std::move(parts.value().split);
  std::vector<std::uint32_t> generator_of = generators_by_partition(parts.value().starts);
  Executor executor(
      model, device, options, faults,
      make_plan(model, std::move(parts.value().starts), std::move(generator_of), options.skips),
      options.schedule, checkpoint_stops(options));
  PipelineRun run = executor.run();
  run.split = std::move(split);
  return run;
}

Result<PipelineRun> simulate_reference(const Model& model, const DeviceProfile& device,
                                       const PipelineOptions& options) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  Status valid = check_options(model, options);
  if (!valid.ok()) return valid.error();
  auto parts = partition_model(model, options.devices * options.virtual_stages, options.split);
  if (!parts.ok()) return parts.error();
  std::vector<std::uint32_t> generator_of = generators_by_partition(parts.value().starts);
  PipelineOptions reference = options;
  reference.devices = 1;
  reference.virtual_stages = 1;
  reference.schedule = Schedule::GPipe;
  reference.offload.policy = Policy::None;  // the computation as written, nothing moved
  reference.stages.clear();
  std::vector<std::uint32_t> single = {0, static_cast<std::uint32_t>(model.ops.size())};
  Executor executor(model, device, reference, PipelineFaults{},
                    make_plan(model, std::move(single), std::move(generator_of), reference.skips),
                    pipeline::Schedule::Sequential, {0});
  return executor.run();
}

}  // namespace ferry::sim
