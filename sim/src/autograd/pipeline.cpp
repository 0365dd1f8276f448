#include "ferry/sim/autograd/pipeline.hpp"

#include <fmt/format.h>

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
  if (options.schedule == Schedule::InterleavedZeroBubble &&
      options.offload.policy != Policy::None) {
    return Error{
        "offload in stages under interleaved-zero-bubble is not simulated (its weight steps "
        "read saved tensors after their backward); use policy none or another schedule"};
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

}  // namespace

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
  auto starts = balance_by_duration(model, options.devices * options.virtual_stages);
  if (!starts.ok()) return starts.error();
  std::vector<std::uint32_t> generator_of = generators_by_partition(starts.value());
  const std::int32_t m = options.micro_batches;
  const std::int32_t stop = options.checkpoint == CheckpointMode::Always       ? m
                            : options.checkpoint == CheckpointMode::ExceptLast ? m - 1
                                                                               : 0;
  Executor executor(
      model, device, options, faults,
      make_plan(model, std::move(starts).value(), std::move(generator_of), options.skips),
      options.schedule, stop);
  return executor.run();
}

Result<PipelineRun> simulate_reference(const Model& model, const DeviceProfile& device,
                                       const PipelineOptions& options) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  Status valid = check_options(model, options);
  if (!valid.ok()) return valid.error();
  auto starts = balance_by_duration(model, options.devices * options.virtual_stages);
  if (!starts.ok()) return starts.error();
  std::vector<std::uint32_t> generator_of = generators_by_partition(starts.value());
  PipelineOptions reference = options;
  reference.devices = 1;
  reference.virtual_stages = 1;
  reference.schedule = Schedule::GPipe;
  reference.offload.policy = Policy::None;  // the computation as written, nothing moved
  std::vector<std::uint32_t> single = {0, static_cast<std::uint32_t>(model.ops.size())};
  Executor executor(model, device, reference, PipelineFaults{},
                    make_plan(model, std::move(single), std::move(generator_of), reference.skips),
                    pipeline::Schedule::Sequential, 0);
  return executor.run();
}

}  // namespace ferry::sim
