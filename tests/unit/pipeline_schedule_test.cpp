// 1F1B, interleaved 1F1B and the zero-bubble schedules on simulated devices: equal results to the
// single-device reference with no hazard, the measured bubble against the analytic one on equal
// stages, the micro-batches in flight on stage 0, the planted faults of the receives' waits, and
// the options refused.

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "ferry/sim/autograd/pipeline.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using testing::equal_layers;
using testing::simple_profile;
using testing::tiny_gpt;

PipelineOptions options(Schedule schedule, std::int32_t devices, std::int32_t micro_batches,
                        std::int32_t virtual_stages = 1,
                        CheckpointMode mode = CheckpointMode::Never) {
  PipelineOptions o;
  o.schedule = schedule;
  o.devices = devices;
  o.micro_batches = micro_batches;
  o.virtual_stages = virtual_stages;
  o.checkpoint = mode;
  // tiny-gpt's 2 layers make at most 4 stages by layers (torchtitan's rule); these tests cut it
  // into up to 6, by forward time.
  o.split.rule = PipelineSplit::Rule::Balanced;
  return o;
}

std::string first_hazard(const PipelineRun& run) {
  return run.hazards().empty() ? std::string() : testing::hazard_lines(run.sim);
}

// `run` clean (no hazard, no content mismatch, nothing left held) with `reference`'s gradients.
void expect_clean_with_reference_gradients(const PipelineRun& run, const PipelineRun& reference) {
  ASSERT_FALSE(run.failure) << run.failure->message;
  EXPECT_TRUE(run.hazards().empty()) << first_hazard(run);
  EXPECT_TRUE(run.content_mismatches().empty());
  EXPECT_EQ(run.param_grads, reference.param_grads);
  EXPECT_EQ(run.buffers_left, 0);
}

TEST(PipelineSchedule, TinyGptMatchesTheReferenceUnderEachSchedule) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  for (const auto& [schedule, devices, m, v] :
       {std::tuple{Schedule::OneFOneB, 2, 4, 1}, std::tuple{Schedule::OneFOneB, 4, 6, 1},
        std::tuple{Schedule::Interleaved1F1B, 2, 4, 2},
        std::tuple{Schedule::Interleaved1F1B, 3, 6, 2},
        std::tuple{Schedule::InterleavedZeroBubble, 2, 4, 1},
        std::tuple{Schedule::InterleavedZeroBubble, 2, 4, 2},
        std::tuple{Schedule::InterleavedZeroBubble, 3, 6, 2},
        std::tuple{Schedule::ZeroBubbleV, 2, 4, 2}, std::tuple{Schedule::ZeroBubbleV, 3, 6, 2},
        std::tuple{Schedule::ZeroBubbleV, 4, 3, 2}}) {
    for (const CheckpointMode mode : {CheckpointMode::Never, CheckpointMode::ExceptLast}) {
      SCOPED_TRACE(fmt::format("{} {}x{} v{} {}", schedule_name(schedule), devices, m, v,
                               checkpoint_mode_name(mode)));
      const PipelineOptions o = options(schedule, devices, m, v, mode);
      const PipelineRun run = simulate_pipeline(model, device, o).value();
      const PipelineRun reference = simulate_reference(model, device, o).value();
      ASSERT_FALSE(run.failure) << run.failure->message;
      EXPECT_EQ(run.partition_starts.size(), static_cast<std::size_t>(devices * v) + 1);
      EXPECT_TRUE(run.hazards().empty()) << first_hazard(run);
      EXPECT_TRUE(run.content_mismatches().empty());
      EXPECT_FALSE(run.param_grads.empty());
      EXPECT_EQ(run.param_grads, reference.param_grads);
      EXPECT_EQ(run.buffers_left, 0);
      EXPECT_GT(run.sim.copied().peer.count(), 0);
      EXPECT_EQ(run.peak_allocated.size(), static_cast<std::size_t>(devices));
    }
  }
}

// The bubble of a device is its compute stream's idle share of the pipeline span (from the
// first task kernel's start to the last one's end); with equal stages every device has the same.
// Analytic, with zero-cost transfers: 1F1B and GPipe (pp - 1) / (m + pp - 1); interleaved 1F1B
// with V stages a device, each 1/V of a device's work, (pp - 1) / (V m + pp - 1), the same
// pp - 1 idle slots of a stage's forward and backward, each V times shorter.
TEST(PipelineSchedule, BubbleMatchesTheAnalyticFractionOnEqualStages) {
  const DeviceProfile device = simple_profile();
  for (const auto& [schedule, pp, m, v] :
       {std::tuple{Schedule::GPipe, 4, 8, 1}, std::tuple{Schedule::OneFOneB, 2, 4, 1},
        std::tuple{Schedule::OneFOneB, 4, 4, 1}, std::tuple{Schedule::OneFOneB, 4, 8, 1},
        std::tuple{Schedule::OneFOneB, 4, 16, 1}, std::tuple{Schedule::OneFOneB, 8, 16, 1},
        std::tuple{Schedule::Interleaved1F1B, 2, 4, 2},
        std::tuple{Schedule::Interleaved1F1B, 4, 8, 2},
        std::tuple{Schedule::Interleaved1F1B, 4, 16, 2},
        std::tuple{Schedule::Interleaved1F1B, 4, 8, 4},
        std::tuple{Schedule::Interleaved1F1B, 8, 16, 2}}) {
    const std::string name = fmt::format("{} pp{} m{} v{}", schedule_name(schedule), pp, m, v);
    SCOPED_TRACE(name);
    const Model model = equal_layers(static_cast<std::uint32_t>(pp * v * 2));
    const PipelineRun run = simulate_pipeline(model, device, options(schedule, pp, m, v)).value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    EXPECT_TRUE(run.hazards().empty()) << first_hazard(run);
    const double analytic = static_cast<double>(pp - 1) / static_cast<double>(v * m + pp - 1);
    const double measured = step_bubble(run);
    std::cout << fmt::format("{}: bubble {:.4f}, analytic {:.4f}, (pp-1)/(m+pp-1)/V {:.4f}\n", name,
                             measured, analytic, static_cast<double>(pp - 1) / (m + pp - 1) / v);
    EXPECT_NEAR(measured, analytic, 0.02 * analytic);
    for (std::size_t d = 0; d < run.busy.size(); ++d) {
      EXPECT_NEAR(device_bubble(run, d), analytic, 0.02 * analytic) << "gpu" << d;
    }
  }
}

// Stage 0 holds the activations of every micro-batch it has run forward and not yet backward:
// all m under GPipe, min(pp, m) under 1F1B (its warm-up forwards).
TEST(PipelineSchedule, StageZeroHoldsTheAnalyticNumberOfMicroBatches) {
  const DeviceProfile device = simple_profile();
  for (const auto& [schedule, pp, m] :
       {std::tuple{Schedule::GPipe, 2, 4}, std::tuple{Schedule::GPipe, 4, 8},
        std::tuple{Schedule::OneFOneB, 2, 4}, std::tuple{Schedule::OneFOneB, 4, 4},
        std::tuple{Schedule::OneFOneB, 4, 8}, std::tuple{Schedule::OneFOneB, 4, 16},
        std::tuple{Schedule::OneFOneB, 8, 16}}) {
    SCOPED_TRACE(fmt::format("{} pp{} m{}", schedule_name(schedule), pp, m));
    const Model model = equal_layers(static_cast<std::uint32_t>(pp * 2));
    const PipelineRun run = simulate_pipeline(model, device, options(schedule, pp, m)).value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    ASSERT_EQ(run.peak_in_flight.size(), static_cast<std::size_t>(pp));
    const std::int32_t expected = schedule == Schedule::GPipe ? m : std::min(pp, m);
    EXPECT_EQ(run.peak_in_flight[0], expected);
    // Under 1F1B stage s warms up with pp - s forwards: fewer in flight further down.
    if (schedule == Schedule::OneFOneB) {
      EXPECT_EQ(run.peak_in_flight[pp - 1], 1);
    }
  }
}

TEST(PipelineSchedule, OneFOneBHoldsLessThanGPipeOnStageZero) {
  const DeviceProfile device = simple_profile();
  const Model model = equal_layers(8);
  const PipelineRun gpipe =
      simulate_pipeline(model, device, options(Schedule::GPipe, 4, 16)).value();
  const PipelineRun one =
      simulate_pipeline(model, device, options(Schedule::OneFOneB, 4, 16)).value();
  EXPECT_LT(one.peak_allocated[0], gpipe.peak_allocated[0]);
  EXPECT_LT(one.peak_activations[0], gpipe.peak_activations[0]);
}

// Zero bubble fills the interleaved schedule's drain with the deferred weight steps: on the
// same equal stages (each backward half input gradient, half weight gradient, so that forward,
// input and weight steps take equal time) its bubble is below interleaved 1F1B's and equals the
// analytic (pp - 1) / (3 V m + pp - 1) within 2 % (ZB-H1's (pp - 1)(F + I - W) idle time, each
// step V times shorter), and every weight gradient still equals the reference's.
TEST(PipelineSchedule, ZeroBubbleFillsTheBubbleWithWeightSteps) {
  const DeviceProfile device = simple_profile();
  for (const auto& [pp, m, v] :
       {std::tuple{2, 4, 1}, std::tuple{4, 8, 1}, std::tuple{4, 8, 2}, std::tuple{4, 16, 2}}) {
    const std::string name = fmt::format("pp{} m{} v{}", pp, m, v);
    SCOPED_TRACE(name);
    const Model model = equal_layers(static_cast<std::uint32_t>(pp * v * 2));
    const PipelineOptions zb = options(Schedule::InterleavedZeroBubble, pp, m, v);
    const PipelineRun run = simulate_pipeline(model, device, zb).value();
    const PipelineRun loop =
        simulate_pipeline(model, device, options(Schedule::Interleaved1F1B, pp, m, v)).value();
    const PipelineRun reference = simulate_reference(model, device, zb).value();
    expect_clean_with_reference_gradients(run, reference);
    std::cout << fmt::format(
        "zero bubble {}: bubble {:.4f}, analytic {:.4f}, interleaved 1f1b {:.4f}\n", name,
        step_bubble(run), static_cast<double>(pp - 1) / static_cast<double>(3 * v * m + pp - 1),
        step_bubble(loop));
    EXPECT_LT(step_bubble(run), step_bubble(loop));
    const double analytic = static_cast<double>(pp - 1) / static_cast<double>(3 * v * m + pp - 1);
    EXPECT_NEAR(step_bubble(run), analytic, 0.02 * analytic);
  }
}

// ZBV places stages pp - 1 and pp on one rank (and the first and the last): the stage hands
// its tensors to the next without a send (Note [Stages on one rank]). With one rank both
// stages are there, so nothing crosses a device, and the gradients are still the reference's.
TEST(PipelineSchedule, ZeroBubbleVPassesTensorsBetweenStagesOnOneRankWithoutCopies) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  for (const CheckpointMode mode : {CheckpointMode::Never, CheckpointMode::ExceptLast}) {
    SCOPED_TRACE(checkpoint_mode_name(mode));
    const PipelineOptions o = options(Schedule::ZeroBubbleV, 1, 3, 2, mode);
    const PipelineRun run = simulate_pipeline(model, device, o).value();
    const PipelineRun reference = simulate_reference(model, device, o).value();
    expect_clean_with_reference_gradients(run, reference);
    EXPECT_EQ(run.partition_starts.size(), 3U);
    EXPECT_EQ(run.sim.copied().peer.count(), 0);
  }
}

// ZBV on the same equal stages as above (forward, input and weight steps of equal time), two
// stages a rank: its bubble is below interleaved 1F1B's with two stages a rank at the same
// (pp, m), and every device's is only the fill, (pp - 1) / (6 m + pp - 1) within 2 %: each rank
// idles pp - 1 steps of its 6 m. Measured: pp2 m4 0.0401 (interleaved 1F1B 0.1112), pp4 m8 0.0590
// (0.1580), pp4 m16 0.0305 (0.0858); interleaved zero bubble with two stages a rank measures the
// same.
TEST(PipelineSchedule, ZeroBubbleVBubbleIsBelowInterleavedOneFOneBs) {
  const DeviceProfile device = simple_profile();
  for (const auto& [pp, m] : {std::tuple{2, 4}, std::tuple{4, 8}, std::tuple{4, 16}}) {
    const std::string name = fmt::format("pp{} m{}", pp, m);
    SCOPED_TRACE(name);
    const Model model = equal_layers(static_cast<std::uint32_t>(pp * 2 * 2));
    const PipelineOptions zbv = options(Schedule::ZeroBubbleV, pp, m, 2);
    const PipelineRun run = simulate_pipeline(model, device, zbv).value();
    const PipelineRun loop =
        simulate_pipeline(model, device, options(Schedule::Interleaved1F1B, pp, m, 2)).value();
    const PipelineRun zb =
        simulate_pipeline(model, device, options(Schedule::InterleavedZeroBubble, pp, m, 2))
            .value();
    const PipelineRun reference = simulate_reference(model, device, zbv).value();
    expect_clean_with_reference_gradients(run, reference);
    std::cout << fmt::format(
        "zbv {}: bubble {:.4f}, interleaved 1f1b {:.4f}, interleaved zero bubble {:.4f}\n", name,
        step_bubble(run), step_bubble(loop), step_bubble(zb));
    EXPECT_LT(step_bubble(run), step_bubble(loop));
    const double analytic = static_cast<double>(pp - 1) / static_cast<double>(6 * m + pp - 1);
    EXPECT_NEAR(step_bubble(run), analytic, 0.02 * analytic);
    for (std::size_t d = 0; d < run.busy.size(); ++d) {
      EXPECT_NEAR(device_bubble(run, d), analytic, 0.02 * analytic) << "gpu" << d;
    }
  }
}

TEST(PipelineSchedule, TwoRunsAreIdentical) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  for (const Schedule schedule : {Schedule::Interleaved1F1B, Schedule::ZeroBubbleV}) {
    SCOPED_TRACE(schedule_name(schedule));
    const PipelineOptions o = options(schedule, 2, 4, 2);
    const PipelineRun a = simulate_pipeline(model, device, o).value();
    const PipelineRun b = simulate_pipeline(model, device, o).value();
    EXPECT_EQ(a.step_time, b.step_time);
    EXPECT_EQ(a.busy, b.busy);
    EXPECT_EQ(a.peak_allocated, b.peak_allocated);
    EXPECT_EQ(a.sim.ops().size(), b.sim.ops().size());
  }
}

TEST(PipelineSchedule, RefusesWhatTorchRefuses) {
  const DeviceProfile device = simple_profile();
  const Model model = equal_layers(8);
  const auto error = [&](const PipelineOptions& o) {
    auto run = simulate_pipeline(model, device, o);
    return run.ok() ? std::string() : run.error().message;
  };
  EXPECT_NE(error(options(Schedule::OneFOneB, 4, 3)).find("at least as many micro-batches"),
            std::string::npos);
  EXPECT_NE(error(options(Schedule::OneFOneB, 2, 4, 2)).find("interleaved-1f1b"),
            std::string::npos);
  EXPECT_NE(error(options(Schedule::Interleaved1F1B, 4, 9, 2)).find("multiple of the rounds"),
            std::string::npos);
  EXPECT_NE(error(options(Schedule::Interleaved1F1B, 1, 4, 2)).find("at least 2 devices"),
            std::string::npos);
  PipelineOptions offload = options(Schedule::InterleavedZeroBubble, 2, 4);
  offload.offload.policy = Policy::Ferry;
  EXPECT_NE(error(offload).find("not simulated"), std::string::npos);
  EXPECT_NE(error(options(Schedule::ZeroBubbleV, 4, 8, 1)).find("exactly 2 stages"),
            std::string::npos);
  PipelineOptions zbv_offload = options(Schedule::ZeroBubbleV, 2, 4, 2);
  zbv_offload.offload.policy = Policy::Ferry;
  EXPECT_NE(error(zbv_offload).find("not simulated"), std::string::npos);
  PipelineOptions skips = options(Schedule::OneFOneB, 2, 4);
  skips.skips = {SkipConnection{1, 2}};
  EXPECT_NE(error(skips).find("torchgpipe"), std::string::npos);
}

// Each wait of a receive, dropped, is a race the checker reports.
TEST(PipelineScheduleFault, DroppedReceiveWaitsAreRaces) {
  const DeviceProfile device = simple_profile();
  const Model model = equal_layers(8);
  for (const auto& [schedule, pp, m, v] :
       {std::tuple{Schedule::OneFOneB, 2, 4, 1}, std::tuple{Schedule::Interleaved1F1B, 2, 4, 2},
        std::tuple{Schedule::InterleavedZeroBubble, 2, 4, 2},
        std::tuple{Schedule::ZeroBubbleV, 2, 4, 2}, std::tuple{Schedule::ZeroBubbleV, 3, 6, 2}}) {
    SCOPED_TRACE(schedule_name(schedule));
    const PipelineOptions o = options(schedule, pp, m, v);
    EXPECT_TRUE(simulate_pipeline(model, device, o).value().hazards().empty());
    PipelineFaults faults;
    faults.skip_receive_wait = true;
    EXPECT_FALSE(simulate_pipeline(model, device, o, faults).value().hazards().empty());
    faults = {};
    faults.skip_receive_arrival_wait = true;
    EXPECT_FALSE(simulate_pipeline(model, device, o, faults).value().hazards().empty());
  }
}

}  // namespace
}  // namespace ferry::sim
