// GPipe on simulated devices: balance, the layer split, the single-device reference, portals freed
// right after their last use, the direct copy of a long skip, checkpoint modes, determinism, bad
// options, planted faults, and the step times and peaks of two presets.

#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/sim/autograd/pipeline.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using testing::simple_profile;
using testing::tiny_gpt;

const CheckpointMode kModes[] = {CheckpointMode::Never, CheckpointMode::ExceptLast,
                                 CheckpointMode::Always};

// Every residual add of a transformer preset reads the block's input through a skip.
std::vector<SkipConnection> residual_skips(const Model& model) {
  std::vector<SkipConnection> skips;
  for (std::uint32_t k = 1; k < model.ops.size(); ++k) {
    const ModelOp& op = model.ops[k];
    if (op.name.find("residual") == std::string::npos) continue;
    const std::vector<std::uint32_t>& previous = model.ops[k - 1].outputs;
    for (const std::uint32_t t : op.inputs) {
      if (std::find(previous.begin(), previous.end(), t) == previous.end()) {
        skips.push_back(SkipConnection{t, k});
      }
    }
  }
  return skips;
}

DeviceProfile h100() {
  return load_device_profile(std::string(FERRY_SCENARIOS_DIR) + "/devices", "h100-sxm-pcie5")
      .value();
}

// x -> embed -> h0 -> a -> h1 | drop -> h2 -> b -> h3 | c -> h4 -> add(h4, h0) -> h5 -> loss;
// four ops of 15 us and three of 10 us: on three devices the only split with a 30 us bottleneck
// is [0, 2), [2, 4), [4, 7), and the skip h0 -> add runs from gpu0 straight to gpu2.
Model skip_model() {
  testing::ModelBuilder b;
  b.m.name = "skip";
  auto op = [&](std::string name, std::vector<std::uint32_t> in, std::vector<std::uint32_t> out,
                std::vector<std::uint32_t> saved, bool rng = false) {
    const SimTime forward(b.m.ops.size() < 4 ? 15'000 : 10'000);
    b.op(std::move(name), std::move(in), std::move(out), std::move(saved), forward,
         SimTime(2 * forward.ns()))
        .draws_rng = rng;
  };
  const auto x = b.tensor("x", 4096, TensorRole::Input);
  const auto w0 = b.tensor("w0", 2048, TensorRole::Param);
  const auto w1 = b.tensor("w1", 2048, TensorRole::Param);
  const auto w3 = b.tensor("w3", 2048, TensorRole::Param);
  const auto h0 = b.tensor("h0", 8192, TensorRole::Activation);
  const auto h1 = b.tensor("h1", 8192, TensorRole::Activation);
  const auto h2 = b.tensor("h2", 8192, TensorRole::Activation);
  const auto mask = b.tensor("mask", 4096, TensorRole::Activation);
  const auto h3 = b.tensor("h3", 8192, TensorRole::Activation);
  const auto h4 = b.tensor("h4", 8192, TensorRole::Activation);
  const auto h5 = b.tensor("h5", 8192, TensorRole::Activation);
  const auto loss = b.tensor("loss", 4, TensorRole::Activation);
  op("embed", {x, w0}, {h0}, {x, w0});
  op("a", {h0, w1}, {h1}, {h0, w1});
  op("drop", {h1}, {h2, mask}, {mask}, true);
  op("b", {h2, w3}, {h3}, {h2, w3});
  op("c", {h3}, {h4}, {h3});
  op("add", {h4, h0}, {h5}, {});
  op("loss", {h5}, {loss}, {h5});
  b.m.loss = loss;
  return b.m;
}

PipelineOptions options(std::int32_t devices, std::int32_t micro_batches, CheckpointMode mode,
                        std::vector<SkipConnection> skips) {
  PipelineOptions o;
  o.devices = devices;
  o.micro_batches = micro_batches;
  o.checkpoint = mode;
  o.skips = std::move(skips);
  return o;
}

std::string first_hazard(const PipelineRun& run) {
  if (run.hazards().empty()) return {};
  const Hazard& h = run.hazards().front();
  return std::string(run.sim.label(run.sim.ops()[h.first.value()].label)) + " / " +
         std::string(run.sim.label(run.sim.ops()[h.second.value()].label));
}

// Empty when every buffer a portal held was freed by the step, with nothing but frees and
// record_stream calls between its last kernel or copy and its free; else what went wrong.
std::string portal_free_problem(const PipelineRun& run) {
  for (const PortalLifetime& l : run.portal_lifetimes) {
    const std::string name = fmt::format("skip {} micro-batch {}{}", l.key.skip, l.key.micro_batch,
                                         l.gradient ? " (grad)" : "");
    if (!l.freed.valid()) return name + ": never freed";
    if (l.freed_at_step_end) return name + ": freed only when the step ended";
    if (!l.last_use.valid() || l.freed <= l.last_use) return name + ": freed before its use";
    if (l.freed_at < run.sim.ops()[l.last_use.value()].issued) return name + ": time runs back";
    for (std::uint32_t op = l.last_use.value() + 1; op < l.freed.value(); ++op) {
      const OpKind kind = run.sim.ops()[op].kind;
      if (kind != OpKind::Free && kind != OpKind::RecordStream) {
        return name + ": op " + std::to_string(op) + " (" +
               std::string(run.sim.label(run.sim.ops()[op].label)) +
               ") ran between its last use and its free";
      }
    }
  }
  return {};
}

// Activation bytes of one micro-batch that enter, cross or leave partition j, and the loss: a
// bound on what checkpointing the last micro-batch keeps or re-creates next to its recompute.
Bytes boundary_bytes(const Model& model, const std::vector<std::uint32_t>& starts,
                     std::uint32_t j) {
  const auto partition = [&](std::uint32_t op) {
    return static_cast<std::uint32_t>(std::upper_bound(starts.begin(), starts.end(), op) -
                                      starts.begin() - 1);
  };
  std::vector<std::int32_t> producer(model.tensors.size(), -1);
  for (std::uint32_t k = 0; k < model.ops.size(); ++k) {
    for (const auto t : model.ops[k].outputs) producer[t] = static_cast<std::int32_t>(k);
  }
  std::set<std::uint32_t> crossing;
  for (std::uint32_t k = 0; k < model.ops.size(); ++k) {
    for (const auto t : model.ops[k].inputs) {
      const auto base = static_cast<std::uint32_t>(
          model.tensors[t].view_of >= 0 ? model.tensors[t].view_of : static_cast<std::int32_t>(t));
      if (producer[base] < 0) continue;
      const std::uint32_t from = partition(static_cast<std::uint32_t>(producer[base]));
      const std::uint32_t to = partition(k);
      if (from < to && from <= j && j <= to) crossing.insert(base);
    }
  }
  Bytes sum = model.tensors[model.loss].bytes;
  for (const auto b : crossing) sum += model.tensors[b].bytes;
  return sum;
}

TEST(Balance, SplitsIntoContiguousRangesWithTheSmallestBottleneck) {
  Model m = skip_model();
  const std::int64_t durations[] = {1, 1, 1, 1, 4, 1, 1};
  for (std::size_t k = 0; k < m.ops.size(); ++k) m.ops[k].duration = SimTime(durations[k]);
  EXPECT_EQ(balance_by_duration(m, 1).value(), (std::vector<std::uint32_t>{0, 7}));
  EXPECT_EQ(balance_by_duration(m, 2).value(), (std::vector<std::uint32_t>{0, 4, 7}));
  EXPECT_EQ(balance_by_duration(m, 3).value(), (std::vector<std::uint32_t>{0, 4, 5, 7}));
  const auto seven = balance_by_duration(m, 7).value();
  EXPECT_EQ(seven, (std::vector<std::uint32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(Balance, RejectsMoreDevicesThanOps) {
  const auto result = balance_by_duration(skip_model(), 8);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error().message.find("between 1 and 7 devices"), std::string::npos);
  EXPECT_FALSE(balance_by_duration(skip_model(), 0).ok());
}

// torchtitan's default (generate_llm_fqn_per_model_part, input and output weight 1): layers + 2
// equivalents over the stages, the first (layers + 2) % stages one more, less the input on the
// first stage and the output on the last. 32 layers on 4 stages: 34 = 9 + 9 + 8 + 8.
TEST(Split, LayerCountsAreTorchtitansDefault) {
  EXPECT_EQ(layers_per_stage(32, 1).value(), (std::vector<std::int32_t>{32}));
  EXPECT_EQ(layers_per_stage(32, 2).value(), (std::vector<std::int32_t>{16, 16}));
  EXPECT_EQ(layers_per_stage(32, 4).value(), (std::vector<std::int32_t>{8, 9, 8, 7}));
  EXPECT_EQ(layers_per_stage(32, 8).value(), (std::vector<std::int32_t>{4, 5, 4, 4, 4, 4, 4, 3}));
  EXPECT_EQ(layers_per_stage(80, 8).value(),
            (std::vector<std::int32_t>{10, 11, 10, 10, 10, 10, 10, 9}));
  EXPECT_EQ(layers_per_stage(2, 4).value(), (std::vector<std::int32_t>{0, 1, 1, 0}));
  const auto too_many = layers_per_stage(2, 5);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.error().message.find("1 to 4 stages, not 5"), std::string::npos);
}

// The layers each stage of a preset holds, counted from its ops' ModelOp::layer.
std::vector<std::int32_t> layer_counts(const std::vector<StageSpan>& spans) {
  std::vector<std::int32_t> counts;
  for (const StageSpan& s : spans) {
    counts.push_back(s.first_layer < 0 ? 0 : s.last_layer - s.first_layer + 1);
  }
  return counts;
}

TEST(Split, LayersCutAPresetAsTorchtitanDoes) {
  const Model model = model_preset("llama3-8b-s4096").value();
  const auto n = static_cast<std::uint32_t>(model.ops.size());
  for (const std::int32_t stages : {4, 8}) {
    SCOPED_TRACE(stages);
    const Partitions parts = partition_model(model, stages, PipelineSplit{}).value();
    EXPECT_EQ(parts.split, "layers");
    const std::vector<StageSpan> spans = stage_spans(model, parts.starts);
    EXPECT_EQ(layer_counts(spans), layers_per_stage(32, stages).value());
    // The embedding goes with the first stage, the norm, head and loss with the last; every
    // other stage starts at its first layer's first op.
    EXPECT_EQ(spans.front().begin, 0U);
    EXPECT_LT(model.ops[0].layer, 0);
    EXPECT_EQ(spans.back().end, n);
    EXPECT_LT(model.ops[n - 1].layer, 0);
    for (std::size_t s = 1; s < spans.size(); ++s) {
      EXPECT_EQ(model.ops[spans[s].begin].layer, spans[s].first_layer);
      EXPECT_NE(model.ops[spans[s].begin - 1].layer, spans[s].first_layer);
      EXPECT_EQ(spans[s].first_layer, spans[s - 1].last_layer + 1);
    }
  }
}

TEST(Split, InterleavedStagesFollowTheLayerSplitAroundTheDevices) {
  // tiny-gpt's 2 layers on 2 devices x 2 virtual stages: torchtitan's [0, 1, 1, 0], the
  // embedding alone on stage 0 (gpu0) and the norm, head and loss alone on stage 3 (gpu1).
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  PipelineOptions o;
  o.devices = 2;
  o.virtual_stages = 2;
  o.micro_batches = 4;
  o.schedule = Schedule::Interleaved1F1B;
  const PipelineRun run = simulate_pipeline(model, device, o).value();
  ASSERT_FALSE(run.failure) << run.failure->message;
  EXPECT_EQ(run.split, "layers");
  EXPECT_EQ(layer_counts(run.stages), (std::vector<std::int32_t>{0, 1, 1, 0}));
  EXPECT_EQ(stage_spans(model, run.partition_starts), run.stages);
  EXPECT_EQ(run.param_grads, simulate_reference(model, device, o).value().param_grads);
  const std::string looped = stage_spans_text(run.stages, Schedule::Interleaved1F1B, 2);
  EXPECT_NE(looped.find("s1 gpu1 ops"), std::string::npos) << looped;
  EXPECT_NE(looped.find("s2 gpu0 ops"), std::string::npos) << looped;
  // Under zbv the stages sit in a V: stage 2 on gpu1, stage 3 on gpu0.
  const std::string v = stage_spans_text(run.stages, Schedule::ZeroBubbleV, 2);
  EXPECT_NE(v.find("s2 gpu1 ops"), std::string::npos) << v;
  EXPECT_NE(v.find("s3 gpu0 ops"), std::string::npos) << v;
  // GPT-2 small's 12 layers on 4 devices x 2: torchtitan's 14 equivalents over 8 stages,
  // [1, 2, 2, 2, 2, 2, 1, 0], the last stage the norm, head and loss alone.
  Model gpt2 = model_preset("gpt2-small-s1024").value();
  assign_roofline_durations(gpt2, h100());
  o.devices = 4;
  o.micro_batches = 8;
  const PipelineRun interleaved = simulate_pipeline(gpt2, h100(), o).value();
  ASSERT_FALSE(interleaved.failure) << interleaved.failure->message;
  EXPECT_EQ(layer_counts(interleaved.stages), (std::vector<std::int32_t>{1, 2, 2, 2, 2, 2, 1, 0}));
  EXPECT_EQ(layer_counts(interleaved.stages), layers_per_stage(12, 8).value());
  EXPECT_TRUE(interleaved.hazards().empty());
  EXPECT_EQ(interleaved.peak_allocated.size(), 4U);
}

TEST(Split, ExplicitPointsAreHonoured) {
  const Model model = model_preset("llama3-8b-s4096").value();
  const PipelineSplit split = parse_split("4,20,28").value();
  EXPECT_EQ(split.rule, PipelineSplit::Rule::Points);
  EXPECT_EQ(split_name(split), "4,20,28");
  const Partitions parts = partition_model(model, 4, split).value();
  const std::vector<StageSpan> spans = stage_spans(model, parts.starts);
  ASSERT_EQ(spans.size(), 4U);
  EXPECT_EQ(spans[0].first_layer, 0);
  EXPECT_EQ(spans[0].last_layer, 3);
  EXPECT_EQ(spans[1].first_layer, 4);
  EXPECT_EQ(spans[1].last_layer, 19);
  EXPECT_EQ(spans[2].first_layer, 20);
  EXPECT_EQ(spans[2].last_layer, 27);
  EXPECT_EQ(spans[3].first_layer, 28);
  EXPECT_EQ(spans[3].last_layer, 31);
  // The layer split spelled out as points cuts the same ops.
  EXPECT_EQ(partition_model(model, 4, parse_split("8,17,25").value()).value().starts,
            partition_model(model, 4, PipelineSplit{}).value().starts);
  // Point 0: the first stage holds the embedding alone; point 32, the last the output alone.
  const auto ends =
      stage_spans(model, partition_model(model, 3, parse_split("0,32").value()).value().starts);
  EXPECT_EQ(ends[0].first_layer, -1);
  EXPECT_EQ(ends[1].first_layer, 0);
  EXPECT_EQ(ends[1].last_layer, 31);
  EXPECT_EQ(ends[2].first_layer, -1);
}

TEST(Split, BadSplitsAreRefusedNamingTheFlag) {
  const Model llama = model_preset("llama3-8b-s4096").value();
  const auto refused = [](std::string_view text, std::int32_t stages, std::string_view what,
                          const Model& model) {
    SCOPED_TRACE(text);
    auto split = parse_split(text);
    std::string message;
    if (!split.ok()) {
      message = split.error().message;
    } else {
      auto parts = partition_model(model, stages, split.value());
      ASSERT_FALSE(parts.ok());
      message = parts.error().message;
    }
    EXPECT_NE(message.find("--split"), std::string::npos) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
  };
  refused("8,16", 4, "gives 2 split points for 4 stages; give 3", llama);
  refused("8,16,24,30", 4, "gives 4 split points for 4 stages; give 3", llama);
  refused("16,8,24", 4, "8 does not follow 16", llama);
  refused("8,8,24", 4, "8 does not follow 8", llama);
  refused("8,16,33", 4, "not an increasing layer index from 0 to 32", llama);
  refused("8,x,24", 4, "\"x\" is not a layer index", llama);
  refused("8,,24", 4, "\"\" is not a layer index", llama);
  refused("", 4, "give layers, balanced", llama);
  refused("even", 4, "give layers, balanced", llama);
  refused("-1,8,16", 4, "is not a layer index", llama);
  refused("layers", 35, "use --split balanced, or fewer stages", llama);
  // A model of four layers of two ops each and no op outside them: point 0 leaves the first
  // stage nothing, and the layer split of five stages ([1, 1, 1, 1, 0]) the last.
  Model layered = testing::equal_layers(8);
  for (std::size_t k = 0; k < layered.ops.size(); ++k) {
    layered.ops[k].layer = static_cast<std::int32_t>(k / 2);
  }
  refused("0,2", 3, "stage 0 of 3 would hold no op", layered);
  refused("layers", 5, "stage 4 of 5 would hold no op", layered);
  EXPECT_EQ(partition_model(layered, 3, PipelineSplit{}).value().starts,
            (std::vector<std::uint32_t>{0, 2, 6, 8}));
  refused("2,4", 3, "carry no layers", skip_model());
}

TEST(Split, AModelWithoutLayersIsBalancedAndSaysSo) {
  const Model model = skip_model();
  const Partitions parts = partition_model(model, 3, PipelineSplit{}).value();
  EXPECT_EQ(parts.starts, balance_by_duration(model, 3).value());
  EXPECT_EQ(parts.split, "balanced (the model's ops carry no layers)");
  // Points need layers to split at.
  const auto points = partition_model(model, 3, parse_split("2,4").value());
  ASSERT_FALSE(points.ok());
  EXPECT_NE(points.error().message.find("--split 2,4: the model's ops carry no layers, so"),
            std::string::npos);
  const Partitions balanced = partition_model(model, 3, parse_split("balanced").value()).value();
  EXPECT_EQ(balanced.starts, parts.starts);
  EXPECT_EQ(balanced.split, "balanced");
}

// Layers out of op order (an encoder-decoder numbered twice) cannot be counted: the layer split
// balances them instead and says why; explicit points are refused.
TEST(Split, LayersOutOfOpOrderAreBalancedOrRefused) {
  Model model = model_preset("tiny-gpt").value();
  std::size_t last = 0;
  for (std::size_t k = 0; k < model.ops.size(); ++k) {
    if (model.ops[k].layer >= 0) last = k;
  }
  ASSERT_EQ(model.ops[last].layer, 1);
  model.ops[last].layer = 0;  // a layer-0 op after layer 1's
  const Partitions parts = partition_model(model, 2, PipelineSplit{}).value();
  EXPECT_EQ(parts.starts, balance_by_duration(model, 2).value());
  EXPECT_NE(parts.split.find("balanced (op '"), std::string::npos) << parts.split;
  EXPECT_NE(parts.split.find("of layer 0 follows layer 1: its layers are not contiguous)"),
            std::string::npos)
      << parts.split;
  const auto points = partition_model(model, 2, parse_split("1").value());
  ASSERT_FALSE(points.ok());
  EXPECT_NE(points.error().message.find("--split 1: op '"), std::string::npos);
  EXPECT_NE(points.error().message.find("use --split balanced"), std::string::npos);
}

TEST(Pipeline, TinyGptMatchesTheSingleDeviceRunOnTwoToFourDevices) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  for (std::int32_t devices = 2; devices <= 4; ++devices) {
    for (const CheckpointMode mode : kModes) {
      SCOPED_TRACE(fmt::format("{} devices, checkpoint {}", devices, checkpoint_mode_name(mode)));
      const PipelineOptions o = options(devices, 4, mode, residual_skips(model));
      const PipelineRun run = simulate_pipeline(model, device, o).value();
      const PipelineRun reference = simulate_reference(model, device, o).value();
      ASSERT_FALSE(run.failure) << run.failure->message;
      EXPECT_EQ(run.partition_starts.size(), static_cast<std::size_t>(devices) + 1);
      EXPECT_TRUE(run.hazards().empty()) << first_hazard(run);
      EXPECT_TRUE(run.content_mismatches().empty());
      EXPECT_TRUE(reference.content_mismatches().empty());
      EXPECT_FALSE(run.param_grads.empty());
      EXPECT_EQ(run.param_grads, reference.param_grads);
      EXPECT_EQ(run.buffers_left, 0);
      EXPECT_EQ(reference.buffers_left, 0);
      EXPECT_GT(run.sim.copied().peer.count(), 0);
    }
  }
}

TEST(Pipeline, PortalsAreFreedRightAfterTheirLastUse) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  for (const std::int32_t devices : {2, 4}) {
    for (const CheckpointMode mode : kModes) {
      SCOPED_TRACE(fmt::format("{} devices, checkpoint {}", devices, checkpoint_mode_name(mode)));
      const PipelineRun run =
          simulate_pipeline(model, device, options(devices, 4, mode, residual_skips(model)))
              .value();
      ASSERT_FALSE(run.failure) << run.failure->message;
      EXPECT_FALSE(run.portal_lifetimes.empty());
      EXPECT_EQ(portal_free_problem(run), "");
      EXPECT_EQ(run.portal_frees, static_cast<std::int64_t>(run.portal_lifetimes.size()));
      EXPECT_EQ(run.portal_stats.live, 0);
    }
  }
}

TEST(Pipeline, LongSkipIsCopiedStraightToTheConsumersDevice) {
  const Model model = skip_model();
  const PipelineRun run =
      simulate_pipeline(model, simple_profile(),
                        options(3, 2, CheckpointMode::Never, {SkipConnection{4, 5}}))
          .value();
  ASSERT_FALSE(run.failure) << run.failure->message;
  EXPECT_EQ(run.partition_starts, (std::vector<std::uint32_t>{0, 2, 4, 7}));
  std::int32_t forward = 0;
  std::int32_t backward = 0;
  for (const OpRecord& op : run.sim.ops()) {
    if (op.kind != OpKind::Copy) continue;
    const std::string label(run.sim.label(op.label));
    if (label.find("h0") == std::string::npos) continue;
    // h0 and its gradient never travel through gpu1: PortalCopy goes gpu0 -> gpu2, its
    // backward gpu2 -> gpu0, each on the copy stream of that pair.
    if (label.find("portal h0 gpu0->gpu2") != std::string::npos) {
      EXPECT_EQ(run.sim.stream_name(op.stream), "copy gpu0->gpu2");
      ++forward;
    } else {
      EXPECT_NE(label.find("portal h0.grad gpu2->gpu0"), std::string::npos) << label;
      EXPECT_EQ(run.sim.stream_name(op.stream), "copy gpu2->gpu0");
      ++backward;
    }
  }
  EXPECT_EQ(forward, 2);  // one per micro-batch
  EXPECT_EQ(backward, 2);
  EXPECT_EQ(portal_free_problem(run), "");
}

TEST(Pipeline, CheckpointedSkipCopyLivesUntilTheConsumersRecompute) {
  const Model model = skip_model();
  for (const CheckpointMode mode : {CheckpointMode::Never, CheckpointMode::Always}) {
    const PipelineRun run =
        simulate_pipeline(model, simple_profile(), options(3, 2, mode, {SkipConnection{4, 5}}))
            .value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    for (const PortalLifetime& l : run.portal_lifetimes) {
      if (l.gradient || l.device != DeviceId(2)) continue;
      const std::string last(run.sim.label(run.sim.ops()[l.last_use.value()].label));
      const std::string expected = fmt::format(
          "mb{} add{}", l.key.micro_batch, mode == CheckpointMode::Always ? " (recompute)" : "");
      EXPECT_EQ(last, expected) << checkpoint_mode_name(mode);
    }
  }
}

TEST(Pipeline, PortalCountsFollowTheTensorLives) {
  const Model model = skip_model();
  const std::int64_t m = 4;
  // (puts, uses) per cross-partition skip: a forward stash with blue and orange, and under
  // checkpoint a re-stash with the recomputed blue and the recomputed orange.
  const std::pair<CheckpointMode, std::pair<std::int64_t, std::int64_t>> expected[] = {
      {CheckpointMode::Never, {m, 2 * m}},
      {CheckpointMode::ExceptLast, {2 * m - 1, 4 * m - 2}},
      {CheckpointMode::Always, {2 * m, 4 * m}},
  };
  for (const auto& [mode, counts] : expected) {
    const PipelineRun run =
        simulate_pipeline(model, simple_profile(), options(3, 4, mode, {SkipConnection{4, 5}}))
            .value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    EXPECT_EQ(run.portal_stats.puts, counts.first) << checkpoint_mode_name(mode);
    EXPECT_EQ(run.portal_stats.uses, counts.second) << checkpoint_mode_name(mode);
    EXPECT_EQ(run.portal_stats.copies, m);
    EXPECT_EQ(run.portal_stats.grad_puts, 2 * m);  // the orange's, then PortalCopy's
    EXPECT_EQ(run.portal_stats.grad_uses, 2 * m);  // PortalCopy's, then the blue's
    EXPECT_EQ(run.portal_stats.live, 0);
    // Without checkpoint a portal lives from the stash on gpu0 to the pop on gpu2, two clocks
    // later: three micro-batches at once. Under checkpoint every micro-batch's copy waits in its
    // portal for the recompute.
    EXPECT_EQ(run.portal_stats.max_live, mode == CheckpointMode::Never ? 3 : m);
  }
}

TEST(Pipeline, CheckpointModesTradeMemoryForRecompute) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  SimTime forward;
  for (const ModelOp& op : model.ops) forward += op.duration;
  for (const std::int32_t devices : {2, 4}) {
    std::vector<PipelineRun> runs;
    for (const CheckpointMode mode : kModes) {
      // Balanced, every stage holds a block to checkpoint; by layers tiny-gpt's first of four
      // stages is the embedding alone, whose checkpoint keeps its input and saves nothing.
      PipelineOptions o = options(devices, 4, mode, residual_skips(model));
      o.split.rule = PipelineSplit::Rule::Balanced;
      runs.push_back(simulate_pipeline(model, device, o).value());
      ASSERT_FALSE(runs.back().failure);
    }
    const PipelineRun& never = runs[0];
    const PipelineRun& except_last = runs[1];
    const PipelineRun& always = runs[2];
    EXPECT_EQ(never.recompute_time, SimTime(0));
    EXPECT_EQ(except_last.recompute_time, SimTime(3 * forward.ns()));
    EXPECT_EQ(always.recompute_time, SimTime(4 * forward.ns()));
    EXPECT_LT(never.step_time, except_last.step_time);
    EXPECT_LT(except_last.step_time, always.step_time);
    for (std::uint32_t j = 0; j < static_cast<std::uint32_t>(devices); ++j) {
      SCOPED_TRACE(fmt::format("{} devices, gpu{}", devices, j));
      EXPECT_GT(never.peak_activations[j], except_last.peak_activations[j]);
      EXPECT_GT(never.peak_allocated[j], except_last.peak_allocated[j]);
      // Checkpointing the last micro-batch too saves nothing at the peak (that micro-batch is
      // materialized either way, by its forward or by its recompute) and may cost up to its
      // partition's boundary tensors: Checkpoint keeps its whole input until the backward,
      // where a plain forward frees what no op saves; its skip copies wait in their portals for
      // the recompute (life 3); the recompute re-creates outputs that are already held.
      EXPECT_LE(always.peak_activations[j], except_last.peak_activations[j] +
                                                boundary_bytes(model, always.partition_starts, j));
    }
  }
}

// Note [A parameter's gradients]: a stage keeps its gradients through the step, and each
// backward node makes its gradient of a weight before adding it in. Stage 0 holds its 1 MiB
// weight, the weight's kept gradient and, in the weight's backward, the new one.
TEST(Pipeline, AWeightsNewGradientLivesBesideTheKeptOne) {
  testing::ModelBuilder b;
  b.m.name = "weights";
  const auto x = b.tensor("x", 1024, TensorRole::Input);
  const auto w0 = b.tensor("w0", 1 << 20, TensorRole::Param);
  const auto w1 = b.tensor("w1", 1024, TensorRole::Param);
  const auto h0 = b.tensor("h0", 1024, TensorRole::Activation);
  const auto loss = b.tensor("loss", 4, TensorRole::Activation);
  b.op("a", {x, w0}, {h0}, {x, w0}, SimTime(10'000), SimTime(20'000));
  b.op("b", {h0, w1}, {loss}, {h0, w1}, SimTime(10'000), SimTime(20'000));
  b.m.loss = loss;
  const PipelineRun run =
      simulate_pipeline(b.m, simple_profile(), options(2, 2, CheckpointMode::Never, {})).value();
  ASSERT_FALSE(run.failure) << run.failure->message;
  EXPECT_TRUE(run.hazards().empty()) << first_hazard(run);
  const double mib = static_cast<double>(run.peak_allocated[0].count()) / (1 << 20);
  EXPECT_GE(mib, 3.0);
  EXPECT_LT(mib, 3.1);
}

TEST(Pipeline, OutOfMemoryStopsTheStepWithTheAllocatorsReport) {
  DeviceProfile small = simple_profile();
  small.memory = Bytes(4LL << 20);  // two small-pool segments: the first large one fails
  Model model = skip_model();
  model.tensors[9].bytes = Bytes(8LL << 20);  // h4, produced on gpu2
  const PipelineRun run =
      simulate_pipeline(model, small, options(3, 2, CheckpointMode::Never, {SkipConnection{4, 5}}))
          .value();
  ASSERT_TRUE(run.failure);
  EXPECT_NE(run.failure->message.find("out of memory"), std::string::npos) << run.failure->message;
  EXPECT_EQ(run.failure->kind, FailureKind::OutOfMemory);
  EXPECT_GT(run.buffers_left, 0);
}

TEST(Pipeline, ReferenceRunsEveryMicroBatchOnOneStream) {
  const Model model = skip_model();
  const PipelineRun reference =
      simulate_reference(model, simple_profile(),
                         options(3, 2, CheckpointMode::Always, {SkipConnection{4, 5}}))
          .value();
  ASSERT_FALSE(reference.failure);
  EXPECT_EQ(reference.sim.device_count(), 1U);
  EXPECT_EQ(reference.partition_starts, (std::vector<std::uint32_t>{0, 7}));
  EXPECT_EQ(reference.recompute_time, SimTime(0));
  EXPECT_EQ(reference.portal_stats.puts, 0);
  EXPECT_EQ(reference.sim.copied().peer.count(), 0);
  for (const OpRecord& op : reference.sim.ops()) {
    if (op.kind == OpKind::Kernel) {
      EXPECT_EQ(reference.sim.stream_name(op.stream), "compute");
    }
  }
}

TEST(Pipeline, TwoRunsAreIdentical) {
  const DeviceProfile device = simple_profile();
  const Model model = tiny_gpt(device);
  const PipelineOptions o = options(3, 3, CheckpointMode::ExceptLast, residual_skips(model));
  const PipelineRun a = simulate_pipeline(model, device, o).value();
  const PipelineRun b = simulate_pipeline(model, device, o).value();
  EXPECT_EQ(a.step_time, b.step_time);
  EXPECT_EQ(a.peak_allocated, b.peak_allocated);
  EXPECT_EQ(a.param_grads, b.param_grads);
  ASSERT_EQ(a.sim.ops().size(), b.sim.ops().size());
  for (std::size_t op = 0; op < a.sim.ops().size(); ++op) {
    EXPECT_EQ(a.sim.label(a.sim.ops()[op].label), b.sim.label(b.sim.ops()[op].label));
    EXPECT_EQ(a.sim.ops()[op].end, b.sim.ops()[op].end);
  }
}

TEST(Pipeline, RejectsBadOptionsWithTheirReason) {
  const Model model = skip_model();
  const auto error = [&](PipelineOptions o) {
    const auto run = simulate_pipeline(model, simple_profile(), o);
    return run.ok() ? std::string() : run.error().message;
  };
  EXPECT_NE(error(options(2, 2, CheckpointMode::Never, {SkipConnection{5, 5}}))
                .find("does not read 'h1'"),
            std::string::npos);
  EXPECT_NE(
      error(options(2, 2, CheckpointMode::Never, {SkipConnection{1, 0}})).find("not an activation"),
      std::string::npos);
  EXPECT_NE(error(options(2, 2, CheckpointMode::Never, {SkipConnection{4, 5}, {4, 5}}))
                .find("repeats skip 0"),
            std::string::npos);
  EXPECT_NE(
      error(options(2, 2, CheckpointMode::Never, {SkipConnection{99, 5}})).find("out of range"),
      std::string::npos);
  EXPECT_NE(error(options(2, 0, CheckpointMode::Never, {})).find("micro_batches is 0"),
            std::string::npos);
  EXPECT_NE(error(options(8, 2, CheckpointMode::Never, {})).find("7 ops into 8 partitions"),
            std::string::npos);
}

TEST(PipelineFault, DroppedRngRestoreRecomputesOtherNumbers) {
  const Model model = skip_model();
  PipelineOptions o = options(3, 2, CheckpointMode::Always, {SkipConnection{4, 5}});
  PipelineFaults faults;
  faults.skip_rng_restore = true;
  const PipelineRun run = simulate_pipeline(model, simple_profile(), o, faults).value();
  const PipelineRun reference = simulate_reference(model, simple_profile(), o).value();
  EXPECT_FALSE(run.content_mismatches().empty());
  EXPECT_NE(run.param_grads, reference.param_grads);
}

TEST(PipelineFault, DroppedPortalCopyWaitIsARace) {
  const Model model = skip_model();
  PipelineOptions o = options(3, 2, CheckpointMode::Never, {SkipConnection{4, 5}});
  PipelineFaults faults;
  faults.skip_portal_copy_wait = true;
  EXPECT_FALSE(simulate_pipeline(model, simple_profile(), o, faults).value().hazards().empty());
  faults = {};
  faults.skip_portal_arrival_wait = true;
  EXPECT_FALSE(simulate_pipeline(model, simple_profile(), o, faults).value().hazards().empty());
}

TEST(PipelineFault, WrongTensorLifeStopsTheStepWithThePortalError) {
  const Model model = skip_model();
  PipelineOptions o = options(3, 2, CheckpointMode::Always, {SkipConnection{4, 5}});
  PipelineFaults faults;
  faults.portal.fixed_life = true;
  const PipelineRun run = simulate_pipeline(model, simple_profile(), o, faults).value();
  ASSERT_TRUE(run.failure);
  EXPECT_NE(run.failure->message.find("tensor in portal has been removed"), std::string::npos);
  o.checkpoint = CheckpointMode::Never;  // life 2 is right without checkpoint
  EXPECT_FALSE(simulate_pipeline(model, simple_profile(), o).value().failure);
}

// The figures quoted in docs/pipeline.md: step time and peak allocated bytes per device of one
// step with 4 micro-batches on the H100 profile, residual adds as skips.
TEST(PipelineFigures, PresetsOnH100) {
  const DeviceProfile device = h100();
  for (const char* preset : {"tiny-gpt", "gpt2-small-s1024"}) {
    Model model = model_preset(preset).value();
    assign_roofline_durations(model, device);
    for (const std::int32_t devices : {2, 4}) {
      for (const CheckpointMode mode : kModes) {
        const PipelineOptions o = options(devices, 4, mode, residual_skips(model));
        const PipelineRun run = simulate_pipeline(model, device, o).value();
        ASSERT_FALSE(run.failure) << run.failure->message;
        EXPECT_TRUE(run.hazards().empty()) << first_hazard(run);
        EXPECT_TRUE(run.content_mismatches().empty());
        const PipelineRun reference = simulate_reference(model, device, o).value();
        EXPECT_EQ(run.param_grads, reference.param_grads);
        std::string peaks;
        for (const Bytes b : run.peak_allocated) {
          peaks += fmt::format(" {:.1f}", static_cast<double>(b.count()) / (1 << 20));
        }
        std::cout << fmt::format(
            "{} {} devices {}: step {} us (one device, sequential: {} us), recompute {} us, "
            "peak MiB{}\n",
            preset, devices, checkpoint_mode_name(mode), run.step_time.ns() / 1000,
            reference.step_time.ns() / 1000, run.recompute_time.ns() / 1000, peaks);
      }
    }
  }
}

}  // namespace
}  // namespace ferry::sim
