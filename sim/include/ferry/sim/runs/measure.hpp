#pragma once
/// What one simulated training run of a configuration costs: the figures `ferry simulate`,
/// `ferry compare` and the planner report.

#include <map>
#include <optional>
#include <string>

#include "ferry/failure.hpp"
#include "ferry/sim/autograd/autograd.hpp"

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
  /// What the paged stash did, last step (TrainingRun::paged_stash); nothing without it.
  std::optional<PagedStashStats> paged_stash;

  /// Whether the run completed within the device's memory: not out of memory (whose figures
  /// are of a run with room to spare) and not failed otherwise (`failure` says why).
  [[nodiscard]] bool completed_within_memory() const { return fits && !failure; }
};

/// Runs one row. A configuration that runs out of device memory is run again on the roomy
/// device (configurations.hpp), so the table can say how much it would need (fits = false).
/// With `keep`, the run the figures come from is moved there (for its trace).
[[nodiscard]] RowResult run_row(const CheckedModel& model, const DeviceProfile& device,
                                const PolicyRow& row, std::optional<TrainingRun>* keep = nullptr);
/// check_model(model), then the row above (a model the check refuses gives a row that failed
/// with its error): for a model run once (tests, examples).
[[nodiscard]] RowResult run_row(const Model& model, const DeviceProfile& device,
                                const PolicyRow& row, std::optional<TrainingRun>* keep = nullptr);

}  // namespace ferry::sim
