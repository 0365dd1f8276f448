// The plan of a pipeline (plan_pipeline): under 2 and 4 stages every stage of the plan fits the
// budget, its checked run is hazard-free, it is no slower than the fastest of `ferry compare`'s
// pipeline rows that fits (run here on their own), a budget below the floor is refused naming
// it, the floor itself plans, `auto` explains its schedule, a planted fault's hazards are never
// planned, the reports do not depend on the number of jobs, and a per-stage plan (only the first
// stage recomputing) beats every uniform configuration where only the first stage binds.

#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/pipeline_plan.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using testing::simple_profile;

CheckedModel checked_tiny_gpt(const DeviceProfile& device) {
  return check_model(testing::tiny_gpt(device)).value();
}

PipelinePlanOptions options(std::int32_t devices, Bytes budget, Schedule schedule) {
  PipelinePlanOptions o;
  o.devices = devices;
  o.micro_batches = 2 * devices;
  o.schedules = {schedule};
  o.budget = budget;
  o.jobs = 1;
  return o;
}

// A compare row as run on its own: its step time and its largest stage's peak reserved.
struct Measured {
  std::string name;
  SimTime step;
  Bytes peak;
  bool completed = false;
};

std::vector<Measured> compare_rows(const CheckedModel& model, const DeviceProfile& device,
                                   std::int32_t devices, Schedule schedule) {
  std::vector<Measured> out;
  for (const PipelineRow& row : pipeline_rows(model, device, devices, 2 * devices, schedule)) {
    const PipelineRun run = simulate_pipeline(model, device, row.options).value();
    Measured m{row.name, run.step_time, Bytes(0), !run.failure};
    for (std::size_t d = 0; d < run.peak_allocated.size(); ++d) {
      m.peak = std::max(
          m.peak,
          run.sim.device_allocator(DeviceId(static_cast<std::uint32_t>(d))).stats().reserved_peak);
    }
    out.push_back(m);
  }
  return out;
}

std::optional<Measured> fastest_that_fits(const std::vector<Measured>& rows, Bytes budget) {
  std::optional<Measured> best;
  for (const Measured& m : rows) {
    if (!m.completed || m.peak > budget) continue;
    if (!best || m.step < best->step) best = m;
  }
  return best;
}

Bytes smallest_peak(const std::vector<Measured>& rows) {
  Bytes low{0};
  for (const Measured& m : rows) {
    if (m.completed && (low.count() == 0 || m.peak < low)) low = m.peak;
  }
  return low;
}

void expect_plan_holds(const PipelinePlan& p, const std::vector<Measured>& rows) {
  const PipelineCandidate& c = p.candidates[p.chosen];
  ASSERT_FALSE(c.failure);
  EXPECT_TRUE(c.checked);
  EXPECT_EQ(c.hazards, 0U);
  ASSERT_EQ(c.peak_reserved.size(), static_cast<std::size_t>(p.options.devices));
  for (const Bytes b : c.peak_reserved) EXPECT_LE(b, p.planned_budget);
  EXPECT_EQ(c.max_reserved, c.peak_reserved[c.binding]);
  const auto best = fastest_that_fits(rows, p.planned_budget);
  ASSERT_TRUE(best) << "no compare row fits " << format_bytes(p.planned_budget);
  EXPECT_LE(c.step_time, best->step) << best->name;
  ASSERT_TRUE(p.best_fixed);
  EXPECT_EQ(p.candidates[*p.best_fixed].step_time, best->step);
}

TEST(PlanPipeline, FitsEveryStageAndIsNoSlowerThanTheBestFixedRowUnder2And4Stages) {
  const DeviceProfile device = simple_profile();
  const CheckedModel model = checked_tiny_gpt(device);
  for (const std::int32_t devices : {2, 4}) {
    for (const Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB}) {
      SCOPED_TRACE(fmt::format("{} stages, {}", devices, pipeline::schedule_name(schedule)));
      const std::vector<Measured> rows = compare_rows(model, device, devices, schedule);
      // At the device's memory, and at the smallest peak a compare row reaches, where most rows
      // do not fit and the choice binds.
      for (const Bytes budget : {device.memory, smallest_peak(rows)}) {
        const auto plan = plan_pipeline(model, device, options(devices, budget, schedule));
        ASSERT_TRUE(plan.ok()) << plan.error().message;
        expect_plan_holds(plan.value(), rows);
      }
    }
  }
}

TEST(PlanPipeline, ABudgetBelowTheFloorIsRefusedNamingItAndTheFloorPlans) {
  const DeviceProfile device = simple_profile();
  const CheckedModel model = checked_tiny_gpt(device);
  PipelinePlanOptions o = options(2, device.memory, Schedule::OneFOneB);
  const PipelinePlan roomy = plan_pipeline(model, device, o).value();
  Bytes floor_peak{0};
  for (const PipelineCandidate& c : roomy.candidates) {
    if (!c.failure && (floor_peak.count() == 0 || c.max_reserved < floor_peak)) {
      floor_peak = c.max_reserved;
    }
  }
  ASSERT_GT(floor_peak.count(), 0);
  o.margin_permille = 100;
  const Bytes floor_budget = smallest_budget_for(floor_peak, o.margin_permille);
  o.budget = floor_budget - Bytes(1);
  Bytes floor{0};
  const auto refused = plan_pipeline(model, device, o, &floor);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(floor, floor_peak);
  const std::string& why = refused.error().message;
  EXPECT_NE(why.find("infeasible budget"), std::string::npos) << why;
  EXPECT_NE(why.find(fmt::format("the floor (the smallest budget that plans) is {} ({} bytes)",
                                 format_bytes(floor_budget), floor_budget.count())),
            std::string::npos)
      << why;
  o.budget = floor_budget;
  const auto at_floor = plan_pipeline(model, device, o);
  ASSERT_TRUE(at_floor.ok()) << at_floor.error().message;
  EXPECT_EQ(at_floor.value().candidates[at_floor.value().chosen].max_reserved, floor_peak);
}

TEST(PlanPipeline, AutoPlansEachScheduleAndSaysWhichFitAndTheirTimes) {
  const DeviceProfile device = simple_profile();
  const CheckedModel model = checked_tiny_gpt(device);
  PipelinePlanOptions o = options(2, device.memory, Schedule::GPipe);
  o.micro_batches = 4;
  o.schedules = {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B,
                 Schedule::InterleavedZeroBubble};
  const PipelinePlan p = plan_pipeline(model, device, o).value();
  // The plan is the fastest of the one-schedule plans.
  SimTime fastest{std::numeric_limits<std::int64_t>::max()};
  for (const Schedule s : o.schedules) {
    PipelinePlanOptions one = o;
    one.schedules = {s};
    const auto plan = plan_pipeline(model, device, one);
    if (!plan.ok()) continue;  // torch refuses the counts (skipped under auto)
    fastest = std::min(fastest, plan.value().candidates[plan.value().chosen].step_time);
  }
  EXPECT_EQ(p.candidates[p.chosen].step_time, fastest);
  const std::string text = pipeline_plan_text(p, *model, device);
  EXPECT_NE(text.find("the fastest that fits of gpipe "), std::string::npos) << text;
  EXPECT_NE(text.find("1f1b "), std::string::npos) << text;
}

// With two stages a device auto plans zbv beside the interleaved schedules (gpipe and 1f1b
// skipped, as torch runs one stage a rank under them); zbv alone with one stage a device is
// refused with torch's reason.
TEST(PlanPipeline, AutoWithTwoStagesADevicePlansZbvToo) {
  const DeviceProfile device = simple_profile();
  const CheckedModel model = checked_tiny_gpt(device);
  PipelinePlanOptions o = options(2, device.memory, Schedule::GPipe);
  o.virtual_stages = 2;
  o.schedules = {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B,
                 Schedule::InterleavedZeroBubble, Schedule::ZeroBubbleV};
  const PipelinePlan p = plan_pipeline(model, device, o).value();
  ASSERT_EQ(p.skipped.size(), 2U);
  std::size_t zbv = 0;
  for (const PipelineCandidate& c : p.candidates) {
    if (c.options.schedule != Schedule::ZeroBubbleV) continue;
    ++zbv;
    EXPECT_EQ(c.name.rfind("zbv 2x4x2 ", 0), 0U) << c.name;
    EXPECT_FALSE(c.failure) << c.name;
  }
  EXPECT_EQ(zbv, 3U);  // the checkpoint modes, without offload (as zero bubble's)
  EXPECT_EQ(p.candidates[p.chosen].hazards, 0U);
  const std::string text = pipeline_plan_text(p, *model, device);
  EXPECT_NE(text.find("zbv "), std::string::npos) << text;
  PipelinePlanOptions one = options(2, device.memory, Schedule::ZeroBubbleV);
  const auto refused = plan_pipeline(model, device, one);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("exactly 2 stages"), std::string::npos)
      << refused.error().message;
}

TEST(PlanPipeline, APlantedReceiveFaultIsCaughtByTheCheckedRunAndNeverPlanned) {
  const DeviceProfile device = simple_profile();
  const CheckedModel model = checked_tiny_gpt(device);
  PipelinePlanOptions o = options(2, device.memory, Schedule::OneFOneB);
  o.faults.skip_receive_wait = true;
  const auto plan = plan_pipeline(model, device, o);
  ASSERT_FALSE(plan.ok()) << "planned " << plan.value().candidates[plan.value().chosen].name;
  EXPECT_NE(plan.error().message.find("hazards when checked"), std::string::npos)
      << plan.error().message;
  // The same options without the fault plan.
  o.faults = {};
  EXPECT_TRUE(plan_pipeline(model, device, o).ok());
}

TEST(PlanPipeline, TheReportsAreTheSameBytesForAnyNumberOfJobs) {
  const DeviceProfile device = simple_profile();
  const CheckedModel model = checked_tiny_gpt(device);
  PipelinePlanOptions o = options(2, device.memory, Schedule::GPipe);
  o.schedules = {Schedule::GPipe, Schedule::OneFOneB};
  const PipelinePlan one = plan_pipeline(model, device, o).value();
  o.jobs = 3;
  const PipelinePlan three = plan_pipeline(model, device, o).value();
  EXPECT_EQ(pipeline_plan_text(one, *model, device), pipeline_plan_text(three, *model, device));
  EXPECT_EQ(pipeline_plan_json(one, *model, device).dump(),
            pipeline_plan_json(three, *model, device).dump());
}

// GPT-2 small over 4 stages under 1F1B, 8 micro-batches, 1300 MiB a stage on the H100 profile:
// keeping everything (never) is fastest, 15.9 ms, but its first stage, 4 micro-batches in
// flight, peaks at 1.30 GiB while the others fit; the fastest uniform configuration that fits,
// except_last, recomputes on every stage: 21.9 ms. Recomputing on the first stage only takes
// 17.2 ms with every stage within the budget (the figures of this run, as `ferry plan` prints).
TEST(PlanPipeline, APerStagePlanRecomputesOnlyOnTheBindingFirstStageAndBeatsEveryUniformOne) {
  const DeviceProfile device =
      load_device_profile(FERRY_SCENARIOS_DIR "/devices", "h100-sxm-pcie5").value();
  Model raw = model_preset("gpt2-small-s1024").value();
  assign_roofline_durations(raw, device);
  const CheckedModel model = check_model(std::move(raw)).value();
  PipelinePlanOptions o = options(4, Bytes(1300LL << 20), Schedule::OneFOneB);
  const PipelinePlan p = plan_pipeline(model, device, o).value();
  const PipelineCandidate& c = p.candidates[p.chosen];
  // The premise: uniform never is the fastest configuration, and only its first stage is over.
  const PipelineCandidate* never = nullptr;
  for (const PipelineCandidate& k : p.candidates) {
    if (k.stage_configs.empty() && k.name == "1f1b 4x8 never") never = &k;
  }
  ASSERT_NE(never, nullptr);
  ASSERT_FALSE(never->failure);
  EXPECT_GT(never->peak_reserved[0], p.planned_budget);
  for (std::size_t d = 1; d < 4; ++d) EXPECT_LE(never->peak_reserved[d], p.planned_budget) << d;
  // The plan: the first stage recomputes all but its last micro-batch, the others keep all.
  EXPECT_EQ(c.stage_configs, (std::vector<std::string>{"except_last", "never", "never", "never"}));
  EXPECT_EQ(c.name, "1f1b 4x8 per stage: gpu0 except_last, gpu1-3 never");
  EXPECT_TRUE(c.checked);
  EXPECT_EQ(c.hazards, 0U);
  for (const Bytes b : c.peak_reserved) EXPECT_LE(b, p.planned_budget);
  // Faster than every uniform configuration that fits, the best fixed row among them.
  ASSERT_TRUE(p.best_fixed);
  const PipelineCandidate& fixed = p.candidates[*p.best_fixed];
  EXPECT_EQ(fixed.name, "1f1b 4x8 except_last");
  for (const PipelineCandidate& k : p.candidates) {
    if (k.stage_configs.empty() && k.fits) {
      EXPECT_LT(c.step_time, k.step_time) << k.name;
    }
  }
  // Nearer the uniform never's step than except_last's: the recompute is on one stage of four.
  EXPECT_LT(2 * c.step_time.ns(), never->step_time.ns() + fixed.step_time.ns());
  const std::string text = pipeline_plan_text(p, *model, device);
  EXPECT_NE(text.find("stage configurations: gpu0 except_last, gpu1 never, gpu2 never, gpu3 "
                      "never\n"),
            std::string::npos)
      << text;
  const auto json = pipeline_plan_json(p, *model, device);
  EXPECT_EQ(json["plan"]["stages"][0]["checkpoint"], "except_last");
  EXPECT_EQ(json["plan"]["stages"][3]["checkpoint"], "never");
  EXPECT_TRUE(json["plan"]["checkpoint"].is_null());
  // The search and its probes run the same for any number of jobs.
  o.jobs = 3;
  const PipelinePlan three = plan_pipeline(model, device, o).value();
  EXPECT_EQ(pipeline_plan_text(three, *model, device), text);
  EXPECT_EQ(pipeline_plan_json(three, *model, device).dump(), json.dump());
}

TEST(PlanPipeline, CountsTorchRefusesAreAnErrorNamingTheSchedule) {
  const DeviceProfile device = simple_profile();
  const CheckedModel model = checked_tiny_gpt(device);
  PipelinePlanOptions o = options(4, device.memory, Schedule::OneFOneB);
  o.micro_batches = 2;  // 1F1B takes no fewer micro-batches than stages
  const auto plan = plan_pipeline(model, device, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.error().message.find("--schedule 1f1b"), std::string::npos)
      << plan.error().message;
}

}  // namespace
}  // namespace ferry::sim
