#pragma once
/// What-if runs of a model under offload policies: `ferry simulate` and `ferry compare`.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ferry/failure.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/autograd/pipeline.hpp"

namespace ferry::sim {

/// One configuration to simulate.
struct PolicyRow {
  std::string name;
  TrainingOptions options;
};

/// What one configuration costs. Times are of the last simulated step (the steady state).
struct RowResult {
  std::string name;
  Policy policy = Policy::None;
  std::optional<Failure> failure;  ///< out of memory, or an offloader error
  bool fits = true;                ///< false: ran out of device memory on this device
  SimTime step_time;       ///< simulated time from the step's start to its end (device synced)
  SimTime forward_time;    ///< from the step's start to the forward pass's last kernel's end
  SimTime backward_stall;  ///< compute stream blocked on reloads in backward
  SimTime forward_stall;   ///< compute stream blocked on offload guards in forward
  SimTime recompute_time;  ///< kernel time spent recomputing checkpointed regions
  std::int64_t overlap_permille = 0;  ///< copy time overlapped with compute
  Bytes peak_allocated;
  Bytes peak_reserved;
  Bytes pinned_peak;
  Bytes d2h;  ///< moved off the device in the last step
  Bytes h2d;  ///< moved back in the last step
  std::size_t hazards = 0;
  OffloadTelemetry telemetry;
  /// The ferry policy's offload horizon the run used (OffloadOptions::horizon_bytes).
  std::optional<Bytes> horizon;
  /// The offloader's decisions per layer (TrainingRun::layer_decisions), last step.
  std::map<std::int32_t, LayerDecisions> layers;
};

/// The rows of `ferry compare`: none, trl, ferry, ferry knob variants, checkpointing every
/// layer, selective checkpointing, and offload of checkpoint inputs with recompute inside. The
/// ferry rows offload up to the horizon offload_horizon derives for them on `device`.
[[nodiscard]] std::vector<PolicyRow> default_rows(const TrainingOptions& base, const Model& model,
                                                  const DeviceProfile& device);

/// The ferry policy's offload horizon (OffloadOptions::horizon_bytes) for `options` on
/// `device`: the bytes of the saved storages whose copies, queued on the device-to-host link in
/// pack order, end before backward needs them again (Note [Deriving the offload horizon] in
/// horizon.cpp). Unset when every copy is hidden, and for other policies. `model` must have
/// durations assigned.
[[nodiscard]] std::optional<Bytes> offload_horizon(const Model& model, const DeviceProfile& device,
                                                   const TrainingOptions& options);

/// Parses a checkpoint spec: "none", "every:K" (one region per K layers), "selective" (every
/// layer, attention core recomputed), "segments:N" or "reentrant-segments:N"
/// (checkpoint_sequential). The error names the accepted forms.
Result<CheckpointPlan> parse_checkpoint_spec(std::string_view spec, const Model& model);

/// Parses a side-stream spec: "none", or a comma-separated list of layers ("3") and layer
/// ranges ("2-5") whose ops run on the side stream, "recompute" (checkpoint replays there) and
/// "all-reduce" (parameter gradients all-reduced on a comm stream). The error names the forms.
Result<SideStreamOptions> parse_side_streams(std::string_view spec);

/// Runs one row. A configuration that runs out of device memory is run again on a device
/// with room to spare, so the table can say how much it would need (fits = false). With
/// `keep`, the run the figures come from is moved there (for its trace).
[[nodiscard]] RowResult run_row(const Model& model, const DeviceProfile& device,
                                const PolicyRow& row, std::optional<TrainingRun>* keep = nullptr);

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
