// Per-stage policies (PipelineOptions::stages): every device given the pipeline-wide mode and
// policy runs the same step, a mix (the first stage checkpointed but for its last micro-batch,
// which it offloads; the others neither) matches the single-device reference with no hazard and
// lowers only that stage's peak, the receives' planted faults are still races under a mix, and a
// wrong count is refused.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ferry/sim/autograd/pipeline.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using testing::simple_profile;
using testing::tiny_gpt;

PipelineOptions options(Schedule schedule, std::int32_t devices) {
  PipelineOptions o;
  o.schedule = schedule;
  o.devices = devices;
  o.micro_batches = 2 * devices;
  o.virtual_stages = schedule == Schedule::Interleaved1F1B ? 2 : 1;
  o.checkpoint = CheckpointMode::Never;
  // tiny-gpt's 2 layers make at most 4 stages by layers (torchtitan's rule); these tests cut it
  // into up to 8, by forward time.
  o.split.rule = PipelineSplit::Rule::Balanced;
  return o;
}

StagePolicy ferry_except_last() {
  StagePolicy s{.checkpoint = CheckpointMode::ExceptLast};
  s.offload = OffloadOptions{};
  s.offload.policy = Policy::Ferry;
  return s;
}

// The first stage checkpointed but for its last micro-batch, whose saved tensors ferry offloads,
// the others keeping what they save.
PipelineOptions first_stage_mixed(Schedule schedule, std::int32_t devices) {
  PipelineOptions o = options(schedule, devices);
  o.stages.assign(static_cast<std::size_t>(devices),
                  StagePolicy{.checkpoint = CheckpointMode::Never});
  o.stages[0] = ferry_except_last();
  return o;
}

TEST(PipelineStagePolicy, TheSamePolicyOnEveryStageRunsTheUniformStep) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  for (const Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB}) {
    SCOPED_TRACE(schedule_name(schedule));
    PipelineOptions uniform = options(schedule, 4);
    uniform.checkpoint = CheckpointMode::ExceptLast;
    uniform.offload = OffloadOptions{};
    uniform.offload.policy = Policy::Ferry;
    PipelineOptions staged = uniform;
    staged.stages.assign(4, stage_policy(uniform, 0));
    const PipelineRun a = simulate_pipeline(model, device, uniform).value();
    const PipelineRun b = simulate_pipeline(model, device, staged).value();
    ASSERT_FALSE(a.failure);
    EXPECT_EQ(a.step_time, b.step_time);
    EXPECT_EQ(a.peak_allocated, b.peak_allocated);
    EXPECT_EQ(a.sim.ops().size(), b.sim.ops().size());
    ASSERT_EQ(a.telemetry.size(), b.telemetry.size());
    for (std::size_t d = 0; d < a.telemetry.size(); ++d) {
      EXPECT_EQ(a.telemetry[d].bytes_d2h, b.telemetry[d].bytes_d2h);
    }
  }
}

TEST(PipelineStagePolicy, AFirstStageMixMatchesTheReferenceAndLowersOnlyItsPeak) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  for (const Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B}) {
    SCOPED_TRACE(schedule_name(schedule));
    const PipelineOptions mixed = first_stage_mixed(schedule, 4);
    const PipelineRun run = simulate_pipeline(model, device, mixed).value();
    const PipelineRun never = simulate_pipeline(model, device, options(schedule, 4)).value();
    const PipelineRun reference = simulate_reference(model, device, mixed).value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    EXPECT_TRUE(run.hazards().empty()) << testing::hazard_lines(run.sim);
    EXPECT_TRUE(run.content_mismatches().empty());
    EXPECT_FALSE(run.param_grads.empty());
    EXPECT_EQ(run.param_grads, reference.param_grads);
    EXPECT_EQ(run.buffers_left, 0);
    EXPECT_GT(run.recompute_time.ns(), 0);
    // Only the first device offloads; the others' peaks are the uniform never run's.
    ASSERT_EQ(run.telemetry.size(), 4U);
    EXPECT_GT(run.telemetry[0].packed, 0);
    for (std::size_t d = 1; d < 4; ++d) EXPECT_EQ(run.telemetry[d].packed, 0) << d;
    EXPECT_LT(run.peak_activations[0], never.peak_activations[0]);
    if (schedule != Schedule::Interleaved1F1B) {
      // Interleaved, device 0 also holds stage 4, which the mix runs the same way.
      for (std::size_t d = 1; d < 4; ++d) {
        EXPECT_EQ(run.peak_activations[d], never.peak_activations[d]) << d;
      }
    }
  }
}

// The mix adds no wait: the receives' waits are the ones that keep it hazard-free.
TEST(PipelineStagePolicyFault, DroppedReceiveWaitsAreRacesUnderAMix) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  const PipelineOptions mixed = first_stage_mixed(Schedule::OneFOneB, 4);
  EXPECT_TRUE(simulate_pipeline(model, device, mixed).value().hazards().empty());
  PipelineFaults faults;
  faults.skip_receive_wait = true;
  EXPECT_FALSE(simulate_pipeline(model, device, mixed, faults).value().hazards().empty());
  faults = {};
  faults.skip_receive_arrival_wait = true;
  EXPECT_FALSE(simulate_pipeline(model, device, mixed, faults).value().hazards().empty());
}

TEST(PipelineStagePolicy, AWrongCountOrOffloadUnderZeroBubbleIsRefused) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  PipelineOptions o = first_stage_mixed(Schedule::OneFOneB, 4);
  o.stages.pop_back();
  const auto short_run = simulate_pipeline(model, device, o);
  ASSERT_FALSE(short_run.ok());
  EXPECT_NE(short_run.error().message.find("3 per-stage policies for 4 devices"), std::string::npos)
      << short_run.error().message;
  PipelineOptions zb = first_stage_mixed(Schedule::InterleavedZeroBubble, 2);
  zb.virtual_stages = 2;
  const auto zb_run = simulate_pipeline(model, device, zb);
  ASSERT_FALSE(zb_run.ok());
  EXPECT_NE(zb_run.error().message.find("interleaved-zero-bubble"), std::string::npos);
}

}  // namespace
}  // namespace ferry::sim
