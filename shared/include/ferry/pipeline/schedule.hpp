#pragma once
/// The order in which a pipeline runs its tasks: one task is one micro-batch on one stage
/// (partition), forward or backward. GPipe runs clock ticks (each tick issues the fences of its
/// tasks, then their compute); 1F1B and interleaved 1F1B run each rank's list of actions in
/// the order torch.distributed.pipelining runs them. See Note [Schedule orders].

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ferry::pipeline {

/// A task's step. Under zero-bubble schedules Backward is the input-gradient step (torch's
/// BACKWARD_INPUT) and Weight the weight-gradient step (BACKWARD_WEIGHT); otherwise Backward is
/// the whole backward and there is no Weight step.
enum class Phase : std::uint8_t { Forward, Backward, Weight };

/// A task's place: micro-batch `micro_batch` on stage (partition) `partition`.
struct Cell {
  std::uint32_t micro_batch = 0;
  std::uint32_t partition = 0;

  friend bool operator==(const Cell&, const Cell&) = default;
};

/// One clock tick: every cell's fence (copies in), then every cell's compute.
struct Tick {
  Phase phase = Phase::Forward;
  std::vector<Cell> cells;
};

enum class Schedule : std::uint8_t {
  GPipe,            ///< fill-drain: forward diagonals i + j = k, then backward in reverse
  Sequential,       ///< one micro-batch after another, its forward then its backward
  OneFOneB,         ///< torch's Schedule1F1B: warm-up forwards, one forward one backward, cool-down
  Interleaved1F1B,  ///< torch's ScheduleInterleaved1F1B: V stages a rank, looped
  /// torch's ScheduleInterleavedZeroBubble: as Interleaved1F1B, with each backward split into
  /// the input-gradient step and a deferred weight-gradient step
  InterleavedZeroBubble,
};

/// "gpipe", "sequential", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble".
[[nodiscard]] const char* schedule_name(Schedule schedule);

/// The ticks of one training step (GPipe and Sequential). GPipe tick k of forward runs the
/// cells with i + j = k in partition order; backward runs the same diagonals in reverse, later
/// partitions first (torchgpipe's clock_cycles).
[[nodiscard]] std::vector<Tick> clock(Schedule schedule, std::uint32_t micro_batches,
                                      std::uint32_t partitions);

/// One step of a rank's list: the forward or backward of micro-batch `cell.micro_batch` on
/// stage `cell.partition`.
struct Action {
  Phase phase = Phase::Forward;
  Cell cell;

  friend bool operator==(const Action&, const Action&) = default;
};

/// Why `micro_batches`, `ranks` and `virtual_stages` do not make a schedule torch runs (its
/// constructors' checks), or nothing when they do. GPipe and Sequential take any counts with
/// one stage a rank.
[[nodiscard]] std::optional<std::string> schedule_error(Schedule schedule,
                                                        std::uint32_t micro_batches,
                                                        std::uint32_t ranks,
                                                        std::uint32_t virtual_stages);

/// Stage s of a schedule with `ranks` ranks runs on rank s % ranks (torch's looped placement:
/// rank r holds stages r, r + ranks, ...).
[[nodiscard]] constexpr std::uint32_t rank_of_stage(std::uint32_t stage, std::uint32_t ranks) {
  return stage % ranks;
}

/// Each rank's actions in the order torch runs them, for `ranks * virtual_stages` stages
/// (OneFOneB takes virtual_stages 1). GPipe and Sequential give their clocks' order per rank.
/// The counts must pass schedule_error.
[[nodiscard]] std::vector<std::vector<Action>> rank_orders(Schedule schedule,
                                                           std::uint32_t micro_batches,
                                                           std::uint32_t ranks,
                                                           std::uint32_t virtual_stages);

/// One host thread's order of the ranks' actions: each rank's in its own order, every action
/// after the ones whose data it receives (the forward of stage s - 1 and the backward of stage
/// s + 1 for the same micro-batch) and after its own forward. The ranks are visited in turn,
/// one ready action each; `stages` is the number of stages.
[[nodiscard]] std::vector<Action> issue_order(const std::vector<std::vector<Action>>& ranks,
                                              std::uint32_t stages);

}  // namespace ferry::pipeline
