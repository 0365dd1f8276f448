#pragma once
/// The simulated autograd: replays a model's training steps on the simulated device, with the
/// offloader's pack/unpack hooks, post-hooks and end-of-backward callback, as PyTorch's engine
/// would call them.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ferry/offload_options.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/model.hpp"
#include "ferry/sim/simulator.hpp"

namespace ferry::sim {

struct TrainingOptions {
  OffloadOptions offload;
  SimOptions sim;
  std::int32_t steps = 1;
  /// Keep the graph after backward and run backward on it a second time (retain_graph=True).
  bool retain_graph = false;
  /// 0: backward nodes in reverse forward order; otherwise a random valid topological order.
  std::uint64_t order_seed = 0;
  /// Tell the offloader the node order at backward start (else it assumes decreasing ids).
  bool announce_order = true;
  /// Every n-th backward node keeps a view of its first unpacked tensor for one more node
  /// (0: never): the case where the reference offloader falls back to record_stream.
  std::int32_t escape_period = 0;
  /// Unpack every saved tensor twice (as when hooks read grad_fn._saved_* too).
  bool unpack_twice = false;
  /// Synchronize the device at the end of each step (as loss.item() does).
  bool sync_each_step = true;
};

struct StepTimes {
  SimTime start;
  SimTime forward_end;
  SimTime end;
};

struct TrainingRun {
  Simulator sim;
  OffloadTelemetry telemetry;
  /// Set when the run stopped early: out of memory, or an error the offloader raised.
  std::optional<std::string> failure;
  std::vector<StepTimes> steps;
  Bytes baseline_allocated;               ///< device bytes allocated before the first forward
  /// Device bytes allocated after each step, less frees deferred by record_stream (they
  /// return at the next allocation).
  std::vector<Bytes> allocated_after;
  std::vector<std::size_t> tracked_after; ///< ids the offloader still tracks after each step
  std::vector<std::uint32_t> backward_order;  ///< node order of the last backward
};

/// Runs `options.steps` training steps of `model` (durations must be assigned) on one device.
Result<TrainingRun> simulate_training(const Model& model, const DeviceProfile& device,
                                      const TrainingOptions& options);

/// Time the compute stream spent blocked in waits between `from` and `to` (stall).
[[nodiscard]] SimTime compute_stall(const Simulator& sim, StreamId compute, SimTime from,
                                    SimTime to);
/// Thousandths of copy time that overlapped kernel time.
[[nodiscard]] std::int64_t copy_overlap_permille(const Simulator& sim);

}  // namespace ferry::sim
