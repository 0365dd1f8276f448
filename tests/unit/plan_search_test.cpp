// The planner's search against cost models that are tables rather than the simulator
// (Note [The cost model]): it returns the fastest plan that fits, and finds the one plan that
// fits when only one does, be it a plan of its own or a seed; a plan the cost model fails is
// never a candidate.

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/search.hpp"

namespace ferry::sim::planning {
namespace {

// Every configuration of the layers of `space`, one vector per plan.
std::vector<std::vector<LayerConfig>> every_config(const PlanSpace& space) {
  std::vector<std::vector<LayerConfig>> all{{}};
  for (const Layer& layer : space.layers()) {
    std::vector<std::vector<LayerConfig>> next;
    for (const auto& prefix : all) {
      for (std::size_t level = 0; level < layer.levels.size(); ++level) {
        for (const bool offload : {false, true}) {
          next.push_back(prefix);
          next.back().push_back(LayerConfig{level, offload});
        }
      }
    }
    all = std::move(next);
  }
  return all;
}

// A cost model that is a table over the plans of per-layer configurations (any other plan
// fails). Every layer is alike: at level k of its top level K it keeps 1 MiB * (K + 1) /
// (K + 1 + 3k), less with every level, by less and less; it recomputes for k * k
// microseconds, more with every level, by more and more; offloaded, it keeps a quarter of that
// and moves the rest to pinned memory for 5 us. `fails` plants a fault: the plans it names
// fail; `adjust` changes an evaluation.
class TableCost final : public CostModel {
 public:
  explicit TableCost(const PlanSpace& space) {
    for (const auto& configs : every_config(space)) {
      Evaluation e{true, SimTime(1'000'000), Bytes(1 << 20), Bytes(0)};
      for (std::size_t l = 0; l < configs.size(); ++l) {
        const auto k = static_cast<std::int64_t>(configs[l].level);
        const auto top = static_cast<std::int64_t>(space.layers()[l].levels.size()) - 1;
        const std::int64_t kept = (1 << 20) * (top + 1) / (top + 1 + 3 * k);
        e.time += SimTime(1000 * k * k);
        if (configs[l].offload) {
          e.reserved += Bytes(kept / 4);
          e.pinned += Bytes(kept - kept / 4);
          e.time += SimTime(5000);
        } else {
          e.reserved += Bytes(kept);
        }
      }
      table_.emplace(key_of(space.plan_of(configs, PlanKnobs{}, std::nullopt)), e);
    }
  }

  Evaluation evaluate(const Plan& plan) override {
    Plan unbudgeted = plan;
    unbudgeted.host_budget = std::nullopt;  // the table is of the decisions
    const std::string key = key_of(unbudgeted);
    seen_.insert(key);
    const auto it = table_.find(key);
    if (it == table_.end() || (fails && fails(plan))) return Evaluation{};
    Evaluation e = it->second;
    if (adjust) adjust(plan, e);
    return e;
  }

  [[nodiscard]] std::int64_t runs() const override {
    return static_cast<std::int64_t>(seen_.size());
  }

  /// The plans of the table.
  [[nodiscard]] std::size_t size() const { return table_.size(); }

  std::function<bool(const Plan&)> fails;
  std::function<void(const Plan&, Evaluation&)> adjust;

 private:
  std::map<std::string, Evaluation> table_;
  std::set<std::string> seen_;
};

struct Fixture {
  Fixture() {
    auto d = load_device_profile(std::filesystem::path(FERRY_SCENARIOS_DIR) / "devices",
                                 "h100-sxm-pcie5");
    EXPECT_TRUE(d.ok());
    device = d.value();
    auto m = model_preset("tiny-gpt");
    EXPECT_TRUE(m.ok());
    model = m.value();
    assign_roofline_durations(model, device);
  }
  DeviceProfile device;
  Model model;
};

// Every plan of per-layer configurations, as the search builds them.
std::vector<Plan> every_plan(const Search& search, const PlanSpace& space) {
  std::vector<Plan> plans;
  for (const auto& configs : every_config(space)) {
    plans.push_back(search.plan_of(configs, PlanKnobs{}));
  }
  return plans;
}

// The fastest plan of every_plan that fits `budgets` under `cost`, or null.
std::optional<Evaluation> fastest_that_fits(TableCost& cost, const PlanSpace& space,
                                            const Budgets& budgets) {
  Search probe(cost, space, budgets);
  std::optional<Evaluation> best;
  for (const Plan& plan : every_plan(probe, space)) {
    const Evaluation e = cost.evaluate(plan);
    if (probe.fits(e) && (!best || e.time < best->time)) best = e;
  }
  return best;
}

// Budgets from 1 MiB (below everything recomputed and offloaded) up to everything kept.
std::vector<Budgets> budgets_up_to_kept(const PlanSpace& space, std::optional<Bytes> host) {
  TableCost all(space);
  const Evaluation kept = all.evaluate(space.kept());
  std::vector<Budgets> out;
  for (std::int64_t step = 0; step <= 40; ++step) {
    out.push_back(
        Budgets{Bytes((1 << 20) + (kept.reserved.count() - (1 << 20)) * step / 40), host});
  }
  return out;
}

TEST(PlanSearch, FindsTheFastestPlanThatFitsEveryBudget) {
  // Alike layers, no pinned memory to offload to: each level frees less and costs more than
  // the last, and the search's moves reach the fastest plan. (The search is a heuristic: where
  // layers differ, or offload competes with recompute, the fastest plan can take a level from
  // one layer and give another one more, or trade a level for offload elsewhere: two moves at
  // once, which it does not try. It then returns a slightly slower plan.)
  const Fixture f;
  const PlanSpace space(f.model, f.device);
  ASSERT_EQ(space.layers().size(), 2U);
  ASSERT_GT(space.layers().front().levels.size(), 2U);
  std::int32_t feasible = 0;
  for (const Budgets& budgets : budgets_up_to_kept(space, Bytes(0))) {
    TableCost all(space);
    const std::optional<Evaluation> best = fastest_that_fits(all, space, budgets);
    TableCost cost(space);
    Search search(cost, space, budgets);
    run_search(search, {}, {});
    if (!best) {
      EXPECT_TRUE(search.ranked().empty()) << "budget " << budgets.device.count();
      continue;
    }
    ++feasible;
    ASSERT_FALSE(search.ranked().empty()) << "budget " << budgets.device.count();
    const Candidate& found = *search.ranked().front();
    EXPECT_EQ(found.evaluation.time, best->time) << "budget " << budgets.device.count();
    EXPECT_LE(found.evaluation.reserved, budgets.device);
    EXPECT_LT(cost.runs(), static_cast<std::int64_t>(cost.size()))
        << "the search evaluated every plan: it proves nothing about its moves";
  }
  EXPECT_GT(feasible, 20);
}

TEST(PlanSearch, EveryCandidateFitsAndTheyComeFastestFirst) {
  const Fixture f;
  const PlanSpace space(f.model, f.device);
  TableCost cost(space);
  const Evaluation kept = cost.evaluate(space.kept());
  const Budgets budgets{Bytes(kept.reserved.count() * 2 / 3), Bytes(kept.reserved.count() / 4)};
  Search search(cost, space, budgets);
  run_search(search, {}, {});
  const std::vector<const Candidate*> ranked = search.ranked();
  ASSERT_FALSE(ranked.empty());
  for (std::size_t i = 0; i < ranked.size(); ++i) {
    EXPECT_TRUE(search.fits(ranked[i]->evaluation));
    EXPECT_LE(ranked[i]->evaluation.pinned, *budgets.host);
    EXPECT_EQ(ranked[i]->plan.budget, budgets.device);
    if (i > 0) {
      EXPECT_LE(ranked[i - 1]->evaluation.time, ranked[i]->evaluation.time);
    }
  }
}

TEST(PlanSearch, APlanTheCostModelFailsIsNeverACandidate) {
  // Planted fault: the fastest plan that fits fails when run; the search returns the next.
  const Fixture f;
  const PlanSpace space(f.model, f.device);
  TableCost probe(space);
  const Evaluation kept = probe.evaluate(space.kept());
  const Budgets budgets{Bytes(kept.reserved.count() * 3 / 4), Bytes(0)};
  TableCost cost(space);
  Search first(cost, space, budgets);
  run_search(first, {}, {});
  ASSERT_FALSE(first.ranked().empty());
  const std::string fastest = key_of(first.ranked().front()->plan);
  TableCost faulty(space);
  faulty.fails = [&](const Plan& plan) { return key_of(plan) == fastest; };
  const std::optional<Evaluation> best = fastest_that_fits(faulty, space, budgets);
  ASSERT_TRUE(best);
  TableCost planted(space);
  planted.fails = faulty.fails;
  Search search(planted, space, budgets);
  run_search(search, {}, {});
  ASSERT_FALSE(search.ranked().empty());
  for (const Candidate* c : search.ranked()) EXPECT_NE(key_of(c->plan), fastest);
  EXPECT_EQ(search.ranked().front()->evaluation.time, best->time);
}

TEST(PlanSearch, WhenOnlyTheDeepestPlanFitsTheSearchFindsIt) {
  // Every layer recomputed at its top level and offloaded is the only plan within the budget.
  const Fixture f;
  const PlanSpace space(f.model, f.device);
  std::vector<LayerConfig> deepest;
  for (const Layer& layer : space.layers()) deepest.push_back({layer.levels.size() - 1, true});
  const std::string only = key_of(space.plan_of(deepest, PlanKnobs{}, std::nullopt));
  const Budgets budgets{Bytes(1 << 20), std::nullopt};
  TableCost cost(space);
  cost.adjust = [&](const Plan& plan, Evaluation& e) {
    e.reserved = key_of(plan) == only ? budgets.device : budgets.device + Bytes(1);
  };
  Search search(cost, space, budgets);
  run_search(search, {}, {});
  ASSERT_EQ(search.ranked().size(), 1U);
  EXPECT_EQ(key_of(search.ranked().front()->plan), only);
}

TEST(PlanSearch, WhenOnlyASeedFitsTheSearchReturnsTheSeed) {
  // A fixed configuration no layer configuration expresses (every op offloaded, the ops
  // outside the layers too) is the only plan within the budget.
  const Fixture f;
  const PlanSpace space(f.model, f.device);
  Seed seed;
  seed.plan = space.kept();
  for (PlanOp& op : seed.plan.ops) op.saved = SavedDecision::Offload;
  const Budgets budgets{Bytes(1 << 20), std::nullopt};
  seed.evaluation =
      Evaluation{true, SimTime(1'000'000'000), budgets.device, Bytes(0), SimTime(0), Bytes(0)};
  TableCost cost(space);
  cost.adjust = [&](const Plan&, Evaluation& e) { e.reserved = budgets.device + Bytes(1); };
  Search search(cost, space, budgets);
  run_search(search, {seed}, {});
  ASSERT_EQ(search.ranked().size(), 1U);
  EXPECT_EQ(key_of(search.ranked().front()->plan), key_of(seed.plan));
  EXPECT_EQ(search.floor(), budgets.device);
}

TEST(PlanSearch, NothingFitsLeavesNoCandidateAndTheSmallestPeakAsTheFloor) {
  const Fixture f;
  const PlanSpace space(f.model, f.device);
  TableCost cost(space);
  const Budgets budgets{Bytes(1), std::nullopt};
  Search search(cost, space, budgets);
  run_search(search, {}, {});
  EXPECT_TRUE(search.ranked().empty());
  std::optional<Bytes> smallest;
  TableCost all(space);
  for (const Plan& plan : every_plan(search, space)) {
    const Evaluation e = all.evaluate(plan);
    if (!smallest || e.reserved < *smallest) smallest = e.reserved;
  }
  ASSERT_TRUE(smallest);
  EXPECT_EQ(search.floor(), *smallest);
}

}  // namespace
}  // namespace ferry::sim::planning
