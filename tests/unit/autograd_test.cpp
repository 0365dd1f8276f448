#include "ferry/sim/autograd/autograd.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "ferry/sim/io/model_json.hpp"

#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

TrainingOptions with(Policy policy) { return testing::two_steps(policy); }

void expect_clean(const TrainingRun& run) {
  EXPECT_FALSE(run.failure) << run.failure->message;
  EXPECT_TRUE(run.sim.hazards().empty()) << run.sim.hazards().size() << " hazards";
  EXPECT_TRUE(run.sim.content_mismatches().empty());
  for (std::size_t s = 0; s < run.allocated_after.size(); ++s) {
    EXPECT_EQ(run.allocated_after[s], run.baseline_allocated) << "step " << s;
    EXPECT_EQ(run.tracked_after[s], 0U) << "step " << s;
  }
}

class EveryPolicy : public ::testing::TestWithParam<Policy> {};

TEST_P(EveryPolicy, ChainTrainsWithoutHazardsAndReturnsToBaseline) {
  const Model m = testing::chain_model(6, 1 << 20);
  auto run = simulate_training(m, testing::simple_profile(), with(GetParam()));
  ASSERT_TRUE(run.ok()) << run.error().message;
  expect_clean(run.value());
  EXPECT_EQ(run.value().steps.size(), 2U);
}

TEST_P(EveryPolicy, RandomBackwardOrdersStayClean) {
  const Model m = testing::chain_model(5, 1 << 20);
  TrainingOptions o = with(GetParam());
  o.order_seed = 7;
  auto run = simulate_training(m, testing::simple_profile(), o);
  ASSERT_TRUE(run.ok());
  expect_clean(run.value());
}

// The offloader's counters and per-layer decisions are of the last step, as the step time and
// the peaks are: a third step changes none of them.
TEST_P(EveryPolicy, CountersAreOfTheLastStep) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions two = with(GetParam());
  TrainingOptions three = two;
  three.steps = 3;
  auto a = simulate_training(m, testing::simple_profile(), two);
  auto b = simulate_training(m, testing::simple_profile(), three);
  ASSERT_TRUE(a.ok() && b.ok());
  const OffloadTelemetry& x = a.value().telemetry;
  const OffloadTelemetry& y = b.value().telemetry;
  if (GetParam() != Policy::None) {
    EXPECT_GT(x.packed, 0);
  }
  EXPECT_EQ(x.packed, y.packed);
  EXPECT_EQ(x.offloaded, y.offloaded);
  EXPECT_EQ(x.kept, y.kept);
  EXPECT_EQ(x.deduplicated, y.deduplicated);
  EXPECT_EQ(x.prefetched, y.prefetched);
  EXPECT_EQ(x.on_demand, y.on_demand);
  EXPECT_EQ(x.stash_hits, y.stash_hits);
  EXPECT_EQ(x.bytes_d2h, y.bytes_d2h);
  EXPECT_EQ(x.bytes_h2d, y.bytes_h2d);
  EXPECT_EQ(a.value().layer_decisions, b.value().layer_decisions);
}

// The planner's unchecked runs keep no content values (TrainingOptions::content_values): a
// checkpointed, offloaded, set-to-none run of tiny-gpt times and allocates exactly as the
// checked run of the same options, and reports no gradient values.
TEST_P(EveryPolicy, ARunWithoutContentValuesTimesAndAllocatesAsTheCheckedRun) {
  const DeviceProfile device = testing::simple_profile();
  const Model m = testing::tiny_gpt(device);
  TrainingOptions checked = with(GetParam());
  checked.checkpoint = checkpoint_every(m, 2);
  checked.grads_set_to_none = true;
  TrainingOptions unchecked = checked;
  unchecked.content_values = false;
  unchecked.sim.track_content = false;
  unchecked.sim.check_hazards = false;
  auto a = simulate_training(m, device, checked);
  auto b = simulate_training(m, device, unchecked);
  ASSERT_TRUE(a.ok() && b.ok());
  expect_clean(a.value());
  ASSERT_EQ(a.value().steps.size(), b.value().steps.size());
  for (std::size_t s = 0; s < a.value().steps.size(); ++s) {
    EXPECT_EQ(a.value().steps[s].start, b.value().steps[s].start);
    EXPECT_EQ(a.value().steps[s].end, b.value().steps[s].end);
  }
  const AllocatorStats& x = a.value().sim.device_allocator(DeviceId(0)).stats();
  const AllocatorStats& y = b.value().sim.device_allocator(DeviceId(0)).stats();
  EXPECT_EQ(x.reserved_peak, y.reserved_peak);
  EXPECT_EQ(x.allocated_peak, y.allocated_peak);
  EXPECT_EQ(x.segment_allocs, y.segment_allocs);
  EXPECT_EQ(a.value().sim.pinned_allocator().stats().reserved_peak,
            b.value().sim.pinned_allocator().stats().reserved_peak);
  EXPECT_EQ(a.value().recompute_time, b.value().recompute_time);
  EXPECT_EQ(a.value().telemetry.bytes_d2h, b.value().telemetry.bytes_d2h);
  EXPECT_FALSE(a.value().gradient_values.empty());
  EXPECT_TRUE(b.value().gradient_values.empty());
  // What reads the values must be off too.
  unchecked.sim.track_content = true;
  auto refused = simulate_training(m, device, unchecked);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("content_values"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Policies, EveryPolicy,
                         ::testing::Values(Policy::None, Policy::Trl, Policy::Ferry),
                         [](const auto& p) { return std::string(policy_name(p.param)); });

// A CheckedModel's run is the plain model's; the plain overload still refuses a model that
// validate_model refuses (planted: a loss that is not the last op's activation), and no
// simulation starts on it.
TEST(Autograd, ACheckedModelRunsAsThePlainOneAndABadPlainModelIsRefused) {
  const Model m = testing::chain_model(4, 1 << 20);
  auto checked = check_model(m);
  ASSERT_TRUE(checked.ok()) << checked.error().message;
  auto plain = simulate_training(m, testing::simple_profile(), with(Policy::Ferry));
  auto once = simulate_training(checked.value(), testing::simple_profile(), with(Policy::Ferry));
  ASSERT_TRUE(plain.ok() && once.ok());
  EXPECT_EQ(plain.value().steps.back().end, once.value().steps.back().end);
  EXPECT_EQ(plain.value().telemetry.bytes_d2h, once.value().telemetry.bytes_d2h);

  Model bad = m;
  bad.loss = 0;
  auto refused = simulate_training(bad, testing::simple_profile(), with(Policy::Ferry));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message, validate_model(bad).error().message);
  EXPECT_FALSE(check_model(bad).ok());
}

TEST(Autograd, OffloadLowersPeakMemory) {
  const Model m = testing::chain_model(8, 8 << 20);
  auto none = simulate_training(m, testing::simple_profile(), with(Policy::None));
  auto ferry = simulate_training(m, testing::simple_profile(), with(Policy::Ferry));
  ASSERT_TRUE(none.ok() && ferry.ok());
  const Bytes peak_none = none.value().sim.device_allocator(DeviceId(0)).stats().allocated_peak;
  const Bytes peak_ferry = ferry.value().sim.device_allocator(DeviceId(0)).stats().allocated_peak;
  EXPECT_LT(peak_ferry, peak_none);
  EXPECT_GT(ferry.value().telemetry.offloaded, 0);
}

// Pinning a new host block (cudaHostAlloc) holds up the host: the first step, which pins the
// offloader's blocks, is slower; the second reuses them from the pool and runs as with no cost.
TEST(Autograd, PinningHostBlocksSlowsTheFirstStepAlone) {
  const Model m = testing::chain_model(8, 8 << 20);
  DeviceProfile pins = testing::simple_profile();
  pins.overheads.host_alloc = SimTime(1'000'000);
  for (const Policy policy : {Policy::Ferry, Policy::Trl}) {
    auto free = simulate_training(m, testing::simple_profile(), with(policy));
    auto paid = simulate_training(m, pins, with(policy));
    ASSERT_TRUE(free.ok() && paid.ok());
    const std::int64_t allocs = paid.value().sim.pinned_allocator().stats().host_allocs;
    ASSERT_GT(allocs, 0);
    const auto step = [](const TrainingRun& run, std::size_t s) {
      return (run.steps.at(s).end - run.steps.at(s).start).ns();
    };
    const std::int64_t first_extra = step(paid.value(), 0) - step(free.value(), 0);
    EXPECT_GT(first_extra, 0);
    EXPECT_LE(first_extra, allocs * 1'000'000);
    EXPECT_EQ(step(paid.value(), 1), step(free.value(), 1));
  }
}

// Note [A parameter's gradients]: a weight read by an embedding and, through a whole view (the
// transpose F.linear takes), by an output head. The head's gradient waits in the engine's input
// buffer; the embedding's arrives at the end, and the two are summed into a third storage, as a
// tied Llama's are (torch.profiler on the CPU: three weights' bytes over the step's start, two
// when the head reads the weight itself and the sum is in place).
Model tied_weight(bool head_through_view) {
  testing::ModelBuilder b;
  b.m.name = "tied";
  constexpr std::int64_t kWeight = 1 << 20;
  const std::uint32_t x = b.tensor("x", 1024, TensorRole::Input);
  const std::uint32_t w = b.tensor("w", kWeight, TensorRole::Param);
  std::uint32_t head_w = w;
  if (head_through_view) {
    head_w = b.tensor("w.t", kWeight, TensorRole::Param);
    b.m.tensors[head_w].view_of = static_cast<std::int32_t>(w);
  }
  const std::uint32_t h = b.tensor("h", 1024, TensorRole::Activation);
  const std::uint32_t logits = b.tensor("logits", 1024, TensorRole::Activation);
  const std::uint32_t loss = b.tensor("loss", 4, TensorRole::Activation);
  b.op("embed", {w, x}, {h}, {x}, SimTime(1000), SimTime(2000));
  b.op("head", {h, head_w}, {logits}, {h, head_w}, SimTime(1000), SimTime(2000));
  b.op("loss", {logits}, {loss}, {logits}, SimTime(1000), SimTime(1000));
  b.m.loss = loss;
  return b.m;
}

// The step's peak over its start, in weights (1 MiB each; the rest is a few KiB).
double peak_in_weights(bool head_through_view, bool set_to_none) {
  TrainingOptions o = with(Policy::None);
  o.grads_set_to_none = set_to_none;
  auto run = simulate_training(tied_weight(head_through_view), testing::simple_profile(), o);
  EXPECT_TRUE(run.ok()) << run.error().message;
  expect_clean(run.value());
  const Bytes peak = run.value().sim.device_allocator(DeviceId(0)).stats().allocated_peak;
  return static_cast<double>((peak - run.value().baseline_allocated).count()) / (1 << 20);
}

TEST(Autograd, AWeightsGradientsThroughAViewAreSummedIntoAThirdStorage) {
  // Freed between steps: the two gradients and their sum; in place: the two.
  EXPECT_NEAR(peak_in_weights(true, true), 3.0, 0.02);
  EXPECT_NEAR(peak_in_weights(false, true), 2.0, 0.02);
  // Kept: the same buffers, then added into the kept gradient in place.
  EXPECT_NEAR(peak_in_weights(true, false), 3.0, 0.02);
  EXPECT_NEAR(peak_in_weights(false, false), 2.0, 0.02);
}

TEST(Autograd, AKeptGradientTakesEachNewOneInPlaceAfterItIsMade) {
  // chain_model's weights are 4 KiB, each written by one node: kept, each node's gradient is
  // made and then added in; freed, the first one becomes the gradient.
  const Model m = testing::chain_model(1, 1 << 20);
  TrainingOptions kept = with(Policy::None);
  TrainingOptions freed = kept;
  freed.grads_set_to_none = true;
  auto a = simulate_training(m, testing::simple_profile(), kept);
  auto b = simulate_training(m, testing::simple_profile(), freed);
  ASSERT_TRUE(a.ok() && b.ok());
  expect_clean(a.value());
  EXPECT_EQ(a.value().gradient_values, b.value().gradient_values);
  const auto over_start = [](const TrainingRun& run) {
    return run.sim.device_allocator(DeviceId(0)).stats().allocated_peak - run.baseline_allocated;
  };
  EXPECT_EQ(over_start(a.value()), over_start(b.value()));
}

// Note [Held activations]: a head whose output is upcast (2 MiB) before the loss. Held by the
// loop, the upcast copy outlives the loss node that saved it: through the rest of backward,
// where the head's node adds its 1 MiB gradient to it (the peak 1 MiB above the plain run's,
// whose peak is the loss node's), and through the next forward until the upcast runs again,
// which frees it. So each step ends with one copy over the baseline, however many steps run.
TEST(Autograd, AHeldActivationLivesUntilTheNextStepProducesIt) {
  constexpr std::int64_t kMiB = 1 << 20;
  const auto head = [&](bool held) {
    testing::ModelBuilder b;
    b.m.name = "head";
    const std::uint32_t x = b.tensor("x", kMiB, TensorRole::Input);
    const std::uint32_t w = b.tensor("w", 4096, TensorRole::Param);
    const std::uint32_t logits = b.tensor("logits", kMiB, TensorRole::Activation);
    const std::uint32_t up = b.tensor("up", 2 * kMiB, TensorRole::Activation);
    const std::uint32_t loss = b.tensor("loss", 4, TensorRole::Activation);
    b.m.tensors[up].held = held;
    b.op("head", {x, w}, {logits}, {x, w}, SimTime(1000), SimTime(2000));
    b.op("upcast", {logits}, {up}, {}, SimTime(1000), SimTime(1000));
    b.op("loss", {up}, {loss}, {up}, SimTime(1000), SimTime(1000));
    b.m.loss = loss;
    EXPECT_TRUE(validate_model(b.m).ok());
    TrainingOptions o = with(Policy::None);
    o.steps = 3;
    auto run = simulate_training(b.m, testing::simple_profile(), o);
    EXPECT_TRUE(run.ok()) << run.error().message;
    return std::move(run.value());
  };
  const TrainingRun plain = head(false);
  const TrainingRun held = head(true);
  EXPECT_FALSE(held.failure);
  EXPECT_TRUE(held.sim.hazards().empty());
  ASSERT_EQ(held.allocated_after.size(), 3U);
  for (std::size_t s = 0; s < 3; ++s) {
    EXPECT_EQ(plain.allocated_after[s], plain.baseline_allocated) << "step " << s;
    EXPECT_EQ(held.allocated_after[s], held.baseline_allocated + Bytes(2 * kMiB)) << "step " << s;
  }
  const auto peak = [](const TrainingRun& r) {
    return r.sim.device_allocator(DeviceId(0)).stats().allocated_peak;
  };
  EXPECT_EQ(peak(held) - peak(plain), Bytes(kMiB));
}

TEST(Autograd, RetainGraphWorksWithFerryAndFailsWithTrlAsTheReferenceDoes) {
  const Model m = testing::chain_model(4, 1 << 20);
  TrainingOptions o = with(Policy::Ferry);
  o.retain_graph = true;
  auto ferry = simulate_training(m, testing::simple_profile(), o);
  ASSERT_TRUE(ferry.ok());
  expect_clean(ferry.value());
  o.offload.policy = Policy::Trl;
  auto trl = simulate_training(m, testing::simple_profile(), o);
  ASSERT_TRUE(trl.ok());
  ASSERT_TRUE(trl.value().failure);
  EXPECT_NE(trl.value().failure->message.find("untracked tensor with id"), std::string::npos);
  EXPECT_EQ(trl.value().failure->kind, FailureKind::Misuse);
}

TEST(Autograd, EscapedViewsAreProtectedByRecordStream) {
  const Model m = testing::chain_model(6, 1 << 20);
  for (const Policy p : {Policy::Trl, Policy::Ferry}) {
    TrainingOptions o = with(p);
    o.escape_period = 2;
    auto run = simulate_training(m, testing::simple_profile(), o);
    ASSERT_TRUE(run.ok());
    expect_clean(run.value());
    EXPECT_GT(run.value().telemetry.record_stream_fallbacks, 0) << policy_name(p);
  }
}

TEST(Autograd, RunningOutOfDeviceMemoryIsAFailureOfThatKind) {
  const Model m = testing::chain_model(6, 1 << 20);
  DeviceProfile small = testing::simple_profile();
  small.memory = Bytes(2 << 20);
  auto run = simulate_training(m, small, with(Policy::None));
  ASSERT_TRUE(run.ok());
  ASSERT_TRUE(run.value().failure);
  EXPECT_EQ(run.value().failure->kind, FailureKind::OutOfMemory);
  EXPECT_NE(run.value().failure->message.find("out of memory"), std::string::npos)
      << run.value().failure->message;
}

TEST(Autograd, PlantedFaultSkippingTheReloadWaitIsCaught) {
  const Model m = testing::chain_model(6, 1 << 20);
  TrainingOptions o = with(Policy::Ferry);
  TrainingFaults faults;
  faults.offload.skip_reload_wait = true;
  auto run = simulate_training(m, testing::simple_profile(), o, faults);
  ASSERT_TRUE(run.ok());
  EXPECT_FALSE(run.value().sim.hazards().empty());
}

// Note [Mesh collectives]: a rank's collective op runs on its process group's stream and
// collective lane, forward and backward, between the current stream's two waits.
TEST(MeshCollectives, ACollectiveOpRunsOnItsGroupsStreamBetweenTwoWaits) {
  std::ifstream in(std::filesystem::path(FERRY_TESTS_DIR) / "fuzz" / "corpus" / "model" /
                   "sequence_parallel.json");
  std::stringstream text;
  text << in.rdbuf();
  auto parsed = parse_model(text.str(), "sequence_parallel.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  DeviceProfile device = testing::simple_profile();
  device.collectives.intra_node = {Bandwidth(1'000'000'000), SimTime(2000)};
  Model model = parsed.value();
  ASSERT_TRUE(check_roofline(model, device).ok());
  assign_roofline_durations(model, device);
  TrainingOptions options;
  options.steps = 1;
  auto run = simulate_training(model, device, options);
  ASSERT_TRUE(run.ok()) << run.error().message;
  ASSERT_FALSE(run.value().failure);
  const Simulator& sim = run.value().sim;
  EXPECT_TRUE(sim.hazards().empty());
  std::vector<std::string> collectives;
  for (const OpRecord& op : sim.ops()) {
    if (op.kind != OpKind::Kernel || !op.collective) continue;
    collectives.push_back(std::string(sim.label(op.label)) + " on " + sim.stream_name(op.stream));
    EXPECT_EQ(op.end - op.start, sim.label(op.label) == "gather" ? model.ops[1].duration
                                                                 : model.ops[1].backward_duration);
  }
  EXPECT_EQ(collectives,
            (std::vector<std::string>{"gather on tp comm", "gather backward on tp comm"}));
  // The op that reads the gathered tensor starts once the all-gather is done.
  const auto started = [&](std::string_view label) {
    for (const OpRecord& op : sim.ops()) {
      if (op.kind == OpKind::Kernel && sim.label(op.label) == label) return op;
    }
    ADD_FAILURE() << label;
    return OpRecord{};
  };
  EXPECT_GE(started("sum").start, started("gather").end);
  EXPECT_GE(started("gather").start, started("norm").end);
}

}  // namespace
}  // namespace ferry::sim
