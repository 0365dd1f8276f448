#include "ferry/pipeline/schedule.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <set>
#include <utility>

#include "ferry/check.hpp"

namespace ferry::pipeline {

// Note [Schedule orders]
// torch.distributed.pipelining runs one list of actions a rank, each a forward or a backward of
// one micro-batch on one of the rank's stages; a rank issues its list in order and its receives
// make its compute stream wait for the data. The lists here follow torch 2.11's schedules.py:
//
// * Schedule1F1B (one stage a rank, stage s on rank s): min(m, pp - s) warm-up forwards, then
//   one backward and one forward in turn while forwards remain, then the remaining backwards.
//   torch refuses m < pp.
// * ScheduleInterleaved1F1B (V stages a rank, stage s on rank s % pp): rounds = max(1, m / pp),
//   m must be a multiple of rounds, and mpr = m / rounds micro-batches make a round. Rank r
//   runs w = min((V - 1) * mpr + 2 * (pp - 1 - r), m * V) warm-up forwards, then m * V - w
//   steps of one forward and one backward, then w backwards. Step k's forward is on local
//   stage (k / mpr) % V, its backward on local stage V - 1 - ((k - w) / mpr) % V; each stage
//   takes its micro-batches in order 0, 1, ... (torch's _get_1f1b_rank_ops without its no-op
//   padding, which only aligns the ranks' lists in time).
// * ScheduleInterleavedZeroBubble: as ScheduleInterleaved1F1B with w = min((V - 1) * mpr +
//   (pp - 1 - r), m * V) and each backward split into its input-gradient step (Phase::Backward)
//   and its weight-gradient step (Phase::Weight): rank r's steady and cool-down steps k with
//   k - w >= r follow their backward with the weight step of the oldest backward still without
//   one, and the weight steps left run at the end.
// * ScheduleZBVZeroBubble (two stages a rank, rank r holding stage a = r and stage
//   b = 2 pp - 1 - r, torch's V placement: rank_of_stage): its list is built for
//   n = max(m, 2 pp - 1) micro-batches, then every action of a micro-batch >= m is dropped.
//   Warm-up: 2 (pp - r) - 1 forwards of a; r times a forward of b then one of a; pp - r times
//   a forward of b with its input and weight steps at once. Steady, while a has forwards left
//   or b trails a: a forward of a (if any left), the input and weight steps of a's oldest
//   micro-batch without them, a forward of b, the same two steps on b. Cool-down: r times an
//   input step of a then one of b; pp - r times an input step of a then the oldest weight
//   step of a still owed; then b's owed weight steps, then a's. Stages pp - 1 and pp (both on
//   rank pp - 1) pass their tensors without a send (set_local_fwd_input and
//   set_local_bwd_input): the receiving stage reads the sender's buffer.
//
// The simulator has one host thread, so the ranks' lists are merged into one issue order
// (issue_order): the ranks in turn, each issuing its next action when what it receives has been
// issued, which keeps every rank's order and lets every wait name an event that exists. Which
// rank goes first only moves host time: the device order of each rank is its list.

const char* schedule_name(Schedule schedule) {
  switch (schedule) {
    case Schedule::GPipe:
      return "gpipe";
    case Schedule::Sequential:
      return "sequential";
    case Schedule::OneFOneB:
      return "1f1b";
    case Schedule::Interleaved1F1B:
      return "interleaved-1f1b";
    case Schedule::InterleavedZeroBubble:
      return "interleaved-zero-bubble";
    case Schedule::ZeroBubbleV:
      return "zbv";
  }
  return "gpipe";
}

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
  FERRY_CHECK(schedule == Schedule::GPipe, "{} runs by rank orders, not a clock",
              schedule_name(schedule));
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

std::optional<std::string> schedule_error(Schedule schedule, std::uint32_t micro_batches,
                                          std::uint32_t ranks, std::uint32_t virtual_stages) {
  if (micro_batches == 0 || ranks == 0) {
    return fmt::format("{} needs at least one micro-batch and one rank", schedule_name(schedule));
  }
  if (virtual_stages == 0) return std::string("virtual stages must be at least 1");
  switch (schedule) {
    case Schedule::GPipe:
    case Schedule::Sequential:
    case Schedule::OneFOneB:
      if (virtual_stages != 1) {
        return fmt::format("{} runs one stage a rank; virtual stages {} need interleaved-1f1b",
                           schedule_name(schedule), virtual_stages);
      }
      if (schedule == Schedule::OneFOneB && micro_batches < ranks) {
        return fmt::format(
            "1f1b needs at least as many micro-batches as stages ({} < {}), as torch's "
            "Schedule1F1B",
            micro_batches, ranks);
      }
      return std::nullopt;
    case Schedule::Interleaved1F1B:
    case Schedule::InterleavedZeroBubble: {
      const char* name = schedule_name(schedule);
      if (ranks < 2) {
        return fmt::format(
            "{} needs at least 2 devices (a rank's stages pass their data to the next rank)", name);
      }
      const std::uint32_t rounds = std::max(1U, micro_batches / ranks);
      if (micro_batches % rounds != 0) {
        return fmt::format(
            "{} needs the micro-batches to be a multiple of the rounds, max(1, micro-batches / "
            "devices) = {}, as torch's {}; got {}",
            name, rounds,
            schedule == Schedule::Interleaved1F1B ? "ScheduleInterleaved1F1B"
                                                  : "ScheduleInterleavedZeroBubble",
            micro_batches);
      }
      return std::nullopt;
    }
    case Schedule::ZeroBubbleV:
      // torch's ScheduleZBVZeroBubble takes exactly two stages a rank and any micro-batch count
      // (it pads its lists to 2 pp - 1 micro-batches and drops the padding).
      if (virtual_stages != 2) {
        return fmt::format(
            "zbv runs exactly 2 stages a device, as torch's ScheduleZBVZeroBubble; got virtual "
            "stages {} (use 2)",
            virtual_stages);
      }
      return std::nullopt;
  }
  return std::nullopt;
}

namespace {

// Schedule1F1B's list for stage (and rank) s.
std::vector<Action> one_f_one_b(std::uint32_t m, std::uint32_t ranks, std::uint32_t s) {
  std::vector<Action> out;
  const std::uint32_t warmup = std::min(m, ranks - s);
  std::uint32_t f = 0;
  std::uint32_t b = 0;
  for (; f < warmup; ++f) out.push_back(Action{Phase::Forward, Cell{f, s}});
  while (true) {
    out.push_back(Action{Phase::Backward, Cell{b++, s}});
    if (f == m) break;
    out.push_back(Action{Phase::Forward, Cell{f++, s}});
  }
  while (b < m) out.push_back(Action{Phase::Backward, Cell{b++, s}});
  return out;
}

// ScheduleInterleaved1F1B's list for rank r, or with `zero_bubble` ScheduleInterleavedZeroBubble's
// (its warm-up one forward a hop shorter, each backward split into the input-gradient step,
// Phase::Backward, and the weight-gradient step, Phase::Weight, the latter deferred).
std::vector<Action> interleaved(std::uint32_t m, std::uint32_t ranks, std::uint32_t v,
                                std::uint32_t r, bool zero_bubble) {
  const std::uint32_t rounds = std::max(1U, m / ranks);
  const std::uint32_t per_round = m / rounds;
  const std::uint32_t ops = m * v;
  const std::uint32_t hops = (zero_bubble ? 1 : 2) * (ranks - 1 - r);
  const std::uint32_t warmup = std::min((v - 1) * per_round + hops, ops);
  const std::uint32_t steady = ops - warmup;
  std::vector<std::uint32_t> next_forward(v, 0);
  std::vector<std::uint32_t> next_backward(v, 0);
  std::vector<std::uint32_t> next_weight(v, 0);
  std::vector<std::uint32_t> backward_steps;  // the steps whose backward ran, for their weights
  std::size_t weights = 0;
  std::vector<Action> out;
  const auto forward = [&](std::uint32_t step) {
    const std::uint32_t local = (step / per_round) % v;
    out.push_back(Action{Phase::Forward, Cell{next_forward[local]++, local * ranks + r}});
  };
  const auto backward_local = [&](std::uint32_t step) {
    return v - 1 - ((step - warmup) / per_round) % v;
  };
  const auto backward = [&](std::uint32_t step) {
    const std::uint32_t local = backward_local(step);
    out.push_back(Action{Phase::Backward, Cell{next_backward[local]++, local * ranks + r}});
    backward_steps.push_back(step);
  };
  const auto weight = [&] {
    const std::uint32_t local = backward_local(backward_steps[weights++]);
    out.push_back(Action{Phase::Weight, Cell{next_weight[local]++, local * ranks + r}});
  };
  for (std::uint32_t step = 0; step < warmup + steady + warmup; ++step) {
    if (step < warmup) {
      forward(step);
      continue;
    }
    if (step < warmup + steady) forward(step);
    backward(step);
    // Rank r runs r backwards before it defers weights (torch's num_1f1b_microbatches).
    if (zero_bubble && step - warmup >= r) weight();
  }
  while (zero_bubble && weights < backward_steps.size()) weight();
  return out;
}

// ScheduleZBVZeroBubble's list for rank r: stages a = r and b = 2 ranks - 1 - r.
std::vector<Action> zero_bubble_v(std::uint32_t m, std::uint32_t ranks, std::uint32_t r) {
  const std::uint32_t n = std::max(m, 2 * ranks - 1);
  const std::array<std::uint32_t, 2> stage{r, 2 * ranks - 1 - r};
  std::array<std::uint32_t, 2> f{0, 0};  // next forward, per local stage
  std::array<std::uint32_t, 2> b{0, 0};  // next input step
  std::array<std::uint32_t, 2> w{0, 0};  // next weight step
  std::vector<Action> out;
  const auto add = [&](Phase phase, std::uint32_t local, std::uint32_t& next) {
    const std::uint32_t mb = next++;
    if (mb < m) out.push_back(Action{phase, Cell{mb, stage[local]}});
  };
  // The weight step right after its input step.
  const auto input_and_weight = [&](std::uint32_t local) {
    add(Phase::Backward, local, b[local]);
    add(Phase::Weight, local, w[local]);
  };
  for (std::uint32_t k = 0; k < 2 * (ranks - r) - 1; ++k) add(Phase::Forward, 0, f[0]);
  for (std::uint32_t k = 0; k < r; ++k) {
    add(Phase::Forward, 1, f[1]);
    add(Phase::Forward, 0, f[0]);
  }
  for (std::uint32_t k = 0; k < ranks - r; ++k) {
    add(Phase::Forward, 1, f[1]);
    input_and_weight(1);
  }
  while (f[1] < f[0] || f[0] < n) {
    if (f[0] < n) add(Phase::Forward, 0, f[0]);
    input_and_weight(0);
    add(Phase::Forward, 1, f[1]);
    input_and_weight(1);
  }
  for (std::uint32_t k = 0; k < r; ++k) {
    add(Phase::Backward, 0, b[0]);
    add(Phase::Backward, 1, b[1]);
  }
  for (std::uint32_t k = 0; k < ranks - r; ++k) input_and_weight(0);
  while (w[1] < b[1]) add(Phase::Weight, 1, w[1]);
  while (w[0] < b[0]) add(Phase::Weight, 0, w[0]);
  FERRY_CHECK(f == b && b == w && f[0] == n && f[1] == n, "zbv's list for rank {} of {} is uneven",
              r, ranks);
  return out;
}

}  // namespace

std::vector<std::vector<Action>> rank_orders(Schedule schedule, std::uint32_t micro_batches,
                                             std::uint32_t ranks, std::uint32_t virtual_stages) {
  const auto error = schedule_error(schedule, micro_batches, ranks, virtual_stages);
  FERRY_CHECK(!error, "{}", error.value_or(""));
  std::vector<std::vector<Action>> out(ranks);
  switch (schedule) {
    case Schedule::GPipe:
    case Schedule::Sequential:
      for (const Tick& tick : clock(schedule, micro_batches, ranks)) {
        for (const Cell c : tick.cells) out[c.partition].push_back(Action{tick.phase, c});
      }
      break;
    case Schedule::OneFOneB:
      for (std::uint32_t r = 0; r < ranks; ++r) out[r] = one_f_one_b(micro_batches, ranks, r);
      break;
    case Schedule::Interleaved1F1B:
    case Schedule::InterleavedZeroBubble:
      for (std::uint32_t r = 0; r < ranks; ++r) {
        out[r] = interleaved(micro_batches, ranks, virtual_stages, r,
                             schedule == Schedule::InterleavedZeroBubble);
      }
      break;
    case Schedule::ZeroBubbleV:
      for (std::uint32_t r = 0; r < ranks; ++r) out[r] = zero_bubble_v(micro_batches, ranks, r);
      break;
  }
  return out;
}

std::vector<Action> issue_order(const std::vector<std::vector<Action>>& ranks,
                                std::uint32_t stages) {
  // issued[(phase, stage, micro-batch)]
  std::set<std::array<std::uint32_t, 3>> issued;
  const auto done = [&](Phase phase, std::uint32_t stage, std::uint32_t mb) {
    return issued.contains({static_cast<std::uint32_t>(phase), stage, mb});
  };
  std::vector<std::size_t> next(ranks.size(), 0);
  std::size_t total = 0;
  for (const auto& list : ranks) total += list.size();
  std::vector<Action> out;
  out.reserve(total);
  while (out.size() < total) {
    bool progress = false;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      if (next[r] == ranks[r].size()) continue;
      const Action a = ranks[r][next[r]];
      const std::uint32_t s = a.cell.partition;
      const std::uint32_t i = a.cell.micro_batch;
      const bool ready = a.phase == Phase::Forward ? (s == 0 || done(Phase::Forward, s - 1, i))
                         : a.phase == Phase::Weight
                             ? done(Phase::Backward, s, i)
                             : (done(Phase::Forward, s, i) &&
                                (s + 1 == stages || done(Phase::Backward, s + 1, i)));
      if (!ready) continue;
      issued.insert({static_cast<std::uint32_t>(a.phase), s, i});
      out.push_back(a);
      ++next[r];
      progress = true;
    }
    FERRY_CHECK(progress, "the ranks' orders wait for each other ({} of {} actions issued)",
                out.size(), total);
  }
  return out;
}

}  // namespace ferry::pipeline
