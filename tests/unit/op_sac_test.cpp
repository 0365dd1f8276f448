// The selective checkpoint policies decide by what each op runs (ModelOp::kind), on the presets
// and on traced Hugging Face models (tests/data/traced, written by
// tests/python/traced_families.py): torchtitan's op-level SAC saves its listed operators (every
// attention kernel, every second mm of a layer), and a preset and the trace of the same
// architecture make the same decisions.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ferry/sim/autograd/checkpoint_plan.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {
namespace {

Model traced(const std::string& family) {
  const std::filesystem::path path =
      std::filesystem::path(FERRY_TESTS_DIR) / "data" / "traced" / (family + ".json");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto model = parse_model(text.str(), path.string());
  EXPECT_TRUE(model.ok()) << (model.ok() ? "" : model.error().message);
  return std::move(model).value();
}

CheckpointPlan op_sac(const Model& model) {
  CheckpointPlan plan = checkpoint_every(model, 1);
  const Status status = apply_op_sac_policy(plan, model);
  EXPECT_TRUE(status.ok()) << (status.ok() ? "" : status.error().message);
  return plan;
}

CheckpointPlan selective(const Model& model) {
  CheckpointPlan plan = checkpoint_every(model, 1);
  apply_selective_policy(plan, model);
  return plan;
}

/// The names of the ops of `layer` the plan gives `policy`.
std::set<std::string> ops_with(const Model& model, const CheckpointPlan& plan, std::int32_t layer,
                               OpPolicy policy) {
  std::set<std::string> names;
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    if (model.ops[i].layer == layer && plan.op_policy[i] == policy) names.insert(model.ops[i].name);
  }
  return names;
}

/// Per layer, how many ops of each kind the plan saves.
std::map<std::int32_t, std::map<std::string, int>> saved_by_kind(const Model& model,
                                                                 const CheckpointPlan& plan) {
  std::map<std::int32_t, std::map<std::string, int>> counts;
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const ModelOp& op = model.ops[i];
    if (op.layer >= 0 && plan.op_policy[i] == OpPolicy::MustSave) ++counts[op.layer][op.kind];
  }
  return counts;
}

std::set<std::string> prefixed(const std::string& prefix, std::set<std::string> names) {
  std::set<std::string> out;
  for (const std::string& name : names) out.insert(prefix + name);
  return out;
}

constexpr const char* kCpuFlash = "self_attn/_scaled_dot_product_flash_attention_for_cpu";

struct Family {
  std::string name;
  std::string layer_prefix;  // "model.layers." + the layer + "."
  std::set<std::string> saved;
};

// What torchtitan's list names, layer by layer, in each traced family: the attention kernel
// (or eager attention's two batched matmuls), every addmm (on its list, not counted), and the
// first, third, ... of the layer's mm's in the order they run (q, k, v, o, gate, up, down).
std::vector<Family> families() {
  return {
      {"llama",
       "model.layers.",
       {"self_attn.q_proj/mm", "self_attn.v_proj/mm", kCpuFlash, "mlp.gate_proj/mm",
        "mlp.down_proj/mm"}},
      {"mistral",
       "model.layers.",
       {"self_attn.q_proj/mm", "self_attn.v_proj/mm", kCpuFlash, "mlp.gate_proj/mm",
        "mlp.down_proj/mm"}},
      // Q, K and V have biases: addmm, saved and not counted; o, gate, up, down are mm 1 to 4.
      {"qwen2",
       "model.layers.",
       {"self_attn.q_proj/addmm", "self_attn.k_proj/addmm", "self_attn.v_proj/addmm", kCpuFlash,
        "self_attn.o_proj/mm", "mlp.up_proj/mm"}},
      // Eager attention (soft-capping): its batched matmuls are on the list.
      {"gemma2",
       "model.layers.",
       {"self_attn.q_proj/mm", "self_attn.v_proj/mm", "self_attn/bmm", "self_attn/bmm#1",
        "mlp.gate_proj/mm", "mlp.down_proj/mm"}},
      // Conv1D layers are addmm: all saved.
      {"gpt2",
       "transformer.h.",
       {"attn.c_attn/addmm", "attn/bmm", "attn/bmm#1", "attn.c_proj/addmm", "mlp.c_fc/addmm",
        "mlp.c_proj/addmm"}},
  };
}

TEST(OpSac, SavesWhatTorchtitansListNamesInEveryTracedFamily) {
  for (const Family& family : families()) {
    SCOPED_TRACE(family.name);
    const Model model = traced(family.name);
    const CheckpointPlan plan = op_sac(model);
    for (const std::int32_t layer : {0, 1}) {
      const std::string prefix = family.layer_prefix + std::to_string(layer) + ".";
      EXPECT_EQ(ops_with(model, plan, layer, OpPolicy::MustSave), prefixed(prefix, family.saved))
          << "layer " << layer;
    }
  }
}

TEST(OpSac, NothingOfAnAttentionModuleIsSavedForItsName) {
  // The rule this replaces saved every op whose name holds "attn" or "attention": the
  // projections, rotary products and views of `self_attn`, the float32 ops of
  // `post_attention_layernorm`.
  const Model model = traced("llama");
  const CheckpointPlan plan = op_sac(model);
  std::size_t attention_named = 0;
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const ModelOp& op = model.ops[i];
    if (op.layer < 0 || op.name.find("attn") == std::string::npos) continue;
    ++attention_named;
    const bool kernel = op.kind == "aten._scaled_dot_product_flash_attention.default";
    const bool listed_mm = op.name.ends_with("q_proj/mm") || op.name.ends_with("v_proj/mm");
    EXPECT_EQ(plan.op_policy[i] == OpPolicy::MustSave, kernel || listed_mm) << op.name;
  }
  EXPECT_GT(attention_named, 40U);
}

TEST(OpSac, SavesThePresetsKernelsAndEveryOtherMatmulOfALayer) {
  const Model llama = model_preset("tiny-llama").value();
  const CheckpointPlan plan = op_sac(llama);
  for (const std::int32_t layer : {0, 1}) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    // Fused QKV (mm 1), o_proj (2), gate (3), up (4), down (5).
    EXPECT_EQ(ops_with(llama, plan, layer, OpPolicy::MustSave),
              (std::set<std::string>{p + "qkv", p + "attn", p + "gate", p + "down"}));
  }
  const Model gpt = model_preset("tiny-gpt").value();
  const CheckpointPlan gpt_plan = op_sac(gpt);
  EXPECT_EQ(ops_with(gpt, gpt_plan, 1, OpPolicy::MustSave),
            (std::set<std::string>{"layers.1.qkv", "layers.1.scores", "layers.1.attn_v",
                                   "layers.1.proj", "layers.1.fc1", "layers.1.fc2"}));
  // Outside the layers nothing is checkpointed.
  for (std::size_t i = 0; i < gpt.ops.size(); ++i) {
    if (gpt.ops[i].layer < 0) {
      EXPECT_EQ(gpt_plan.op_policy[i], OpPolicy::MustSave);
    }
  }
}

TEST(OpSac, EveryMatmulSavedAsTheGraphTrainersDefaultPolicySavesThem) {
  // MatmulSaving::Every (`--checkpoint op-sac-all`) saves every listed op: no matmul alternates.
  const Model llama = model_preset("tiny-llama").value();
  CheckpointPlan plan = checkpoint_every(llama, 1);
  ASSERT_TRUE(apply_op_sac_policy(plan, llama, MatmulSaving::Every).ok());
  EXPECT_EQ(ops_with(llama, plan, 1, OpPolicy::MustSave),
            (std::set<std::string>{"layers.1.qkv", "layers.1.attn", "layers.1.o_proj",
                                   "layers.1.gate", "layers.1.up", "layers.1.down"}));
  // On a traced model: the alternating policy's matmuls and the others, and no other op.
  const Model trace = traced("llama");
  CheckpointPlan all = checkpoint_every(trace, 1);
  ASSERT_TRUE(apply_op_sac_policy(all, trace, MatmulSaving::Every).ok());
  const auto every = saved_by_kind(trace, all);
  const auto alternate = saved_by_kind(trace, op_sac(trace));
  for (const std::int32_t layer : {0, 1}) {
    EXPECT_EQ(every.at(layer).at("aten.mm.default"), 7) << layer;  // q, k, v, o, gate, up, down
    EXPECT_EQ(alternate.at(layer).at("aten.mm.default"), 4) << layer;
    auto others = every.at(layer);
    auto alternate_others = alternate.at(layer);
    others.erase("aten.mm.default");
    alternate_others.erase("aten.mm.default");
    EXPECT_EQ(others, alternate_others) << layer;
  }
}

TEST(OpSac, APresetAndTheTraceOfItsArchitectureDecideAlike) {
  // The traced-Llama preset at the fixture's shape (Hugging Face Llama, 2 layers, hidden 64,
  // 4 heads, 2 key/value heads, MLP 176, vocabulary 512, tied head, sequence 32, batch 1).
  TransformerShape shape = model_preset_shape("llama3.2-3b-traced-s4096-b2").value();
  shape.layers = 2;
  shape.hidden = 64;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.ffn = 176;
  shape.vocab = 512;
  shape.sequence = 32;
  shape.micro_batch = 1;
  const Model preset = make_transformer(shape, "traced-llama");
  const Model trace = traced("llama");
  const auto from_preset = saved_by_kind(preset, op_sac(preset));
  EXPECT_EQ(from_preset, saved_by_kind(trace, op_sac(trace)));
  EXPECT_EQ(from_preset.at(0),
            (std::map<std::string, int>{{"aten.mm.default", 4},
                                        {"aten._scaled_dot_product_flash_attention.default", 1}}));
  // The layers run the same operators in the same order. Views are left out: they run no
  // kernel forward, and the trace lists one only where its backward does work (the sum of a
  // tensor's gradients from several readers, a slice's backward).
  const auto forward_kernels = [](const Model& model, std::int32_t layer) {
    std::vector<std::string> kinds;
    for (const ModelOp& op : model.ops) {
      const bool runs = !op.outputs.empty() || op.flops > 0 || op.bytes > Bytes(0);
      if (op.layer == layer && runs) kinds.push_back(op.kind);
    }
    return kinds;
  };
  for (const std::int32_t layer : {0, 1}) {
    EXPECT_EQ(forward_kernels(preset, layer), forward_kernels(trace, layer)) << "layer " << layer;
  }

  // GPT-2: the `tiny-gpt` preset (eager attention, fused QKV) and Hugging Face's GPT-2 at its
  // shape.
  const Model gpt = model_preset("tiny-gpt").value();
  const Model gpt_trace = traced("gpt2");
  const auto gpt_saved = saved_by_kind(gpt, op_sac(gpt));
  EXPECT_EQ(gpt_saved, saved_by_kind(gpt_trace, op_sac(gpt_trace)));
  EXPECT_EQ(gpt_saved.at(1),
            (std::map<std::string, int>{{"aten.addmm.default", 4}, {"aten.bmm.default", 2}}));
}

TEST(OpSac, AnOpWithoutAKindIsNamed) {
  Model model = model_preset("tiny-llama").value();
  std::size_t index = 0;
  while (model.ops[index].layer != 1) ++index;
  model.ops[index].kind.clear();
  CheckpointPlan plan = checkpoint_every(model, 1);
  const Status status = apply_op_sac_policy(plan, model);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.error().message,
            "ops[" + std::to_string(index) +
                "] \"layers.1.attn_norm\": op-sac decides by the operator each op runs, and this "
                "op has no \"kind\"; trace the model again (python -m ferry trace records every "
                "op's operator) or add one (docs/model-format.md)");
}

TEST(SelectivePolicy, RecomputesTheEagerAttentionCoreByWhatItRuns) {
  const Model gpt = model_preset("tiny-gpt").value();
  EXPECT_EQ(ops_with(gpt, selective(gpt), 0, OpPolicy::PreferRecompute),
            (std::set<std::string>{"layers.0.scores", "layers.0.softmax", "layers.0.attn_dropout",
                                   "layers.0.attn_v"}));
  // Hugging Face's GPT-2: from the scores' bmm to the one over the values, with the scaling,
  // the causal mask, the softmax and its dropout between.
  const Model trace = traced("gpt2");
  const CheckpointPlan plan = selective(trace);
  const auto recomputed = ops_with(trace, plan, 1, OpPolicy::PreferRecompute);
  EXPECT_TRUE(recomputed.contains("transformer.h.1.attn/bmm"));
  EXPECT_TRUE(recomputed.contains("transformer.h.1.attn/_softmax"));
  EXPECT_TRUE(recomputed.contains("transformer.h.1.attn/native_dropout"));
  EXPECT_TRUE(recomputed.contains("transformer.h.1.attn/bmm#1"));
  EXPECT_FALSE(recomputed.contains("transformer.h.1.attn.c_attn/addmm"));
  EXPECT_FALSE(recomputed.contains("transformer.h.1.attn.resid_dropout/native_dropout"));
  // And the scaling and the mask between (views cost nothing and are not listed).
  EXPECT_EQ(recomputed.size(), 6U);
  for (const std::string& name : recomputed) {
    EXPECT_TRUE(name.starts_with("transformer.h.1.attn/")) << name;
  }
  // With a fused attention kernel the core is that one op.
  for (const char* family : {"llama", "qwen2"}) {
    const Model flash = traced(family);
    const CheckpointPlan fused = selective(flash);
    for (const std::int32_t layer : {0, 1}) {
      EXPECT_EQ(ops_with(flash, fused, layer, OpPolicy::PreferRecompute),
                (std::set<std::string>{"model.layers." + std::to_string(layer) + "." + kCpuFlash}))
          << family;
    }
  }
  const Model llama = model_preset("tiny-llama").value();
  EXPECT_EQ(ops_with(llama, selective(llama), 1, OpPolicy::PreferRecompute),
            (std::set<std::string>{"layers.1.attn"}));
}

}  // namespace
}  // namespace ferry::sim
