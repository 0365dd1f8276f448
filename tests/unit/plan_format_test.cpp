// The plan format (a plan's JSON): every field read back, each validation error naming its
// path, and the byte sizes the options take.

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

}  // namespace
}  // namespace ferry::sim
