#include "ferry/sim/workload/model.hpp"
#include "ferry/sim/io/model_json.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/io/program_json.hpp"

namespace ferry::sim {
namespace {

const std::filesystem::path kScenarioDir = FERRY_SCENARIOS_DIR;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TransformerShape gpt_shape(std::int64_t s, std::int64_t b, std::int64_t h, std::int64_t a) {
  TransformerShape shape;
  shape.kind = TransformerShape::Kind::Gpt;
  shape.layers = 2;
  shape.hidden = h;
  shape.heads = a;
  shape.kv_heads = a;
  shape.ffn = 4 * h;
  shape.vocab = 1000;
  shape.sequence = s;
  shape.micro_batch = b;
  return shape;
}

TransformerShape llama_shape(std::int64_t s, bool flash) {
  TransformerShape shape;
  shape.kind = TransformerShape::Kind::Llama;
  shape.layers = 2;
  shape.hidden = 256;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.ffn = 704;
  shape.vocab = 1000;
  shape.sequence = s;
  shape.micro_batch = 2;
  shape.flash_attention = flash;
  return shape;
}

/// The index of the tensor or op called `name`; fails the test when there is none.
template <class Item>
std::size_t index_of(const std::vector<Item>& items, std::string_view name) {
  const auto it =
      std::find_if(items.begin(), items.end(), [&](const Item& item) { return item.name == name; });
  EXPECT_NE(it, items.end()) << name;
  return static_cast<std::size_t>(it - items.begin());
}

/// Name -> bytes of the distinct activations the ops of `layer` save.
std::map<std::string, std::int64_t> saved_activations(const Model& model, std::int32_t layer) {
  std::map<std::string, std::int64_t> saved;
  for (const ModelOp& op : model.ops) {
    if (op.layer != layer) continue;
    for (const std::uint32_t t : op.saved) {
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.role == TensorRole::Activation) saved[tensor.name] = tensor.bytes.count();
    }
  }
  return saved;
}

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

// ---------------------------------------------------------------------------------------------
// Roofline timing

DeviceProfile round_device(std::int64_t flops_per_s, std::int64_t bytes_per_s) {
  DeviceProfile device;
  device.name = "round";
  device.flops_per_s = flops_per_s;
  device.memory_bandwidth = Bandwidth(bytes_per_s);
  return device;
}

TEST(Roofline, DurationIsTheSlowerOfComputeAndMemoryAtTheAssumedEfficiencies) {
  Model model;
  model.name = "m";
  model.tensors.push_back(
      {"y", Bytes(4), DType::F32, TensorRole::Activation, -1, Bytes(0), false, Bytes(0), 0});
  ModelOp compute_bound;
  compute_bound.name = "matmul";
  compute_bound.flops = 600'000'000'000;   // 1 ms at 60% of 1 PFLOP/s
  compute_bound.bytes = Bytes(8'000'000);  // 10 us at 80% of 1 TB/s
  compute_bound.backward_flops = 1'200'000'000'000;
  compute_bound.backward_bytes = Bytes(16'000'000);
  ModelOp memory_bound;
  memory_bound.name = "add";
  memory_bound.flops = 1000;
  memory_bound.bytes = Bytes(800'000'001);  // 1 ms + a fraction of a ns
  memory_bound.backward_flops = 0;
  memory_bound.backward_bytes = Bytes(0);
  memory_bound.outputs = {0};
  model.ops = {compute_bound, memory_bound};
  ASSERT_TRUE(validate_model(model).ok()) << validate_model(model).error().message;

  assign_roofline_durations(model, round_device(1'000'000'000'000'000, 1'000'000'000'000));
  EXPECT_EQ(model.ops[0].duration, SimTime(1'000'000));
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(2'000'000));
  EXPECT_EQ(model.ops[1].duration, SimTime(1'000'001));   // rounded up
  EXPECT_EQ(model.ops[1].backward_duration, SimTime(1));  // at least 1 ns
}

/// A device of 4 SMs with 128 x 128 tiles, a peak of 1.024 PFLOP/s and 1 TB/s, whose GEMMs
/// reach half the peak, flash attention a quarter forward and an eighth backward, and streaming
/// kernels 90 % of the bandwidth.
DeviceProfile kernel_device() {
  DeviceProfile device = round_device(1'024'000'000'000'000, 1'000'000'000'000);
  device.kernels = KernelFigures{.sm_count = 4,
                                 .matmul_tile_m = 128,
                                 .matmul_tile_n = 128,
                                 .matmul_permille = 500,
                                 .flash_forward_permille = 250,
                                 .flash_backward_permille = 125,
                                 .memory_permille = 900};
  return device;
}

ModelOp gemm_op(std::int64_t m, std::int64_t n, std::int64_t k) {
  ModelOp op;
  op.name = "mm";
  op.kind = "aten.mm.default";
  op.flops = 2 * m * n * k;
  op.backward_flops = 4 * m * n * k;
  op.gemm = GemmShape{.m = m, .n = n, .k = k, .batch = 1};
  return op;
}

TEST(KernelTiming, AMatmulPaysForWholeWavesOfTiles) {
  // One SM's share of the GEMM rate: 1.024e15 x 0.5 / 4 = 1.28e14 FLOP/s, so one wave of
  // 128 x 128 tiles over k = 1000 (32.768 MFLOP) takes 256 ns.
  Model model;
  model.ops = {gemm_op(512, 128, 1000), gemm_op(513, 128, 1000), gemm_op(1, 1, 1000)};
  assign_roofline_durations(model, kernel_device());
  EXPECT_EQ(model.ops[0].duration, SimTime(256));  // 4 tiles: one full wave
  EXPECT_EQ(model.ops[1].duration, SimTime(512));  // 5 tiles: a second wave for one tile
  EXPECT_EQ(model.ops[2].duration, SimTime(256));  // smaller than a tile: a whole one
  // Backward: dX (512 x 1000 over 128: 4 x 8 = 32 tiles, 8 waves of 32.768 ns) and dW
  // (1000 x 128 over 512: 8 tiles, 2 waves of 131.072 ns), 524.288 ns rounded up.
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(525));
  // A frozen weight: backward has half the FLOPs, and half the two products' time.
  model.ops[0].backward_flops /= 2;
  assign_roofline_durations(model, kernel_device());
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(263));
  // Without kernel figures the same op takes the flat roofline's 60 %.
  assign_roofline_durations(model, round_device(1'024'000'000'000'000, 1'000'000'000'000));
  EXPECT_EQ(model.ops[0].duration, SimTime(214));  // 131,072,000 FLOP at 614.4 TFLOP/s
}

TEST(KernelTiming, AttentionRunsAtItsKernelsFigureAndBytesAtTheMeasuredBandwidth) {
  Model model;
  ModelOp flash;
  flash.name = "attn";
  flash.kind = "aten._scaled_dot_product_flash_attention.default";
  flash.flops = 256'000'000;  // 1 us at a quarter of 1.024 PFLOP/s
  flash.backward_flops = 640'000'000;
  ModelOp efficient = flash;
  efficient.name = "attn2";
  efficient.kind = "aten._scaled_dot_product_efficient_attention.default";  // no figure: 60 %
  ModelOp add;
  add.name = "add";
  add.kind = "aten.add.Tensor";
  add.flops = 1000;
  add.bytes = Bytes(900'000);  // 1 us at 90 % of 1 TB/s
  ModelOp mm_without_shape;
  mm_without_shape.name = "mm";
  mm_without_shape.kind = "aten.mm.default";
  mm_without_shape.flops = 512'000'000;  // 1 us at half the peak
  model.ops = {flash, efficient, add, mm_without_shape};
  assign_roofline_durations(model, kernel_device());
  EXPECT_EQ(model.ops[0].duration, SimTime(1000));
  EXPECT_EQ(model.ops[0].backward_duration, SimTime(5000));  // at an eighth
  EXPECT_EQ(model.ops[1].duration, SimTime(417));            // 256 MFLOP at 614.4 TFLOP/s
  EXPECT_EQ(model.ops[2].duration, SimTime(1000));
  EXPECT_EQ(model.ops[3].duration, SimTime(1000));
}

TEST(KernelTiming, PresetsGiveTheirMatmulsShapes) {
  const auto model = model_preset("llama3-8b-s8192");
  ASSERT_TRUE(model.ok());
  const ModelOp& gate = model.value().ops[index_of(model.value().ops, "layers.0.gate")];
  EXPECT_EQ(gate.gemm, (GemmShape{.m = 8192, .n = 14336, .k = 4096, .batch = 1}));
  const auto again = parse_model(model_to_json(model.value()), "written.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
}

TEST(Roofline, DurationsArePositiveAndScaleWithTheDevice) {
  const auto h100 = load_device_profile(kScenarioDir / "devices", "h100-sxm-pcie5");
  const auto a100 = load_device_profile(kScenarioDir / "devices", "a100-pcie4");
  ASSERT_TRUE(h100.ok() && a100.ok());
  auto fast = model_preset("gpt2-small-s1024");
  ASSERT_TRUE(fast.ok());
  Model slow = fast.value();
  assign_roofline_durations(fast.value(), h100.value());
  assign_roofline_durations(slow, a100.value());
  SimTime fast_total;
  SimTime slow_total;
  for (std::size_t i = 0; i < slow.ops.size(); ++i) {
    const ModelOp& f = fast.value().ops[i];
    const ModelOp& s = slow.ops[i];
    EXPECT_GE(f.duration, SimTime(1)) << f.name;
    EXPECT_GE(f.backward_duration, SimTime(1)) << f.name;
    EXPECT_GT(s.duration, f.duration) << s.name;  // the A100 is slower at both FLOPs and bytes
    fast_total += f.duration + f.backward_duration;
    slow_total += s.duration + s.backward_duration;
  }
  EXPECT_GT(slow_total, fast_total);

  // Twice the peak and twice the bandwidth: every duration halves, to within rounding.
  DeviceProfile doubled = h100.value();
  doubled.flops_per_s *= 2;
  doubled.memory_bandwidth = Bandwidth(2 * doubled.memory_bandwidth.bytes_per_s());
  Model faster = fast.value();
  assign_roofline_durations(faster, doubled);
  for (std::size_t i = 0; i < faster.ops.size(); ++i) {
    const std::int64_t before = fast.value().ops[i].duration.ns();
    const std::int64_t after = faster.ops[i].duration.ns();
    EXPECT_LE(std::abs(2 * after - before), 2) << faster.ops[i].name;
  }
}

// ---------------------------------------------------------------------------------------------
// JSON

void expect_round_trip(const Model& model) {
  const std::string written = model_to_json(model);
  const auto again = parse_model(written, "written.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_TRUE(again.value() == model);
  EXPECT_EQ(model_to_json(again.value()), written);
}

TEST(ModelJson, PresetsRoundTrip) {
  for (const std::string_view name : {"tiny-gpt", "tiny-llama", "gpt2-small-s1024"}) {
    SCOPED_TRACE(name);
    auto model = model_preset(name);
    ASSERT_TRUE(model.ok());
    expect_round_trip(model.value());
    assign_roofline_durations(model.value(),
                              round_device(1'000'000'000'000'000, 1'000'000'000'000));
    expect_round_trip(model.value());
  }
}

TEST(ModelJson, WritesKeysInAFixedOrder) {
  auto model = model_preset("tiny-gpt");
  ASSERT_TRUE(model.ok());
  const std::string written = model_to_json(model.value());
  EXPECT_EQ(written.rfind("{\n  \"format\": \"ferry.model/1\",\n  \"name\": \"tiny-gpt\",\n"
                          "  \"tensors\": [\n    {\n      \"name\": \"tokens\",\n"
                          "      \"bytes\": 2048,\n      \"dtype\": \"i64\",\n"
                          "      \"role\": \"input\"\n    },",
                          0),
            0U)
      << written.substr(0, 300);
  EXPECT_NE(written.find("\"view_of\": \"layers.0.qkv.out\",\n      \"view_offset\": 32768"),
            std::string::npos);
  EXPECT_EQ(written.substr(written.size() - 19), "  \"loss\": \"loss\"\n}\n");
}

TEST(ModelJson, ScenarioModelsParseAndRoundTrip) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(kScenarioDir / "models")) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 2U);
  for (const auto& file : files) {
    SCOPED_TRACE(file.string());
    const auto model = parse_model(read_file(file), file.string());
    ASSERT_TRUE(model.ok()) << model.error().message;
    expect_round_trip(model.value());
  }
}

TEST(ModelJson, TheMlpScenarioHasViewsParamsAndAnOffloadOptOut) {
  const auto path = kScenarioDir / "models" / "mlp.json";
  const auto result = parse_model(read_file(path), path.string());
  ASSERT_TRUE(result.ok()) << result.error().message;
  const Model& model = result.value();
  ASSERT_EQ(model.ops.size(), 4U);
  const auto up = index_of(model.tensors, "up");
  EXPECT_EQ(model.tensors[up].view_of,
            static_cast<std::int32_t>(index_of(model.tensors, "fc1.out")));
  EXPECT_EQ(model.tensors[up].view_offset, Bytes(2048));
  EXPECT_EQ(model.tensors[index_of(model.tensors, "fc1.weight")].role, TensorRole::Param);
  EXPECT_TRUE(model.ops.back().no_offload);
  EXPECT_EQ(model.tensors[model.loss].name, "loss");
}

TEST(ModelJson, AnUnusedBranchIsAllowed) {
  const auto path = kScenarioDir / "models" / "unused_branch.json";
  const auto result = parse_model(read_file(path), path.string());
  ASSERT_TRUE(result.ok()) << result.error().message;
  const Model& model = result.value();
  const auto probe = static_cast<std::uint32_t>(index_of(model.tensors, "probe.out"));
  for (const ModelOp& op : model.ops) {
    EXPECT_EQ(std::count(op.inputs.begin(), op.inputs.end(), probe), 0) << op.name;
  }
  EXPECT_TRUE(model.tensors[index_of(model.tensors, "norm.out")].no_offload);
  EXPECT_EQ(model.tensors[index_of(model.tensors, "norm.running_mean")].role, TensorRole::Buffer);
  EXPECT_TRUE(model.ops[index_of(model.ops, "dropout")].draws_rng);
  EXPECT_EQ(saved_activation_bytes(model, 0), Bytes(16384 + 8192));  // fc.out and the mask
}

TEST(ModelJson, TheDocumentedExamplesParse) {
  const std::string text = read_file(FERRY_TESTS_DIR "/../docs/model-format.md");
  const std::string fence = "```json\n";
  std::size_t examples = 0;
  for (auto at = text.find(fence); at != std::string::npos; at = text.find(fence, at)) {
    at += fence.size();
    const auto end = text.find("```", at);
    ASSERT_NE(end, std::string::npos);
    const auto model = parse_model(text.substr(at, end - at), "model-format.md");
    EXPECT_TRUE(model.ok()) << model.error().message;
    ++examples;
  }
  EXPECT_GE(examples, 1U);
}

// ---------------------------------------------------------------------------------------------
// Bad models

constexpr std::string_view kValidModel = R"({
  "format": "ferry.model/1",
  "name": "toy",
  "tensors": [
    {"name": "x", "bytes": 64, "dtype": "bf16", "role": "input"},
    {"name": "w", "bytes": 128, "dtype": "bf16", "role": "param"},
    {"name": "h", "bytes": 64, "dtype": "bf16", "role": "activation"},
    {"name": "h_lo", "bytes": 32, "dtype": "bf16", "role": "activation", "view_of": "h",
     "view_offset": 0},
    {"name": "y", "bytes": 4, "dtype": "f32", "role": "activation"}
  ],
  "ops": [
    {"name": "fc", "layer": 0, "flops": 100, "bytes": 256, "backward_flops": 200,
     "backward_bytes": 512, "inputs": ["x", "w"], "outputs": ["h", "h_lo"], "saved": ["x", "w"]},
    {"name": "sum", "flops": 16, "bytes": 36, "backward_flops": 32, "backward_bytes": 72,
     "inputs": ["h_lo"], "outputs": ["y"], "saved": []}
  ],
  "loss": "y"
})";

/// The valid model with the one occurrence of `from` replaced by `to`.
std::string valid_with(std::string_view from, std::string_view to) {
  std::string text(kValidModel);
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(text.find(from, at + 1), std::string::npos) << "ambiguous: " << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST(ModelJson, AnOpsKindIsReadAndWrittenBack) {
  const std::string text =
      valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "aten.mm.default",)");
  auto model = parse_model(text, "toy.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  EXPECT_EQ(model.value().ops[0].kind, "aten.mm.default");
  EXPECT_EQ(model.value().ops[1].kind, "");
  const std::string written = model_to_json(model.value());
  EXPECT_NE(written.find(R"("name": "fc",
      "kind": "aten.mm.default",
      "layer": 0,)"),
            std::string::npos)
      << written;
  auto again = parse_model(written, "again.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
  // Other namespaces and higher-order operators are operators too.
  for (const char* kind : {"_c10d_functional.reduce_scatter_tensor.default",
                           "higher_order.flex_attention", "ferry.rotary.default"}) {
    Model other = model.value();
    other.ops[0].kind = kind;
    EXPECT_TRUE(validate_model(other).ok()) << kind;
  }
}

TEST(ModelJson, TheParallelismSectionIsReadAndWrittenBack) {
  const std::string text = valid_with(
      R"("loss": "y")",
      R"("loss": "y", "parallelism": {"fsdp": 16, "nodes": 2, "hsdp": 2, "reshard_after_forward": 4})");
  auto model = parse_model(text, "toy.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  EXPECT_EQ(model.value().parallelism,
            (Parallelism{
                .ranks = 16, .nodes = 2, .replicas = 2, .reshard_after_forward = Reshard::K(4)}));
  auto again = parse_model(model_to_json(model.value()), "again.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
  auto kept = parse_model(
      valid_with(R"("loss": "y")",
                 R"("loss": "y", "parallelism": {"fsdp": 8, "reshard_after_forward": false})"),
      "toy.json");
  ASSERT_TRUE(kept.ok()) << kept.error().message;
  EXPECT_EQ(kept.value().parallelism.reshard_after_forward, Reshard::False());
  EXPECT_EQ(kept.value().parallelism.nodes, 0);
  // Tensor parallelism, with FSDP or alone (no "fsdp" then).
  // Context and expert parallelism, with FSDP.
  for (const auto& [section, expected] : std::vector<std::pair<std::string, Parallelism>>{
           {R"({"fsdp": 2, "cp": 4})", Parallelism{.ranks = 2, .cp = 4}},
           {R"({"fsdp": 8, "ep": 4})", Parallelism{.ranks = 8, .ep = 4}},
       }) {
    SCOPED_TRACE(section);
    auto mesh = parse_model(
        valid_with(R"("loss": "y")", R"("loss": "y", "parallelism": )" + section), "toy.json");
    ASSERT_TRUE(mesh.ok()) << mesh.error().message;
    EXPECT_EQ(mesh.value().parallelism, expected);
    auto back = parse_model(model_to_json(mesh.value()), "again.json");
    ASSERT_TRUE(back.ok()) << back.error().message;
    EXPECT_EQ(back.value(), mesh.value());
  }
  for (const std::string section : {R"({"fsdp": 4, "tp": 2})", R"({"tp": 2})"}) {
    SCOPED_TRACE(section);
    auto sharded = parse_model(
        valid_with(R"("loss": "y")", R"("loss": "y", "parallelism": )" + section), "toy.json");
    ASSERT_TRUE(sharded.ok()) << sharded.error().message;
    EXPECT_EQ(sharded.value().parallelism.tp, 2);
    EXPECT_EQ(sharded.value().parallelism.ranks, section.find("fsdp") == std::string::npos ? 0 : 4);
    const std::string written = model_to_json(sharded.value());
    EXPECT_NE(written.find(R"("tp": 2)"), std::string::npos) << written;
    auto back = parse_model(written, "again.json");
    ASSERT_TRUE(back.ok()) << back.error().message;
    EXPECT_EQ(back.value(), sharded.value());
  }
  // Without the section: one GPU, and none is written.
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain.value().parallelism.on());
  EXPECT_EQ(model_to_json(plain.value()).find("parallelism"), std::string::npos);
}

TEST(ModelJson, ABadParallelismSectionIsNamed) {
  for (const auto& [section, where] : std::vector<std::pair<std::string, std::string>>{
           {R"({"fsdp": 0})", "parallelism.fsdp"},
           {R"({"nodes": 2})", "fsdp"},
           {R"({"fsdp": 8, "hsdp": 0})", "parallelism.hsdp"},
           {R"({"fsdp": 8, "reshard_after_forward": 1})", "parallelism.reshard_after_forward"},
           {R"({"fsdp": 8, "reshard_after_forward": "yes"})", "parallelism.reshard_after_forward"},
           {R"({"fsdp": 8, "tp": 0})", "parallelism.tp"},
           {R"({"tp": 2048})", "parallelism.tp"},
           {R"({"fsdp": 8, "cp": 0})", "parallelism.cp"},
           {R"({"cp": 2})", "fsdp"},
           {R"({"fsdp": 8, "ep": 0})", "parallelism.ep"},
           {R"({"fsdp": 8, "pp": 2})", "pp"},
       }) {
    auto model = parse_model(
        valid_with(R"("loss": "y")", R"("loss": "y", "parallelism": )" + section), "toy.json");
    ASSERT_FALSE(model.ok()) << section;
    EXPECT_NE(model.error().message.find(where), std::string::npos)
        << section << ": " << model.error().message;
  }
}

// A static-capacity buffer (docs/model-format.md, Tensors): a base activation allocated for
// more than its bytes, with its rows of data; read, written back, and refused where it is not
// that, naming the member.
TEST(ModelJson, AStaticCapacityIsReadWrittenBackAndChecked) {
  const std::string h = R"({"name": "h", "bytes": 64, "dtype": "bf16", "role": "activation")";
  auto padded = parse_model(valid_with(h, h + R"(, "capacity": 256, "rows": 4)"), "toy.json");
  ASSERT_TRUE(padded.ok()) << padded.error().message;
  EXPECT_EQ(padded.value().tensors[2].capacity, Bytes(256));
  EXPECT_EQ(padded.value().tensors[2].rows, 4);
  EXPECT_EQ(allocated_bytes(padded.value().tensors[2]), Bytes(256));
  EXPECT_TRUE(has_static_capacity(padded.value()));
  auto back = parse_model(model_to_json(padded.value()), "again.json");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back.value(), padded.value());
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(has_static_capacity(plain.value()));
  EXPECT_EQ(model_to_json(plain.value()).find("capacity"), std::string::npos);

  const std::string lo = R"("view_offset": 0})";
  for (const auto& [from, to, where] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {h, h + R"(, "capacity": 32, "rows": 4)", "tensors[2].capacity"},   // below its bytes
           {h, h + R"(, "capacity": 257, "rows": 4)", "tensors[2].capacity"},  // half an element
           {h, h + R"(, "capacity": 256)", "tensors[2].capacity"},             // the member given
           {h, h + R"(, "rows": 4)", "tensors[2].rows"},
           {h, h + R"(, "capacity": 256, "rows": 5)", "tensors[2].rows"},
           {lo, R"("view_offset": 0, "capacity": 64, "rows": 2})", "tensors[3].capacity"},
       }) {
    auto bad = parse_model(valid_with(from, to), "toy.json");
    ASSERT_FALSE(bad.ok()) << to;
    EXPECT_NE(bad.error().message.find(where), std::string::npos)
        << to << ": " << bad.error().message;
  }
}

TEST(ModelJson, TheRoutingAssumptionIsReadAndWrittenBack) {
  for (const auto& [section, want] : std::vector<std::pair<std::string, RoutingAssumption>>{
           {R"({"assumption": "balanced"})", {.assumption = "balanced"}},
           {R"({"assumption": "loads", "loads": [4, 2, 0, 1.5]})",
            {.assumption = "loads", .loads = {4, 2, 0, 1.5}}},
           {R"({"assumption": "random", "seed": 7})", {.assumption = "random", .seed = 7}},
           {R"({"assumption": "random", "seed": 0, "capacity_factor": 1.25})",
            {.assumption = "random", .capacity_factor = 1.25}},
       }) {
    SCOPED_TRACE(section);
    auto model = parse_model(valid_with(R"("loss": "y")", R"("loss": "y", "routing": )" + section),
                             "toy.json");
    ASSERT_TRUE(model.ok()) << model.error().message;
    EXPECT_EQ(model.value().routing, want);
    const std::string text = model_to_json(model.value());
    auto again = parse_model(text, "again.json");
    ASSERT_TRUE(again.ok()) << again.error().message;
    EXPECT_EQ(again.value(), model.value());
    // Whole loads are written as integers, as the trace writes them.
    if (want.assumption == "loads") {
      EXPECT_NE(text.find("4,\n      2,\n      0,\n      1.5"), std::string::npos) << text;
    }
  }
  // Without the member: none assumed, and none is written.
  auto plain = parse_model(std::string(kValidModel), "toy.json");
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain.value().routing.assumption.empty());
  EXPECT_EQ(model_to_json(plain.value()).find("routing"), std::string::npos);
}

TEST(ModelJson, ABadRoutingAssumptionIsNamed) {
  for (const auto& [section, message] : std::vector<std::pair<std::string, std::string>>{
           {R"("balanced")", R"(toy.json: routing: expected an object, got a string "balanced")"},
           {R"({"assumption": "uniform"})",
            R"(toy.json: routing.assumption: expected "balanced", "loads" or "random", got )"
            R"("uniform")"},
           {R"({"loads": [1]})", R"(toy.json: routing: missing required key "assumption")"},
           {R"({"assumption": "loads"})", R"(toy.json: routing: missing required key "loads")"},
           {R"({"assumption": "loads", "loads": [0, 0]})",
            R"(toy.json: routing: "loads": expected at least one load above 0)"},
           {R"({"assumption": "loads", "loads": [1, -1]})",
            "toy.json: routing.loads[1]: expected a number >= 0"},
           {R"({"assumption": "loads", "loads": [1, "2"]})",
            "toy.json: routing.loads[1]: expected a number >= 0"},
           {R"({"assumption": "balanced", "seed": 1})",
            R"(toy.json: routing.seed: "seed" applies to the assumption "random" only)"},
           {R"({"assumption": "random", "seed": 1, "loads": [1]})",
            R"(toy.json: routing.loads: "loads" applies to the assumption "loads" only)"},
           {R"({"assumption": "random"})", R"(toy.json: routing: missing required key "seed")"},
           {R"({"assumption": "random", "seed": -1})",
            "toy.json: routing.seed: expected a non-negative integer, got -1"},
           {R"({"assumption": "random", "seed": 1, "capacity_factor": 0.5})",
            "toy.json: routing.capacity_factor: expected a number >= 1"},
           {R"({"assumption": "random", "seed": 1, "top_k": 2})",
            R"(toy.json: routing: unknown key "top_k" (allowed: assumption, loads, seed, )"
            "capacity_factor)"},
       }) {
    SCOPED_TRACE(section);
    auto model = parse_model(valid_with(R"("loss": "y")", R"("loss": "y", "routing": )" + section),
                             "toy.json");
    ASSERT_FALSE(model.ok());
    EXPECT_EQ(model.error().message, message);
  }
}

struct BadCase {
  std::string name;
  std::string text;
  std::string expected;  // the whole message
};

std::vector<BadCase> bad_cases() {
  const std::string more_tensors =
      R"({"name": "y", "bytes": 4, "dtype": "f32", "role": "activation"})";
  return {
      {"kind not an operator", valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "mm",)"),
       R"(toy.json: ops[0].kind: expected an operator as namespace.name.overload ("aten.mm.default"), )"
       R"(got "mm")"},
      {"kind with a space", valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "aten.mm x",)"),
       R"(toy.json: ops[0].kind: expected an operator as namespace.name.overload ("aten.mm.default"), )"
       R"(got "aten.mm x")"},
      {"empty kind", valid_with(R"("name": "fc",)", R"("name": "fc", "kind": "",)"),
       R"(toy.json: ops[0].kind: expected a non-empty name, got an empty string)"},
      {"unknown tensor in saved", valid_with(R"("saved": ["x", "w"])", R"("saved": ["x", "z"])"),
       R"(toy.json: ops[0].saved[1]: unknown tensor "z")"},
      {"unknown tensor in inputs", valid_with(R"("inputs": ["h_lo"])", R"("inputs": ["hi"])"),
       R"(toy.json: ops[1].inputs[0]: unknown tensor "hi")"},
      {"unknown loss", valid_with(R"("loss": "y")", R"("loss": "l")"),
       R"(toy.json: loss: unknown tensor "l")"},
      {"unknown base", valid_with(R"("view_of": "h")", R"("view_of": "hh")"),
       R"(toy.json: tensors[3].view_of: unknown tensor "hh")"},
      {"view out of its base", valid_with(R"("view_offset": 0)", R"("view_offset": 48)"),
       R"(toy.json: tensors[3].view_offset: 32 bytes at offset 48 lie outside its base "h" )"
       "(64 bytes)"},
      {"view of a view", valid_with(more_tensors, more_tensors + R"(,
    {"name": "h_lo2", "bytes": 2, "dtype": "bf16", "role": "activation", "view_of": "h_lo"})"),
       R"(toy.json: tensors[5].view_of: base "h_lo" is itself a view (of "h"); take the view of )"
       R"("h" instead)"},
      {"view with another role",
       valid_with(R"("name": "h_lo", "bytes": 32, "dtype": "bf16", "role": "activation")",
                  R"("name": "h_lo", "bytes": 32, "dtype": "bf16", "role": "param")"),
       R"(toy.json: tensors[3].view_of: a view has its base's role: "h_lo" is param, base "h" )"
       "is activation"},
      {"offset without a base",
       valid_with(R"("dtype": "bf16", "role": "input"})",
                  R"("dtype": "bf16", "role": "input", "view_offset": 0})"),
       R"(toy.json: tensors[0].view_offset: "view_offset" applies to views only: add "view_of")"},
      {"activation read before produced",
       valid_with(R"("inputs": ["x", "w"])", R"("inputs": ["x", "w", "y"])"),
       R"(toy.json: ops[0].inputs[2]: activation "y" is read before it is produced)"},
      {"an op reading its own output",
       valid_with(R"("inputs": ["h_lo"])", R"("inputs": ["h_lo", "y"])"),
       R"(toy.json: ops[1].inputs[1]: activation "y" is read before it is produced)"},
      {"produced twice", valid_with(R"("outputs": ["y"])", R"("outputs": ["y", "h"])"),
       R"(toy.json: ops[1].outputs[1]: activation "h" is produced twice (first by ops[0] "fc"))"},
      {"view before its base", valid_with(R"("outputs": ["h", "h_lo"])", R"("outputs": ["h_lo"])"),
       R"(toy.json: ops[0].outputs[0]: view "h_lo" is produced before its base "h")"},
      {"view never produced", valid_with(R"("outputs": ["h", "h_lo"])", R"("outputs": ["h"])"),
       R"(toy.json: ops[1].inputs[0]: activation "h_lo" is read before it is produced)"},
      {"unused activation never produced", valid_with(more_tensors, more_tensors + R"(,
    {"name": "z", "bytes": 2, "dtype": "bf16", "role": "activation"})"),
       R"(toy.json: tensors[5]: activation "z" is never produced by an op)"},
      {"op producing a param", valid_with(R"("outputs": ["y"])", R"("outputs": ["y", "w"])"),
       R"(toy.json: ops[1].outputs[1]: "w" is a param; ops produce activations only)"},
      {"op producing the batch", valid_with(R"("outputs": ["y"])", R"("outputs": ["y", "x"])"),
       R"(toy.json: ops[1].outputs[1]: "x" is an input; ops produce activations only)"},
      {"saved twice", valid_with(R"("saved": ["x", "w"])", R"("saved": ["x", "w", "x"])"),
       R"(toy.json: ops[0].saved[2]: "x" is already saved by this op (saved[0]))"},
      {"saved before produced", valid_with(R"("saved": ["x", "w"])", R"("saved": ["x", "w", "y"])"),
       R"(toy.json: ops[0].saved[2]: "y" is neither an input nor an output of this op; an op )"
       "saves only tensors it reads or produces"},
      {"saved activation the op does not touch",
       valid_with(R"("inputs": ["h_lo"], "outputs": ["y"], "saved": [])",
                  R"("inputs": ["h_lo"], "outputs": ["y"], "saved": ["h"])"),
       R"(toy.json: ops[1].saved[0]: "h" is neither an input nor an output of this op; an op )"
       "saves only tensors it reads or produces"},
      {"saved param the op does not read",
       valid_with(R"("inputs": ["h_lo"], "outputs": ["y"], "saved": [])",
                  R"("inputs": ["h_lo"], "outputs": ["y"], "saved": ["w"])"),
       R"(toy.json: ops[1].saved[0]: "w" is neither an input nor an output of this op; an op )"
       "saves only tensors it reads or produces"},
      {"loss not produced by the last op", valid_with(R"("loss": "y")", R"("loss": "h")"),
       R"(toy.json: loss: "h" is produced by ops[0] "fc", not by the last op (ops[1] "sum"))"},
      {"loss is a param", valid_with(R"("loss": "y")", R"("loss": "w")"),
       R"(toy.json: loss: "w" is a param; the loss is an activation)"},
      {"negative flops", valid_with(R"("flops": 100)", R"("flops": -5)"),
       "toy.json: ops[0].flops: expected a non-negative integer, got -5"},
      {"float flops", valid_with(R"("flops": 100)", R"("flops": 1e2)"),
       "toy.json: ops[0].flops: expected a non-negative integer, got 100.0 (write integers "
       "without a fraction or exponent)"},
      {"huge flops", valid_with(R"("flops": 100)", R"("flops": 1000000000000000001)"),
       "toy.json: ops[0].flops: 1000000000000000001 is above the limit of "
       "1000000000000000000"},
      {"negative duration",
       valid_with(R"("backward_bytes": 72)", R"("backward_bytes": 72, "duration_ns": -1)"),
       "toy.json: ops[1].duration_ns: expected a non-negative integer, got -1"},
      {"layer below -1", valid_with(R"("layer": 0)", R"("layer": -2)"),
       "toy.json: ops[0].layer: expected an integer in [-1, 2147483647], got -2"},
      {"bad dtype",
       valid_with(R"("bytes": 64, "dtype": "bf16", "role": "input")",
                  R"("bytes": 64, "dtype": "fp8", "role": "input")"),
       R"(toy.json: tensors[0].dtype: unknown dtype "fp8" (allowed: f32, bf16, f16, u8, i64))"},
      {"bad role", valid_with(R"("role": "param")", R"("role": "weight")"),
       R"(toy.json: tensors[1].role: unknown role "weight" (allowed: input, param, buffer, )"
       "activation)"},
      {"bytes not whole elements",
       valid_with(R"("bytes": 4, "dtype": "f32")", R"("bytes": 6, "dtype": "f32")"),
       "toy.json: tensors[4].bytes: 6 bytes is not a whole number of f32 elements (4 bytes "
       "each)"},
      {"zero bytes", valid_with(R"("bytes": 128)", R"("bytes": 0)"),
       "toy.json: tensors[1].bytes: expected a positive integer, got 0"},
      {"unknown key in a tensor", valid_with(R"("bytes": 128)", R"("size": 128)"),
       R"(toy.json: tensors[1]: unknown key "size" (allowed: name, bytes, dtype, role, view_of, )"
       "view_offset, no_offload, capacity, rows)"},
      {"unknown key in an op", valid_with(R"("saved": [])", R"("saves": [])"),
       R"(toy.json: ops[1]: unknown key "saves" (allowed: name, kind, layer, flops, bytes, )"
       "backward_flops, backward_bytes, duration_ns, backward_duration_ns, inputs, outputs, "
       "saved, no_offload, draws_rng, draws_cpu_rng, gemm, collective, group_rows)"},
      {"group rows on an op that is not a grouped matmul",
       valid_with(R"("saved": ["x", "w"]})", R"("saved": ["x", "w"], "group_rows": [1, 2]})"),
       "toy.json: ops[0].group_rows: applies to a grouped matmul (aten._grouped_mm, "
       "aten._scaled_grouped_mm) only; the op's kind is not known"},
      {"more group rows than the product's",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "kind": "aten._grouped_mm.default", )"
                  R"("gemm": {"m": 2, "n": 5, "k": 5}, "group_rows": [2, 1]})"),
       "toy.json: ops[0].group_rows: the groups hold 3 rows, more than the product's m of 2"},
      {"negative group rows",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "kind": "aten._grouped_mm.default", )"
                  R"("group_rows": [2, -1]})"),
       "toy.json: ops[0].group_rows[1]: expected a non-negative integer, got -1"},
      {"gemm disagrees with the FLOPs",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "gemm": {"m": 2, "n": 5, "k": 6}})"),
       "toy.json: ops[0].gemm: 2 x 5 x 6 (batch 1) is 2 m n k batch = 120 FLOPs, but flops is "
       "100 (they must agree within 0.1 %)"},
      {"gemm dim zero",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "gemm": {"m": 0, "n": 5, "k": 5}})"),
       "toy.json: ops[0].gemm.m: expected a positive integer, got 0"},
      {"gemm unknown key",
       valid_with(R"("saved": ["x", "w"]})",
                  R"("saved": ["x", "w"], "gemm": {"m": 2, "n": 5, "k": 5, "l": 1}})"),
       R"(toy.json: ops[0].gemm: unknown key "l" (allowed: m, n, k, batch))"},
      {"unknown top-level key", valid_with(R"("loss": "y")", R"("loss": "y", "step": 1)"),
       R"(toy.json: unknown key "step" (allowed: format, name, tensors, ops, loss, parallelism, )"
       "allocator, routing)"},
      {"unknown allocator", valid_with(R"("loss": "y")", R"("loss": "y", "allocator": "cuda")"),
       R"(toy.json: allocator: expected "default" or "expandable", got "cuda")"},
      {"missing loss",
       valid_with(R"(,
  "loss": "y")",
                  ""),
       R"(toy.json: missing required key "loss")"},
      {"wrong format", valid_with(R"("ferry.model/1")", R"("ferry.program/1")"),
       R"(toy.json: format: expected "ferry.model/1", got "ferry.program/1")"},
      {"duplicate tensor name", valid_with(R"({"name": "h_lo")", R"({"name": "h")"),
       R"(toy.json: tensors[3].name: duplicate tensor name "h" (first declared at )"
       "tensors[2].name)"},
      {"duplicate op name", valid_with(R"("name": "sum")", R"("name": "fc")"),
       R"(toy.json: ops[1].name: duplicate op name "fc" (first at ops[0]))"},
      {"empty op name", valid_with(R"("name": "sum")", R"("name": "")"),
       "toy.json: ops[1].name: expected a non-empty name, got an empty string"},
      {"flag not a boolean", valid_with(R"("saved": [])", R"("saved": [], "draws_rng": 1)"),
       "toy.json: ops[1].draws_rng: expected true or false, got 1"},
      {"syntax error", valid_with(R"("loss": "y")", R"("loss": "y",)"),
       "toy.json:19:1: syntax "
       "error while parsing object key - unexpected '}'; expected string literal"},
  };
}

TEST(ModelJson, RejectsBadModelsWithThePathInTheMessage) {
  const auto cases = bad_cases();
  EXPECT_GE(cases.size(), 15U);
  const auto valid = parse_model(kValidModel, "toy.json");
  ASSERT_TRUE(valid.ok()) << valid.error().message;
  for (const BadCase& bad : cases) {
    SCOPED_TRACE(bad.name);
    Result<Model> result = Error{"not run"};
    ASSERT_NO_THROW(result = parse_model(bad.text, "toy.json"));
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.error().message, bad.expected);
  }
}

// ---------------------------------------------------------------------------------------------
// validate_model on models built in code

Model small_valid_model() {
  const auto parsed = parse_model(kValidModel, "toy.json");
  EXPECT_TRUE(parsed.ok());
  return parsed.value();
}

TEST(Roofline, AnOpLongerThanTheFormatAllowsOnTheDeviceIsAnError) {
  Model model = small_valid_model();
  model.ops[1].backward_flops = kMaxModelFlops;
  const DeviceProfile fast = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  EXPECT_TRUE(check_roofline(model, fast).ok());  // 10^18 FLOP at 0.6 PFLOP/s: 1.7e12 ns
  DeviceProfile slow = round_device(1'000'000, 1'000'000'000'000);  // the slowest rate allowed
  slow.name = "slow";
  EXPECT_EQ(check_roofline(model, slow).error().message,
            "ops[1].backward_flops: 1000000000000000000 FLOP at 1000000 FLOP/s x 600/1000 on "
            "device \"slow\" take over 1000000000000000 ns, the longest duration a model op may "
            "have");
  model.ops[1].backward_flops = 0;
  model.ops[0].bytes = Bytes(std::int64_t{1} << 50);
  EXPECT_EQ(check_roofline(model, round_device(1'000'000'000'000'000, 1'000'000))
                .error()
                .message.substr(0, 45),
            "ops[0].bytes: 1125899906842624 bytes at 10000");
}

// A model is checked once on its way in: a parsed one by its reader, and its durations, the only
// thing assigned after, by check_roofline.
TEST(CheckedModel, DurationsAreAssignedToTheCheckedModelWithoutAnotherCheck) {
  auto parsed = parse_checked_model(kValidModel, "toy.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  const Model* before = &parsed.value().model();
  const DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  auto timed = with_roofline_durations(std::move(parsed).value(), device);
  ASSERT_TRUE(timed.ok()) << timed.error().message;
  EXPECT_EQ(&timed.value().model(), before);  // no copy shared it: changed in place
  Model expected = small_valid_model();
  assign_roofline_durations(expected, device);
  for (std::size_t i = 0; i < expected.ops.size(); ++i) {
    EXPECT_EQ(timed.value()->ops[i].duration, expected.ops[i].duration);
    EXPECT_EQ(timed.value()->ops[i].backward_duration, expected.ops[i].backward_duration);
  }
  EXPECT_TRUE(validate_model(*timed.value()).ok());
}

TEST(CheckedModel, ASharedModelIsCopiedAndADurationPastTheFormatIsRefused) {
  Model model = small_valid_model();
  model.ops[1].backward_flops = kMaxModelFlops;
  const CheckedModel checked = check_model(model).value();
  const DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  auto timed = with_roofline_durations(checked, device);
  ASSERT_TRUE(timed.ok()) << timed.error().message;
  EXPECT_NE(&timed.value().model(), &checked.model());  // the copy it shares is left alone
  EXPECT_EQ(checked->ops[1].backward_duration, SimTime(0));
  EXPECT_GT(timed.value()->ops[1].backward_duration, SimTime(0));
  DeviceProfile slow = round_device(1'000'000, 1'000'000'000'000);
  slow.name = "slow";
  const auto refused = with_roofline_durations(checked, slow);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message, check_roofline(model, slow).error().message);
}

TEST(CheckedModel, AParsedModelIsCheckedByItsReader) {
  std::string text(kValidModel);
  const auto at = text.find("\"loss\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 6, "\"lost\"");
  const auto parsed = parse_checked_model(text, "toy.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.error().message, parse_model(text, "toy.json").error().message);
}

// The models the rules of docs/model-format.md allow, one test each.

TEST(ModelRules, LayersNeedNotStartAtZeroBeContiguousOrInOrder) {
  Model model = small_valid_model();
  model.ops[0].layer = 7;
  model.ops[1].layer = 3;
  EXPECT_TRUE(validate_model(model).ok());
  EXPECT_EQ(saved_activation_bytes(model, 7), Bytes(0));  // fc saves the batch and a param
}

TEST(ModelRules, AViewMayBeProducedByALaterOpThanItsBase) {
  Model model = small_valid_model();
  model.ops[0].outputs = {2};  // fc: h
  ModelOp slice;
  slice.name = "slice";
  slice.inputs = {2};
  slice.outputs = {3};  // h_lo, a view of h
  model.ops.insert(model.ops.begin() + 1, slice);
  const Status status = validate_model(model);
  EXPECT_TRUE(status.ok()) << status.error().message;
}

TEST(ModelRules, AnOpSavesItsInputsAndOutputsOfAnyRole) {
  Model model = small_valid_model();
  model.ops[0].saved = {0, 1, 2, 3};  // the batch, a param, its output and a view of it
  model.ops[1].saved = {3, 4};        // its input and its output (the loss)
  const Status status = validate_model(model);
  EXPECT_TRUE(status.ok()) << status.error().message;
}

TEST(ModelRules, TwoOpsMaySaveTheSameTensorAndItCountsOnce) {
  Model model = small_valid_model();
  model.ops[0].saved = {3};
  model.ops[1].saved = {3};
  model.ops[1].layer = 0;
  ASSERT_TRUE(validate_model(model).ok());
  EXPECT_EQ(saved_activation_bytes(model, 0), Bytes(32));
}

TEST(ValidateModel, RejectsIndicesOutOfRange) {
  Model model = small_valid_model();
  model.ops[1].inputs.push_back(9);
  EXPECT_EQ(validate_model(model).error().message,
            "ops[1].inputs[1]: tensor index 9 out of range (5 tensors)");

  model = small_valid_model();
  model.tensors[3].view_of = 7;
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[3].view_of: base index 7 out of range (5 tensors)");

  model = small_valid_model();
  model.tensors[3].view_of = 3;
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[3].view_of: a tensor cannot be a view of itself");

  model = small_valid_model();
  model.loss = 5;
  EXPECT_EQ(validate_model(model).error().message, "loss: tensor index 5 out of range (5 tensors)");
}

TEST(ValidateModel, RejectsNegativeCountsAndEmptyModels) {
  Model model = small_valid_model();
  model.ops[0].backward_flops = -1;
  EXPECT_EQ(validate_model(model).error().message,
            "ops[0].backward_flops: expected a non-negative count, got -1");

  model = small_valid_model();
  model.ops[1].backward_duration = SimTime(-3);
  EXPECT_EQ(validate_model(model).error().message,
            "ops[1].backward_duration_ns: expected a non-negative count, got -3");

  model = small_valid_model();
  model.tensors[0].view_offset = Bytes(2);
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[0].view_offset: only a view has an offset; \"x\" has its own storage");

  model = small_valid_model();
  model.ops[0].flops = kMaxModelFlops + 1;
  EXPECT_EQ(validate_model(model).error().message,
            "ops[0].flops: 1000000000000000001 is above the limit of 1000000000000000000");

  model = small_valid_model();
  model.tensors[1].bytes = Bytes((std::int64_t{1} << 50) + 2);
  EXPECT_EQ(validate_model(model).error().message,
            "tensors[1].bytes: 1125899906842626 is above the limit of 1125899906842624");

  model = small_valid_model();
  model.ops.clear();
  EXPECT_EQ(validate_model(model).error().message, "ops: a model needs at least one op");

  model = small_valid_model();
  model.name.clear();
  EXPECT_EQ(validate_model(model).error().message, "name: a model needs a non-empty name");
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

// ---------------------------------------------------------------------------------------------
// Collective ops (Note [Collective ops] in model.cpp)

// A sequence-parallel step of one rank of two: a local op, an all-gather of its output (a
// reduce-scatter in backward), and the loss over the gathered tensor.
constexpr std::string_view kCollectiveModel = R"({
  "format": "ferry.model/1",
  "name": "sp",
  "tensors": [
    {"name": "x", "bytes": 64, "dtype": "bf16", "role": "input"},
    {"name": "h", "bytes": 64, "dtype": "bf16", "role": "activation"},
    {"name": "g", "bytes": 128, "dtype": "bf16", "role": "activation"},
    {"name": "y", "bytes": 4, "dtype": "f32", "role": "activation"}
  ],
  "ops": [
    {"name": "norm", "flops": 100, "bytes": 128, "backward_flops": 200, "backward_bytes": 256,
     "inputs": ["x"], "outputs": ["h"], "saved": ["x"]},
    {"name": "gather", "kind": "_c10d_functional.all_gather_into_tensor.default", "flops": 0,
     "bytes": 0, "backward_flops": 0, "backward_bytes": 0,
     "collective": {"forward": "all_gather", "backward": "reduce_scatter", "axis": "tp",
                    "ranks": 2, "nodes": 1},
     "inputs": ["h"], "outputs": ["g"], "saved": []},
    {"name": "sum", "flops": 64, "bytes": 132, "backward_flops": 64, "backward_bytes": 132,
     "inputs": ["g"], "outputs": ["y"], "saved": []}
  ],
  "loss": "y"
})";

std::string collective_with(std::string_view from, std::string_view to) {
  std::string text(kCollectiveModel);
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(text.find(from, at + 1), std::string::npos) << "ambiguous: " << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

DeviceProfile linked_device() {
  DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  device.collectives.intra_node = {Bandwidth(100'000'000'000), SimTime(1000)};
  device.collectives.inter_node = {Bandwidth(10'000'000'000), SimTime(5000)};
  return device;
}

TEST(OpKinds, FusedAttentionIsTheKernelNotItsBackwardNorItsParts) {
  for (const std::string_view kind :
       {"aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default", "aten._flash_attention_forward.default",
        "higher_order.flex_attention", "torch_attn._varlen_attn.default"}) {
    EXPECT_TRUE(is_fused_attention_kind(kind)) << kind;
  }
  for (const std::string_view kind : {"aten._scaled_dot_product_flash_attention_backward.default",
                                      "higher_order.flex_attention_backward", "aten.bmm.default",
                                      "aten._softmax.default", "aten.mm.default", ""}) {
    EXPECT_FALSE(is_fused_attention_kind(kind)) << kind;
  }
  EXPECT_TRUE(is_grouped_matmul_kind("aten._grouped_mm.default"));
  EXPECT_FALSE(is_grouped_matmul_kind("aten.mm.default"));
}

TEST(CollectiveOps, AreReadAndWrittenBack) {
  auto model = parse_model(kCollectiveModel, "sp.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  const OpCollective& c = model.value().ops[1].collective;
  EXPECT_EQ(c.forward, CollectiveKind::AllGather);
  EXPECT_EQ(c.backward, CollectiveKind::ReduceScatter);
  EXPECT_EQ(c.axis, MeshAxis::Tensor);
  EXPECT_EQ(c.ranks, 2);
  EXPECT_EQ(c.nodes, 1);
  EXPECT_FALSE(model.value().ops[0].collective.any());
  const std::string written = model_to_json(model.value());
  EXPECT_NE(written.find(R"("collective": {
        "forward": "all_gather",
        "backward": "reduce_scatter",
        "axis": "tp",
        "ranks": 2,
        "nodes": 1
      })"),
            std::string::npos)
      << written;
  EXPECT_EQ(std::count(written.begin(), written.end(), '{'),
            std::count(kCollectiveModel.begin(), kCollectiveModel.end(), '{'))
      << "an op without a collective writes none";
  auto again = parse_model(written, "again.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
  // Either direction may run none; nodes default to one.
  std::string text = collective_with(R"("backward": "reduce_scatter", )", "");
  text.erase(text.find(R"(, "nodes": 1)"), std::string_view(R"(, "nodes": 1)").size());
  auto forward_only = parse_model(text, "sp.json");
  ASSERT_TRUE(forward_only.ok()) << forward_only.error().message;
  EXPECT_EQ(forward_only.value().ops[1].collective.backward, std::nullopt);
  EXPECT_EQ(forward_only.value().ops[1].collective.nodes, 1);
}

TEST(CollectiveOps, RejectsACollectiveThatDoesNotFitItsOp) {
  const std::vector<BadCase> cases = {
      {"one rank", collective_with(R"("ranks": 2)", R"("ranks": 1)"),
       "sp.json: ops[1].collective.ranks: expected an integer in [2, 1048576], got 1"},
      {"more nodes than ranks", collective_with(R"("nodes": 1)", R"("nodes": 3)"),
       "sp.json: ops[1].collective.nodes: 3 is above the limit of 2"},
      {"unknown kind", collective_with(R"("forward": "all_gather")", R"("forward": "gather")"),
       R"(sp.json: ops[1].collective.forward: expected "all_gather", "reduce_scatter", )"
       R"("all_reduce" or "all_to_all", got "gather")"},
      {"unknown axis", collective_with(R"("axis": "tp")", R"("axis": "dp")"),
       R"(sp.json: ops[1].collective.axis: expected "tp", "cp" or "ep", got "dp")"},
      {"no direction",
       collective_with(R"("forward": "all_gather", "backward": "reduce_scatter", )", ""),
       "sp.json: ops[1].collective: a collective op runs a collective in its forward, its "
       "backward or both"},
      {"computes",
       collective_with(R"("flops": 0,
     "bytes": 0)",
                       R"("flops": 5,
     "bytes": 0)"),
       "sp.json: ops[1].collective: a collective op computes nothing: its time is its link's, so "
       "flops, bytes, backward_flops and backward_bytes must be 0 and it has no gemm"},
      {"forward does not fit",
       collective_with(R"("forward": "all_gather")", R"("forward": "all_reduce")"),
       "sp.json: ops[1].collective.forward: all_reduce over 2 ranks cannot turn 64 bytes into "
       "128 (the op's inputs into its outputs)"},
      {"backward does not fit",
       collective_with(R"("backward": "reduce_scatter")", R"("backward": "all_gather")"),
       "sp.json: ops[1].collective.backward: all_gather over 2 ranks cannot turn 128 bytes into "
       "64 (the op's outputs' gradients into its inputs' gradients)"},
      {"unknown key", collective_with(R"("nodes": 1)", R"("nodes": 1, "stride": 2)"),
       R"(sp.json: ops[1].collective: unknown key "stride" (allowed: forward, backward, axis, )"
       R"(ranks, nodes))"},
  };
  for (const BadCase& bad : cases) {
    SCOPED_TRACE(bad.name);
    Result<Model> result = Error{"not run"};
    ASSERT_NO_THROW(result = parse_model(bad.text, "sp.json"));
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.error().message, bad.expected);
  }
}

TEST(CollectiveOps, TakeTheirLinksTimeInEachDirection) {
  auto parsed = parse_model(kCollectiveModel, "sp.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  const DeviceProfile device = linked_device();
  for (const std::int32_t nodes : {1, 2}) {
    SCOPED_TRACE(nodes);
    Model model = parsed.value();
    model.ops[1].collective.nodes = nodes;
    ASSERT_TRUE(check_roofline(model, device).ok());
    assign_roofline_durations(model, device);
    // Forward: an all-gather whose output is 128 bytes; backward: a reduce-scatter of the
    // output's 128-byte gradient.
    EXPECT_EQ(collective_op_bytes(model, model.ops[1], false), Bytes(128));
    EXPECT_EQ(collective_op_bytes(model, model.ops[1], true), Bytes(128));
    const GroupPlacement group{2, nodes};
    EXPECT_EQ(model.ops[1].duration,
              collective_time(CollectiveKind::AllGather, Bytes(128), group, device.collectives));
    EXPECT_EQ(
        model.ops[1].backward_duration,
        collective_time(CollectiveKind::ReduceScatter, Bytes(128), group, device.collectives));
    EXPECT_GT(model.ops[1].duration, SimTime(1));
  }
  // A direction that runs none takes the shortest time an op may.
  Model forward_only = parsed.value();
  forward_only.ops[1].collective.backward.reset();
  assign_roofline_durations(forward_only, device);
  EXPECT_EQ(forward_only.ops[1].backward_duration, SimTime(1));
  EXPECT_EQ(collective_op_bytes(forward_only, forward_only.ops[1], true), Bytes(0));
}

TEST(CollectiveOps, ADeviceWithoutTheGroupsLinkIsRefused) {
  auto parsed = parse_model(kCollectiveModel, "sp.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  DeviceProfile device = linked_device();
  device.collectives.inter_node = {};
  EXPECT_TRUE(check_roofline(parsed.value(), device).ok());
  Model across = parsed.value();
  across.ops[1].collective.nodes = 2;
  const Status refused = check_roofline(across, device);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message,
            R"(ops[1].collective: device "round" has no inter_node link for a collective over 2 )"
            R"(ranks on 2 nodes (its profile's "collectives" section, docs/devices.md))");
  // A link too slow for the format's longest duration is refused, not wrapped.
  device.collectives.intra_node = {Bandwidth(1), SimTime(0)};
  Model huge = parsed.value();
  for (const std::uint32_t t : {1U, 2U}) huge.tensors[t].bytes = Bytes(std::int64_t{1} << (t + 40));
  const Status slow = check_roofline(huge, device);
  ASSERT_FALSE(slow.ok());
  EXPECT_NE(slow.error().message.find("ops[1].collective.forward: "), std::string::npos)
      << slow.error().message;
}

}  // namespace
}  // namespace ferry::sim
