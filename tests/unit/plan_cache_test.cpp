// Planners kept between requests (PlannerCache), and the planner's parallel workers: the
// reports of one, knobs that change only the runs of plans that offload, and progress.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "ferry/plan/lower.hpp"
#include "ferry/plan/plan.hpp"
#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/export/memory_snapshot.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/bound.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/planner/seeds.hpp"
#include "ferry/sim/planner/space.hpp"
#include "ferry/sim/planner/sweep.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/runs/horizon.hpp"
#include "plan_test_support.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using plan_test::preset;
using plan_test::profile;
using plan_test::traced_llama;

// A plan request for tiny-gpt's document (as Python gives a traced model) at `budget` MiB.
PlanRequest tiny_gpt_request(std::int64_t budget_mib, PlannerCache* planners) {
  PlanRequest r;
  r.target.model = ModelSource{"tiny-gpt", model_to_json(model_preset("tiny-gpt").value())};
  r.target.device = "h100-sxm-pcie5";
  r.target.scenarios = FERRY_SCENARIOS_DIR;
  r.budget = Bytes(budget_mib << 20);
  r.margin_permille = 0;
  r.planners = planners;
  return r;
}

TEST(PlannerCache, ALaterBudgetPlansWithTheKeptPlannerAndIsNoSlower) {
  PlannerCache planners;
  const auto top = respond(tiny_gpt_request(1024, &planners));
  ASSERT_TRUE(top.ok()) << top.error().message;
  ASSERT_EQ(top.value().outcome, Outcome::Ok);
  const std::int64_t first = planners.simulations();
  EXPECT_EQ(planners.size(), 1U);
  EXPECT_GT(first, 0);
  // Refused below the floor, by the kept planner.
  const auto refused = respond(tiny_gpt_request(1, &planners));
  ASSERT_TRUE(refused.ok());
  ASSERT_EQ(refused.value().outcome, Outcome::Refused);
  EXPECT_GT(planners.simulations(), first);
  // Between the floor and the no-offload peak: the kept planner's plan fits and is no slower
  // than a fresh planner's.
  const std::int64_t between =
      (refused.value().floor.count() + top.value().plan->row.peak_reserved.count()) / 2 >> 20;
  const auto kept = respond(tiny_gpt_request(between, &planners));
  const auto fresh = respond(tiny_gpt_request(between, nullptr));
  ASSERT_TRUE(kept.ok() && fresh.ok());
  ASSERT_EQ(fresh.value().outcome, Outcome::Ok) << fresh.value().refusal;
  ASSERT_EQ(kept.value().outcome, Outcome::Ok) << kept.value().refusal;
  EXPECT_EQ(planners.size(), 1U);
  EXPECT_LE(kept.value().plan->row.peak_reserved, Bytes(between << 20));
  EXPECT_LE(kept.value().plan->row.step_time, fresh.value().plan->row.step_time);
  // Planning the first budget again runs nothing new (the report says so) and gives its plan.
  const std::int64_t before = planners.simulations();
  const auto again = respond(tiny_gpt_request(1024, &planners));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(planners.simulations(), before);
  EXPECT_EQ(again.value().document.at("simulations"), 0);
  EXPECT_GT(again.value().document.at("reused_simulations"), 0);
  EXPECT_EQ(again.value().document.at("plan").dump(), top.value().document.at("plan").dump());
}

TEST(PlannerCache, OtherSettingsGetAPlannerOfTheirOwnAndSomeRequestsPlanAlone) {
  PlannerCache planners;
  ASSERT_TRUE(respond(tiny_gpt_request(1024, &planners)).ok());
  PlanRequest steps = tiny_gpt_request(1024, &planners);
  steps.steps = 3;
  ASSERT_TRUE(respond(steps).ok());
  PlanRequest device = tiny_gpt_request(1024, &planners);
  device.target.device = "a100-pcie4";
  ASSERT_TRUE(respond(device).ok());
  EXPECT_EQ(planners.size(), 3U);
  // A model named by a file or a preset (which may change between requests) and a request for
  // a memory snapshot (whose run must be recorded) plan alone.
  PlanRequest named = tiny_gpt_request(1024, &planners);
  named.target.model = ModelSource{"tiny-gpt"};
  ASSERT_TRUE(respond(named).ok());
  PlanRequest snapshot = tiny_gpt_request(1024, &planners);
  snapshot.memory_snapshot = true;
  const auto recorded = respond(snapshot);
  ASSERT_TRUE(recorded.ok());
  EXPECT_NE(recorded.value().plan->run, nullptr);
  EXPECT_EQ(planners.size(), 3U);
}

// Note [Parallel simulations]: one worker and four make the same plans, reports and
// simulation counts, byte for byte, at budgets where the search runs every stage (a shallow
// traced stack: the exact stage's coupled measurements and the second pass of single ops),
// one Planner after another budget as a sweep's is, and in a sweep.
TEST(PlanParallel, FourWorkersMakeTheReportsOfOne) {
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = traced_llama(device);
  const CheckedModel checked = check_model(model).value();
  const auto reports = [&](std::int32_t jobs) {
    Planner planner(checked, device, 2);
    Bytes every;
    for (const RowResult& r : planner.fixed()) {
      if (r.name == "checkpoint every layer") every = r.peak_reserved;
    }
    std::string out;
    for (const std::int64_t tenths : {10, 8}) {
      PlannerOptions options{Bytes(every.count() * tenths / 10), std::nullopt, 2};
      options.jobs = jobs;
      auto outcome = planner.plan(options);
      out += outcome ? plan_report_json(outcome.value(), model, device).dump() +
                           plan_text(outcome.value(), model, device)
                     : outcome.error().message;
    }
    PlannerOptions sweep;
    sweep.jobs = jobs;
    out += sweep_json(plan_sweep(checked, device, sweep, 2), model, device).dump();
    return out;
  };
  const std::string one = reports(1);
  EXPECT_NE(one.find("\"simulations\""), std::string::npos);
  EXPECT_EQ(reports(4), one);
}

// Note [Runs of plans that offload nothing]: the knob variants and a pinned budget do not
// change the run of a plan that offloads nothing, which is why its runs share one run key;
// they do change the run of one that offloads, whose run key keeps them.
TEST(PlanParallel, KnobsChangeOnlyTheRunsOfPlansThatOffload) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("gpt2-small-s1024", device);
  const CheckedModel checked = check_model(model).value();
  Plan kept = keep_everything_plan(model, device);
  Plan offloading = kept;
  for (PlanOp& op : offloading.ops) op.saved = SavedDecision::Offload;
  // The distinct runs (step time, peaks) and run keys of `plan` under each knob variant, the
  // default knobs and a pinned budget.
  const auto distinct = [&](Plan plan) {
    std::vector<Plan> variants;
    for (const PlanKnobs& k : planning::knob_variants()) {
      plan.knobs = k;
      variants.push_back(plan);
    }
    plan.knobs = PlanKnobs{};
    variants.push_back(plan);
    plan.host_budget = Bytes(256 * kMiB);
    variants.push_back(plan);
    std::set<std::tuple<std::int64_t, std::int64_t, std::int64_t>> runs;
    std::set<std::string> keys;
    for (const Plan& p : variants) {
      auto row = replay_plan(p, checked, device, timing_only(2));
      EXPECT_TRUE(row.ok()) << (row.ok() ? "" : row.error().message);
      if (!row.ok()) continue;
      runs.emplace(row.value().step_time.ns(), row.value().peak_reserved.count(),
                   row.value().pinned_peak.count());
      keys.insert(planning::run_key_of(p));
    }
    return std::pair{runs.size(), keys.size()};
  };
  EXPECT_EQ(distinct(kept), std::pair(std::size_t{1}, std::size_t{1}));
  const auto [runs, keys] = distinct(offloading);
  EXPECT_GT(runs, 1U);
  EXPECT_EQ(keys, planning::knob_variants().size() + 2);
}

// The search's progress (the fixed configurations measured before): the seeds first, the
// checked runs last, each stage
// with the plans it asked about, counted up, and the fastest plan that fits never slower
// than before.
TEST(PlanParallel, ProgressNamesEachStageAndTheBestSoFar) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("gpt2-small-s1024", device);
  std::vector<std::string> stages;
  std::optional<SimTime> best;
  std::int64_t last_done = 0;
  bool monotone = true;
  Planner planner(check_model(model).value(), device, 2);
  Bytes every;
  for (const RowResult& r : planner.fixed()) {
    if (r.name == "checkpoint every layer") every = r.peak_reserved;
  }
  PlannerOptions options{every, std::nullopt, 2};
  options.progress = [&](const PlanProgress& p) {
    if (stages.empty() || stages.back() != p.stage) {
      stages.emplace_back(p.stage);
      last_done = 0;
    }
    monotone = monotone && p.done >= last_done && (p.total == 0 || p.done <= p.total);
    last_done = p.done;
    if (best && p.best) monotone = monotone && *p.best <= *best;
    if (p.best) best = p.best;
  };
  auto outcome = planner.plan(options);
  ASSERT_TRUE(outcome.ok()) << outcome.error().message;
  ASSERT_GE(stages.size(), 4U);
  EXPECT_EQ(stages.front(), "seeds");
  EXPECT_EQ(stages.back(), "checked runs");
  EXPECT_NE(std::find(stages.begin(), stages.end(), "exact: layer options"), stages.end());
  EXPECT_TRUE(monotone);
  EXPECT_TRUE(best.has_value());
}

}  // namespace
}  // namespace ferry::sim
