// The transformer presets and the models make_transformer builds: the saved bytes of the
// Korthikanti et al. formula, Llama's with and without flash attention, views of one
// storage, a Llama as a trace lists it, and a checked model.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model_test_support.hpp"

namespace ferry::sim {
namespace {

using model_test::gpt_shape;
using model_test::index_of;
using model_test::llama_shape;
using model_test::saved_activations;

std::int64_t param_count(const Model& model) {
  std::int64_t count = 0;
  for (const ModelTensor& tensor : model.tensors) {
    if (tensor.role == TensorRole::Param) count += tensor.bytes.count() / dtype_size(tensor.dtype);
  }
  return count;
}

// ---------------------------------------------------------------------------------------------
// The Korthikanti et al. formula

TEST(Korthikanti, FormulaMultipliesOut) {
  // s=1024 b=1 h=768 a=12: 34 x 1024 x 768 + 5 x 12 x 1024^2.
  EXPECT_EQ(korthikanti_layer_bytes(gpt_shape(1024, 1, 768, 12)), Bytes(89'653'248));
  // a*s/h need not be whole: s=2048 h=1600 a=25 gives 5as/h = 160, s*b*h = 6'553'600.
  EXPECT_EQ(korthikanti_layer_bytes(gpt_shape(2048, 2, 1600, 25)), Bytes(6'553'600LL * 194));
}

TEST(Korthikanti, GptLayerSavesExactlyTheFormulaBytes) {
  const std::vector<TransformerShape> shapes = {
      gpt_shape(1024, 1, 768, 12), gpt_shape(2048, 2, 1600, 25), gpt_shape(512, 4, 4096, 32),
      gpt_shape(128, 2, 64, 4),    gpt_shape(100, 3, 96, 3),
  };
  for (const TransformerShape& shape : shapes) {
    SCOPED_TRACE(testing::Message() << "s=" << shape.sequence << " b=" << shape.micro_batch
                                    << " h=" << shape.hidden << " a=" << shape.heads);
    const Model model = make_transformer(shape, "gpt");
    ASSERT_TRUE(validate_model(model).ok()) << validate_model(model).error().message;
    for (std::int32_t layer = 0; layer < shape.layers; ++layer) {
      EXPECT_EQ(saved_activation_bytes(model, layer), korthikanti_layer_bytes(shape))
          << "layer " << layer;
    }
  }
}

TEST(Korthikanti, EachTermOfTheFormulaIsItsOwnTensor) {
  const std::int64_t s = 128;
  const std::int64_t b = 2;
  const std::int64_t h = 64;
  const std::int64_t a = 4;
  const std::int64_t sbh = s * b * h;
  const std::int64_t as2b = a * s * s * b;
  const Model model = make_transformer(gpt_shape(s, b, h, a), "gpt");
  const std::map<std::string, std::int64_t> expected = {
      {"embed_dropout.out", 2 * sbh},           // ln1 input: the residual stream
      {"layers.0.ln1.out", 2 * sbh},            // QKV input
      {"layers.0.q", 2 * sbh},                  // QK^T
      {"layers.0.k", 2 * sbh},                  // QK^T
      {"layers.0.softmax.out", 2 * as2b},       // softmax backward
      {"layers.0.attn_dropout.mask", as2b},     // softmax dropout mask
      {"layers.0.attn_dropout.out", 2 * as2b},  // attention over V
      {"layers.0.v", 2 * sbh},                  // attention over V
      {"layers.0.attn_v.out", 2 * sbh},         // output projection input
      {"layers.0.dropout.mask", sbh},           // attention dropout mask
      {"layers.0.attn_residual.out", 2 * sbh},  // ln2 input
      {"layers.0.ln2.out", 2 * sbh},            // fc1 input
      {"layers.0.fc1.out", 8 * sbh},            // GeLU input
      {"layers.0.gelu.out", 8 * sbh},           // fc2 input
      {"layers.0.dropout2.mask", sbh},          // MLP dropout mask
  };
  EXPECT_EQ(saved_activations(model, 0), expected);
  const auto mask = index_of(model.tensors, "layers.0.attn_dropout.mask");
  EXPECT_EQ(model.tensors[mask].dtype, DType::U8);
}

TEST(Korthikanti, ParamsAreSavedButNotCounted) {
  const Model model = make_transformer(gpt_shape(128, 2, 64, 4), "gpt");
  const ModelOp& qkv = model.ops[index_of(model.ops, "layers.1.qkv")];
  const auto weight = index_of(model.tensors, "layers.1.qkv.weight");
  EXPECT_NE(std::find(qkv.saved.begin(), qkv.saved.end(), weight), qkv.saved.end());
  EXPECT_EQ(model.tensors[weight].role, TensorRole::Param);
  const ModelOp& ln = model.ops[index_of(model.ops, "layers.1.ln1")];
  EXPECT_EQ(ln.saved.size(), 2U);  // input and gain; the bias is not needed for backward
}

// ---------------------------------------------------------------------------------------------
// CheckedModel

TEST(CheckedModel, CheckModelKeepsAValidModelAndCopiesShareIt) {
  auto model = model_preset("tiny-gpt");
  ASSERT_TRUE(model.ok()) << model.error().message;
  const std::size_t ops = model.value().ops.size();
  auto checked = check_model(std::move(model).value());
  ASSERT_TRUE(checked.ok()) << checked.error().message;
  const CheckedModel copy = checked.value();
  EXPECT_EQ(copy->name, "tiny-gpt");
  EXPECT_EQ(copy->ops.size(), ops);
  EXPECT_EQ(&copy.model(), &checked.value().model());  // one model, shared
}

// Planted faults: a model validate_model refuses never becomes a CheckedModel, and the error is
// validate_model's, naming the place.
TEST(CheckedModel, CheckModelRefusesWhatValidateModelRefuses) {
  auto model = model_preset("tiny-gpt");
  ASSERT_TRUE(model.ok()) << model.error().message;
  Model unnamed = model.value();
  unnamed.name.clear();
  auto refused = check_model(unnamed);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message, validate_model(unnamed).error().message);
  EXPECT_EQ(refused.error().message, "name: a model needs a non-empty name");

  Model bad_loss = model.value();
  bad_loss.loss = 0;  // the first tensor, not the last op's activation
  auto wrong = check_model(bad_loss);
  ASSERT_FALSE(wrong.ok());
  EXPECT_TRUE(wrong.error().message.starts_with("loss: ")) << wrong.error().message;
}

// Presets

TEST(Presets, EveryPresetValidates) {
  const std::vector<std::string> expected = {
      "gpt2-small-s1024", "gpt2-small-s2048", "llama3-8b-s4096",
      "llama3-8b-s8192",  "llama3-8b-s16384", "titan-llama3-8b-s8192",
      "llama-70b-s4096",  "llama-70b-s8192",  "llama3.2-3b-traced-s4096-b2",
      "tiny-gpt",         "tiny-llama"};
  EXPECT_EQ(model_preset_names(), expected);
  for (const std::string& name : model_preset_names()) {
    SCOPED_TRACE(name);
    const auto model = model_preset(name);
    ASSERT_TRUE(model.ok()) << model.error().message;
    EXPECT_EQ(model.value().name, name);
    const Status status = validate_model(model.value());
    EXPECT_TRUE(status.ok()) << status.error().message;
    for (const ModelOp& op : model.value().ops) {
      EXPECT_EQ(op.duration, SimTime(0)) << op.name;  // durations depend on the device
      EXPECT_GE(op.flops, 0) << op.name;
      // Only a traced model lists ops that move nothing (views: t, view, transpose).
      if (op.outputs.empty() && name.find("traced") != std::string::npos) continue;
      EXPECT_GT(op.bytes.count(), 0) << op.name;
    }
  }
}

TEST(Presets, UnknownNameListsThePresets) {
  const auto model = model_preset("llama3-8b");
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.error().message.find("unknown model preset \"llama3-8b\" (presets: "
                                       "gpt2-small-s1024, gpt2-small-s2048, llama3-8b-s4096"),
            std::string::npos)
      << model.error().message;
}

TEST(Presets, ParamCountsMatchThePublishedModels) {
  const auto gpt2 = model_preset("gpt2-small-s1024");
  const auto llama8 = model_preset("llama3-8b-s8192");
  const auto llama70 = model_preset("llama-70b-s4096");
  ASSERT_TRUE(gpt2.ok() && llama8.ok() && llama70.ok());
  EXPECT_EQ(param_count(gpt2.value()), 124'439'808);      // GPT-2 small, tied head
  EXPECT_EQ(param_count(llama8.value()), 8'030'261'248);  // Llama 3 8B
  EXPECT_EQ(param_count(llama70.value()), 70'553'706'496);
}

TEST(Presets, GptPresetsMatchTheFormula) {
  for (const std::string_view name : {"gpt2-small-s1024", "gpt2-small-s2048", "tiny-gpt"}) {
    SCOPED_TRACE(name);
    const auto shape = model_preset_shape(name);
    const auto model = model_preset(name);
    ASSERT_TRUE(shape.ok() && model.ok());
    for (std::int32_t layer = 0; layer < shape.value().layers; ++layer) {
      EXPECT_EQ(saved_activation_bytes(model.value(), layer),
                korthikanti_layer_bytes(shape.value()));
    }
  }
}

TEST(Presets, OutputHeadAndLossAreNoOffloadAndDropoutDrawsRandomNumbers) {
  const auto model = model_preset("tiny-gpt");
  ASSERT_TRUE(model.ok());
  const Model& m = model.value();
  for (const ModelOp& op : m.ops) {
    const bool head = op.name == "head" || op.name == "loss";
    EXPECT_EQ(op.no_offload, head) << op.name;
    EXPECT_EQ(op.draws_rng, op.name.find("dropout") != std::string::npos) << op.name;
  }
  EXPECT_EQ(m.tensors[m.loss].name, "loss");
  EXPECT_EQ(m.tensors[m.loss].dtype, DType::F32);
  EXPECT_EQ(m.tensors[index_of(m.tensors, "tokens")].bytes, Bytes(128 * 2 * 8));
  EXPECT_EQ(m.tensors[index_of(m.tensors, "tokens")].role, TensorRole::Input);
  EXPECT_EQ(m.ops.size(), 2U * 15 + 5);
}

TEST(MakeTransformer, RefusesShapesItCannotBuild) {
  TransformerShape uneven = gpt_shape(128, 1, 100, 3);
  EXPECT_THROW((void)make_transformer(uneven, "uneven"), InvariantError);
  TransformerShape grouped = llama_shape(128, true);
  grouped.kv_heads = 3;
  EXPECT_THROW((void)make_transformer(grouped, "grouped"), InvariantError);
  TransformerShape huge = gpt_shape(1 << 20, 64, 768, 12);  // 2^56 bytes of attention scores
  EXPECT_THROW((void)make_transformer(huge, "huge"), InvariantError);
  TransformerShape masks = gpt_shape(128, 1, 64, 4);
  masks.dtype = DType::U8;
  EXPECT_THROW((void)make_transformer(masks, "masks"), InvariantError);
}

// How fast it builds is measured by bench_sim's BM_BuildLargestPreset, not here.
TEST(Presets, LargestPresetBuildsAndValidates) {
  const auto model = model_preset("llama-70b-s8192");
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE(validate_model(model.value()).ok());
  EXPECT_EQ(model.value().ops.size(), 80U * 13 + 4);
}

// ---------------------------------------------------------------------------------------------
// Llama

TEST(LlamaModel, FlashAttentionSavedBytesGrowLinearlyInSequence) {
  const Model short_model = make_transformer(llama_shape(256, true), "short");
  const Model long_model = make_transformer(llama_shape(512, true), "long");
  const Bytes short_bytes = saved_activation_bytes(short_model, 0);
  EXPECT_EQ(saved_activation_bytes(long_model, 0), 2 * short_bytes);
  for (const ModelTensor& tensor : long_model.tensors) {
    // No tensor as large as one byte per attention score (a s^2 b), the smallest s^2 tensor.
    EXPECT_LT(tensor.bytes.count(), 8 * 512 * 512 * 2) << tensor.name;
  }
  // sbh (12 + 4 kv/a) + 4 a s b + 8 s b f at 16 bits.
  const std::int64_t s = 256;
  const std::int64_t b = 2;
  const std::int64_t sbh = s * b * 256;
  EXPECT_EQ(short_bytes, Bytes(sbh * 12 + sbh * 4 * 2 / 8 + 4 * 8 * s * b + 8 * s * b * 704));
}

TEST(LlamaModel, FlashAttentionCountsTheCausalPairsTheEagerMatmulsEveryPair) {
  const std::int64_t s = 256;
  const std::int64_t b = 2;
  const std::int64_t h = 256;
  const auto attention_flops = [](const Model& model, std::int64_t ModelOp::*field) {
    std::int64_t total = 0;
    for (const ModelOp& op : model.ops) {
      if (op.layer == 0 && (op.kind == "aten._scaled_dot_product_flash_attention.default" ||
                            op.kind == "aten.bmm.default")) {
        total += op.*field;
      }
    }
    return total;
  };
  const Model flash = make_transformer(llama_shape(s, true), "flash");
  const Model eager = make_transformer(llama_shape(s, false), "eager");
  // Two matmuls of 2 b (s(s+1)/2) h FLOPs forward and five backward: the pairs at or below the
  // diagonal, which a causal FlashAttention kernel computes; the eager matmuls compute all s^2.
  EXPECT_EQ(attention_flops(flash, &ModelOp::flops), 2 * b * h * s * (s + 1));
  EXPECT_EQ(attention_flops(flash, &ModelOp::backward_flops), 5 * b * h * s * (s + 1));
  EXPECT_EQ(attention_flops(eager, &ModelOp::flops), 2 * 2 * b * s * s * h);
  const Model traced = make_transformer(
      [&] {
        TransformerShape shape = llama_shape(s, true);
        shape.kind = TransformerShape::Kind::LlamaTraced;
        return shape;
      }(),
      "traced");
  EXPECT_EQ(attention_flops(traced, &ModelOp::flops), 2 * b * h * s * (s + 1));
}

TEST(LlamaModel, WithoutFlashAttentionTheProbabilitiesAreSaved) {
  const std::int64_t s = 256;
  const std::int64_t b = 2;
  const std::int64_t a = 8;
  const Model flash = make_transformer(llama_shape(s, true), "flash");
  const Model eager = make_transformer(llama_shape(s, false), "eager");
  ASSERT_TRUE(validate_model(eager).ok());
  // The probabilities (2 a s^2 b) replace the logsumexp (4 a s b).
  EXPECT_EQ(saved_activation_bytes(eager, 1) - saved_activation_bytes(flash, 1),
            Bytes(2 * a * s * s * b - 4 * a * s * b));
}

TEST(LlamaModel, SavesTheDocumentedSet) {
  const Model model = make_transformer(llama_shape(64, true), "llama");
  const std::int64_t sbh = 64 * 2 * 256;
  const std::int64_t kv = sbh * 2 / 8;
  const std::int64_t sbf = 64 * 2 * 704;
  const std::map<std::string, std::int64_t> expected = {
      {"embed.out", 2 * sbh},
      {"layers.0.attn_norm.out", 2 * sbh},
      {"layers.0.rotary.q", 2 * sbh},
      {"layers.0.rotary.k", 2 * kv},
      {"layers.0.v", 2 * kv},
      {"layers.0.attn.out", 2 * sbh},
      {"layers.0.attn.lse", 8 * 64 * 2 * 4},
      {"layers.0.attn_residual.out", 2 * sbh},
      {"layers.0.mlp_norm.out", 2 * sbh},
      {"layers.0.gate.out", 2 * sbf},
      {"layers.0.silu.out", 2 * sbf},
      {"layers.0.up.out", 2 * sbf},
      {"layers.0.mul.out", 2 * sbf},
  };
  EXPECT_EQ(saved_activations(model, 0), expected);
  const ModelOp& rotary = model.ops[index_of(model.ops, "layers.0.rotary")];
  ASSERT_EQ(rotary.saved.size(), 1U);
  EXPECT_EQ(model.tensors[rotary.saved[0]].role, TensorRole::Buffer);
  for (const ModelTensor& tensor : model.tensors) {
    EXPECT_EQ(tensor.name.find(".bias"), std::string::npos) << tensor.name;
  }
}

// ---------------------------------------------------------------------------------------------
// Views

TEST(Views, QueryKeyValueAreSlicesOfTheProjectionOutput) {
  for (const std::string_view name : {"tiny-gpt", "tiny-llama"}) {
    SCOPED_TRACE(name);
    const auto result = model_preset(name);
    ASSERT_TRUE(result.ok());
    const Model& model = result.value();
    const auto base = index_of(model.tensors, "layers.1.qkv.out");
    const auto q = index_of(model.tensors, "layers.1.q");
    const auto k = index_of(model.tensors, "layers.1.k");
    const auto v = index_of(model.tensors, "layers.1.v");
    for (const auto view : {q, k, v}) {
      EXPECT_EQ(model.tensors[view].view_of, static_cast<std::int32_t>(base));
    }
    EXPECT_EQ(model.tensors[q].view_offset, Bytes(0));
    EXPECT_EQ(model.tensors[k].view_offset, model.tensors[q].bytes);
    EXPECT_EQ(model.tensors[v].view_offset, model.tensors[q].bytes + model.tensors[k].bytes);
    EXPECT_EQ(model.tensors[v].view_offset + model.tensors[v].bytes, model.tensors[base].bytes);
    // The projection produces its output and the three views of it.
    const ModelOp& qkv = model.ops[index_of(model.ops, "layers.1.qkv")];
    const std::vector<std::uint32_t> outputs = {
        static_cast<std::uint32_t>(base), static_cast<std::uint32_t>(q),
        static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(v)};
    EXPECT_EQ(qkv.outputs, outputs);
    // V is saved as a view; its base is never saved, so the views' storage is shared.
    bool v_saved = false;
    for (const ModelOp& op : model.ops) {
      EXPECT_EQ(std::count(op.saved.begin(), op.saved.end(), base), 0) << op.name;
      v_saved = v_saved || std::count(op.saved.begin(), op.saved.end(), v) > 0;
    }
    EXPECT_TRUE(v_saved);
  }
}

TEST(Views, SharedTensorsAreCountedOnce) {
  const auto result = model_preset("tiny-llama");
  ASSERT_TRUE(result.ok());
  const Model& model = result.value();
  // gate and up both save mlp_norm's output; o_proj and attn both save the attention output.
  const auto norm = index_of(model.tensors, "layers.0.mlp_norm.out");
  const auto out = index_of(model.tensors, "layers.0.attn.out");
  int norm_saves = 0;
  int out_saves = 0;
  for (const ModelOp& op : model.ops) {
    norm_saves += static_cast<int>(std::count(op.saved.begin(), op.saved.end(), norm));
    out_saves += static_cast<int>(std::count(op.saved.begin(), op.saved.end(), out));
  }
  EXPECT_EQ(norm_saves, 2);
  EXPECT_EQ(out_saves, 2);
  EXPECT_EQ(saved_activations(model, 0).count("layers.0.mlp_norm.out"), 1U);
}

TEST(TracedLlama, ListsWhatATraceOfAHuggingFaceLlamaLists) {
  // Note [A Llama as a trace lists it]: the ops of one layer, the views of one storage that the
  // rotary op writes for every layer, the head without offload and the float loss after it.
  TransformerShape shape = llama_shape(128, true);
  shape.kind = TransformerShape::Kind::LlamaTraced;
  shape.layers = 3;
  const Model m = make_transformer(shape, "traced");
  ASSERT_TRUE(validate_model(m).ok()) << validate_model(m).error().message;
  for (std::int32_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(std::count_if(m.ops.begin(), m.ops.end(),
                            [&](const ModelOp& op) { return op.layer == layer; }),
              74);
  }
  const ModelOp& cos = m.ops[index_of(m.ops, "model.rotary_emb/_to_copy#2")];
  EXPECT_EQ(cos.outputs.size(), 1U + 3U);
  for (std::size_t k = 1; k < cos.outputs.size(); ++k) {
    EXPECT_EQ(m.tensors[cos.outputs[k]].view_of, static_cast<std::int32_t>(cos.outputs[0]));
  }
  EXPECT_TRUE(m.ops[index_of(m.ops, "lm_head/mm")].no_offload);
  const ModelOp& log_softmax = m.ops[index_of(m.ops, "_log_softmax")];
  EXPECT_FALSE(log_softmax.no_offload);
  ASSERT_EQ(log_softmax.saved.size(), 1U);
  EXPECT_EQ(m.tensors[log_softmax.saved[0]].bytes, Bytes(128 * 2 * 1000 * 4));
  // Nobody saves the norms' float intermediates or the projections' outputs.
  const std::size_t pow = index_of(m.tensors, "model.layers.1.input_layernorm/pow.out");
  const std::size_t q = index_of(m.tensors, "model.layers.1.self_attn.q_proj/mm.out");
  for (const ModelOp& op : m.ops) {
    for (const std::uint32_t t : op.saved) {
      EXPECT_NE(t, pow);
      EXPECT_NE(t, q);
    }
  }
  // The preset saves, per layer, what the trace of Llama-3.2-3B at sequence 4096 and batch 2
  // (`python -m ferry trace`, transformers 5.23) saves: 23 tensors, 1,278,017,536 bytes.
  const auto preset = model_preset("llama3.2-3b-traced-s4096-b2");
  ASSERT_TRUE(preset.ok());
  EXPECT_EQ(saved_activation_bytes(preset.value(), 0), Bytes(1'278'017'536));
}

}  // namespace
}  // namespace ferry::sim
