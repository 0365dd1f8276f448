// Checkpointing through the simulated autograd: recompute, the nestable rules, early stop,
// RNG, the reference's errors, the reentrant variant, selective policies, and composition
// with offload.

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "plan_replay.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

Model tiny() {
  Model m = model_preset("tiny-gpt").value();
  assign_roofline_durations(m, testing::simple_profile());
  return m;
}

TrainingRun train(const Model& m, TrainingOptions o, const TrainingFaults& faults = {}) {
  auto run = simulate_training(m, testing::simple_profile(), o, faults);
  EXPECT_TRUE(run.ok()) << (run.ok() ? "" : run.error().message);
  return std::move(run).value();
}

TrainingOptions plain(Policy offload = Policy::None) {
  TrainingOptions o;
  o.offload.policy = offload;
  o.steps = 2;
  return o;
}

void expect_clean(const TrainingRun& r) {
  ASSERT_FALSE(r.failure) << r.failure->message;
  EXPECT_TRUE(r.sim.hazards().empty());
  EXPECT_TRUE(r.sim.content_mismatches().empty());
  for (std::size_t s = 0; s < r.allocated_after.size(); ++s) {
    EXPECT_EQ(r.allocated_after[s], r.baseline_allocated);
  }
}

Bytes peak(const TrainingRun& r) {
  return r.sim.device_allocator(DeviceId(0)).stats().requested_peak;
}

TEST(Checkpoint, EveryLayerGivesTheSameGradientsWithLessMemory) {
  const Model m = tiny();
  const TrainingRun base = train(m, plain());
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  const TrainingRun ck = train(m, o);
  expect_clean(ck);
  EXPECT_EQ(ck.gradient_values, base.gradient_values);
  EXPECT_LT(peak(ck), peak(base));
  EXPECT_GT(ck.recompute_time.ns(), 0);
  EXPECT_EQ(ck.recomputations, 2 * static_cast<std::int64_t>(o.checkpoint.regions.size()));
}

// Note [A replay frees as the forward does]: a 1 MiB square that only the mean reads is gone
// before the layer's 1 MiB output is computed again, in the replay as in forward. Held until
// the replay's end it would sit beside the output and its gradient, 1 MiB above the plain step.
TEST(Checkpoint, TheReplayFreesWhatNothingSavesAfterItsLastReader) {
  constexpr std::string_view kModel = R"({
  "format": "ferry.model/1", "name": "square-mean-scale",
  "tensors": [
    {"name": "x", "bytes": 1024, "dtype": "bf16", "role": "input"},
    {"name": "w", "bytes": 1024, "dtype": "bf16", "role": "param"},
    {"name": "sq", "bytes": 1048576, "dtype": "bf16", "role": "activation"},
    {"name": "m", "bytes": 1024, "dtype": "bf16", "role": "activation"},
    {"name": "y", "bytes": 1048576, "dtype": "bf16", "role": "activation"},
    {"name": "loss", "bytes": 4, "dtype": "f32", "role": "activation"}
  ],
  "ops": [
    {"name": "layers.0.square", "layer": 0, "flops": 1024, "bytes": 2048, "backward_flops": 0,
     "backward_bytes": 0, "inputs": ["x"], "outputs": ["sq"], "saved": []},
    {"name": "layers.0.mean", "layer": 0, "flops": 1024, "bytes": 2048, "backward_flops": 0,
     "backward_bytes": 0, "inputs": ["sq"], "outputs": ["m"], "saved": []},
    {"name": "layers.0.scale", "layer": 0, "flops": 1024, "bytes": 2048, "backward_flops": 2048,
     "backward_bytes": 4096, "inputs": ["x", "m", "w"], "outputs": ["y"],
     "saved": ["x", "m", "w"]},
    {"name": "loss", "flops": 1024, "bytes": 2048, "backward_flops": 1024, "backward_bytes": 2048,
     "inputs": ["y"], "outputs": ["loss"], "saved": ["y"]}
  ],
  "loss": "loss"
})";
  auto parsed = parse_model(kModel, "square-mean-scale");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  Model m = std::move(parsed).value();
  assign_roofline_durations(m, testing::simple_profile());
  const TrainingRun base = train(m, plain());
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  const TrainingRun ck = train(m, o);
  expect_clean(ck);
  EXPECT_EQ(ck.recomputations, 2);
  EXPECT_LT(peak(ck), peak(base) + kMiB);
}

TEST(Checkpoint, EarlyStopEndsTheReplayAtTheLastSavedTensor) {
  const Model m = tiny();
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  const TrainingRun early = train(m, o);
  ASSERT_FALSE(early.replay_stops.empty());
  for (const auto& [ran, last_saving] : early.replay_stops) EXPECT_EQ(ran, last_saving);
  o.checkpoint.global_early_stop = false;
  const TrainingRun full = train(m, o);
  expect_clean(full);
  EXPECT_GE(full.recompute_time, early.recompute_time);
  EXPECT_EQ(full.gradient_values, early.gradient_values);
}

// Note [A replay ends before the op it no longer needs]. A traced Llama layer's last op that
// saves a tensor is its down projection's matmul, which saves its inputs alone: with early stop
// the replay packs them and ends without running it (torch 2.11's non-reentrant checkpoint of
// `x + silu(x @ w1) @ w2` recomputes `x @ w1` and the SiLU, not the last matmul); without early
// stop every op of the region runs again.
TEST(Checkpoint, TheReplayEndsBeforeAnOpThatSavesItsInputsAlone) {
  Model m = testing::traced_file("llama.json");
  assign_roofline_durations(m, testing::simple_profile());
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  ASSERT_FALSE(o.checkpoint.regions.empty());
  SimTime before_last{};
  SimTime whole{};
  for (const CheckpointRegion& r : o.checkpoint.regions) {
    std::uint32_t last = r.end_op;
    for (std::uint32_t i = r.end_op; i-- > r.first_op;) {
      if (!m.ops[i].saved.empty()) {
        last = i;
        break;
      }
    }
    ASSERT_LT(last, r.end_op);
    const ModelOp& op = m.ops[last];
    ASSERT_GT(op.flops, 0) << op.name << ": the layer's last saving op is a matmul";
    for (const std::uint32_t t : op.saved) {
      ASSERT_NE(std::find(op.inputs.begin(), op.inputs.end(), t), op.inputs.end())
          << op.name << " saves " << m.tensors[t].name << ", not an input";
    }
    for (std::uint32_t i = r.first_op; i < r.end_op; ++i) {
      whole += m.ops[i].duration;
      if (i < last) before_last += m.ops[i].duration;
    }
  }
  const TrainingRun early = train(m, o);
  expect_clean(early);
  EXPECT_EQ(early.recompute_time, before_last);
  o.checkpoint.global_early_stop = false;
  const TrainingRun full = train(m, o);
  expect_clean(full);
  EXPECT_EQ(full.recompute_time, whole);
  EXPECT_EQ(full.gradient_values, early.gradient_values);
}

TEST(Checkpoint, NestedRegionsRecomputeTheParentForTheChildsInputs) {
  const Model m = tiny();
  const TrainingRun base = train(m, plain());
  TrainingOptions o = plain();
  CheckpointPlan layers = checkpoint_every(m, 1);
  ASSERT_GE(layers.regions.size(), 2U);
  // One outer region over both layers, each layer checkpointed inside it.
  o.checkpoint.regions.push_back(
      CheckpointRegion{layers.regions[0].first_op, layers.regions[1].end_op, false, std::nullopt});
  for (const auto& r : layers.regions) o.checkpoint.regions.push_back(r);
  const TrainingRun ck = train(m, o);
  expect_clean(ck);
  EXPECT_EQ(ck.gradient_values, base.gradient_values);
  EXPECT_GT(ck.recomputations, 2 * static_cast<std::int64_t>(layers.regions.size()));
}

TEST(Checkpoint, RetainGraphRecomputesForEachBackward) {
  const Model m = tiny();
  TrainingOptions o = plain();
  o.steps = 1;
  o.checkpoint = checkpoint_every(m, 1);
  o.retain_graph = true;
  const TrainingRun ck = train(m, o);
  expect_clean(ck);
  EXPECT_EQ(ck.recomputations, 2 * static_cast<std::int64_t>(o.checkpoint.regions.size()));
}

TEST(Checkpoint, RandomBackwardOrdersStillMatch) {
  const Model m = tiny();
  const TrainingRun base = train(m, plain());
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  o.order_seed = 11;
  const TrainingRun ck = train(m, o);
  expect_clean(ck);
  EXPECT_EQ(ck.gradient_values, base.gradient_values);
}

TEST(Checkpoint, PlantedFaultSkippingTheRngRestoreChangesWhatBackwardReads) {
  const Model m = tiny();
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  TrainingFaults faults;
  faults.skip_rng_restore = true;
  const TrainingRun bad = train(m, o, faults);
  EXPECT_FALSE(bad.sim.content_mismatches().empty());
  EXPECT_NE(bad.gradient_values, train(m, plain()).gradient_values);
}

TEST(Checkpoint, CpuGeneratorStateIsRestoredForRecomputeToo) {
  Model m = tiny();
  for (ModelOp& op : m.ops)
    op.draws_cpu_rng = op.layer >= 0 && op.name.find("ln") != std::string::npos;
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  const TrainingRun base = train(m, plain());
  const TrainingRun good = train(m, o);
  expect_clean(good);
  EXPECT_EQ(good.gradient_values, base.gradient_values);
  TrainingFaults faults;
  faults.skip_rng_restore = true;
  const TrainingRun bad = train(m, o, faults);
  EXPECT_FALSE(bad.sim.content_mismatches().empty());
}

TEST(Checkpoint, UnpackingTwiceWithoutARecomputeIsAnError) {
  const Model m = tiny();
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  o.unpack_twice = true;
  const TrainingRun r = train(m, o);
  ASSERT_TRUE(r.failure);
  EXPECT_NE(r.failure->message.find("already unpacked once"), std::string::npos)
      << r.failure->message;
}

TEST(Checkpoint, ADifferentNumberOfSavedTensorsOnRecomputeIsAnError) {
  const Model m = tiny();
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  o.checkpoint.global_early_stop = false;
  TrainingFaults faults;
  faults.drop_recomputed = 0;
  const TrainingRun r = train(m, o, faults);
  ASSERT_TRUE(r.failure);
  EXPECT_NE(r.failure->message.find("A different number of tensors"), std::string::npos)
      << r.failure->message;
}

TEST(Checkpoint, MetadataMismatchOnRecomputeIsAnError) {
  const Model m = tiny();
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  TrainingFaults faults;
  faults.alter_recomputed_meta = true;
  const TrainingRun r = train(m, o, faults);
  ASSERT_TRUE(r.failure);
  EXPECT_NE(r.failure->message.find("different metadata"), std::string::npos) << r.failure->message;
}

TEST(Checkpoint, DeviceStateFirstInitializedInsideARegionIsAnError) {
  const Model m = tiny();
  TrainingOptions o = plain();
  // One region from the first op, so the model's first random draw happens inside it.
  o.checkpoint.regions = {
      CheckpointRegion{0, checkpoint_every(m, 1).regions[0].end_op, false, std::nullopt}};
  o.checkpoint.lazy_device_rng = true;
  const TrainingRun r = train(m, o);
  ASSERT_TRUE(r.failure);
  EXPECT_NE(r.failure->message.find("device state was initialized in the forward pass"),
            std::string::npos);
  o.checkpoint.preserve_rng = false;  // without RNG preservation the reference allows it
  expect_clean(train(m, o));
}

TEST(Checkpoint, ReentrantVariantRecomputesWholeRegions) {
  const Model m = tiny();
  const TrainingRun base = train(m, plain());
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_segments(m, 3, true);
  ASSERT_EQ(o.checkpoint.regions.size(), 2U) << "the last segment is not checkpointed";
  const TrainingRun ck = train(m, o);
  expect_clean(ck);
  EXPECT_EQ(ck.gradient_values, base.gradient_values);
  EXPECT_LT(peak(ck), peak(base));
}

// A traced model lists views as ops that produce no tensor of their own; an even split by op
// count may end a segment on one, and a reentrant segment has nothing to return there.
TEST(Checkpoint, ReentrantSegmentsOfATracedModelEndAtAnOpWithAnOutput) {
  for (const char* family : {"gpt2", "llama", "gemma2"}) {
    const std::filesystem::path path = std::filesystem::path(FERRY_TESTS_DIR) / "data" / "traced" /
                                       (std::string(family) + ".json");
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    auto parsed = parse_model(text.str(), path.string());
    ASSERT_TRUE(parsed.ok()) << parsed.error().message;
    Model m = std::move(parsed).value();
    assign_roofline_durations(m, testing::simple_profile());
    const TrainingRun base = train(m, plain());
    for (const std::int32_t segments : {2, 3, 24, 100}) {
      TrainingOptions o = plain();
      o.checkpoint = checkpoint_segments(m, segments, true);
      ASSERT_FALSE(o.checkpoint.regions.empty()) << family << " " << segments;
      EXPECT_LT(o.checkpoint.regions.size(), static_cast<std::size_t>(segments));
      for (const CheckpointRegion& r : o.checkpoint.regions) {
        EXPECT_FALSE(m.ops[r.end_op - 1].outputs.empty()) << family << " " << segments;
      }
      const TrainingRun ck = train(m, o);
      expect_clean(ck);
      EXPECT_EQ(ck.gradient_values, base.gradient_values) << family << " " << segments;
    }
  }
}

TEST(Checkpoint, SelectivePolicyRecomputesOnlyTheAttentionCore) {
  const Model m = tiny();
  TrainingOptions full = plain();
  full.checkpoint = checkpoint_every(m, 1);
  TrainingOptions selective = full;
  apply_selective_policy(selective.checkpoint, m);
  const TrainingRun a = train(m, full);
  const TrainingRun b = train(m, selective);
  expect_clean(b);
  EXPECT_EQ(a.gradient_values, b.gradient_values);
  EXPECT_LT(b.recompute_time, a.recompute_time);
  EXPECT_GE(peak(b), peak(a));
}

// Megatron's selective recomputation checkpoints the attention core alone: on a traced model,
// whose ops are the eager operators one by one, each core is one region and the rest of the
// layer is saved as autograd saves it, so the peak is never above no checkpointing's (with a
// policy inside whole-layer regions it was: every output of every saved op was cached). A
// decoder's layer has one core; T5's encoder block one, its decoder block two (self-attention,
// then cross-attention over the encoder's output).
TEST(Checkpoint, SelectiveRecomputationOfATracedModelIsOneRegionPerAttentionCore) {
  const std::map<std::string, std::map<std::int32_t, std::size_t>> cores_of_layers = {
      {"t5", {{0, 1}, {1, 2}}}};
  for (const char* family : testing::kSizedFamilies) {
    Model m = testing::sized_family(family);
    ASSERT_FALSE(m.ops.empty()) << family;
    DeviceProfile roomy = testing::simple_profile();
    roomy.memory = Bytes(64LL << 30);
    assign_roofline_durations(m, roomy);
    std::map<std::int32_t, std::uint32_t> layer_ops;
    for (const ModelOp& op : m.ops) {
      if (op.layer >= 0) ++layer_ops[op.layer];
    }
    TrainingOptions o = plain();
    o.checkpoint = checkpoint_attention_cores(m);
    std::map<std::int32_t, std::size_t> cores;
    for (const auto& [layer, ops] : layer_ops) cores[layer] = 1;
    if (const auto listed = cores_of_layers.find(family); listed != cores_of_layers.end()) {
      cores = listed->second;
    }
    std::map<std::int32_t, std::size_t> regions;
    for (const CheckpointRegion& r : o.checkpoint.regions) {
      // A fused kernel, or eager attention's two batched matmuls and what lies between: a small
      // part of its layer.
      const std::int32_t layer = m.ops[r.first_op].layer;
      ++regions[layer];
      EXPECT_EQ(layer, m.ops[r.end_op - 1].layer) << family;
      EXPECT_LT(4 * (r.end_op - r.first_op), layer_ops[layer])
          << family << " " << m.ops[r.first_op].name;
    }
    EXPECT_EQ(regions, cores) << family;
    auto run = [&](const TrainingOptions& options) {
      auto r = simulate_training(m, roomy, options);
      EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
      return std::move(r).value();
    };
    const TrainingRun base = run(plain());
    const TrainingRun ck = run(o);
    expect_clean(ck);
    EXPECT_EQ(ck.gradient_values, base.gradient_values) << family;
    EXPECT_GT(ck.recompute_time, SimTime(0)) << family;
    EXPECT_LE(peak(ck), peak(base)) << family;
  }
}

TEST(Checkpoint, OffloadPolicyOpsAreReloadedForTheReplay) {
  const Model m = tiny();
  TrainingOptions o = plain(Policy::Ferry);
  o.offload.min_bytes = Bytes(0);
  o.checkpoint = checkpoint_every(m, 1);
  o.checkpoint.op_policy.assign(m.ops.size(), OpPolicy::Offload);
  const TrainingRun r = train(m, o);
  expect_clean(r);
  EXPECT_EQ(r.gradient_values, train(m, plain()).gradient_values);
  EXPECT_GT(r.telemetry.offloaded, 0);
}

TEST(Checkpoint, ComposesWithOffloadOfTheRegionInputs) {
  const Model m = tiny();
  const TrainingRun base = train(m, plain());
  for (const Policy p : {Policy::Trl, Policy::Ferry}) {
    TrainingOptions o = plain(p);
    o.offload.min_bytes = Bytes(0);
    o.checkpoint = checkpoint_every(m, 1);
    const TrainingRun r = train(m, o);
    expect_clean(r);
    EXPECT_EQ(r.gradient_values, base.gradient_values) << policy_name(p);
    // Inside regions nothing reaches the offloader; the region inputs do, and come back
    // during the recompute.
    EXPECT_GT(r.telemetry.offloaded, 0) << policy_name(p);
    EXPECT_GT(r.telemetry.on_demand + r.telemetry.prefetched + r.telemetry.stash_hits, 0);
  }
}

TEST(Checkpoint, BackwardInsideARegionWhileItsForwardRuns) {
  const Model m = tiny();
  const CheckpointPlan layers = checkpoint_every(m, 1);
  const std::uint32_t inside = layers.regions[1].first_op + 3;  // mid-way through layer 1
  TrainingOptions base = plain();
  base.backward_inside_op = static_cast<std::int32_t>(inside);
  const TrainingRun reference = train(m, base);
  expect_clean(reference);
  for (const bool early : {true, false}) {
    TrainingOptions o = base;
    o.checkpoint = layers;
    o.checkpoint.global_early_stop = early;
    const TrainingRun r = train(m, o);
    expect_clean(r);
    EXPECT_EQ(r.gradient_values, reference.gradient_values);
    // One more replay per step: the region recomputed for the backward inside its forward.
    EXPECT_EQ(r.recomputations, 2 * static_cast<std::int64_t>(layers.regions.size() + 1));
  }
}

// A traced model lists the views of a storage where the storage is written (the rotary cos of
// a Hugging Face Llama, one view per layer): one op outputs the storage and views over the same
// bytes, and each layer reads its own view from outside its region.
Model shared_views_model() {
  Model m;
  m.name = "shared-views";
  auto tensor = [&](std::string name, std::int64_t size, TensorRole role, std::int32_t view_of) {
    m.tensors.push_back(ModelTensor{std::move(name), Bytes(size), DType::BF16, role, view_of,
                                    Bytes(0), false, Bytes(0), 0});
    return static_cast<std::uint32_t>(m.tensors.size() - 1);
  };
  auto op = [&](std::string name, std::int32_t layer, std::vector<std::uint32_t> inputs,
                std::vector<std::uint32_t> outputs, std::vector<std::uint32_t> saved) {
    ModelOp o;
    o.name = std::move(name);
    o.layer = layer;
    o.duration = SimTime(10'000);
    o.backward_duration = SimTime(20'000);
    o.inputs = std::move(inputs);
    o.outputs = std::move(outputs);
    o.saved = std::move(saved);
    m.ops.push_back(std::move(o));
  };
  const std::uint32_t x = tensor("x", 8192, TensorRole::Input, -1);
  const std::uint32_t table = tensor("table", 4096, TensorRole::Activation, -1);
  const std::uint32_t view0 = tensor("view0", 4096, TensorRole::Activation, 1);
  const std::uint32_t view1 = tensor("view1", 4096, TensorRole::Activation, 1);
  op("table", -1, {x}, {table, view0, view1}, {});
  std::uint32_t stream = x;
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    const std::uint32_t view = layer == 0 ? view0 : view1;
    const std::string p = "layers." + std::to_string(layer) + ".";
    const std::uint32_t mixed = tensor(p + "mul.out", 8192, TensorRole::Activation, -1);
    op(p + "mul", layer, {stream, view}, {mixed}, {stream, view});
    const std::uint32_t out = tensor(p + "act.out", 8192, TensorRole::Activation, -1);
    op(p + "act", layer, {mixed}, {out}, {mixed});
    stream = out;
  }
  const std::uint32_t loss = tensor("loss", 4, TensorRole::Activation, -1);
  op("loss", -1, {stream}, {loss}, {stream});
  m.loss = loss;
  return m;
}

TEST(Checkpoint, ViewsWrittenTogetherOverOneStorageReplayAsForwardSawThem) {
  const Model m = shared_views_model();
  ASSERT_TRUE(validate_model(m).ok());
  const TrainingRun base = train(m, plain());
  expect_clean(base);
  TrainingOptions o = plain();
  o.checkpoint = checkpoint_every(m, 1);
  ASSERT_EQ(o.checkpoint.regions.size(), 2U);
  const TrainingRun ck = train(m, o);
  expect_clean(ck);
  EXPECT_EQ(ck.gradient_values, base.gradient_values);
  EXPECT_GT(ck.recompute_time.ns(), 0);
}

TEST(Checkpoint, OverlappingRegionsAreRejected) {
  const Model m = tiny();
  TrainingOptions o = plain();
  o.checkpoint.regions = {CheckpointRegion{0, 4, false, std::nullopt},
                          CheckpointRegion{2, 6, false, std::nullopt}};
  auto run = simulate_training(m, testing::simple_profile(), o);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.error().message.find("overlap"), std::string::npos);
}

}  // namespace
}  // namespace ferry::sim
