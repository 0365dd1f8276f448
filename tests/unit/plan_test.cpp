// The plan format (round trip, every validation error names its JSON path), byte counts for
// people, and the planner on gpt2-small-s1024: never slower than a fixed policy that fits the
// same budget, infeasible budgets named with the floor.

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
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

DeviceProfile profile(const std::string& name) {
  auto p = load_device_profile(std::string(FERRY_SCENARIOS_DIR) + "/devices", name);
  EXPECT_TRUE(p.ok()) << (p.ok() ? "" : p.error().message);
  return p.value();
}

Model preset(const std::string& name, const DeviceProfile& device) {
  auto m = model_preset(name);
  EXPECT_TRUE(m.ok());
  Model model = m.value();
  assign_roofline_durations(model, device);
  return model;
}

// A plan over tiny-gpt with every kind of decision.
Plan sample_plan() {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("tiny-gpt", device);
  Plan plan = keep_everything_plan(model, device);
  plan.budget = Bytes(123456789);
  plan.host_budget = Bytes(987654321);
  plan.knobs.window_bytes = 128 * kMiB;
  plan.knobs.prefetch = false;
  plan.ops[1].saved = SavedDecision::Offload;
  plan.regions.push_back(PlanRegion{2, 5, SavedDecision::Offload});
  plan.ops[3].saved = SavedDecision::Recompute;
  plan.ops[4].saved = SavedDecision::Offload;
  plan.predicted.step_time = SimTime(1000);
  plan.predicted.peak_reserved = Bytes(4096);
  plan.parallelism = Parallelism{
      .ranks = 16, .nodes = 2, .replicas = 2, .reshard_after_forward = Reshard::False()};
  return plan;
}

TEST(PlanFormat, RoundTripsEveryField) {
  const Plan plan = sample_plan();
  const std::string text = plan_to_json(plan);
  auto back = parse_plan(text, "plan.json");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back.value(), plan);
  EXPECT_EQ(plan_to_json(back.value()), text);  // byte-stable
}

// Replaces the first occurrence of `from` in the sample plan's JSON by `to`.
std::string mutated(const std::string& from, const std::string& to) {
  std::string text = plan_to_json(sample_plan());
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  text.replace(at, from.size(), to);
  return text;
}

TEST(PlanFormat, EachValidationErrorNamesItsPath) {
  struct Case {
    std::string from, to, path;
  };
  const Case cases[] = {
      {"\"ferry.plan/1\"", "\"ferry.plan/2\"", "format"},
      {"\"budget_bytes\": 123456789", "\"budget_bytes\": -1", "budget_bytes"},
      {"\"host_budget_bytes\": 987654321", "\"host_budget_bytes\": \"lots\"", "host_budget_bytes"},
      {"\"window_bytes\": 134217728", "\"window_bytes\": 1.5", "knobs.window_bytes"},
      {"\"prefetch\": false", "\"prefetch\": 0", "knobs.prefetch"},
      {"\"saved\": \"offload\"", "\"saved\": \"evict\"", "ops[1].saved"},
      {"\"saved\": \"keep\"", "\"saved\": \"recompute\"", "ops[0].saved"},
      {"\"first_op\": 2", "\"first_op\": 99", "regions[0].first_op"},
      {"\"end_op\": 5", "\"end_op\": 2", "regions[0].end_op"},
      {"\"inputs\": \"offload\"", "\"inputs\": \"recompute\"", "regions[0].inputs"},
      {"\"name\": \"embed\"", "\"name\": \"\"", "ops[0].name"},
      {"\"name\": \"embed\"", "\"name\": \"embed\", \"why\": 1", "ops[0]"},
      {"\"step_time_ns\": 1000", "\"step_time_ns\": -3", "predicted.step_time_ns"},
      {"\"model\": \"tiny-gpt\",", "", "missing required key \"model\""},
  };
  for (const Case& c : cases) {
    auto plan = parse_plan(mutated(c.from, c.to), "plan.json");
    ASSERT_FALSE(plan.ok()) << c.to;
    // At the root the message names the key itself.
    EXPECT_NE(plan.error().message.find("plan.json: " + c.path), std::string::npos)
        << c.to << " -> " << plan.error().message;
  }
}

TEST(PlanFormat, OverlappingRegionsNameTheSecond) {
  Plan plan = sample_plan();
  plan.regions.push_back(PlanRegion{4, 6, SavedDecision::Keep});
  auto back = parse_plan(plan_to_json(plan), "p.json");
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.error().message.find("p.json: regions[1].first_op"), std::string::npos)
      << back.error().message;
}

TEST(PlanFormat, PlanForAnotherModelNamesTheOp) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  Plan plan = sample_plan();
  plan.ops[2].name = "not_an_op";
  auto options = plan_training_options(plan, preset("tiny-gpt", device), TrainingOptions{});
  ASSERT_FALSE(options.ok());
  EXPECT_NE(options.error().message.find("ops[2].name"), std::string::npos);
  plan.ops.pop_back();
  options = plan_training_options(plan, preset("tiny-gpt", device), TrainingOptions{});
  ASSERT_FALSE(options.ok());
  EXPECT_NE(options.error().message.find("ops:"), std::string::npos);
}

// A replay re-runs only the random ops it recomputes: recomputing a later dropout while an
// earlier one is served from forward would give it the earlier one's numbers.
TEST(PlanFormat, RecomputedRandomOpsMustComeFirstInTheirRegion) {
  const DeviceProfile device = profile("h100-sxm-pcie5");
  const Model model = preset("tiny-gpt", device);
  Plan plan = keep_everything_plan(model, device);
  std::uint32_t first = 0;
  std::uint32_t end = 0;
  std::vector<std::uint32_t> random;
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    if (model.ops[i].layer != 0) continue;
    if (end == 0) first = i;
    end = i + 1;
    if (model.ops[i].draws_rng) random.push_back(i);
  }
  ASSERT_GE(random.size(), 2U);
  plan.regions.push_back(PlanRegion{first, end, SavedDecision::Keep});
  plan.ops[random.back()].saved = SavedDecision::Recompute;
  auto options = plan_training_options(plan, model, TrainingOptions{});
  ASSERT_FALSE(options.ok());
  EXPECT_NE(options.error().message.find(fmt::format("ops[{}].saved", random.back())),
            std::string::npos)
      << options.error().message;
  EXPECT_NE(options.error().message.find(fmt::format("(ops[{}])", random.front())),
            std::string::npos)
      << options.error().message;
  recompute_random_prefix(plan, model);
  for (const std::uint32_t i : random) EXPECT_EQ(plan.ops[i].saved, SavedDecision::Recompute);
  options = plan_training_options(plan, model, TrainingOptions{});
  ASSERT_TRUE(options.ok()) << options.error().message;
  auto run = simulate_training(model, device, options.value());
  ASSERT_TRUE(run.ok());
  EXPECT_TRUE(run.value().sim.content_mismatches().empty());
  EXPECT_TRUE(run.value().sim.hazards().empty());
}

TEST(ParseBytes, AcceptsTheUsualSpellings) {
  EXPECT_EQ(parse_bytes("40GiB", "--budget").value(), 40 * kGiB);
  EXPECT_EQ(parse_bytes("40 GiB", "--budget").value(), 40 * kGiB);
  EXPECT_EQ(parse_bytes("1.5GiB", "--budget").value(), Bytes(3 * kGiB.count() / 2));
  EXPECT_EQ(parse_bytes("4e10", "--budget").value(), Bytes(40'000'000'000));
  EXPECT_EQ(parse_bytes("4e10 B", "--budget").value(), Bytes(40'000'000'000));
  EXPECT_EQ(parse_bytes("40GB", "--budget").value(), Bytes(40'000'000'000));
  EXPECT_EQ(parse_bytes("512MiB", "--budget").value(), 512 * kMiB);
  EXPECT_EQ(parse_bytes("1024", "--budget").value(), Bytes(1024));
  EXPECT_EQ(parse_bytes("0.5 KiB", "--budget").value(), Bytes(512));
  // A fraction of a unit rounds down to whole bytes: 0.001 KiB is 1.024 bytes.
  EXPECT_EQ(parse_bytes("0.001KiB", "--budget").value(), Bytes(1));
  EXPECT_EQ(parse_bytes("35.74GiB", "--budget").value(), Bytes(38375532789));
}

TEST(ParseBytes, RefusesWithTheArgumentAndTheText) {
  for (const char* bad : {"", "GiB", "40 parsecs", "1.3 B", "-1GiB", "4e", "2e20", "40 GiB x"}) {
    auto b = parse_bytes(bad, "--host-budget");
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_NE(b.error().message.find("--host-budget: \"" + std::string(bad) + "\""),
              std::string::npos)
        << b.error().message;
  }
}

RowResult fixed_row(const Model& model, const DeviceProfile& device, const PolicyRow& row) {
  PolicyRow unchecked = row;
  unchecked.options.sim.check_hazards = false;
  unchecked.options.sim.track_content = false;
  return run_row(model, device, unchecked);
}

// The measured no-offload row of `model` on `device`.
RowResult no_offload_row(const Model& model, const DeviceProfile& device) {
  return fixed_row(model, device, default_rows(TrainingOptions{}, model, device).front());
}

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
  // A budget the no-offload run fits by 3 %: the default 16 % margin rules it out.
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
  EXPECT_EQ(margin_text(160), "16 %");
  EXPECT_EQ(margin_text(55), "5.5 %");
}

// Note [Monotone in the budget], on a case where a fresh search is not monotone: Llama 3 8B on
// A100 at 1.10x and 1.15x the peak of checkpointing every layer. One Planner takes the faster
// plan of the smaller budget; a Planner per budget (make_plan) finds a slower one at 1.15x.
TEST(Planner, ALargerBudgetReusesAFasterPlanOfASmallerOne) {
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = preset("llama3-8b-s8192", device);
  const std::vector<PolicyRow> rows = default_rows(TrainingOptions{}, model, device);
  const auto every = std::find_if(rows.begin(), rows.end(), [](const PolicyRow& r) {
    return r.name == "checkpoint every layer";
  });
  ASSERT_NE(every, rows.end());
  const Bytes peak = fixed_row(model, device, *every).peak_reserved;
  const Bytes small(peak.count() * 110 / 100);
  const Bytes large(peak.count() * 115 / 100);
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

// A Llama as a trace lists a Hugging Face one (Note [A Llama as a trace lists it]), small.
Model traced_llama(const DeviceProfile& device) {
  TransformerShape shape;
  shape.kind = TransformerShape::Kind::LlamaTraced;
  shape.layers = 4;
  shape.hidden = 256;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.ffn = 704;
  shape.vocab = 4096;
  shape.sequence = 512;
  shape.micro_batch = 2;
  Model model = make_transformer(shape, "traced-llama");
  assign_roofline_durations(model, device);
  return model;
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

// A model written op by op: tensors by name, bytes and role; ops of 10 ms forward and 20 ms
// backward that save their input.
struct ModelBuilder {
  Model m;

  std::uint32_t tensor(std::string name, std::int64_t bytes, TensorRole role) {
    m.tensors.push_back(ModelTensor{std::move(name), Bytes(bytes), DType::BF16, role, -1, Bytes(0),
                                    false, Bytes(0), 0});
    return static_cast<std::uint32_t>(m.tensors.size() - 1);
  }

  ModelOp& op(std::string name, std::int32_t layer, std::uint32_t in, std::uint32_t out) {
    ModelOp o;
    o.name = std::move(name);
    o.layer = layer;
    o.duration = SimTime(10'000'000);
    o.backward_duration = SimTime(20'000'000);
    o.inputs = {in};
    o.outputs = {out};
    o.saved = {in};
    m.ops.push_back(o);
    return m.ops.back();
  }
};

// Note [What the link can carry in forward]: a storage saved as forward ends cannot leave the
// device before backward, whatever the link's bandwidth times the forward's length.
TEST(LowerBound, TheLinkCarriesOnlyWhatForwardHasSavedSoFar) {
  DeviceProfile device = profile("a100-pcie4");
  ModelBuilder b;
  b.m.name = "late";
  const std::uint32_t x = b.tensor("x", 1 << 10, TensorRole::Input);
  const std::uint32_t h0 = b.tensor("h0", 1 << 10, TensorRole::Activation);
  const std::uint32_t h1 = b.tensor("h1", std::int64_t{1} << 32, TensorRole::Activation);
  const std::uint32_t loss = b.tensor("loss", 4, TensorRole::Activation);
  b.op("l0", -1, x, h0).saved.clear();
  b.op("l1", -1, h0, h1).saved.clear();
  b.op("loss", -1, h1, loss);  // h1 (4 GiB) is saved by the last op, as forward ends
  b.m.loss = loss;
  ASSERT_TRUE(validate_model(b.m).ok());
  RowResult none;
  none.step_time = SimTime(90'000'000);
  none.forward_time = SimTime(30'000'000);
  none.peak_reserved = Bytes(std::int64_t{5} << 30);
  // 512 MiB to free: 30 ms of a 25.5 GB/s link would carry 765 MB, but nothing is saved before
  // the last op ends, so the link must have a longer forward: 512 MiB at its bandwidth.
  const Bytes budget = none.peak_reserved - Bytes(512LL << 20);
  const SimTime bound = step_lower_bound(b.m, device, none, budget);
  const std::int64_t link = (512LL << 20) * 1'000'000'000 / device.d2h.bandwidth.bytes_per_s();
  EXPECT_NEAR(static_cast<double>((bound - none.step_time).ns()), static_cast<double>(link), 1e3);
}

// --- the ferry policy's offload horizon (Note [Deriving the offload horizon]) ---------------

TEST(OffloadHorizon, KeepsATensorSavedAtTheEndOfForwardThatTheLinkCannotCarryInTime) {
  // x -> l0 -> l1 -> loss: the last layer saves a storage whose copy would take far longer
  // than the backward work left after it; the first layer's copy is hidden.
  DeviceProfile device = profile("a100-pcie4");
  ModelBuilder b;
  Model& m = b.m;
  m.name = "tail";
  const std::uint32_t x = b.tensor("x", 1 << 20, TensorRole::Input);
  const std::uint32_t h0 = b.tensor("h0", 1 << 20, TensorRole::Activation);
  const std::uint32_t h1 = b.tensor("h1", std::int64_t{1} << 32, TensorRole::Activation);
  const std::uint32_t loss = b.tensor("loss", 4, TensorRole::Activation);
  b.op("l0", 0, x, h0);
  b.op("l1", 1, h0, h1);
  b.op("loss", -1, h1, loss);
  m.loss = loss;
  ASSERT_TRUE(validate_model(m).ok());
  TrainingOptions o;
  o.offload.policy = Policy::Ferry;
  // x and h0 (1 MiB each) are hidden; h1 (4 GiB, 170 ms at 25.5 GB/s) is needed 20 ms after
  // forward ends.
  EXPECT_EQ(offload_horizon(m, device, o), Bytes(2 << 20));
  o.offload.policy = Policy::Trl;
  EXPECT_FALSE(offload_horizon(m, device, o).has_value());
  // Recomputed inside a region, h1 is not saved: every copy is hidden, there is no limit.
  o.offload.policy = Policy::Ferry;
  o.checkpoint = checkpoint_every(m, 1);
  o.offload_selection.ops.assign(m.ops.size(), true);
  o.offload_selection.ops[2] = false;  // the loss keeps
  EXPECT_FALSE(offload_horizon(m, device, o).has_value());
}

TEST(OffloadHorizon, FerryRowsOfATracedLlamaAreNoSlowerThanTrlAndCheckpointing) {
  // On Llama-3.2-3B as a trace lists it, on a100-pcie4: ferry keeps what its link cannot hide
  // (the loss's log-softmax, the last layers), so it beats trl, and ferry + checkpoint costs
  // what checkpointing costs (2%).
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = preset("llama3.2-3b-traced-s4096-b2", device);
  TrainingOptions base;
  base.steps = 2;
  std::map<std::string, RowResult> rows;
  for (const PolicyRow& row : default_rows(base, model, device)) {
    if (row.name == "trl" || row.name == "ferry" || row.name == "checkpoint every layer" ||
        row.name == "ferry + checkpoint") {
      rows[row.name] = fixed_row(model, device, row);
    }
  }
  ASSERT_EQ(rows.size(), 4U);
  const RowResult& ferry = rows["ferry"];
  ASSERT_TRUE(ferry.horizon.has_value());
  EXPECT_GT(ferry.telemetry.past_horizon, 0);
  EXPECT_LE(ferry.step_time, rows["trl"].step_time);
  EXPECT_LE(rows["ferry + checkpoint"].step_time.ns() * 100,
            rows["checkpoint every layer"].step_time.ns() * 102);
  EXPECT_EQ(rows["ferry + checkpoint"].backward_stall, SimTime(0));
}

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
