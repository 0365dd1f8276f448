// Several compute streams in the simulated autograd (SideStreamOptions): with the edges torch
// and careful code add, side-stream work is clean; each planted fault drops one edge and the
// checker reports it with the kind that defect is.

#include <gtest/gtest.h>

#include <string>

#include "ferry/sim/autograd/autograd.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

TrainingOptions side_options(Policy policy) { return testing::two_steps(policy); }

TrainingRun train(const Model& m, const TrainingOptions& o, const TrainingFaults& faults = {}) {
  auto run = simulate_training(m, testing::simple_profile(), o, faults);
  EXPECT_TRUE(run.ok()) << run.error().message;
  return std::move(run.value());
}

std::int64_t kernels_on(const TrainingRun& run, const std::string& stream) {
  std::int64_t n = 0;
  for (const OpRecord& op : run.sim.ops()) {
    if (op.kind == OpKind::Kernel && run.sim.stream_name(op.stream) == stream) ++n;
  }
  return n;
}

// The hazards, a line each, for failure messages.
std::string describe(const TrainingRun& run) { return testing::hazard_lines(run.sim); }

// Whether the checker reports a hazard of this kind and conflict with an op on `stream`.
bool reports(const TrainingRun& run, HazardKind kind, Conflict conflict,
             const std::string& stream) {
  for (const Hazard& h : run.sim.hazards()) {
    if (h.kind != kind || h.conflict != conflict) continue;
    for (const OpId op : {h.first, h.second}) {
      const StreamId on = run.sim.ops()[op.value()].stream;
      if (on.valid() && run.sim.stream_name(on) == stream) return true;
    }
  }
  return false;
}

void expect_clean(const TrainingRun& run) {
  EXPECT_FALSE(run.failure) << run.failure->message;
  EXPECT_TRUE(run.sim.hazards().empty()) << run.sim.hazards().size() << " hazards\n"
                                         << describe(run);
  EXPECT_TRUE(run.sim.content_mismatches().empty());
  for (std::size_t s = 0; s < run.allocated_after.size(); ++s) {
    EXPECT_EQ(run.allocated_after[s], run.baseline_allocated) << "step " << s;
  }
}

TEST(SideStreams, LayersOnTheSideStreamTrainWithoutHazards) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.side.layers = {1, 2, 4};
  const TrainingRun run = train(m, o);
  expect_clean(run);
  // Forward and backward of three layers in each of two steps.
  EXPECT_EQ(kernels_on(run, "side"), 2 * 2 * 3);
}

TEST(SideStreams, GradientsAreThoseOfOneStream) {
  const Model m = testing::chain_model(6, 1 << 20);
  const TrainingRun one = train(m, side_options(Policy::None));
  TrainingOptions o = side_options(Policy::None);
  o.side.layers = {0, 3, 5};
  const TrainingRun two = train(m, o);
  EXPECT_EQ(two.gradient_values, one.gradient_values);
}

TEST(SideStreams, SameOptionsGiveTheSameRun) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.checkpoint = checkpoint_segments(m, 3, false);
  o.side.layers = {1, 4};
  o.side.recompute = true;
  o.side.all_reduce = true;
  o.order_seed = 3;
  const TrainingRun a = train(m, o);
  const TrainingRun b = train(m, o);
  ASSERT_EQ(a.sim.ops().size(), b.sim.ops().size());
  for (std::size_t i = 0; i < a.sim.ops().size(); ++i) {
    const OpRecord& x = a.sim.ops()[i];
    const OpRecord& y = b.sim.ops()[i];
    EXPECT_TRUE(x.kind == y.kind && x.stream == y.stream && x.label == y.label &&
                x.start == y.start && x.end == y.end && x.buffer == y.buffer)
        << "op " << i;
  }
  EXPECT_EQ(a.sim.makespan(), b.sim.makespan());
}

TEST(SideStreams, PlantedMissingWaitBeforeSideLayerIsARace) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.side.layers = {2};
  TrainingFaults faults;
  faults.skip_side_stream_wait = true;
  const TrainingRun run = train(m, o, faults);
  // The side layer reads what the compute stream just wrote.
  EXPECT_TRUE(reports(run, HazardKind::Race, Conflict::ReadAfterWrite, "side"));
}

TEST(SideStreams, PlantedMissingRecordStreamIsALatentReuse) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.side.layers = {2};
  TrainingFaults faults;
  faults.skip_cross_stream_record = true;
  const TrainingRun run = train(m, o, faults);
  EXPECT_TRUE(reports(run, HazardKind::LatentReuse, Conflict::WriteAfterRead, "side"))
      << describe(run);
}

TEST(SideStreams, RecomputeOnTheSideStreamIsClean) {
  const Model m = testing::chain_model(6, 1 << 20);
  for (const bool reentrant : {false, true}) {
    TrainingOptions o = side_options(Policy::None);
    o.checkpoint = checkpoint_segments(m, 3, reentrant);
    o.side.recompute = true;
    const TrainingRun run = train(m, o);
    expect_clean(run);
    EXPECT_GT(run.recomputations, 0);
    EXPECT_GT(kernels_on(run, "side"), 0) << "reentrant " << reentrant;
  }
}

TEST(SideStreams, PlantedRecomputeWithoutTheWaitIsARace) {
  const Model m = testing::chain_model(6, 1 << 20);
  for (const bool reentrant : {false, true}) {
    TrainingOptions o = side_options(Policy::None);
    o.checkpoint = checkpoint_segments(m, 3, reentrant);
    o.side.recompute = true;
    TrainingFaults faults;
    faults.skip_side_stream_wait = true;
    const TrainingRun run = train(m, o, faults);
    // The replay reads the region's inputs, which the compute stream last wrote.
    EXPECT_TRUE(reports(run, HazardKind::Race, Conflict::ReadAfterWrite, "side"))
        << "reentrant " << reentrant;
  }
}

TEST(SideStreams, AllReducesOnTheCommStreamAreClean) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.side.all_reduce = true;
  o.side.layers = {2};
  const TrainingRun run = train(m, o);
  expect_clean(run);
  EXPECT_EQ(kernels_on(run, "comm"), 2 * 6);  // a gradient per layer, two steps
  EXPECT_EQ(run.gradient_values, train(m, side_options(Policy::None)).gradient_values);
}

TEST(SideStreams, PlantedAllReduceWithoutTheWaitIsARace) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.side.all_reduce = true;
  TrainingFaults faults;
  faults.skip_side_stream_wait = true;
  const TrainingRun run = train(m, o, faults);
  // The all-reduce reads the gradient the backward kernel writes.
  EXPECT_TRUE(reports(run, HazardKind::Race, Conflict::ReadAfterWrite, "comm"));
}

// optimizer.zero_grad(set_to_none=True) between steps (TrainingOptions::grads_set_to_none):
// each parameter's gradient is allocated at its first write in backward and freed after the
// step, so the step starts without them; the gradients are those of a run that keeps them.
TEST(SetToNone, GradientsLiveFromTheirFirstWriteToTheStepsEnd) {
  const Model m = testing::chain_model(6, 1 << 20);
  const TrainingOptions kept = side_options(Policy::None);
  TrainingOptions freed = kept;
  freed.grads_set_to_none = true;
  const TrainingRun a = train(m, kept);
  const TrainingRun b = train(m, freed);
  expect_clean(b);
  EXPECT_EQ(b.gradient_values, a.gradient_values);
  Bytes params(0);
  for (const ModelTensor& t : m.tensors) {
    if (t.role == TensorRole::Param) params += t.bytes;
  }
  EXPECT_EQ(a.baseline_allocated - b.baseline_allocated, params);
  const Bytes peak_kept = a.sim.device_allocator(a.device).stats().allocated_peak;
  const Bytes peak_freed = b.sim.device_allocator(b.device).stats().allocated_peak;
  // The peak is in the last layer's backward node, which makes its weight's gradient (4 KiB)
  // either way, kept runs to add it into the one they hold (Note [A parameter's gradients]):
  // every other gradient fewer.
  EXPECT_EQ(peak_kept - peak_freed, params);
}

TEST(SetToNone, GradientsAllReducedOnTheCommStreamAreFreedClean) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.side.all_reduce = true;
  o.side.layers = {2};
  o.grads_set_to_none = true;
  const TrainingRun run = train(m, o);
  expect_clean(run);
  EXPECT_EQ(run.gradient_values, train(m, side_options(Policy::None)).gradient_values);
}

TEST(SetToNone, PlantedFreeAtTheAllReduceIsALatentReuse) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(Policy::None);
  o.side.all_reduce = true;
  o.grads_set_to_none = true;
  TrainingFaults faults;
  faults.free_grad_at_all_reduce = true;
  const TrainingRun run = train(m, o, faults);
  // A later backward kernel reuses a gradient's block while its all-reduce may still read it.
  EXPECT_FALSE(run.sim.hazards().empty());
  EXPECT_TRUE(reports(run, HazardKind::LatentReuse, Conflict::WriteAfterRead, "comm") ||
              reports(run, HazardKind::Race, Conflict::WriteAfterRead, "comm"))
      << describe(run);
}

// The offloader on a side stream: clean because it asks the backend's compute_stream() at each
// pack and unpack (Note [The compute stream is the current one] in offload/tracker.hpp); one
// that keeps the stream it was built with is the planted fault below.
class SideStreamsOffload : public ::testing::TestWithParam<Policy> {};

TEST_P(SideStreamsOffload, OffloaderOrdersCopiesAfterTheCurrentStream) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(GetParam());
  o.side.layers = {1, 3};
  o.side.all_reduce = true;
  const TrainingRun run = train(m, o);
  expect_clean(run);
  EXPECT_GT(run.telemetry.offloaded, 0);
  EXPECT_GT(kernels_on(run, "side"), 0);
}

TEST_P(SideStreamsOffload, RecomputeOnTheSideStreamReloadsForIt) {
  const Model m = testing::chain_model(6, 1 << 20);
  for (const bool reentrant : {false, true}) {
    TrainingOptions o = side_options(GetParam());
    o.checkpoint = checkpoint_segments(m, 3, reentrant);
    o.side.recompute = true;
    const TrainingRun run = train(m, o);
    expect_clean(run);
    EXPECT_GT(run.telemetry.offloaded, 0);
  }
}

TEST_P(SideStreamsOffload, PlantedCachedComputeStreamIsARace) {
  // Before TRL #7195: the offloader orders against the stream current when it was built.
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = side_options(GetParam());
  o.side.layers = {1, 3};
  TrainingFaults faults;
  faults.offload.stale_compute_stream = true;
  const TrainingRun run = train(m, o, faults);
  // The D2H copy reads what the side stream writes; the side stream's backward reads the
  // reload.
  EXPECT_TRUE(reports(run, HazardKind::Race, Conflict::ReadAfterWrite, "side")) << describe(run);
}

INSTANTIATE_TEST_SUITE_P(Policies, SideStreamsOffload,
                         ::testing::Values(Policy::Trl, Policy::Ferry),
                         [](const auto& p) { return std::string(policy_name(p.param)); });

}  // namespace
}  // namespace ferry::sim
