#pragma once
/// The order in which a pipeline runs its tasks: one task is one micro-batch on one stage
/// (partition), forward or backward. GPipe runs clock ticks (each tick issues the fences of its
/// tasks, then their compute); 1F1B, interleaved 1F1B and the zero-bubble schedules run each
/// rank's list of actions in the order torch.distributed.pipelining runs them. See Note
/// [Schedule orders].

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
  /// torch's ScheduleZBVZeroBubble (torchtitan's "ZBVZeroBubble"): two stages a rank placed in
  /// a V (rank r holds stages r and 2 ranks - 1 - r), each backward split as above
  ZeroBubbleV,
};

/// "gpipe", "sequential", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv".
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

/// Whether the schedule splits each backward into a Backward and a Weight step.
[[nodiscard]] constexpr bool splits_backward(Schedule schedule) {
  return schedule == Schedule::InterleavedZeroBubble || schedule == Schedule::ZeroBubbleV;
}

/// The rank stage `stage` of `schedule` runs on, with `ranks` ranks: s % ranks (torch's looped
/// placement: rank r holds stages r, r + ranks, ...), or under ZeroBubbleV torch's V placement
/// (style "v": stage s < ranks on rank s, stage s >= ranks on rank 2 ranks - 1 - s, so stages
/// ranks - 1 and ranks share a rank, as do the first and the last).
[[nodiscard]] constexpr std::uint32_t rank_of_stage(Schedule schedule, std::uint32_t stage,
                                                    std::uint32_t ranks) {
  if (schedule != Schedule::ZeroBubbleV) return stage % ranks;
  const std::uint32_t lap = stage / ranks;
  const std::uint32_t at = stage % ranks;
  return lap % 2 == 0 ? at : ranks - 1 - at;
}

/// Each rank's actions in the order torch runs them, for `ranks * virtual_stages` stages
/// (OneFOneB takes virtual_stages 1, ZeroBubbleV 2). GPipe and Sequential give their clocks' order
/// per rank. The counts must pass schedule_error.
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
