#pragma once
/// What-if runs of a model under offload policies: `ferry simulate` and `ferry compare`.

#include <optional>
#include <string>
#include <vector>

#include "ferry/failure.hpp"
#include "ferry/sim/analysis/configurations.hpp"
#include "ferry/sim/analysis/horizon.hpp"
#include "ferry/sim/analysis/measure.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/autograd/pipeline.hpp"

namespace ferry::sim {

/// Parses a checkpoint spec: "none", "every:K" (one region per K layers), "selective" (every
/// layer, attention core recomputed), "segments:N" or "reentrant-segments:N"
/// (checkpoint_sequential). The error names the accepted forms.
Result<CheckpointPlan> parse_checkpoint_spec(std::string_view spec, const Model& model);

/// Parses a side-stream spec: "none", or a comma-separated list of layers ("3") and layer
/// ranges ("2-5") whose ops run on the side stream, "recompute" (checkpoint replays there) and
/// "all-reduce" (parameter gradients all-reduced on a comm stream). The error names the forms.
Result<SideStreamOptions> parse_side_streams(std::string_view spec);

/// Summary of one run as text / JSON (`ferry simulate`).
[[nodiscard]] std::string simulate_text(const RowResult& row, const Model& model,
                                        const DeviceProfile& device);
[[nodiscard]] std::string simulate_json(const RowResult& row, const Model& model,
                                        const DeviceProfile& device);

/// The comparison table as text (`ferry compare`); ratios are to the "none" row.
[[nodiscard]] std::string compare_text(const std::vector<RowResult>& rows, const Model& model,
                                       const DeviceProfile& device);

/// One pipeline configuration's cost (`ferry simulate --devices N`, `ferry compare --devices N`).
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
};

/// Runs a pipeline configuration.
[[nodiscard]] PipelineRow run_pipeline_row(const Model& model, const DeviceProfile& device,
                                           std::string name, const PipelineOptions& options);
/// "gpipe DxM MODE", and the offload policy when there is one.
[[nodiscard]] std::string pipeline_row_name(const PipelineOptions& options);
/// Parses "always", "except_last" or "never".
Result<CheckpointMode> parse_checkpoint_mode(std::string_view text);
/// The pipeline rows of `ferry compare --devices N --micro-batches M`: each checkpoint mode,
/// then trl and ferry offload in every stage, without checkpoint and except the last.
[[nodiscard]] std::vector<PipelineRow> pipeline_rows(const Model& model,
                                                     const DeviceProfile& device,
                                                     std::int32_t devices,
                                                     std::int32_t micro_batches);
/// The pipeline table as text, and the rows as a JSON array.
[[nodiscard]] std::string pipeline_text(const std::vector<PipelineRow>& rows);
[[nodiscard]] std::string pipeline_json(const std::vector<PipelineRow>& rows);
/// The document of `ferry simulate --devices N --json` ("ferry.pipeline/1"): the rows.
[[nodiscard]] std::string pipeline_document(const std::vector<PipelineRow>& rows);

/// The comparison as one JSON document ("ferry.compare/1"); ratios are to the "none" row. The
/// `pipeline` rows (`ferry compare --devices N`), when there are any, are its "pipeline" array.
[[nodiscard]] std::string compare_json(const std::vector<RowResult>& rows, const Model& model,
                                       const DeviceProfile& device,
                                       const std::vector<PipelineRow>& pipeline = {});

}  // namespace ferry::sim
