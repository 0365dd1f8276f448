// tensor_parallel_model (Note [A rank's model] in rank_model.cpp): one rank's model under
// tensor and sequence parallelism, checked against the sizes torchtitan's plan gives a rank,
// computed here from each preset's shape.

#include "ferry/sim/workload/rank_model.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "plan_replay.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

Model preset(const std::string& name) {
  auto model = model_preset(name);
  EXPECT_TRUE(model.ok()) << name;
  return model.ok() ? model.value() : Model{};
}

TransformerShape shape_of(const std::string& name) {
  auto shape = model_preset_shape(name);
  EXPECT_TRUE(shape.ok()) << name;
  return shape.ok() ? shape.value() : TransformerShape{};
}

Bytes param_bytes(const Model& model) {
  Bytes sum(0);
  for (const ModelTensor& t : model.tensors) {
    if (t.role == TensorRole::Param && t.view_of < 0) sum += t.bytes;
  }
  return sum;
}

std::int64_t flops_of_layer(const Model& model, std::int32_t layer) {
  std::int64_t sum = 0;
  for (const ModelOp& op : model.ops) {
    if (op.layer == layer) sum += op.flops + op.backward_flops;
  }
  return sum;
}

/// The collective ops of each layer (-1: outside the layers) on `axis`, as "kind kind" counts.
std::map<std::int32_t, std::map<std::string, int>> collectives(const Model& model,
                                                               MeshAxis axis = MeshAxis::Tensor) {
  std::map<std::int32_t, std::map<std::string, int>> out;
  for (const ModelOp& op : model.ops) {
    if (!op.collective.any() || op.collective.axis != axis) continue;
    ++out[op.layer][std::string(collective_kind_name(*op.collective.forward)) + "/" +
                    std::string(collective_kind_name(*op.collective.backward))];
  }
  return out;
}

// A device quick enough for the presets, with an intra-node link.
DeviceProfile rank_device() {
  DeviceProfile device = testing::simple_profile();
  device.flops_per_s = 100'000'000'000'000;
  device.memory = Bytes(std::int64_t{1} << 40);
  device.collectives.intra_node = {Bandwidth(100'000'000'000), SimTime(2000)};
  return device;
}

// `rank` trains two steps with offload, without and with checkpointing every layer: clean, its
// collectives on `stream`.
void trains_clean(Model rank, const std::string& stream) {
  const DeviceProfile device = rank_device();
  ASSERT_TRUE(check_roofline(rank, device).ok());
  assign_roofline_durations(rank, device);
  for (const bool checkpoint : {false, true}) {
    SCOPED_TRACE(checkpoint);
    TrainingOptions options;
    options.steps = 2;
    options.offload.policy = Policy::Ferry;
    options.offload.min_bytes = Bytes(0);
    if (checkpoint) options.checkpoint = checkpoint_every(rank, 1);
    auto run = simulate_training(rank, device, options);
    ASSERT_TRUE(run.ok()) << run.error().message;
    ASSERT_FALSE(run.value().failure) << run.value().failure->message;
    const Simulator& sim = run.value().sim;
    EXPECT_TRUE(sim.hazards().empty());
    EXPECT_TRUE(sim.content_mismatches().empty());
    const auto on_stream = std::ranges::count_if(sim.ops(), [&](const OpRecord& op) {
      return op.kind == OpKind::Kernel && op.collective && sim.stream_name(op.stream) == stream;
    });
    EXPECT_GT(on_stream, 0);
  }
}

// The time of `rank`'s second step on rank_device, without offload or checkpointing.
SimTime step_time(Model rank) {
  const DeviceProfile device = rank_device();
  assign_roofline_durations(rank, device);
  TrainingOptions options;
  options.steps = 2;  // the second: the caching allocator holds its segments
  options.offload.policy = Policy::None;
  auto run = simulate_training(rank, device, options);
  if (!run.ok() || run.value().failure || run.value().steps.empty()) {
    ADD_FAILURE() << "the step did not run";
    return SimTime(0);
  }
  const StepTimes& step = run.value().steps.back();
  return step.end - step.start;
}

TEST(TensorParallelModel, OneRankRunsTheWholeModel) {
  const Model whole = preset("tiny-llama");
  auto rank = tensor_parallel_model(whole, 1);
  ASSERT_TRUE(rank.ok());
  EXPECT_EQ(rank.value(), whole);
}

// A Llama rank holds 1/tp of every projection, of the embedding and of the head, and all of
// each norm weight; every op of a layer does 1/tp of its work.
TEST(TensorParallelModel, ALlamaRankHoldsItsShareAsTorchtitansPlanCutsIt) {
  for (const std::string name : {"tiny-llama", "llama3-8b-s8192"}) {
    const TransformerShape x = shape_of(name);
    const Model whole = preset(name);
    for (const std::int32_t tp : {2, 4, 8}) {
      SCOPED_TRACE(name + " at tp " + std::to_string(tp));
      if (x.kv_heads % tp != 0) continue;
      auto cut = tensor_parallel_model(whole, tp);
      ASSERT_TRUE(cut.ok()) << cut.error().message;
      const Model& rank = cut.value();
      ASSERT_TRUE(validate_model(rank).ok()) << validate_model(rank).error().message;
      const std::int64_t h = x.hidden;
      const std::int64_t kv = x.kv_heads * (x.hidden / x.heads);
      const std::int64_t cut_elements =
          2 * x.vocab * h + x.layers * (h * (h + 2 * kv) + h * h + 3 * h * x.ffn);
      const std::int64_t norm_elements = (2 * x.layers + 1) * h;
      EXPECT_EQ(param_bytes(rank), Bytes((cut_elements / tp + norm_elements) * 2));
      for (std::int32_t layer = 0; layer < x.layers; ++layer) {
        EXPECT_EQ(flops_of_layer(rank, layer) * tp, flops_of_layer(whole, layer)) << layer;
      }
      // Per layer: the norms' outputs gathered before the projections that read them, the
      // projections' outputs scattered back; the embedding's partial sums scattered, the final
      // norm gathered before the head.
      const auto counts = collectives(rank);
      for (std::int32_t layer = 0; layer < x.layers; ++layer) {
        EXPECT_EQ(counts.at(layer), (std::map<std::string, int>{{"all_gather/reduce_scatter", 2},
                                                                {"reduce_scatter/all_gather", 2}}));
      }
      EXPECT_EQ(counts.at(-1), (std::map<std::string, int>{{"all_gather/reduce_scatter", 1},
                                                           {"reduce_scatter/all_gather", 1}}));
      // Saved per layer: what the whole layer saves, 1/tp of it, but for the two gathered norm
      // outputs the projections save whole (2sbh bytes each at 16 bits), as DTensor saves them.
      const Bytes gathered(2 * 2 * x.sequence * x.micro_batch * h);
      for (std::int32_t layer = 0; layer < x.layers; ++layer) {
        const Bytes all = saved_activation_bytes(whole, layer);
        EXPECT_EQ(saved_activation_bytes(rank, layer),
                  gathered + Bytes((all - gathered).count() / tp))
            << layer;
      }
    }
  }
}

TEST(TensorParallelModel, AGptRankCutsTheTiedTableOnceAndItsDropoutsByTokens) {
  const TransformerShape x = shape_of("tiny-gpt");
  const Model whole = preset("tiny-gpt");
  for (const std::int32_t tp : {2, 4}) {
    SCOPED_TRACE(tp);
    auto cut = tensor_parallel_model(whole, tp);
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    const std::int64_t h = x.hidden;
    // Cut: the table (the head's weight too), qkv's weight and bias, proj's weight, fc1's
    // weight and bias, fc2's weight. Whole: the position table, the norms, the rowwise biases.
    const std::int64_t cut_elements =
        x.vocab * h + x.layers * (3 * h * h + 3 * h + h * h + h * x.ffn + x.ffn + x.ffn * h);
    const std::int64_t whole_elements = x.sequence * h + x.layers * (4 * h + 2 * h) + 2 * h;
    EXPECT_EQ(param_bytes(rank), Bytes((cut_elements / tp + whole_elements) * 2));
    const auto counts = collectives(rank);
    EXPECT_EQ(counts.at(0), (std::map<std::string, int>{{"all_gather/reduce_scatter", 2},
                                                        {"reduce_scatter/all_gather", 2}}));
    for (std::int32_t layer = 0; layer < x.layers; ++layer) {
      EXPECT_EQ(flops_of_layer(rank, layer) * tp, flops_of_layer(whole, layer)) << layer;
    }
  }
}

TEST(TensorParallelModel, ATracedLlamaCutsLikeTheGeneratedOneAndItsOptimizerStateWithIt) {
  const std::string name = "llama3.2-3b-traced-s4096-b2";
  const TransformerShape x = shape_of(name);
  const Model whole = preset(name);
  auto cut = tensor_parallel_model(whole, 2);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  const Model& rank = cut.value();
  const std::int64_t h = x.hidden;
  const std::int64_t kv = x.kv_heads * (x.hidden / x.heads);
  // Tied embeddings: one table.
  const std::int64_t cut_elements =
      x.vocab * h + x.layers * (h * (h + 2 * kv) + h * h + 3 * h * x.ffn);
  const std::int64_t norm_elements = (2 * x.layers + 1) * h;
  EXPECT_EQ(param_bytes(rank), Bytes((cut_elements / 2 + norm_elements) * 2));
  Bytes state(0);
  Bytes whole_state(0);
  for (std::size_t t = 0; t < whole.tensors.size(); ++t) {
    if (whole.tensors[t].role != TensorRole::Buffer) continue;
    whole_state += whole.tensors[t].bytes;
    state += rank.tensors[t].bytes;
  }
  // The two moments of each cut parameter are cut with it (the norms' are kept whole).
  EXPECT_EQ(whole_state - state, Bytes(2 * (cut_elements - cut_elements / 2) * 2));
  const auto counts = collectives(rank);
  for (std::int32_t layer = 0; layer < x.layers; ++layer) {
    EXPECT_EQ(counts.at(layer), (std::map<std::string, int>{{"all_gather/reduce_scatter", 2},
                                                            {"reduce_scatter/all_gather", 2}}));
  }
}

TEST(TensorParallelModel, WhatDoesNotSplitIsRefusedNamingItAndTheFlag) {
  const auto refused = [](const Model& model, std::int32_t tp) {
    auto cut = tensor_parallel_model(model, tp);
    EXPECT_FALSE(cut.ok());
    return cut.ok() ? std::string() : cut.error().message;
  };
  EXPECT_EQ(refused(preset("llama3-8b-s8192"), 16),
            R"(--tp 16: 8 key/value heads (op "layers.0.attn") do not split among 16 ranks)");
  EXPECT_EQ(refused(preset("tiny-llama"), 3),
            R"(--tp 3: 4 attention heads (op "layers.0.attn") do not split among 3 ranks)");
  EXPECT_EQ(refused(preset("gpt2-small-s1024"), 2),
            R"(--tp 2: the 50257 features of op "head" do not split among 2 ranks)");
  EXPECT_EQ(refused(preset("tiny-llama"), 0), "--tp 0: use 1 or more ranks");
  Model mlp = preset("tiny-llama");
  for (ModelOp& op : mlp.ops) {
    if (op.kind == "aten.add.Tensor") op.kind = "aten.mul.Tensor";
  }
  EXPECT_EQ(refused(mlp, 2),
            R"(--tp 2: tensor parallelism cuts the projections of transformer layers, and model )"
            R"("tiny-llama" has no layer whose projections add to a residual stream)");
}

// A rank's model trains: its collectives on the tensor-parallel stream, no hazard, with
// checkpointing and offload.
TEST(TensorParallelModel, ARankTrainsHazardFreeWithCheckpointingAndOffload) {
  auto cut = tensor_parallel_model(preset("tiny-llama"), 2);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  trains_clean(cut.value(), "tp comm");
}

// The graph trainer's default policy (op-sac-all) on a rank: a rowwise projection's partial sum
// is read only by the reduce-scatter, which the policy saves, so the compiled graph keeps the
// scattered tensor and neither keeps nor recomputes the projection (Note [What a compiled graph
// keeps] in checkpoint_plan.cpp); torchtitan's eager policy (op-sac) keeps what it saves. The
// run is clean, its gradients those of the run without checkpointing, and it holds less.
TEST(TensorParallelModel, ACompiledGraphKeepsTheScatteredSumAndDropsThePartialOne) {
  auto cut = tensor_parallel_model(preset("tiny-llama"), 2);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  Model rank = cut.value();
  const auto dropped = [&](MatmulSaving matmuls) {
    CheckpointPlan plan = checkpoint_every(rank, 1);
    EXPECT_TRUE(apply_op_sac_policy(plan, rank, matmuls).ok());
    std::set<std::string> names;
    for (std::size_t i = 0; i < rank.ops.size(); ++i) {
      if (rank.ops[i].layer == 1 && plan.op_policy[i] == OpPolicy::Dropped) {
        names.insert(rank.ops[i].name);
      }
    }
    return std::pair{names, plan};
  };
  const auto [graph, graph_plan] = dropped(MatmulSaving::Every);
  EXPECT_EQ(graph, (std::set<std::string>{"layers.1.o_proj", "layers.1.down"}));
  EXPECT_TRUE(dropped(MatmulSaving::Alternate).first.empty());
  // The whole model's projections feed recomputed adds: nothing is dropped there.
  const Model whole = preset("tiny-llama");
  CheckpointPlan whole_plan = checkpoint_every(whole, 1);
  ASSERT_TRUE(apply_op_sac_policy(whole_plan, whole, MatmulSaving::Every).ok());
  EXPECT_EQ(std::ranges::count(whole_plan.op_policy, OpPolicy::Dropped), 0);

  const DeviceProfile device = rank_device();
  assign_roofline_durations(rank, device);
  const auto train = [&](std::optional<CheckpointPlan> plan) {
    TrainingOptions options;
    options.steps = 2;
    options.offload.policy = Policy::None;
    if (plan) options.checkpoint = *plan;
    options.checkpoint.content_check = true;
    auto run = simulate_training(rank, device, options);
    EXPECT_TRUE(run.ok()) << run.error().message;
    return std::move(run).value();
  };
  CheckpointPlan eager = graph_plan;
  std::ranges::replace(eager.op_policy, OpPolicy::Dropped, OpPolicy::MustSave);
  const TrainingRun plain = train(std::nullopt);
  const TrainingRun compiled = train(graph_plan);
  const TrainingRun kept = train(eager);
  for (const TrainingRun* run : {&compiled, &kept}) {
    ASSERT_FALSE(run->failure) << run->failure->message;
    EXPECT_TRUE(run->sim.hazards().empty());
    EXPECT_TRUE(run->sim.content_mismatches().empty());
    EXPECT_EQ(run->gradient_values, plain.gradient_values);
  }
  const auto peak = [](const TrainingRun& run) {
    return run.sim.device_allocator(run.device).stats().allocated_peak;
  };
  EXPECT_LT(peak(compiled), peak(kept));
}

// Models nobody tuned the cut for: Hugging Face models as `python -m ferry trace` lists them
// (tests/data/traced/sized, each published config cut to two layers). A dense decoder's rank
// holds 1/tp of every projection and of the embedding and head, and each layer does 1/tp of the
// whole layer's work; a mixture of experts is refused, naming its grouped matmul, and GPT-2,
// whose vocabulary does not split, naming its head. (A mixture of experts' rank is checked
// below: its router and experts are whole on every rank.)
TEST(TensorParallelModel, TracedHuggingFaceModelsCutOrAreRefusedByName) {
  for (const char* family : testing::kSizedFamilies) {
    SCOPED_TRACE(family);
    const Model whole = testing::sized_family(family);
    ASSERT_FALSE(whole.ops.empty());
    auto cut = tensor_parallel_model(whole, 2);
    if (std::string(family) == "mixtral") {
      ASSERT_TRUE(cut.ok()) << cut.error().message;
      continue;
    }
    if (std::string(family) == "gpt2") {
      // GPT-2's 50257 tokens do not split in two (Megatron pads the vocabulary first).
      ASSERT_FALSE(cut.ok());
      EXPECT_EQ(cut.error().message,
                R"(--tp 2: the 50257 features of op "lm_head/mm" do not split among 2 ranks)");
      continue;
    }
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    EXPECT_LT(param_bytes(rank), param_bytes(whole));
    EXPECT_GT(param_bytes(rank).count() * 2, param_bytes(whole).count());
    std::int32_t layers = 0;
    for (const ModelOp& op : whole.ops) layers = std::max(layers, op.layer + 1);
    ASSERT_GT(layers, 0);
    for (std::int32_t layer = 0; layer < layers; ++layer) {
      EXPECT_EQ(flops_of_layer(rank, layer) * 2, flops_of_layer(whole, layer)) << layer;
      EXPECT_EQ(collectives(rank).at(layer),
                (std::map<std::string, int>{{"all_gather/reduce_scatter", 2},
                                            {"reduce_scatter/all_gather", 2}}))
          << layer;
    }
  }
}

// context_parallel_model (Note [A context-parallel rank] in rank_model.cpp).

Bytes saved_in_layers(const Model& model, std::int32_t layers) {
  Bytes sum(0);
  for (std::int32_t layer = 0; layer < layers; ++layer) sum += saved_activation_bytes(model, layer);
  return sum;
}

TEST(ContextParallelModel, OneRankRunsTheWholeModel) {
  const Model whole = preset("tiny-llama");
  auto rank = context_parallel_model(whole, 1);
  ASSERT_TRUE(rank.ok());
  EXPECT_EQ(rank.value(), whole);
}

// A Llama rank holds all the parameters, 1/cp of what every layer saves and does, and gathers
// the whole K and V before each attention kernel, over a group of cp ranks.
TEST(ContextParallelModel, ALlamaRankHoldsItsTokensAndGathersKeysAndValues) {
  for (const std::string name : {"tiny-llama", "llama3-8b-s8192"}) {
    const TransformerShape x = shape_of(name);
    const Model whole = preset(name);
    for (const std::int32_t cp : {2, 4, 8}) {
      SCOPED_TRACE(name + " at cp " + std::to_string(cp));
      auto cut = context_parallel_model(whole, cp, 2);
      ASSERT_TRUE(cut.ok()) << cut.error().message;
      const Model& rank = cut.value();
      EXPECT_EQ(param_bytes(rank), param_bytes(whole));
      const std::int64_t kv_bytes =
          2 * x.sequence * x.micro_batch * x.kv_heads * (x.hidden / x.heads);  // 16-bit
      const auto counts = collectives(rank, MeshAxis::Context);
      for (std::int32_t layer = 0; layer < x.layers; ++layer) {
        EXPECT_EQ(flops_of_layer(rank, layer) * cp, flops_of_layer(whole, layer)) << layer;
        EXPECT_EQ(cp * saved_activation_bytes(rank, layer), saved_activation_bytes(whole, layer))
            << layer;
        EXPECT_EQ(counts.at(layer), (std::map<std::string, int>{{"all_gather/reduce_scatter", 1}}));
      }
      EXPECT_FALSE(counts.contains(-1));
      for (const ModelOp& op : rank.ops) {
        if (!op.collective.any()) continue;
        EXPECT_EQ(op.collective.ranks, cp);
        EXPECT_EQ(op.collective.nodes, 2);
        // In: the rank's K and V; out: the whole sequence's.
        Bytes in(0);
        Bytes out(0);
        for (const std::uint32_t t : op.inputs) in += rank.tensors[t].bytes;
        for (const std::uint32_t t : op.outputs) out += rank.tensors[t].bytes;
        EXPECT_EQ(cp * in, Bytes(2 * kv_bytes));
        EXPECT_EQ(out, Bytes(2 * kv_bytes));
      }
    }
  }
}

// Context parallelism cuts a tensor-parallel rank's tokens again: torchtitan's mesh with both.
TEST(ContextParallelModel, ATensorParallelRankCutsAgainByTokens) {
  const Model whole = preset("llama3-8b-s8192");
  auto tp = tensor_parallel_model(whole, 2);
  ASSERT_TRUE(tp.ok()) << tp.error().message;
  auto both = context_parallel_model(tp.value(), 4);
  ASSERT_TRUE(both.ok()) << both.error().message;
  const Model& rank = both.value();
  EXPECT_EQ(param_bytes(rank), param_bytes(tp.value()));
  for (std::int32_t layer = 0; layer < 32; ++layer) {
    EXPECT_EQ(flops_of_layer(rank, layer) * 8, flops_of_layer(whole, layer)) << layer;
    EXPECT_EQ(4 * saved_activation_bytes(rank, layer), saved_activation_bytes(tp.value(), layer));
  }
  EXPECT_EQ(collectives(rank, MeshAxis::Context).at(0).at("all_gather/reduce_scatter"), 1);
  EXPECT_EQ(collectives(rank, MeshAxis::Tensor), collectives(tp.value(), MeshAxis::Tensor));
}

TEST(ContextParallelModel, WhatDoesNotSplitIsRefusedNamingItAndTheFlag) {
  const auto refused = [](const Model& model, std::int32_t cp) {
    auto cut = context_parallel_model(model, cp);
    EXPECT_FALSE(cut.ok());
    return cut.ok() ? std::string() : cut.error().message;
  };
  EXPECT_EQ(refused(preset("tiny-llama"), 0), "--cp 0: use 1 or more ranks");
  EXPECT_EQ(refused(preset("gpt2-small-s1024"), 2),
            R"(--cp 2: op "layers.0.scores" multiplies two tensors split by tokens (attention )"
            R"(written as matrix products); context parallelism runs attention as one fused )"
            R"(kernel (scaled_dot_product_attention), as torch's context_parallel does)");
  EXPECT_EQ(refused(preset("tiny-llama"), 3),
            "--cp 3: the 256 tokens of a micro-batch do not split among 3 ranks");
  Model no_embedding = preset("tiny-llama");
  for (ModelOp& op : no_embedding.ops) {
    if (op.kind == "aten.embedding.default") op.kind = "aten.index_select.default";
  }
  EXPECT_EQ(refused(no_embedding, 2),
            R"(--cp 2: context parallelism cuts a sequence of tokens, and model "tiny-llama" )"
            R"(embeds no token ids)");
}

// A rank's model trains: its gathers on the context-parallel stream, no hazard, with
// checkpointing and offload.
TEST(ContextParallelModel, ARankTrainsHazardFreeWithCheckpointingAndOffload) {
  auto cut = context_parallel_model(preset("tiny-llama"), 2);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  trains_clean(cut.value(), "cp comm");
}

// Hugging Face models as traced: a decoder with a fused attention kernel keeps every
// parameter and does 1/cp of each layer's work, saving 1/cp of it; one whose attention is
// written as matrix products (GPT-2 and Gemma 2, whose soft-capping Hugging Face runs eagerly)
// is refused, naming the product.
TEST(ContextParallelModel, TracedHuggingFaceModelsCutOrAreRefusedByName) {
  for (const char* family : testing::kSizedFamilies) {
    SCOPED_TRACE(family);
    const Model whole = testing::sized_family(family);
    auto cut = context_parallel_model(whole, 2);
    if (std::string(family) == "gpt2" || std::string(family) == "gemma2") {
      ASSERT_FALSE(cut.ok());
      EXPECT_NE(cut.error().message.find("multiplies two tensors split by tokens"),
                std::string::npos)
          << cut.error().message;
      continue;
    }
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    EXPECT_EQ(param_bytes(rank), param_bytes(whole));
    std::int32_t layers = 0;
    for (const ModelOp& op : whole.ops) layers = std::max(layers, op.layer + 1);
    ASSERT_GT(layers, 0);
    for (std::int32_t layer = 0; layer < layers; ++layer) {
      EXPECT_NEAR(static_cast<double>(flops_of_layer(rank, layer)) * 2,
                  static_cast<double>(flops_of_layer(whole, layer)),
                  1e-6 * static_cast<double>(flops_of_layer(whole, layer)))
          << layer;
      EXPECT_EQ(collectives(rank, MeshAxis::Context).at(layer),
                (std::map<std::string, int>{{"all_gather/reduce_scatter", 1}}))
          << layer;
    }
    // Saved: half of what the layers save, but for tables computed from positions alone (the
    // rotary cos and sin), which no split tensor reaches and each rank holds whole.
    Bytes unsplit(0);
    for (std::int32_t layer = 0; layer < layers; ++layer) {
      std::set<std::uint32_t> seen;
      for (const ModelOp& op : rank.ops) {
        if (op.layer != layer) continue;
        for (const std::uint32_t t : op.saved) {
          const ModelTensor& kept = rank.tensors[t];
          if (kept.role == TensorRole::Activation && kept.bytes == whole.tensors[t].bytes &&
              seen.insert(t).second) {
            unsplit += kept.bytes;
          }
        }
      }
    }
    EXPECT_EQ(2 * saved_in_layers(rank, layers) - saved_in_layers(whole, layers), unsplit);
    EXPECT_LT(20 * unsplit.count(), saved_in_layers(whole, layers).count());
  }
}

// expert_parallel_model (Note [An expert-parallel rank] in rank_model.cpp), on Mixtral 8x7B's
// config cut to two layers (tests/data/traced/sized): 8 experts of 4096 -> 14336, top 2, 4096
// tokens.
// The sized Mixtral without the rows its trace gives each expert (balanced routing).
Model balanced_mixtral() {
  Model m = testing::sized_family("mixtral");
  for (ModelOp& op : m.ops) op.group_rows.clear();
  return m;
}

TEST(ExpertParallelModel, AMixtralRankHoldsItsExpertsAndExchangesTheRoutedRows) {
  const Model whole = balanced_mixtral();
  Bytes experts(0);
  for (const ModelTensor& t : whole.tensors) {
    if (t.role == TensorRole::Param && t.view_of < 0 && t.name.ends_with("_proj") &&
        t.name.find(".experts.") != std::string::npos) {
      experts += t.bytes;
    }
  }
  ASSERT_EQ(experts, Bytes(2 * 8 * 3 * std::int64_t{4096} * 14336 * 2));  // 2 layers, bf16
  for (const std::int32_t ep : {2, 4, 8}) {
    SCOPED_TRACE(ep);
    auto cut = expert_parallel_model(whole, ep, 1);
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    EXPECT_EQ(param_bytes(rank), param_bytes(whole) - experts + Bytes(experts.count() / ep));
    for (const std::int32_t layer : {0, 1}) {
      // Balanced routing: every GPU computes as many rows as it routes.
      EXPECT_EQ(flops_of_layer(rank, layer), flops_of_layer(whole, layer));
      EXPECT_EQ(collectives(rank, MeshAxis::Expert).at(layer),
                (std::map<std::string, int>{{"all_to_all/all_to_all", 2}}));
    }
    for (const ModelOp& op : rank.ops) {
      if (!op.collective.any()) continue;
      EXPECT_EQ(op.collective.ranks, ep);
      // Each exchange moves the routed rows: 4096 tokens x top 2 x 4096 features, bf16.
      EXPECT_EQ(rank.tensors[op.inputs.at(0)].bytes, Bytes(std::int64_t{4096} * 2 * 4096 * 2));
      EXPECT_EQ(rank.tensors[op.outputs.at(0)].bytes, rank.tensors[op.inputs.at(0)].bytes);
    }
  }
  auto odd = expert_parallel_model(whole, 3);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.error().message,
            R"(--ep 3: 8 experts (op "model.layers.0.mlp.experts/_grouped_mm") do not split )"
            R"(among 3 ranks)");
  auto dense = expert_parallel_model(testing::sized_family("llama"), 2);
  ASSERT_FALSE(dense.ok());
  EXPECT_NE(dense.error().message.find("has no grouped expert matmul"), std::string::npos);
  auto one = expert_parallel_model(whole, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one.value(), whole);
}

// The routed rows of Mixtral's first layer as a trace under routing loads=6,2,2,2,1,1,1,1 gives
// them (ModelOp::group_rows): 8192 rows, 4096 tokens x top 2. A rank of ep holds 8/ep experts
// and receives ep x their rows, so the busiest rank (the first) computes 1.5 (ep 2), 2 (ep 4)
// or 3 (ep 8) times the traced rows.
TEST(ExpertParallelModel, TheBusiestRankOfAnUnevenRoutingComputesItsRows) {
  Model whole = balanced_mixtral();
  const std::vector<std::int64_t> rows{3072, 1024, 1024, 1024, 512, 512, 512, 512};
  for (ModelOp& op : whole.ops) {
    if (op.layer == 0 && is_grouped_matmul_kind(op.kind)) op.group_rows = rows;
  }
  ASSERT_TRUE(validate_model(whole).ok());
  const auto grouped_flops = [](const Model& m, std::int32_t layer) {
    std::int64_t flops = 0;
    for (const ModelOp& op : m.ops) {
      if (op.layer == layer && is_grouped_matmul_kind(op.kind)) flops += op.flops;
    }
    return flops;
  };
  const auto exchanged = [](const Model& m, std::int32_t layer) {
    std::vector<std::pair<Bytes, Bytes>> sizes;  // each all-to-all's input and output
    for (const ModelOp& op : m.ops) {
      if (op.layer == layer && op.collective.any()) {
        sizes.emplace_back(m.tensors[op.inputs.at(0)].bytes, m.tensors[op.outputs.at(0)].bytes);
      }
    }
    return sizes;
  };
  const Bytes routed(std::int64_t{4096} * 2 * 4096 * 2);  // the layer's routed rows, bf16
  for (const auto& [ep, times] : {std::pair{2, 3}, std::pair{4, 4}, std::pair{8, 6}}) {
    SCOPED_TRACE(ep);
    auto cut = expert_parallel_model(whole, ep, 1);
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    // times / 2 the rows: the grouped matmuls' FLOPs, the rows dispatched in and out.
    EXPECT_EQ(2 * grouped_flops(rank, 0), times * grouped_flops(whole, 0));
    using Sizes = std::vector<std::pair<Bytes, Bytes>>;
    const Bytes busiest(routed.count() * times / 2);
    EXPECT_EQ(exchanged(rank, 0), (Sizes{{routed, busiest}, {busiest, routed}}));
    for (const ModelOp& op : rank.ops) {
      if (op.layer != 0 || !is_grouped_matmul_kind(op.kind)) continue;
      EXPECT_EQ(2 * op.gemm.m, times * 8192) << op.name;
    }
    EXPECT_GT(saved_activation_bytes(rank, 0), saved_activation_bytes(whole, 0));
    // The second layer's trace gives no rows: balanced, as before.
    EXPECT_EQ(grouped_flops(rank, 1), grouped_flops(whole, 1));
    EXPECT_EQ(exchanged(rank, 1), (Sizes{{routed, routed}, {routed, routed}}));
    EXPECT_GT(step_time(rank), step_time(expert_parallel_model(balanced_mixtral(), ep, 1).value()));
  }
  trains_clean(expert_parallel_model(whole, 2, 1).value(), "ep comm");

  // Balanced rows price as no rows do.
  Model balanced = whole;
  for (ModelOp& op : balanced.ops) {
    if (!op.group_rows.empty()) op.group_rows.assign(8, 1024);
  }
  Model unknown = whole;
  for (ModelOp& op : unknown.ops) op.group_rows.clear();
  auto even = expert_parallel_model(balanced, 4, 1);
  ASSERT_TRUE(even.ok());
  for (ModelOp& op : even.value().ops) op.group_rows.clear();
  EXPECT_EQ(even.value(), expert_parallel_model(unknown, 4, 1).value());

  // The fixture's own rows, traced under random routing with a capacity factor of 1.25: the
  // busiest of 8 ranks holds the expert of 1082 rows of 8192.
  const Model traced = testing::sized_family("mixtral");
  EXPECT_EQ(expert_routing(traced), "busiest_rank");
  EXPECT_EQ(expert_routing(balanced_mixtral()), "balanced");
  auto eight = expert_parallel_model(traced, 8, 1);
  ASSERT_TRUE(eight.ok()) << eight.error().message;
  for (const std::int32_t layer : {0, 1}) {
    std::int64_t most = 0;
    for (const ModelOp& op : traced.ops) {
      if (op.layer == layer && !op.group_rows.empty()) most = std::ranges::max(op.group_rows);
    }
    EXPECT_GT(most, 1024);
    EXPECT_EQ(grouped_flops(eight.value(), layer) * 1024, grouped_flops(traced, layer) * most)
        << layer;
  }

  Model wrong = whole;
  for (ModelOp& op : wrong.ops) {
    if (!op.group_rows.empty()) op.group_rows.resize(4);
  }
  auto refused = expert_parallel_model(wrong, 2, 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message,
            R"(--ep 2: op "model.layers.0.mlp.experts/_grouped_mm" gives the rows of 4 groups, )"
            "but its weights hold 8 experts");
}

// A static dispatcher's capacity (Note [Static capacity] in rank_model.cpp) on the Mixtral above
// with the first layer's uneven rows: at ep 2 its busiest rank receives 1.5 times the traced
// 8192 rows, the second layer's 8192. With a factor of 2 every routed base activation is
// allocated for twice its traced elements and names its rows of data, and nothing else of the
// cut changes; a factor that does not hold the busiest rank's rows is refused with one that does.
TEST(ExpertParallelModel, AStaticCapacityPadsTheRoutedRowsAndNothingElse) {
  Model whole = balanced_mixtral();
  const std::vector<std::int64_t> rows{3072, 1024, 1024, 1024, 512, 512, 512, 512};
  for (ModelOp& op : whole.ops) {
    if (op.layer == 0 && is_grouped_matmul_kind(op.kind)) op.group_rows = rows;
  }
  const Model dynamic = expert_parallel_model(whole, 2, 1).value();
  auto cut = expert_parallel_model(whole, 2, 1, 2.0);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  Model padded = cut.value();
  ASSERT_TRUE(validate_model(padded).ok());
  std::map<std::string, std::int64_t> padded_rows;  // tensor -> rows
  for (std::uint32_t t = 0; t < padded.tensors.size(); ++t) {
    ModelTensor& tensor = padded.tensors[t];
    if (tensor.capacity.count() == 0) continue;
    EXPECT_EQ(tensor.view_of, -1) << tensor.name;
    EXPECT_EQ(tensor.role, TensorRole::Activation) << tensor.name;
    const std::int32_t layer = tensor.name.find("layers.0.") != std::string::npos ? 0 : 1;
    // Twice the traced elements: the busiest rank's bytes over its share of the rows.
    const std::int64_t traced = tensor.bytes.count() * 2 / (layer == 0 ? 3 : 2);
    EXPECT_EQ(tensor.capacity.count(), 2 * traced) << tensor.name;
    EXPECT_EQ(tensor.rows, layer == 0 ? 12288 : 8192) << tensor.name;
    padded_rows[tensor.name] = tensor.rows;
    tensor.capacity = Bytes(0);
    tensor.rows = 0;
  }
  EXPECT_EQ(padded, dynamic);  // nothing but the capacities
  // Per layer: the rows dispatched in, and what the experts compute from them (the first
  // grouped matmul's output, the activation's, the second's).
  for (const std::string layer : {"model.layers.0.", "model.layers.1."}) {
    const auto in_layer = std::ranges::count_if(
        padded_rows, [&](const auto& named) { return named.first.starts_with(layer); });
    EXPECT_GE(in_layer, 4) << layer;
    EXPECT_TRUE(padded_rows.contains(layer + "mlp.experts/_grouped_mm/ep.dispatch.out")) << layer;
    EXPECT_FALSE(padded_rows.contains(layer + "mlp.experts/_grouped_mm#1/ep.combine.out")) << layer;
  }
  trains_clean(padded, "ep comm");

  const auto refused = [&](std::int32_t ep, double capacity) {
    auto r = expert_parallel_model(whole, ep, 1, capacity);
    return r.ok() ? std::string("accepted") : r.error().message;
  };
  const std::string small = refused(2, 1.25);
  EXPECT_NE(small.find("--ep 2: --expert-capacity 1.25: the busiest rank receives "),
            std::string::npos)
      << small;
  EXPECT_NE(small.find(R"("model.layers.0.mlp.experts/_grouped_mm.out", more than its )"
                       "capacity"),
            std::string::npos)
      << small;
  EXPECT_NE(small.find("a factor of 1.50 holds them"), std::string::npos) << small;
  EXPECT_EQ(refused(2, 1.5), "accepted");
  EXPECT_EQ(refused(1, 2.0),
            "--expert-capacity 2 needs --ep 2 or more: one GPU's routed rows are static without "
            "padding");
  EXPECT_EQ(refused(2, 0.5), "--expert-capacity 0.5: use a factor from 1 to 1024");
}

// Two layers whose experts read one tensor (found by FsdpProperty): each layer dispatches it
// into a tensor of its own, named by its exchange.
constexpr std::string_view kSharedRows = R"({
  "format": "ferry.model/1", "name": "shared-rows",
  "tensors": [
    {"name": "x", "bytes": 4096, "dtype": "bf16", "role": "input"},
    {"name": "w0", "bytes": 4096, "dtype": "bf16", "role": "param"},
    {"name": "w1", "bytes": 4096, "dtype": "bf16", "role": "param"},
    {"name": "a", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "y0", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "y1", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "s", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "loss", "bytes": 4, "dtype": "f32", "role": "activation"}
  ],
  "ops": [
    {"name": "in", "flops": 2048, "bytes": 8192, "backward_flops": 2048, "backward_bytes": 8192,
     "inputs": ["x"], "outputs": ["a"], "saved": []},
    {"name": "e0", "kind": "aten._grouped_mm.default", "layer": 0, "flops": 131072,
     "bytes": 12288, "backward_flops": 262144, "backward_bytes": 24576, "inputs": ["a", "w0"],
     "outputs": ["y0"], "saved": ["a", "w0"], "gemm": {"m": 128, "n": 16, "k": 32},
     "group_rows": [64, 32, 16, 16]},
    {"name": "e1", "kind": "aten._grouped_mm.default", "layer": 1, "flops": 131072,
     "bytes": 12288, "backward_flops": 262144, "backward_bytes": 24576, "inputs": ["a", "w1"],
     "outputs": ["y1"], "saved": ["a", "w1"], "gemm": {"m": 128, "n": 16, "k": 32}},
    {"name": "add", "flops": 2048, "bytes": 12288, "backward_flops": 0, "backward_bytes": 8192,
     "inputs": ["y0", "y1"], "outputs": ["s"], "saved": []},
    {"name": "sum", "flops": 2048, "bytes": 4100, "backward_flops": 2048, "backward_bytes": 4100,
     "inputs": ["s"], "outputs": ["loss"], "saved": []}
  ],
  "loss": "loss"
})";

TEST(ExpertParallelModel, TwoLayersExpertsMayReadOneTensor) {
  auto model = parse_model(kSharedRows, "shared-rows.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  // w0 and w1: 2048 elements, 4 experts of 32 x 16.
  auto cut = expert_parallel_model(model.value(), 2, 1);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  std::set<std::string> exchanged;
  for (const ModelOp& op : cut.value().ops) {
    if (op.collective.any()) exchanged.insert(cut.value().tensors[op.outputs.at(0)].name);
  }
  EXPECT_EQ(exchanged, (std::set<std::string>{"e0/ep.dispatch.out", "e0/ep.combine.out",
                                              "e1/ep.dispatch.out", "e1/ep.combine.out"}));
  // The first layer's routing loads the first GPU with 2 x 96 of 128 rows; the second is
  // balanced.
  EXPECT_EQ(cut.value().ops[2].gemm.m, 192);
  EXPECT_EQ(cut.value().ops[5].gemm.m, 128);
  trains_clean(cut.value(), "ep comm");
}

// A file whose busiest GPU would compute more rows than a product may have is refused, naming
// the place, not priced with counts that overflow.
TEST(ExpertParallelModel, RowsPastTheLimitsAreRefused) {
  std::string text(kSharedRows);
  const auto replace = [&](std::string_view from, std::string_view to) {
    text.replace(text.find(from), from.size(), to);
  };
  replace(R"("flops": 131072,)", R"("flops": 1125899906842624,)");  // 2 x 2^40 x 16 x 32
  replace(R"("m": 128,)", R"("m": 1099511627776,)");
  replace("[64, 32, 16, 16]", "[1099511627776, 0, 0, 0]");
  auto model = parse_model(text, "huge-rows.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  auto cut = expert_parallel_model(model.value(), 2, 1);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.error().message,
            "--ep 2: the cut model is not valid (ops[2].gemm.m: expected an integer in [1, "
            "1099511627776], got 2199023255552)");
}

// Tensor parallelism of a mixture of experts (Note [Tensor parallelism of a mixture of
// experts] in rank_model.cpp), on the sized Mixtral: 4096 tokens of 4096 features, 8 experts of
// 4096 -> 14336, top 2.
TEST(TensorParallelModel, AMixtralRankRoutesItsShareOfTheTokensToWholeExperts) {
  const Model whole = balanced_mixtral();
  constexpr std::int64_t kTokens = 4096;
  constexpr std::int64_t kHidden = 4096;
  const auto grouped = [](const Model& m) {
    std::vector<const ModelOp*> out;
    for (const ModelOp& op : m.ops) {
      if (is_grouped_matmul_kind(op.kind)) out.push_back(&op);
    }
    return out;
  };
  // The router: the weight matmul whose output the experts' topk reads (8 scores a token).
  const auto router_flops = [&](const Model& m, std::int32_t layer) {
    std::int64_t flops = 0;
    for (const ModelOp& op : m.ops) {
      if (op.layer == layer && op.gemm.known() && op.gemm.n == 8 && op.gemm.k == kHidden) {
        flops += op.flops + op.backward_flops;
      }
    }
    return flops;
  };
  for (const std::int32_t tp : {2, 4}) {
    SCOPED_TRACE(tp);
    auto cut = tensor_parallel_model(whole, tp);
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    const auto experts = grouped(rank);
    ASSERT_EQ(experts.size(), 4U);  // two a layer
    for (const ModelOp* op : experts) {
      // 1/tp of the 8192 routed rows; the experts' weights whole.
      EXPECT_EQ(op->gemm.m, 8192 / tp);
      EXPECT_EQ(rank.tensors[op->inputs.at(0)].bytes.count() * tp,
                whole.tensors[op->inputs.at(0)].bytes.count());
      EXPECT_EQ(rank.tensors[op->inputs.at(1)].bytes, whole.tensors[op->inputs.at(1)].bytes);
    }
    for (const std::int32_t layer : {0, 1}) {
      SCOPED_TRACE(layer);
      // The router scores every token on every rank; all else is 1/tp of the layer's work.
      const std::int64_t router = router_flops(whole, layer);
      ASSERT_GT(router, 0);
      EXPECT_EQ(router_flops(rank, layer), router);
      const std::int64_t rest = flops_of_layer(rank, layer) - router;
      EXPECT_NEAR(static_cast<double>(rest) * tp,
                  static_cast<double>(flops_of_layer(whole, layer) - router),
                  1e-6 * static_cast<double>(flops_of_layer(whole, layer)));
      // Attention's gather and reduce-scatter, and the block's: its input gathered once for the
      // router and the experts, its output a partial sum reduce-scattered once.
      EXPECT_EQ(collectives(rank).at(layer),
                (std::map<std::string, int>{{"all_gather/reduce_scatter", 2},
                                            {"reduce_scatter/all_gather", 2}}));
    }
    for (const ModelOp& op : rank.ops) {
      if (!op.collective.any()) continue;
      // Each moves a token's features for every token: 4096 x 4096, bf16, whole on one side.
      const Bytes whole_bytes(kTokens * kHidden * 2);
      const Bytes in = rank.tensors[op.inputs.at(0)].bytes;
      const Bytes gathered = rank.tensors[op.outputs.at(0)].bytes;
      EXPECT_EQ(std::max(in, gathered), whole_bytes) << op.name;
      EXPECT_EQ(std::min(in, gathered), Bytes(whole_bytes.count() / tp)) << op.name;
    }
  }
  // An op that is not linear in the block's partial sum (here its change of dtype made a power)
  // reads it reduce-scattered: the reduce-scatter moves the float32 sum of the picks instead.
  {
    Model nonlinear = whole;
    for (ModelOp& op : nonlinear.ops) {
      if (op.name.ends_with("mlp.experts/_to_copy#1")) op.kind = "aten.pow.Tensor_Scalar";
    }
    auto cut = tensor_parallel_model(nonlinear, 2);
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    std::set<std::string> scattered;
    for (const ModelOp& op : cut.value().ops) {
      if (op.collective.any() && op.collective.forward == CollectiveKind::ReduceScatter) {
        scattered.insert(cut.value().tensors[op.inputs.at(0)].name);
      }
    }
    EXPECT_TRUE(scattered.contains("model.layers.0.mlp.experts/sum.out"));
    EXPECT_FALSE(scattered.contains("model.layers.0.mlp.experts/_to_copy#1.out"));
  }
  // Expert parallelism over the tensor-parallel GPUs: each holds half the experts and exchanges
  // its routed rows, half of the layer's.
  auto tp2 = tensor_parallel_model(whole, 2);
  ASSERT_TRUE(tp2.ok());
  auto cut = expert_parallel_model(tp2.value(), 2, 1);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  const Model& rank = cut.value();
  for (const ModelOp* op : grouped(rank)) {
    EXPECT_EQ(rank.tensors[op->inputs.at(1)].bytes.count() * 2,
              whole.tensors[op->inputs.at(1)].bytes.count());
  }
  for (const ModelOp& op : rank.ops) {
    if (op.collective.any() && op.collective.axis == MeshAxis::Expert) {
      EXPECT_EQ(rank.tensors[op.inputs.at(0)].bytes, Bytes(kTokens * 2 * kHidden * 2 / 2));
    }
  }
  trains_clean(rank, "ep comm");
  trains_clean(rank, "tp comm");
}

TEST(ExpertParallelModel, ARankTrainsHazardFreeWithCheckpointingAndOffload) {
  auto cut = expert_parallel_model(testing::sized_family("mixtral"), 2);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  trains_clean(cut.value(), "ep comm");
}

}  // namespace
}  // namespace ferry::sim
