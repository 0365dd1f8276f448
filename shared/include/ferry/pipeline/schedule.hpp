#pragma once
/// The order in which a pipeline runs its tasks: one task is one micro-batch on one partition,
/// forward or backward; a clock tick issues the fences of its tasks, then their compute.

#include <cstdint>
#include <vector>

namespace ferry::pipeline {

enum class Phase : std::uint8_t { Forward, Backward };

/// A task's place: micro-batch `micro_batch` on partition `partition`.
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
  GPipe,       ///< fill-drain: forward diagonals i + j = k, then backward in reverse
  Sequential,  ///< one micro-batch after another, its forward then its backward
};

/// The ticks of one training step. GPipe tick k of forward runs the cells with i + j = k in
/// partition order; backward runs the same diagonals in reverse, later partitions first
/// (torchgpipe's clock_cycles).
[[nodiscard]] std::vector<Tick> clock(Schedule schedule, std::uint32_t micro_batches,
                                      std::uint32_t partitions);

}  // namespace ferry::pipeline
