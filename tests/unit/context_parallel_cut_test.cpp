// context_parallel_model (Note [A context-parallel rank] in context_parallel_cut.cpp).

#include "ferry/sim/workload/rank_model.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "rank_cut_test_support.hpp"

namespace ferry::sim::rank_cut_test {
namespace {

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
// is refused, naming the product, and so is T5, whose fused kernel adds a learned position bias,
// naming the bias.
TEST(ContextParallelModel, TracedHuggingFaceModelsCutOrAreRefusedByName) {
  for (const char* family : testing::kSizedFamilies) {
    SCOPED_TRACE(family);
    const Model whole = testing::sized_family(family);
    auto cut = context_parallel_model(whole, 2);
    if (std::string(family) == "t5") {
      ASSERT_FALSE(cut.ok());
      EXPECT_NE(cut.error().message.find(
                    R"(op "encoder.block.0.layer.0.SelfAttention/)"
                    R"(_scaled_dot_product_flash_attention_for_cpu" attends with a mask or bias)"),
                std::string::npos)
          << cut.error().message;
      continue;
    }
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

}  // namespace
}  // namespace ferry::sim::rank_cut_test
