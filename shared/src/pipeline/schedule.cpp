#include "ferry/pipeline/schedule.hpp"

#include <utility>

namespace ferry::pipeline {

std::vector<Tick> clock(Schedule schedule, std::uint32_t micro_batches, std::uint32_t partitions) {
  const std::uint32_t m = micro_batches;
  const std::uint32_t n = partitions;
  std::vector<Tick> ticks;
  if (schedule == Schedule::Sequential) {
    for (std::uint32_t i = 0; i < m; ++i) {
      for (std::uint32_t j = 0; j < n; ++j) ticks.push_back(Tick{Phase::Forward, {Cell{i, j}}});
      for (std::uint32_t j = n; j-- > 0;) ticks.push_back(Tick{Phase::Backward, {Cell{i, j}}});
    }
    return ticks;
  }
  if (m == 0 || n == 0) return ticks;
  const std::uint32_t clocks = m + n - 1;
  for (std::uint32_t k = 0; k < clocks; ++k) {
    Tick tick{Phase::Forward, {}};
    for (std::uint32_t j = 0; j < n; ++j) {
      if (k >= j && k - j < m) tick.cells.push_back(Cell{k - j, j});
    }
    ticks.push_back(std::move(tick));
  }
  for (std::uint32_t k = clocks; k-- > 0;) {
    Tick tick{Phase::Backward, {}};
    for (std::uint32_t j = n; j-- > 0;) {
      if (k >= j && k - j < m) tick.cells.push_back(Cell{k - j, j});
    }
    ticks.push_back(std::move(tick));
  }
  return ticks;
}

}  // namespace ferry::pipeline
