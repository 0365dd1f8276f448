// The planner: never slower than a fixed policy that fits, within its budget less the margin,
// an earlier budget's runs and plans reused, the floor named where a budget is below it, and
// the reports of a run.

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

using plan_test::fixed_row;
using plan_test::no_offload_row;
using plan_test::preset;
using plan_test::profile;
using plan_test::traced_llama;

TEST(Reports, ARunThatFailsForAnotherReasonThanMemoryDoesNotFit) {
  // trl refuses retain_graph as the reference does: a misuse, with the device's memory ample.
  const Model model = testing::chain_model(4, 1 << 20);
  PolicyRow row{"trl", testing::two_steps(Policy::Trl)};
  row.options.retain_graph = true;
  const DeviceProfile device = testing::simple_profile();
  const RowResult r = run_row(model, device, row);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->kind, FailureKind::Misuse);
  const auto json = simulate_json(r, model, device);
  EXPECT_FALSE(json["result"]["fits"].get<bool>());
  EXPECT_EQ(json["result"]["failure"], r.failure->message);
  EXPECT_FALSE(compare_json({r}, model, device)["rows"][0]["fits"].get<bool>());
  // The text names the failure rather than calling it a want of memory.
  EXPECT_NE(simulate_text(r, model, device).find("failure: "), std::string::npos);
  EXPECT_EQ(simulate_text(r, model, device).find("does not fit"), std::string::npos);
}

TEST(Planner, NeverSlowerThanAFixedPolicyThatFitsOnGpt2Small) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("gpt2-small-s1024", device);
  TrainingOptions base;
  base.steps = 2;
  std::vector<RowResult> fixed;
  for (const PolicyRow& row : default_rows(base, model, device)) {
    fixed.push_back(fixed_row(model, device, row));
  }
  const RowResult& none = fixed.front();
  Bytes smallest = none.peak_reserved;
  for (const RowResult& r : fixed) smallest = std::min(smallest, r.peak_reserved);
  // Each fixed peak up to the no-offload one, and three budgets between the smallest and it.
  std::vector<Bytes> budgets;
  for (int i = 1; i <= 3; ++i) {
    budgets.push_back(smallest + Bytes((none.peak_reserved - smallest).count() * i / 4));
  }
  for (const RowResult& r : fixed) {
    if (r.peak_reserved <= none.peak_reserved) budgets.push_back(r.peak_reserved);
  }
  std::sort(budgets.begin(), budgets.end());
  budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
  std::size_t offloading = 0;
  for (const Bytes budget : budgets) {
    auto outcome = make_plan(model, device, PlannerOptions{budget, std::nullopt, 2});
    ASSERT_TRUE(outcome.ok()) << format_bytes(budget) << ": " << outcome.error().message;
    // The offload options the checked run applied come with the plan: the core rule's.
    const OffloadOptions lowered = plan_offload_options(outcome.value().plan);
    const OffloadOptions& carried = outcome.value().offload;
    EXPECT_EQ(carried.policy, lowered.policy);
    EXPECT_EQ(carried.min_bytes, lowered.min_bytes);
    EXPECT_EQ(carried.window_bytes, lowered.window_bytes);
    EXPECT_EQ(carried.prefetch_bytes, lowered.prefetch_bytes);
    EXPECT_EQ(carried.prefetch, lowered.prefetch);
    EXPECT_EQ(carried.horizon_bytes, lowered.horizon_bytes);
    EXPECT_EQ(carried.host_cap, lowered.host_cap);
    if (carried.policy == Policy::Ferry) ++offloading;
    const RowResult& plan = outcome.value().row;
    EXPECT_EQ(plan.hazards, 0U);
    EXPECT_LE(plan.peak_reserved, budget);
    EXPECT_GE(plan.step_time, outcome.value().lower_bound);
    for (const RowResult& r : fixed) {
      if (r.failure || r.peak_reserved > budget) continue;
      if (r.name == "checkpoint selective") {
        // Its regions are attention cores, which no plan can checkpoint (they run inside an
        // attention module's call; docs/planner.md, Limits): at its own peak its replay, which
        // ends before the core's second batched matmul, may beat the plan by a little.
        EXPECT_LE(plan.step_time.ns() * 1000, r.step_time.ns() * 1005)
            << "budget " << format_bytes(budget) << ": fixed " << r.name << " is faster";
        continue;
      }
      EXPECT_LE(plan.step_time, r.step_time)
          << "budget " << format_bytes(budget) << ": fixed " << r.name << " is faster";
    }
  }
  EXPECT_GT(offloading, 0U);  // some budget's plan offloads: the options are not all "none"
}

TEST(Planner, UnderFsdpThePlanRecordsItsParallelismAndTwoRanksOfANodeAreChecked) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("tiny-gpt", device);
  PlannerOptions options{device.memory, std::nullopt, 2};
  options.parallel.mesh =
      Mesh::make(Parallelism{.ranks = 16, .reshard_after_forward = Reshard::K(4)}, device).value();
  auto outcome = make_plan(model, device, options);
  ASSERT_TRUE(outcome.ok()) << outcome.error().message;
  EXPECT_EQ(outcome.value().node_ranks, 2);
  EXPECT_EQ(outcome.value().plan.parallelism,
            (Parallelism{.ranks = 16, .reshard_after_forward = Reshard::K(4)}));
  auto back = parse_plan(plan_to_json(outcome.value().plan), "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back.value().parallelism, outcome.value().plan.parallelism);
  // One GPU: nothing recorded, no node run.
  auto single = make_plan(model, device, PlannerOptions{device.memory, std::nullopt, 2});
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single.value().node_ranks, 0);
  EXPECT_FALSE(single.value().plan.parallelism.on());
  EXPECT_EQ(plan_to_json(single.value().plan).find("parallelism"), std::string::npos);
}

// Note [The plan margin]: a plan for budget B fits B less the margin, and says so; with the
// margin at 0 the same budget admits a plan that does not.
TEST(Planner, APlanForBudgetBReportsAPeakWithinBLessTheMargin) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("gpt2-small-s1024", device);
  const RowResult none = no_offload_row(model, device);
  // A budget the no-offload run fits by 3 %: the default 7 % margin rules it out.
  const Bytes budget = Bytes(none.peak_reserved.count() * 103 / 100);
  PlannerOptions options{budget, std::nullopt, 2};
  auto without = make_plan(model, device, options);
  ASSERT_TRUE(without.ok()) << without.error().message;
  EXPECT_GT(without.value().row.peak_reserved,
            budget_less_margin(budget, kDefaultPlanMarginPermille));
  for (const std::int32_t margin : {kDefaultPlanMarginPermille, 125, 1}) {
    options.margin_permille = margin;
    auto outcome = make_plan(model, device, options);
    ASSERT_TRUE(outcome.ok()) << margin << ": " << outcome.error().message;
    const PlanOutcome& o = outcome.value();
    const Bytes planned = budget - Bytes((budget.count() * margin + 999) / 1000);
    EXPECT_EQ(o.planned_budget, planned);
    EXPECT_EQ(o.margin_permille, margin);
    EXPECT_EQ(o.plan.budget, budget);  // the file keeps the budget asked for
    EXPECT_LE(o.row.peak_reserved, planned) << margin;
    EXPECT_EQ(o.row.hazards, 0U);
    const std::string text = plan_text(o, model, device);
    EXPECT_NE(text.find(fmt::format("planned to {} (margin {})", format_bytes(planned),
                                    margin_text(margin))),
              std::string::npos)
        << text;
    const std::string json = document_text(plan_report_json(o, model, device));
    EXPECT_NE(json.find(fmt::format("\"planned_budget_bytes\": {}", planned.count())),
              std::string::npos);
  }
  // Below the floor once the margin is taken: refused, naming the margin.
  auto refused = make_plan(
      model, device,
      PlannerOptions{Bytes(none.peak_reserved.count() / 4), std::nullopt, 2, {}, {}, 500});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("less its 50 % margin"), std::string::npos)
      << refused.error().message;
}

// Note [Library workspaces]: a step holds two cuBLAS workspaces of the profile's size, one for
// forward's thread and one for backward's; a model without math holds none.
TEST(LibraryWorkspaces, AStepHoldsTwoCublasWorkspaces) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  ASSERT_EQ(device.blas_workspace, Bytes(32 * kMiB));
  DeviceProfile without = device;
  without.blas_workspace = Bytes(0);
  const Model model = preset("gpt2-small-s1024", device);
  const PolicyRow none = default_rows(TrainingOptions{}, model, device).front();
  const RowResult with_ws = fixed_row(model, device, none);
  const RowResult no_ws = fixed_row(model, without, none);
  EXPECT_EQ(with_ws.peak_allocated, no_ws.peak_allocated + Bytes(64 * kMiB));
  EXPECT_EQ(with_ws.peak_reserved, no_ws.peak_reserved + Bytes(64 * kMiB));
  EXPECT_EQ(with_ws.step_time, no_ws.step_time);
  // No op with FLOPs: no matmul, no workspace.
  Model copies = model;
  for (ModelOp& op : copies.ops) op.flops = op.backward_flops = 0;
  EXPECT_EQ(fixed_row(copies, device, none).peak_allocated,
            fixed_row(copies, without, none).peak_allocated);
}

TEST(Planner, TheMarginAndTheBandFollowTheTable) {
  EXPECT_EQ(budget_less_margin(Bytes(1000), 60), Bytes(940));
  EXPECT_EQ(budget_less_margin(Bytes(1001), 60), Bytes(940));  // the margin rounded up
  EXPECT_EQ(budget_less_margin(Bytes(1000), 0), Bytes(1000));
  const Bytes huge(std::int64_t{1} << 62);
  EXPECT_EQ(budget_less_margin(huge, 500), Bytes(std::int64_t{1} << 61));
  // The default margin covers the table's largest underestimate.
  EXPECT_GE(kDefaultPlanMarginPermille, kPeakReservedErrorBand.under_permille);
  const auto [low, high] = expected_peak_band(Bytes(1'000'000));
  EXPECT_EQ(low, Bytes(1'000'000'000 / (1000 + kPeakReservedErrorBand.over_permille)));
  EXPECT_EQ(high, Bytes(1'000'000'000 / (1000 - kPeakReservedErrorBand.under_permille)));
  EXPECT_EQ(margin_text(190), "19 %");
  EXPECT_EQ(margin_text(55), "5.5 %");
}

// Note [Monotone in the budget], on a case where a fresh search is not monotone: Llama 3 8B on
// A100 at 49.5 GB and 50.5 GB. One Planner takes the faster plan of the smaller budget; a
// Planner per budget (make_plan) finds a slower one at 50.5 GB.
TEST(Planner, ALargerBudgetReusesAFasterPlanOfASmallerOne) {
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = preset("llama3-8b-s8192", device);
  const Bytes small(49'500'000'000);
  const Bytes large(50'500'000'000);
  Planner planner(check_model(model).value(), device, 2);
  auto at_small = planner.plan(PlannerOptions{small, std::nullopt, 2});
  auto at_large = planner.plan(PlannerOptions{large, std::nullopt, 2});
  ASSERT_TRUE(at_small.ok() && at_large.ok());
  EXPECT_LE(at_large.value().row.step_time, at_small.value().row.step_time);
  EXPECT_LE(at_large.value().row.peak_reserved, large);
  EXPECT_EQ(at_large.value().row.hazards, 0U);
  // Without what the smaller budget found, the search alone is slower here.
  auto fresh = make_plan(model, device, PlannerOptions{large, std::nullopt, 2});
  ASSERT_TRUE(fresh.ok());
  EXPECT_GT(fresh.value().row.step_time, at_small.value().row.step_time);
}

// At the peak of checkpointing every layer, partial levels fit when the link carries what they
// save (Note [What a replay never reaches ranks first]): the plan offloads and is more than 8 %
// faster than checkpointing (with the ops after the replay's end recomputed at every level, the
// search finds no such plan and is 0.4 % faster).
TEST(Planner, AtCheckpointingsPeakThePlanOffloadsPartialLevelsOnLlama3_8B) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("llama3-8b-s8192", device);
  Planner planner(check_model(model).value(), device, 2);
  const RowResult* every = nullptr;
  for (const RowResult& r : planner.fixed()) {
    if (r.name == "checkpoint every layer") every = &r;
  }
  ASSERT_NE(every, nullptr);
  auto outcome = planner.plan(PlannerOptions{every->peak_reserved, std::nullopt, 2});
  ASSERT_TRUE(outcome.ok()) << outcome.error().message;
  EXPECT_LT(static_cast<double>(outcome.value().row.step_time.ns()),
            0.92 * static_cast<double>(every->step_time.ns()));
  EXPECT_LE(outcome.value().row.peak_reserved, every->peak_reserved);
  EXPECT_GT(outcome.value().row.d2h, Bytes(0));
}

TEST(Planner, InfeasibleBudgetNamesTheFloor) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("gpt2-small-s1024", device);
  auto outcome = make_plan(model, device, PlannerOptions{kMiB, std::nullopt, 2});
  ASSERT_FALSE(outcome.ok());
  EXPECT_NE(outcome.error().message.find("infeasible"), std::string::npos);
  EXPECT_NE(outcome.error().message.find("floor"), std::string::npos);
}

TEST(Planner, ReplayOfTheWrittenPlanMeasuresWhatThePlannerDid) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("gpt2-small-s1024", device);
  const RowResult none = no_offload_row(model, device);
  const Bytes budget = Bytes(none.peak_reserved.count() * 3 / 4);
  auto outcome = make_plan(model, device, PlannerOptions{budget, std::nullopt, 2});
  ASSERT_TRUE(outcome.ok()) << outcome.error().message;
  auto plan = parse_plan(plan_to_json(outcome.value().plan), "plan.json");
  ASSERT_TRUE(plan.ok()) << plan.error().message;
  TrainingOptions base;
  base.steps = 2;
  DeviceProfile capped = device;
  capped.memory = budget;
  auto row = replay_plan(plan.value(), check_model(model).value(), capped, base);
  ASSERT_TRUE(row.ok()) << row.error().message;
  EXPECT_EQ(row.value().step_time, outcome.value().row.step_time);
  EXPECT_EQ(row.value().peak_reserved, outcome.value().row.peak_reserved);
  EXPECT_EQ(row.value().hazards, 0U);
  EXPECT_EQ(plan.value().predicted.step_time, row.value().step_time);
}

// PlannerOptions::keep_run: the plan's checked run is kept, its allocators' actions recorded, and
// it is the run a second simulation of the plan on the planner's device would be (what
// `ferry plan --memory-snapshot` ran before): the same memory snapshot, byte for byte.
TEST(Planner, TheKeptRunIsThePlansCheckedRun) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("tiny-gpt", device);
  PlannerOptions options{device.memory, std::nullopt, 2};
  options.margin_permille = kDefaultPlanMarginPermille;
  options.keep_run = true;
  auto outcome = make_plan(model, device, options);
  ASSERT_TRUE(outcome.ok()) << outcome.error().message;
  ASSERT_NE(outcome.value().run, nullptr);
  const auto kept = memory_snapshot(outcome.value().run->sim);
  ASSERT_TRUE(kept.ok()) << kept.error().message;
  DeviceProfile capped = device;
  capped.memory = budget_less_margin(options.budget, options.margin_permille);
  TrainingOptions base;
  base.steps = options.steps;
  base.sim.record_allocator = true;
  auto training = plan_training_options(outcome.value().plan, model, base);
  ASSERT_TRUE(training.ok()) << training.error().message;
  std::optional<TrainingRun> again;
  (void)run_row(model, capped, PolicyRow{"plan", training.value()}, &again);
  ASSERT_TRUE(again.has_value());
  const auto rerun = memory_snapshot(again->sim);
  ASSERT_TRUE(rerun.ok()) << rerun.error().message;
  EXPECT_EQ(kept.value(), rerun.value());
  // Not asked: nothing kept, and the same plan.
  options.keep_run = false;
  auto plain = make_plan(model, device, options);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain.value().run, nullptr);
  EXPECT_EQ(plan_to_json(plain.value().plan), plan_to_json(outcome.value().plan));
}

TEST(Planner, SweepRunsFromTheFloorToTheNoOffloadPeak) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("gpt2-small-s1024", device);
  std::size_t heard = 0;
  const auto points = plan_sweep(check_model(model).value(), device, PlannerOptions{}, 3,
                                 [&](std::size_t i, std::size_t n, Bytes) {
                                   EXPECT_EQ(i, heard++);
                                   EXPECT_EQ(n, 3U);
                                 });
  ASSERT_EQ(points.size(), 3U);
  EXPECT_EQ(heard, 3U);
  for (std::size_t i = 0; i < points.size(); ++i) {
    ASSERT_TRUE(points[i].outcome) << format_bytes(points[i].budget) << ": " << points[i].failure;
    EXPECT_LE(points[i].outcome->row.peak_reserved, points[i].budget);
    EXPECT_EQ(points[i].outcome->row.hazards, 0U);
    if (i > 0) {
      EXPECT_GT(points[i].budget, points[i - 1].budget);
    }
  }
  // At the no-offload peak the plan is no offload.
  const PlanOutcome& top = *points.back().outcome;
  EXPECT_EQ(top.row.step_time, top.fixed.front().step_time);
  EXPECT_EQ(points.back().budget, top.fixed.front().peak_reserved);
  EXPECT_NE(sweep_text(points, model, device).find("gpt2-small-s1024"), std::string::npos);
}

TEST(Planner, AtEachFixedRowsPeakThePlanIsNoSlowerThanTheRowOnATracedShape) {
  // The planner takes each row of `ferry compare` that a plan can express as that plan's run.
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = traced_llama(device);
  ASSERT_TRUE(validate_model(model).ok());
  Planner planner(check_model(model).value(), device, 2);
  const std::vector<RowResult>& rows = planner.fixed();
  ASSERT_EQ(rows.size(), default_rows(TrainingOptions{}, model, device).size());
  // At the no-offload peak the plan is the no-offload run itself.
  auto top = planner.plan(PlannerOptions{rows.front().peak_reserved, std::nullopt, 2});
  ASSERT_TRUE(top.ok()) << top.error().message;
  EXPECT_EQ(top.value().row.step_time, rows.front().step_time);
  for (const RowResult& r : rows) {
    if (r.failure || !r.fits || is_trl(r.policy)) continue;
    // At a row's own peak, the plan is at most as slow as it.
    auto outcome = planner.plan(PlannerOptions{r.peak_reserved, std::nullopt, 2});
    ASSERT_TRUE(outcome.ok()) << r.name << ": " << outcome.error().message;
    EXPECT_LE(outcome.value().row.step_time, r.step_time) << r.name;
    EXPECT_EQ(outcome.value().row.hazards, 0U) << r.name;
  }
}

TEST(Planner, ALaterBudgetReusesTheFixedRowsAndTheRunsOfAnEarlierOne) {
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = traced_llama(device);
  Planner planner(check_model(model).value(), device, 2);
  const Bytes every = [&] {
    for (const RowResult& r : planner.fixed()) {
      if (r.name == "checkpoint every layer") return r.peak_reserved;
    }
    return Bytes(0);
  }();
  ASSERT_GT(every, Bytes(0));
  const std::int64_t before = planner.simulations();
  auto first = planner.plan(PlannerOptions{every, std::nullopt, 2});
  ASSERT_TRUE(first.ok()) << first.error().message;
  EXPECT_EQ(first.value().simulations, planner.simulations() - before);
  // The same budget again: nothing new is simulated.
  auto again = planner.plan(PlannerOptions{every, std::nullopt, 2});
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value().simulations, 0);
  EXPECT_GT(again.value().reused, 0);
  EXPECT_EQ(again.value().plan, first.value().plan);
  EXPECT_EQ(again.value().row.step_time, first.value().row.step_time);
  // A looser budget reuses part of what the first one ran.
  auto looser = planner.plan(PlannerOptions{Bytes(every.count() * 11 / 10), std::nullopt, 2});
  ASSERT_TRUE(looser.ok()) << looser.error().message;
  EXPECT_GT(looser.value().reused, 0);
  EXPECT_LE(looser.value().row.step_time, first.value().row.step_time);
}

TEST(Planner, NoRefusalNamesAFloorUnderItsBudget) {
  // At the floor itself, either a plan is returned or the refusal says why the plans that
  // reached it failed; it never names a floor (a peak some plan reached) under the budget.
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = traced_llama(device);
  Bytes floor;
  auto tiny = make_plan(model, device, PlannerOptions{Bytes(1), std::nullopt, 2}, &floor);
  ASSERT_FALSE(tiny.ok());
  auto at_floor = make_plan(model, device, PlannerOptions{floor, std::nullopt, 2});
  if (!at_floor.ok()) {
    EXPECT_EQ(at_floor.error().message.find("the floor"), std::string::npos)
        << at_floor.error().message;
  }
}

TEST(Planner, AFloorUnderAHostBudgetCountsOnlyPlansWithinIt) {
  // With no pinned host memory at all, nothing can be offloaded: the floor is a peak some plan
  // without offload reached, above the floor with host memory to spare (on Llama-3-8B the
  // lowest peaks offload checkpointed inputs), and a refusal at that floor never names a floor
  // under its budget.
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = preset("llama3-8b-s4096", device);
  Bytes with_host;
  Bytes without_host;
  ASSERT_FALSE(
      make_plan(model, device, PlannerOptions{Bytes(1), std::nullopt, 2}, &with_host).ok());
  ASSERT_FALSE(make_plan(model, device, PlannerOptions{Bytes(1), Bytes(0), 2}, &without_host).ok());
  EXPECT_GT(without_host, with_host);
  auto at_floor = make_plan(model, device, PlannerOptions{without_host, Bytes(0), 2});
  if (at_floor.ok()) {
    EXPECT_EQ(at_floor.value().row.pinned_peak, Bytes(0));
  } else {
    EXPECT_EQ(at_floor.error().message.find("the floor"), std::string::npos)
        << at_floor.error().message;
  }
}

}  // namespace
}  // namespace ferry::sim
