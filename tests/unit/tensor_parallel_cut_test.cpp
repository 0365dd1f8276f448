// tensor_parallel_model (Note [A rank's model] in tensor_parallel_cut.hpp): one rank's model
// under tensor and sequence parallelism, checked against the sizes torchtitan's plan gives a rank,
// computed here from each preset's shape.

#include "ferry/sim/workload/rank_model.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/sim/mesh/mesh.hpp"
#include "ferry/sim/workload/rank_workload.hpp"
#include "rank_cut_test_support.hpp"

namespace ferry::sim::rank_cut_test {
namespace {

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
    if (whole.tensors[t].role != TensorRole::OptimizerState) continue;
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
            R"(--tp 16: 8 key/value heads (op "layers.0.attn") do not split among 16 ranks; )"
            R"(--tp 2, 4 or 8 cut this model)");
  EXPECT_EQ(refused(preset("tiny-llama"), 3),
            R"(--tp 3: 4 attention heads (op "layers.0.attn") do not split among 3 ranks; )"
            R"(--tp 2 cuts this model)");
  EXPECT_EQ(
      refused(preset("gpt2-small-s1024"), 2),
      R"(--tp 2: the 50257 features of op "head" do not split among 2 ranks; none of --tp 2, )"
      R"(4 or 8 cuts this model: plan it without --tp)");
  EXPECT_EQ(
      refused(preset("gpt2-small-s1024"), 4),
      R"(--tp 4: the 50257 features of op "head" do not split among 4 ranks; none of --tp 2, )"
      R"(4 or 8 cuts this model: plan it without --tp)");
  EXPECT_EQ(refused(preset("tiny-llama"), 0), "--tp 0: use 1 or more ranks");
  Model mlp = preset("tiny-llama");
  for (ModelOp& op : mlp.ops) {
    if (op.kind == "aten.add.Tensor") op.kind = "aten.mul.Tensor";
  }
  EXPECT_EQ(refused(mlp, 2),
            R"(--tp 2: tensor parallelism cuts the projections of transformer layers, and model )"
            R"("tiny-llama" has no layer whose projections add to a residual stream; none of )"
            R"(--tp 2, 4 or 8 cuts this model: plan it without --tp)");
}

// On a device, a refusal offers the degrees its node holds whole groups of (a node of 4: 2 and
// 4; of 16: up to 16), not those of a node of 8.
TEST(TensorParallelModel, ARefusalOffersTheDegreesTheDevicesNodeHolds) {
  const auto refused = [](const char* name, std::int32_t node_gpus, std::int32_t tp,
                          std::int32_t fsdp = 1) {
    DeviceProfile device = testing::node_profile();
    device.collectives.gpus_per_node = node_gpus;
    const Mesh mesh = Mesh::make(Parallelism{.ranks = fsdp, .tp = tp}, device).value();
    const Workload whole{check_model(preset(name)).value(), device};
    auto rank = rank_workload(whole, mesh);
    EXPECT_FALSE(rank.ok());
    return rank.ok() ? std::string() : rank.error().message;
  };
  EXPECT_EQ(refused("gpt2-small-s1024", 4, 4),
            R"(--tp 4: the 50257 features of op "head" do not split among 4 ranks; none of --tp )"
            R"(2 or 4 cuts this model: plan it without --tp)");
  EXPECT_EQ(refused("gpt2-small-s1024", 16, 2),
            R"(--tp 2: the 50257 features of op "head" do not split among 2 ranks; none of --tp )"
            R"(2, 4, 8 or 16 cuts this model: plan it without --tp)");
  EXPECT_EQ(refused("llama3-8b-s8192", 16, 16),
            R"(--tp 16: 8 key/value heads (op "layers.0.attn") do not split among 16 ranks; )"
            R"(--tp 2, 4 or 8 cut this model)");
  // Three FSDP ranks: 3 x 8 GPUs do not lie evenly on nodes of 16, so --tp 8 is not offered.
  EXPECT_EQ(refused("llama3-8b-s8192", 16, 16, 3),
            R"(--tp 16: 8 key/value heads (op "layers.0.attn") do not split among 16 ranks; )"
            R"(--tp 2 or 4 cut this model)");
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
// whose vocabulary does not split, naming its head; T5, whose attention adds a bias looked up
// by relative position (one column a head), naming its attention. (A mixture of experts' rank
// is checked below: its router and experts are whole on every rank.)
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
    if (std::string(family) == "t5") {
      // The bias table is a parameter of 32 buckets by 12 heads, which the cut does not split
      // by heads: its lookup is laid out as a token embedding's.
      ASSERT_FALSE(cut.ok());
      EXPECT_EQ(cut.error().message,
                R"(--tp 2: op "encoder.block.0.layer.0.SelfAttention/)"
                R"(_scaled_dot_product_flash_attention_for_cpu" reads tensors split by features )"
                R"(and by tokens; none of --tp 2, 4 or 8 cuts this model: plan it without --tp)");
      continue;
    }
    if (std::string(family) == "gpt2") {
      // GPT-2's 50257 tokens do not split in two (Megatron pads the vocabulary first).
      ASSERT_FALSE(cut.ok());
      EXPECT_EQ(cut.error().message,
                R"(--tp 2: the 50257 features of op "lm_head/mm" do not split among 2 ranks; )"
                R"(none of --tp 2, 4 or 8 cuts this model: plan it without --tp)");
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

// Tensor parallelism of a mixture of experts (Note [Tensor parallelism of a mixture of
// experts] in tensor_parallel_cut.hpp), on the sized Mixtral: 4096 tokens of 4096 features, 8
// experts of 4096 -> 14336, top 2.
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

}  // namespace
}  // namespace ferry::sim::rank_cut_test
