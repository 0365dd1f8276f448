#include "ferry/sim/runs/measure.hpp"

#include <limits>
#include <optional>
#include <utility>

#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/runs/metrics.hpp"

namespace ferry::sim {

namespace {

RowResult measure(const TrainingRun& run, const PolicyRow& row) {
  RowResult r;
  r.name = row.name;
  r.policy = row.options.offload.policy;
  r.failure = run.failure;
  r.fits = !(run.failure && run.failure->kind == FailureKind::OutOfMemory);
  const Simulator& sim = run.sim;
  TimelineMetrics metrics(run.compute);
  sim.replay(metrics);
  if (!run.steps.empty()) {
    // Times, stall and bytes moved by copies issued during the last step.
    const StepTimes& last = run.steps.back();
    r.step_time = last.end - last.start;
    // The host returns from forward long before the device finishes it: the forward pass ends
    // when its last kernel does.
    r.forward_time = metrics.kernels_done(last.start, last.forward_end) - last.start;
    r.forward_stall = metrics.stall(last.start, last.forward_end);
    r.backward_stall = metrics.stall(last.forward_end, last.end);
    r.d2h = metrics.copied(CopyDirection::DeviceToHost, last.start, last.end);
    r.h2d = metrics.copied(CopyDirection::HostToDevice, last.start, last.end);
    r.overlap_permille = metrics.copy_overlap_permille(last.start, last.end);
  }
  r.recompute_time = run.recompute_time;
  const AllocatorStats& st = sim.device_allocator(run.device).stats();
  r.peak_allocated = st.allocated_peak;
  r.peak_reserved = st.reserved_peak;
  r.pinned_peak = sim.pinned_allocator().stats().reserved_peak;
  r.hazards = sim.hazards().size();
  r.telemetry = run.telemetry;
  // `--horizon none` runs with the largest byte count, which is no horizon: reported as none.
  const std::optional<Bytes>& horizon = row.options.offload.horizon_bytes;
  if (row.options.offload.policy == Policy::Ferry && horizon &&
      horizon->count() < std::numeric_limits<std::int64_t>::max()) {
    r.horizon = horizon;
  }
  r.layers = run.layer_decisions;
  if (row.options.paged_stash.on) r.paged_stash = run.paged_stash;
  return r;
}

// The row of a run that could not start: `error` says why.
RowResult refused(const PolicyRow& row, const Error& error) {
  RowResult r;
  r.name = row.name;
  r.policy = row.options.offload.policy;
  r.failure = Failure{FailureKind::Infeasible, error.message};
  return r;
}

}  // namespace

RowResult run_row(const CheckedModel& model, const DeviceProfile& device, const PolicyRow& row,
                  std::optional<TrainingRun>* keep) {
  auto run = simulate_training(model, device, row.options);
  if (!run.ok()) return refused(row, run.error());
  RowResult result = measure(run.value(), row);
  if (result.failure && result.failure->kind == FailureKind::OutOfMemory) {
    // What would it need? Run again with ample memory.
    auto again = simulate_training(model, roomy(device), row.options);
    if (again.ok() && !again.value().failure) {
      result = measure(again.value(), row);
      result.fits = false;
      result.failure = run.value().failure;
      if (keep != nullptr) keep->emplace(std::move(again).value());
      return result;
    }
  }
  if (keep != nullptr) keep->emplace(std::move(run).value());
  return result;
}

RowResult run_row(const Model& model, const DeviceProfile& device, const PolicyRow& row,
                  std::optional<TrainingRun>* keep) {
  auto checked = check_model(model);
  if (!checked) return refused(row, checked.error());
  return run_row(checked.value(), device, row, keep);
}

}  // namespace ferry::sim
