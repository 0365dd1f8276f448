// The planner's exact stage (Note [Layer options] in sim/src/planner/exact.cpp): its dynamic
// program against brute force over every choice of a 4-layer model's options, and its picks
// against a program over every option; the Pareto filter, the classes of alike layers, the tails
// (keep the head, recompute the tail), and the stage on a table cost model where the search's
// local moves alone miss the fastest plan.

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/exact.hpp"

namespace ferry::sim::planning {
namespace {

// Every choice of one option per layer.
std::vector<std::vector<std::size_t>> every_choice(const OptionProblem& problem) {
  std::vector<std::vector<std::size_t>> all{{}};
  for (const auto& options : problem.options) {
    std::vector<std::vector<std::size_t>> next;
    for (const auto& prefix : all) {
      for (std::size_t o = 0; o < options.size(); ++o) {
        next.push_back(prefix);
        next.back().push_back(o);
      }
    }
    all = std::move(next);
  }
  return all;
}

// What a random problem's options draw: bytes in steps of `byte_step` up to `bytes_most`, times
// in steps of `time_step` in [time_least, time_most], up to `count_most` options a layer, and
// with `first_keeps` each layer's first option freeing and moving nothing (as keeping a layer as
// it is does).
struct Draws {
  std::int64_t bytes_most = 64LL << 20;
  std::int64_t byte_step = 1;
  std::int64_t time_least = -2'000;
  std::int64_t time_most = 400'000;
  std::int64_t time_step = 1;
  int count_most = 6;
  bool first_keeps = false;
};

// A random problem of `layers` layers: options that free, move and cost at random (by default a
// few of them faster than nothing, as a measurement can be), a need, a link and sometimes a host
// budget between none and everything.
OptionProblem random_problem(std::mt19937_64& rng, std::size_t layers, const Draws& d = {}) {
  std::uniform_int_distribution<std::int64_t> bytes(0, d.bytes_most / d.byte_step);
  std::uniform_int_distribution<std::int64_t> time(d.time_least / d.time_step,
                                                   d.time_most / d.time_step);
  std::uniform_int_distribution<int> count(1, d.count_most);
  std::uniform_int_distribution<int> coin(0, 2);
  OptionProblem p;
  std::int64_t most_freed = 0;
  std::int64_t most_moved = 0;
  for (std::size_t l = 0; l < layers; ++l) {
    std::vector<LayerOption> options;
    const int n = count(rng);
    std::int64_t freed = 0;
    std::int64_t moved = 0;
    for (int o = 0; o < n; ++o) {
      LayerOption option;
      option.config = LayerConfig{static_cast<std::size_t>(o), false, 0};
      if (o > 0 || !d.first_keeps) {
        option.freed = bytes(rng) * d.byte_step;
        option.moved = coin(rng) == 0 ? bytes(rng) * d.byte_step : 0;
      }
      option.time_ns = time(rng) * d.time_step;
      freed = std::max(freed, option.freed);
      moved = std::max(moved, option.moved);
      options.push_back(option);
    }
    most_freed += freed;
    most_moved += moved;
    p.options.push_back(std::move(options));
  }
  p.need = std::uniform_int_distribution<std::int64_t>(-(1LL << 20), most_freed + (1LL << 20))(rng);
  p.link = std::uniform_int_distribution<std::int64_t>(0, most_moved)(rng);
  p.bandwidth = std::uniform_int_distribution<std::int64_t>(1LL << 30, 64LL << 30)(rng);
  if (coin(rng) == 0) p.host = std::uniform_int_distribution<std::int64_t>(0, most_moved)(rng);
  return p;
}

TEST(PlanExact, TheDynamicProgramMatchesBruteForce) {
  std::mt19937_64 rng(37);
  std::int32_t solved = 0;
  std::int32_t refused = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const OptionProblem problem = random_problem(rng, 4);
    const OptionUnits units = units_of(problem);
    std::optional<std::int64_t> best;
    for (const auto& choice : every_choice(problem)) {
      const std::optional<std::int64_t> cost = option_cost(problem, units, choice);
      if (cost && (!best || *cost < *best)) best = cost;
    }
    const std::optional<OptionChoice> found = solve_options(problem);
    ASSERT_EQ(found.has_value(), best.has_value()) << "trial " << trial;
    if (!found) {
      ++refused;
      continue;
    }
    ++solved;
    EXPECT_EQ(found->cost_ns, *best) << "trial " << trial;
    EXPECT_EQ(option_cost(problem, units, found->picked), found->cost_ns) << "trial " << trial;
    // What the model admits frees the need and moves no more than the host budget, in bytes.
    std::int64_t freed = 0;
    std::int64_t moved = 0;
    for (std::size_t l = 0; l < found->picked.size(); ++l) {
      freed += problem.options[l][found->picked[l]].freed;
      moved += problem.options[l][found->picked[l]].moved;
    }
    EXPECT_GE(freed, problem.need) << "trial " << trial;
    if (problem.host) {
      EXPECT_LE(moved, *problem.host) << "trial " << trial;
    }
  }
  // Both outcomes were exercised.
  EXPECT_GT(solved, 100);
  EXPECT_GT(refused, 10);
}

// The dynamic program without pruning: every option of every layer tried at every state (units
// freed, capped at need, by units moved), ties to the first in (state, option) order, and the
// end state of least cost, the first of equal ones. For problems whose every layer has an option
// that frees and moves nothing (so that the program counts freed and moved bytes as given).
std::optional<std::vector<std::size_t>> every_option_program(const OptionProblem& p) {
  const OptionUnits u = units_of(p);
  const auto freed = [&](const LayerOption& o) { return o.freed / u.memory; };
  const auto moved = [&](const LayerOption& o) { return (o.moved + u.moved - 1) / u.moved; };
  const std::int64_t need = (std::max<std::int64_t>(0, p.need) + u.memory - 1) / u.memory;
  std::int64_t k_size = 1;
  for (const auto& options : p.options) {
    std::int64_t most = 0;
    for (const LayerOption& o : options) most = std::max(most, moved(o));
    k_size += most;
  }
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  struct Cell {
    std::int64_t time = kNone;
    std::size_t option = 0;
    std::int64_t from_m = 0;
  };
  using Table = std::vector<std::vector<Cell>>;
  std::vector<Table> tables(p.options.size() + 1,
                            Table(static_cast<std::size_t>(need + 1),
                                  std::vector<Cell>(static_cast<std::size_t>(k_size))));
  tables[0][0][0].time = 0;
  for (std::size_t l = 0; l < p.options.size(); ++l) {
    for (std::int64_t m = 0; m <= need; ++m) {
      for (std::int64_t k = 0; k < k_size; ++k) {
        const std::int64_t t = tables[l][m][k].time;
        if (t == kNone) continue;
        for (std::size_t o = 0; o < p.options[l].size(); ++o) {
          const LayerOption& option = p.options[l][o];
          Cell& to = tables[l + 1][std::min(need, m + freed(option))][k + moved(option)];
          if (t + option.time_ns < to.time) to = Cell{t + option.time_ns, o, m};
        }
      }
    }
  }
  std::optional<std::vector<std::size_t>> out;
  std::int64_t out_cost = 0;
  for (std::int64_t k = 0; k < k_size; ++k) {
    if (tables.back()[need][k].time == kNone) continue;
    std::vector<std::size_t> picked(p.options.size());
    std::int64_t m = need;
    std::int64_t at = k;
    for (std::size_t l = p.options.size(); l-- > 0;) {
      const Cell& cell = tables[l + 1][m][at];
      picked[l] = cell.option;
      at -= moved(p.options[l][cell.option]);
      m = cell.from_m;
    }
    const std::optional<std::int64_t> cost = option_cost(p, u, picked);
    if (cost && (!out || *cost < out_cost)) {
      out = picked;
      out_cost = *cost;
    }
  }
  return out;
}

TEST(PlanExact, TheProgramPicksWhatTheProgramOverEveryOptionPicks) {
  // Options that free, move and cost alike in units (whole MiB, whole microseconds), so that
  // ties and options another beats (which the program sets aside) are common: its choice is the
  // same, option for option.
  const Draws alike{12LL << 20, 1LL << 20, 0, 6'000, 1'000, 8, true};
  std::mt19937_64 rng(5);
  std::int32_t compared = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const OptionProblem p = random_problem(rng, 5, alike);
    const std::optional<OptionChoice> found = solve_options(p);
    const std::optional<std::vector<std::size_t>> plain = every_option_program(p);
    ASSERT_EQ(found.has_value(), plain.has_value()) << "trial " << trial;
    if (!found) continue;
    EXPECT_EQ(found->picked, *plain) << "trial " << trial;
    ++compared;
  }
  EXPECT_GT(compared, 300);
}

TEST(PlanExact, ABruteForceThatSkipsTheLinkTimeIsCaught) {
  // Planted fault: a model that forgets what the bytes beyond the link cost disagrees with the
  // dynamic program on some problem, so the comparison above can fail.
  std::mt19937_64 rng(11);
  bool differs = false;
  for (int trial = 0; trial < 400 && !differs; ++trial) {
    OptionProblem problem = random_problem(rng, 4);
    const std::optional<OptionChoice> found = solve_options(problem);
    OptionProblem free_link = problem;
    free_link.link = std::numeric_limits<std::int64_t>::max() / 4;
    const std::optional<OptionChoice> other = solve_options(free_link);
    differs = found && other && found->cost_ns != other->cost_ns;
  }
  EXPECT_TRUE(differs);
}

TEST(PlanExact, ParetoKeepsTheOptionsNoOtherBeats) {
  const auto option = [](std::size_t level, std::int64_t t, std::int64_t f, std::int64_t m) {
    return LayerOption{LayerConfig{level, false, 0}, t, f, m};
  };
  const std::vector<LayerOption> kept = pareto(
      {option(0, 0, 0, 0), option(1, 10, 100, 0), option(2, 20, 100, 0), option(3, 5, 100, 50),
       option(4, 10, 100, 0), option(5, 30, 200, 0), option(6, 1, 0, 0)});
  std::set<std::size_t> levels;
  for (const LayerOption& o : kept) levels.insert(o.config.level);
  // 2 is beaten by 1, 4 equals 1 (the first stays), 6 by 0; 3 moves bytes but is faster.
  EXPECT_EQ(levels, (std::set<std::size_t>{0, 1, 3, 5}));
}

struct Fixture {
  explicit Fixture(const std::string& preset, std::int64_t layers = 0) {
    auto d = load_device_profile(std::string(FERRY_SCENARIOS_DIR) + "/devices", "h100-sxm-pcie5");
    EXPECT_TRUE(d.ok());
    device = d.value();
    auto shape = model_preset_shape(preset);
    EXPECT_TRUE(shape.ok());
    TransformerShape s = shape.value();
    if (layers > 0) s.layers = layers;
    model = make_transformer(s, preset);
    assign_roofline_durations(model, device);
  }
  DeviceProfile device;
  Model model;
};

TEST(PlanExact, AlikeLayersShareAClass) {
  const Fixture f("tiny-llama", 4);
  const PlanSpace space(f.model, f.device);
  ASSERT_EQ(space.layers().size(), 4U);
  const auto classes = layer_classes(space);
  ASSERT_EQ(classes.size(), 1U);
  EXPECT_EQ(classes.front(), (std::vector<std::size_t>{0, 1, 2, 3}));
  // A layer whose op runs longer is of a class of its own.
  Model changed = f.model;
  changed.ops[space.layers()[2].first].duration += SimTime(1);
  const PlanSpace other(changed, f.device);
  EXPECT_EQ(layer_classes(other).size(), 2U);
}

TEST(PlanExact, ATailKeepsTheHeadAndRecomputesTheRest) {
  const Fixture f("tiny-llama", 4);
  const PlanSpace space(f.model, f.device);
  const Layer& layer = space.layers()[1];
  ASSERT_GT(layer.tails.size(), 1U);
  EXPECT_EQ(layer.tails.front(), layer.end);
  for (std::size_t t = 1; t < layer.tails.size(); ++t) {
    EXPECT_GT(layer.tails[t], layer.first);
    EXPECT_LT(layer.tails[t], layer.tails[t - 1]);  // latest first
  }
  std::vector<LayerConfig> configs(space.layers().size());
  configs[1] = LayerConfig{0, false, layer.tails.size() - 1};
  const Plan plan = space.plan_of(configs, PlanKnobs{}, std::nullopt);
  ASSERT_EQ(plan.regions.size(), 1U);
  EXPECT_EQ(plan.regions.front().first_op, layer.first);
  EXPECT_EQ(plan.regions.front().end_op, layer.end);
  const std::uint32_t tail = layer.tails.back();
  for (std::uint32_t i = tail; i < layer.end; ++i) {
    EXPECT_EQ(plan.ops[i].saved, SavedDecision::Recompute) << i;
  }
  std::int32_t kept = 0;
  for (std::uint32_t i = layer.first; i < tail; ++i)
    kept += plan.ops[i].saved == SavedDecision::Keep;
  EXPECT_GT(kept, 0);
  // Every option the stage measures is a distinct plan.
  std::set<std::string> keys;
  const auto options = options_of(layer, true);
  for (const LayerConfig& c : options) {
    configs[1] = c;
    keys.insert(key_of(space.plan_of(configs, PlanKnobs{}, std::nullopt)));
  }
  EXPECT_EQ(keys.size(), options.size());
}

// Note [What a replay never reaches ranks first] in sim/src/planner/space.cpp: a Llama layer's
// down projection, which its replay never reaches, ranks first; the residual add after it,
// which saves nothing, is not ranked and follows the layer: recomputed when the layer keeps,
// served and offloaded when it offloads, at every level.
TEST(PlanSpace, TheOpsAfterTheReplaysEndFollowTheLayer) {
  const Fixture f("tiny-llama", 4);
  const PlanSpace space(f.model, f.device);
  const Layer& layer = space.layers()[1];
  ASSERT_LT(layer.replayed_end, layer.end);
  EXPECT_FALSE(f.model.ops[layer.replayed_end].saved.empty());
  EXPECT_EQ(layer.ranking.front(), layer.replayed_end);
  std::vector<std::uint32_t> after;
  for (std::uint32_t i = layer.replayed_end + 1; i < layer.end; ++i) {
    EXPECT_TRUE(f.model.ops[i].saved.empty()) << f.model.ops[i].name;
    EXPECT_EQ(std::count(layer.ranking.begin(), layer.ranking.end(), i), 0) << i;
    after.push_back(i);
  }
  ASSERT_FALSE(after.empty());
  std::vector<LayerConfig> configs(space.layers().size());
  for (std::size_t k = 1; k < layer.levels.size(); ++k) {
    for (const bool offload : {false, true}) {
      configs[1] = LayerConfig{k, offload, 0};
      const Plan plan = space.plan_of(configs, PlanKnobs{}, std::nullopt);
      EXPECT_EQ(plan.ops[layer.replayed_end].saved, SavedDecision::Recompute) << k;
      for (const std::uint32_t i : after) {
        EXPECT_EQ(plan.ops[i].saved, offload ? SavedDecision::Offload : SavedDecision::Recompute)
            << "level " << k << ", op " << f.model.ops[i].name;
      }
    }
  }
}

// A cost model that is additive over the layers (Note [The cost model]): each op a layer
// recomputes frees and costs by its place in the layer, unevenly, so that the fastest plan can
// take a level from one layer and give another two, which the local moves do not try. Plans
// that offload fail.
class AdditiveCost final : public CostModel {
 public:
  explicit AdditiveCost(const PlanSpace& space) : space_(&space) {}

  Evaluation evaluate(const Plan& plan) override {
    seen_.insert(key_of(plan));
    Evaluation e{true, SimTime(1'000'000), Bytes(1 << 20), Bytes(0)};
    for (const Layer& layer : space_->layers()) {
      for (std::uint32_t i = layer.first; i < layer.end; ++i) {
        const auto at = static_cast<std::int64_t>(i - layer.first);
        if (plan.ops[i].saved == SavedDecision::Offload) return Evaluation{};
        if (plan.ops[i].saved == SavedDecision::Recompute) {
          e.reserved += Bytes(((at * 37) % 50) << 10);
          e.time += SimTime(100 * ((at * at) % 17 + 1));
        } else {
          e.reserved += Bytes(64 << 10);
        }
      }
    }
    return e;
  }
  [[nodiscard]] std::int64_t runs() const override {
    return static_cast<std::int64_t>(seen_.size());
  }

 private:
  const PlanSpace* space_;
  std::set<std::string> seen_;
};

TEST(PlanExact, TheExactStageFindsTheFastestChoiceOfOptions) {
  // Under a cost model that is additive over layers the option model is the cost model, so the
  // stage's choice is the fastest plan of options that fits: brute force over every choice of
  // the measured options of the 4 layers agrees, at budgets from the floor to everything kept.
  const Fixture f("tiny-llama", 4);
  const PlanSpace space(f.model, f.device);
  AdditiveCost probe(space);
  const std::vector<LayerConfig> zero(space.layers().size());
  const Evaluation kept = probe.evaluate(space.plan_of(zero, PlanKnobs{}, std::nullopt));
  std::int32_t checked = 0;
  for (int step = 1; step <= 12; ++step) {
    const Budgets budgets{kept.reserved - Bytes(kept.reserved.count() * step / 24), Bytes(0)};
    AdditiveCost cost(space);
    Search search(cost, space, budgets);
    const std::optional<Position> found = exact_stage(search, Position{});
    // Brute force over every choice of every option (no offload: the host budget is zero).
    std::vector<std::vector<LayerConfig>> all{{}};
    for (const Layer& layer : space.layers()) {
      std::vector<std::vector<LayerConfig>> next;
      for (const auto& prefix : all) {
        for (const LayerConfig& c : options_of(layer, false)) {
          next.push_back(prefix);
          next.back().push_back(c);
        }
      }
      all = std::move(next);
    }
    std::optional<SimTime> best;
    AdditiveCost brute(space);
    for (const auto& configs : all) {
      const Evaluation e = brute.evaluate(space.plan_of(configs, PlanKnobs{}, std::nullopt));
      if (e.ok && e.reserved <= budgets.device && (!best || e.time < *best)) best = e.time;
    }
    ASSERT_EQ(found.has_value(), best.has_value()) << "step " << step;
    if (!found) continue;
    ++checked;
    EXPECT_LE(found->evaluation.reserved, budgets.device);
    EXPECT_EQ(found->evaluation.time, *best) << "step " << step;
  }
  EXPECT_GT(checked, 6);
}

}  // namespace
}  // namespace ferry::sim::planning
