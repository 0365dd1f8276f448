#pragma once
/// What-if runs of a model under offload and checkpoint options, for `ferry simulate` and
/// `ferry compare`: the parsers of their specs and the pipeline rows. The single-device rows are
/// configurations.hpp's default_rows, run with measure.hpp's run_row.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/failure.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/autograd/pipeline.hpp"

namespace ferry::sim {

/// Parses a checkpoint spec: "none", "every:K" (one region per K layers), "selective" (each
/// layer's attention core a region of its own; an error where the model has no attention core),
/// "segments:N" or "reentrant-segments:N" (checkpoint_sequential). The error names the accepted
/// forms.
Result<CheckpointPlan> parse_checkpoint_spec(std::string_view spec, const Model& model);

/// Parses a side-stream spec: "none", or a comma-separated list of layers ("3") and layer
/// ranges ("2-5") whose ops run on the side stream, "recompute" (checkpoint replays there) and
/// "all-reduce" (parameter gradients all-reduced on a comm stream). The error names the forms.
Result<SideStreamOptions> parse_side_streams(std::string_view spec);

/// One pipeline configuration's cost (`ferry simulate --pp N`, `ferry compare --pp N`).
struct PipelineRow {
  std::string name;
  PipelineOptions options;
  std::optional<Failure> failure;
  SimTime step_time;      ///< the whole step: every micro-batch
  Bytes max_device_peak;  ///< the largest per-device allocated peak
  SimTime recompute_time;
  std::size_t hazards = 0;
  std::vector<Bytes> device_peaks;
  Bytes d2h;  ///< offloaded by every stage's offloader
  /// From the first task kernel's start to the last one's end (PipelineRun::pipeline_span).
  SimTime span;
  std::vector<SimTime> busy;                 ///< per device: its task kernels' time
  std::vector<std::int32_t> peak_in_flight;  ///< per device: most tasks holding activations
  std::vector<StageSpan> stages;             ///< what each stage holds (PipelineRun::stages)
  std::string split;                         ///< PipelineRun::split
};

/// The step's bubble of a row in permille: idle compute time over devices x span, rounded.
[[nodiscard]] std::int64_t bubble_permille(const PipelineRow& row);
/// Device d's bubble in permille: 1 - busy / span, rounded.
[[nodiscard]] std::int64_t bubble_permille(const PipelineRow& row, std::size_t device);

/// Runs a pipeline configuration.
[[nodiscard]] PipelineRow run_pipeline_row(const CheckedModel& model, const DeviceProfile& device,
                                           std::string name, const PipelineOptions& options);
/// "SCHEDULE DxM MODE" ("interleaved-1f1b DxMxV MODE"), and the offload policy when there is
/// one.
[[nodiscard]] std::string pipeline_row_name(const PipelineOptions& options);
/// Parses "gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble" or "zbv".
Result<Schedule> parse_schedule(std::string_view text);
/// Parses "always", "except_last" or "never".
Result<CheckpointMode> parse_checkpoint_mode(std::string_view text);
/// The pipeline rows of `ferry compare --pp N --micro-batches M`: each checkpoint mode,
/// then trl and ferry offload in every stage, without checkpoint and except the last, all under
/// `schedule` with `virtual_stages` stages a device, each stage on `mesh` (`model` the rank's),
/// the model cut by `split`.
[[nodiscard]] std::vector<PipelineRow> pipeline_rows(
    const CheckedModel& model, const DeviceProfile& device, std::int32_t devices,
    std::int32_t micro_batches, Schedule schedule = Schedule::GPipe,
    std::int32_t virtual_stages = 1, const Mesh& mesh = {}, const PipelineSplit& split = {});

}  // namespace ferry::sim
