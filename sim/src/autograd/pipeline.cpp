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

/// Each device has its own random generator: op k draws from its partition's.
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
  Status valid = check_views(model);
  if (!valid.ok()) return valid;
  return check_skips(model, options.skips);
}

}  // namespace

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
  auto starts = balance_by_duration(model, options.devices);
  if (!starts.ok()) return starts.error();
  std::vector<std::uint32_t> generator_of = generators_by_partition(starts.value());
  const std::int32_t m = options.micro_batches;
  const std::int32_t stop = options.checkpoint == CheckpointMode::Always       ? m
                            : options.checkpoint == CheckpointMode::ExceptLast ? m - 1
                                                                               : 0;
  Executor executor(
      model, device, options, faults,
      make_plan(model, std::move(starts).value(), std::move(generator_of), options.skips),
      pipeline::Schedule::GPipe, stop);
  return executor.run();
}

Result<PipelineRun> simulate_reference(const Model& model, const DeviceProfile& device,
                                       const PipelineOptions& options) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  Status valid = check_options(model, options);
  if (!valid.ok()) return valid.error();
  auto starts = balance_by_duration(model, options.devices);
  if (!starts.ok()) return starts.error();
  std::vector<std::uint32_t> generator_of = generators_by_partition(starts.value());
  PipelineOptions reference = options;
  reference.devices = 1;
  reference.offload.policy = Policy::None;  // the computation as written, nothing moved
  std::vector<std::uint32_t> single = {0, static_cast<std::uint32_t>(model.ops.size())};
  Executor executor(model, device, reference, PipelineFaults{},
                    make_plan(model, std::move(single), std::move(generator_of), reference.skips),
                    pipeline::Schedule::Sequential, 0);
  return executor.run();
}

}  // namespace ferry::sim
