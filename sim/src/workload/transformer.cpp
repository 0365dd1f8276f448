#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/model.hpp"
#include "model_builder.hpp"

namespace ferry::sim {
namespace {

using namespace workload_detail;

void check_shape(const TransformerShape& shape) {
  FERRY_CHECK(shape.layers >= 1 && shape.hidden >= 1 && shape.heads >= 1 && shape.ffn >= 1 &&
                  shape.vocab >= 1 && shape.sequence >= 1 && shape.micro_batch >= 1,
              "transformer sizes must be positive");
  FERRY_CHECK(shape.layers <= 1'000'000, "{} layers is too many", shape.layers);
  FERRY_CHECK(shape.hidden % shape.heads == 0, "hidden {} is not a multiple of heads {}",
              shape.hidden, shape.heads);
  if (shape.kind != Kind::Gpt) {
    FERRY_CHECK(shape.kv_heads >= 1 && shape.heads % shape.kv_heads == 0,
                "heads {} is not a multiple of kv_heads {}", shape.heads, shape.kv_heads);
  }
  FERRY_CHECK(shape.dtype == DType::F32 || shape.dtype == DType::BF16 || shape.dtype == DType::F16,
              "transformer dtype must be f32, bf16 or f16, got {}", dtype_name(shape.dtype));
  // Estimated in floating point so that an absurd shape cannot overflow the estimate itself.
  const auto real = [](std::int64_t n) { return static_cast<double>(n); };
  const double tokens = real(shape.sequence) * real(shape.micro_batch);
  const double scores =
      shape.flash_attention ? 0.0 : real(shape.heads) * real(shape.sequence) * tokens;
  const double widest = std::max({3.0 * real(shape.hidden), real(shape.ffn), real(shape.vocab)});
  const double largest_tensor =
      std::max({scores, tokens * widest, real(shape.vocab) * real(shape.hidden)}) *
      real(dtype_size(shape.dtype));
  FERRY_CHECK(largest_tensor <= real(kMaxJsonBytes), "a tensor of {} bytes is over the limit",
              largest_tensor);
  const double largest_flops =
      5.0 * std::max(2.0 * tokens * real(shape.hidden) * widest,
                     2.0 * real(shape.sequence) * tokens * real(shape.hidden));
  FERRY_CHECK(largest_flops <= real(kMaxModelFlops), "an op of {} FLOPs is over the limit",
              largest_flops);
}

/// Attention from Q, K, V to the context; returns the context tensor. `with_dropout` adds the
/// attention-probability dropout of GPT. See Note [Saved tensors of one block].
std::uint32_t attention_core(ModelBuilder& m, const Dims& x, std::int32_t layer,
                             const std::string& p, std::uint32_t q, std::uint32_t k,
                             std::uint32_t v, bool flash, bool with_dropout) {
  const std::int64_t e = m.element();
  if (flash) {
    const std::uint32_t out = m.activation(p + "attn.out", x.tokens * x.h);
    const std::uint32_t lse =
        m.tensor(p + "attn.lse", x.a * x.s * x.b, DType::F32, TensorRole::Activation);
    ModelOp& op = m.op(p + "attn", op_kind::kFlashAttention, layer, {q, k, v}, {out, lse},
                       {q, k, v, out, lse});
    const std::int64_t causal = causal_flash_matmul_flops(x);
    cost(op, 2 * causal, m.bytes(q) + m.bytes(k) + m.bytes(v) + m.bytes(out) + m.bytes(lse));
    // FlashAttention's backward recomputes the scores: 5 matmuls against the forward's 2.
    op.backward_flops = 5 * causal;
    op.draws_rng = with_dropout;  // the dropout mask is regenerated from the generator state
    return out;
  }
  // Batched matmuls compute every (query, key) pair and mask afterwards.
  const std::int64_t qk_flops = 2 * x.b * x.s * x.s * x.h;  // b a s s (h/a) multiply-adds x 2
  const std::int64_t scores_elements = x.b * x.a * x.s * x.s;
  const std::uint32_t scores = m.activation(p + "scores.out", scores_elements);
  ModelOp& scores_op = m.op(p + "scores", op_kind::kBmm, layer, {q, k}, {scores}, {q, k});
  cost(scores_op, qk_flops, m.bytes(q) + m.bytes(k) + m.bytes(scores));
  scores_op.gemm = GemmShape{.m = x.s, .n = x.s, .k = x.d, .batch = x.b * x.a};
  const std::uint32_t probs = m.activation(p + "softmax.out", scores_elements);
  cost(m.op(p + "softmax", op_kind::kSoftmax, layer, {scores}, {probs}, {probs}),
       kSoftmaxFlops * scores_elements, 2 * scores_elements * e);
  std::uint32_t attended = probs;
  if (with_dropout) {
    attended = m.activation(p + "attn_dropout.out", scores_elements);
    const std::uint32_t mask =
        m.tensor(p + "attn_dropout.mask", scores_elements, DType::U8, TensorRole::Activation);
    ModelOp& op =
        m.op(p + "attn_dropout", op_kind::kDropout, layer, {probs}, {attended, mask}, {mask});
    cost(op, kDropoutFlops * scores_elements, 2 * scores_elements * e + scores_elements);
    op.draws_rng = true;
  }
  const std::uint32_t out = m.activation(p + "attn_v.out", x.tokens * x.h);
  ModelOp& attn_v = m.op(p + "attn_v", op_kind::kBmm, layer, {attended, v}, {out}, {attended, v});
  cost(attn_v, qk_flops, m.bytes(attended) + m.bytes(v) + m.bytes(out));
  attn_v.gemm = GemmShape{.m = x.s, .n = x.d, .k = x.s, .batch = x.b * x.a};
  return out;
}

/// Output dropout of a GPT sub-block; returns the dropped tensor.
std::uint32_t dropout(ModelBuilder& m, const Dims& x, std::int32_t layer, const std::string& name,
                      std::uint32_t in) {
  const std::uint32_t out = m.activation(name + ".out", x.tokens * x.h);
  const std::uint32_t mask =
      m.tensor(name + ".mask", x.tokens * x.h, DType::U8, TensorRole::Activation);
  ModelOp& op = m.op(name, op_kind::kDropout, layer, {in}, {out, mask}, {mask});
  cost(op, kDropoutFlops * x.tokens * x.h, 2 * m.bytes(in) + m.bytes(mask));
  op.draws_rng = true;
  return out;
}

/// residual + branch.
std::uint32_t residual_add(ModelBuilder& m, const Dims& x, std::int32_t layer,
                           const std::string& name, std::uint32_t residual, std::uint32_t branch) {
  const std::uint32_t out = m.activation(name + ".out", x.tokens * x.h);
  cost(m.op(name, op_kind::kAdd, layer, {residual, branch}, {out}, {}), x.tokens * x.h,
       3 * m.bytes(out));
  return out;
}

/// LayerNorm (GPT: weight and bias) or RMSNorm (Llama: weight only) over the hidden size.
std::uint32_t norm(ModelBuilder& m, const Dims& x, std::int32_t layer, const std::string& name,
                   std::uint32_t in, bool with_bias) {
  const std::uint32_t weight = m.param(name + ".weight", x.h);
  const std::uint32_t out = m.activation(name + ".out", x.tokens * x.h);
  if (with_bias) {
    const std::uint32_t bias = m.param(name + ".bias", x.h);
    cost(m.op(name, op_kind::kLayerNorm, layer, {in, weight, bias}, {out}, {in, weight}),
         kNormFlops * x.tokens * x.h, 2 * m.bytes(in) + 2 * m.bytes(weight));
  } else {
    cost(m.op(name, op_kind::kRmsNorm, layer, {in, weight}, {out}, {in, weight}),
         (kNormFlops - 1) * x.tokens * x.h, 2 * m.bytes(in) + m.bytes(weight));
  }
  return out;
}

/// A linear layer [tokens, in] -> [tokens, out] that saves its input and weight.
std::uint32_t linear(ModelBuilder& m, const Dims& x, std::int32_t layer, const std::string& name,
                     std::uint32_t in, std::int64_t in_features, std::int64_t out_features,
                     bool with_bias) {
  const std::uint32_t weight = m.param(name + ".weight", in_features * out_features);
  const std::uint32_t out = m.activation(name + ".out", x.tokens * out_features);
  if (with_bias) {
    const std::uint32_t bias = m.param(name + ".bias", out_features);
    matmul_cost(m.op(name, op_kind::kAddmm, layer, {in, weight, bias}, {out}, {in, weight}),
                x.tokens, in_features, out_features, true, m.element());
  } else {
    matmul_cost(m.op(name, op_kind::kMm, layer, {in, weight}, {out}, {in, weight}), x.tokens,
                in_features, out_features, false, m.element());
  }
  return out;
}

// Note [Saved tensors of one block]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The GPT block reproduces Korthikanti et al. (2022), "Reducing Activation Recomputation in
// Large Transformer Models", Section 4.1, term by term (16-bit activations, 1-byte masks):
//
//   ln1 saves its input x ............................. 2sbh
//   qkv saves ln1's output ............................ 2sbh
//   scores (QK^T) saves Q and K (views of qkv.out) .... 4sbh
//   softmax saves its output .......................... 2as^2b
//   attn_dropout saves its mask (u8) .................. as^2b
//   attn_v saves the dropout output and V (a view) .... 2as^2b + 2sbh
//   proj saves its input (the context) ................ 2sbh
//   dropout saves its mask ............................ sbh
//   ln2 saves its input (the residual after attention)  2sbh
//   fc1 saves ln2's output ............................ 2sbh
//   gelu saves its input (fc1's output, 4h wide) ...... 8sbh
//   fc2 saves gelu's output ........................... 8sbh
//   dropout2 saves its mask ........................... sbh
//                                                       = 34sbh + 5as^2b
//
// The residual adds save nothing. Matmuls and norms also save their weights; those are params,
// not activations. Norm statistics (mean, rstd: O(sb)) are not modelled, as in the paper.
// With flash attention the scores, softmax, dropout and attn_v ops become one `attn` op saving
// Q, K, V, its output and a logsumexp (as b f32 values); its dropout mask is regenerated.
//
// The Llama block (no dropout, no biases) saves:
//
//   attn_norm: x; qkv: attn_norm's output; attn (flash): Q and K after rotary, V (a view of
//   qkv.out), the output, the logsumexp; o_proj: the attention output (the same tensor);
//   mlp_norm: the residual after attention; gate and up: mlp_norm's output (one tensor saved
//   by both); silu: gate's output; mul: silu's output and up's output; down: mul's output.
//
// = 2sbh x 6 + 2sbh x kv/a x 2 + 4asb + 2sbf x 4 bytes at 16 bits (f the SwiGLU size). Rotary
// saves only its cos/sin table (a buffer). Without flash attention, `attn` is scores, softmax
// (saving the probabilities, 2as^2b) and attn_v (saving the probabilities again and V).

void gpt_block(ModelBuilder& m, const Dims& x, std::int32_t layer, std::uint32_t& stream,
               bool flash) {
  const std::string p = fmt::format("layers.{}.", layer);
  const std::uint32_t ln1 = norm(m, x, layer, p + "ln1", stream, true);
  const std::uint32_t qkv = linear(m, x, layer, p + "qkv", ln1, x.h, 3 * x.h, true);
  const std::int64_t slice = x.tokens * x.h;
  const std::uint32_t q = m.view(p + "q", qkv, 0, slice);
  const std::uint32_t k = m.view(p + "k", qkv, slice, slice);
  const std::uint32_t v = m.view(p + "v", qkv, 2 * slice, slice);
  m.last_op().outputs.insert(m.last_op().outputs.end(), {q, k, v});
  const std::uint32_t context = attention_core(m, x, layer, p, q, k, v, flash, true);
  const std::uint32_t proj = linear(m, x, layer, p + "proj", context, x.h, x.h, true);
  const std::uint32_t dropped = dropout(m, x, layer, p + "dropout", proj);
  const std::uint32_t resid = residual_add(m, x, layer, p + "attn_residual", stream, dropped);

  const std::uint32_t ln2 = norm(m, x, layer, p + "ln2", resid, true);
  const std::uint32_t fc1 = linear(m, x, layer, p + "fc1", ln2, x.h, x.f, true);
  const std::uint32_t gelu = m.activation(p + "gelu.out", x.tokens * x.f);
  cost(m.op(p + "gelu", op_kind::kGelu, layer, {fc1}, {gelu}, {fc1}), kGeluFlops * x.tokens * x.f,
       m.bytes(fc1) + m.bytes(gelu));
  const std::uint32_t fc2 = linear(m, x, layer, p + "fc2", gelu, x.f, x.h, true);
  const std::uint32_t dropped2 = dropout(m, x, layer, p + "dropout2", fc2);
  stream = residual_add(m, x, layer, p + "mlp_residual", resid, dropped2);
}

void llama_block(ModelBuilder& m, const Dims& x, std::int32_t layer, std::uint32_t& stream,
                 std::uint32_t rope, bool flash) {
  const std::string p = fmt::format("layers.{}.", layer);
  const std::int64_t kv_width = x.kv * x.d;
  const std::uint32_t n1 = norm(m, x, layer, p + "attn_norm", stream, false);
  const std::uint32_t qkv = linear(m, x, layer, p + "qkv", n1, x.h, x.h + 2 * kv_width, false);
  // Q, K, V lie one after another in the fused projection's output.
  const std::uint32_t q = m.view(p + "q", qkv, 0, x.tokens * x.h);
  const std::uint32_t k = m.view(p + "k", qkv, x.tokens * x.h, x.tokens * kv_width);
  const std::uint32_t v = m.view(p + "v", qkv, x.tokens * (x.h + kv_width), x.tokens * kv_width);
  m.last_op().outputs.insert(m.last_op().outputs.end(), {q, k, v});

  const std::uint32_t q_rot = m.activation(p + "rotary.q", x.tokens * x.h);
  const std::uint32_t k_rot = m.activation(p + "rotary.k", x.tokens * kv_width);
  cost(m.op(p + "rotary", op_kind::kRotary, layer, {q, k, rope}, {q_rot, k_rot}, {rope}),
       kRotaryFlops * x.tokens * (x.h + kv_width),
       m.bytes(q) + m.bytes(k) + m.bytes(q_rot) + m.bytes(k_rot) + m.bytes(rope));
  const std::uint32_t attended = attention_core(m, x, layer, p, q_rot, k_rot, v, flash, false);
  const std::uint32_t o = linear(m, x, layer, p + "o_proj", attended, x.h, x.h, false);
  const std::uint32_t resid = residual_add(m, x, layer, p + "attn_residual", stream, o);

  const std::uint32_t n2 = norm(m, x, layer, p + "mlp_norm", resid, false);
  const std::uint32_t gate = linear(m, x, layer, p + "gate", n2, x.h, x.f, false);
  const std::uint32_t up = linear(m, x, layer, p + "up", n2, x.h, x.f, false);
  const std::uint32_t silu = m.activation(p + "silu.out", x.tokens * x.f);
  cost(m.op(p + "silu", op_kind::kSilu, layer, {gate}, {silu}, {gate}), kSiluFlops * x.tokens * x.f,
       m.bytes(gate) + m.bytes(silu));
  const std::uint32_t product = m.activation(p + "mul.out", x.tokens * x.f);
  cost(m.op(p + "mul", op_kind::kMul, layer, {silu, up}, {product}, {silu, up}), x.tokens * x.f,
       3 * m.bytes(product));
  const std::uint32_t down = linear(m, x, layer, p + "down", product, x.f, x.h, false);
  stream = residual_add(m, x, layer, p + "mlp_residual", resid, down);
}

/// Token and position embedding (GPT) or token embedding (Llama); returns the hidden stream.
std::uint32_t embedding(ModelBuilder& m, const Dims& x, const TransformerShape& shape,
                        std::uint32_t tokens, std::uint32_t table) {
  const std::uint32_t out = m.activation("embed.out", x.tokens * x.h);
  if (shape.kind == Kind::Llama) {
    cost(m.op("embed", op_kind::kEmbedding, -1, {tokens, table}, {out}, {tokens}), 0,
         m.bytes(tokens) + 2 * m.bytes(out));
    return out;
  }
  const std::uint32_t positions = m.param("embed.position_weight", x.s * x.h);
  cost(m.op("embed", op_kind::kEmbedding, -1, {tokens, table, positions}, {out}, {tokens}),
       x.tokens * x.h, m.bytes(tokens) + 3 * m.bytes(out));
  return dropout(m, x, -1, "embed_dropout", out);
}

}  // namespace

Model make_transformer(const TransformerShape& shape, std::string name) {
  check_shape(shape);
  if (shape.kind == Kind::LlamaTraced) return make_traced_llama(shape, std::move(name));
  const Dims x = dims_of(shape);
  const bool gpt = shape.kind == Kind::Gpt;
  ModelBuilder m(std::move(name), shape.dtype);
  const auto layers = static_cast<std::size_t>(shape.layers);
  m.reserve(layers * 40 + 20, layers * 16 + 8);

  const std::uint32_t tokens = m.tensor("tokens", x.tokens, DType::I64, TensorRole::Input);
  const std::uint32_t labels = m.tensor("labels", x.tokens, DType::I64, TensorRole::Input);
  const std::uint32_t table = m.param("embed.weight", shape.vocab * x.h);
  // Rotary cos and sin for every position and head dimension, computed once per step.
  const std::uint32_t rope =
      gpt ? 0 : m.tensor("rope.cos_sin", 2 * x.s * x.d, DType::F32, TensorRole::Buffer);

  std::uint32_t stream = embedding(m, x, shape, tokens, table);
  for (std::int64_t layer = 0; layer < shape.layers; ++layer) {
    const auto index = static_cast<std::int32_t>(layer);
    if (gpt) {
      gpt_block(m, x, index, stream, shape.flash_attention);
    } else {
      llama_block(m, x, index, stream, rope, shape.flash_attention);
    }
  }
  const std::uint32_t final_norm = norm(m, x, -1, "final_norm", stream, gpt);

  // GPT-2 ties the output head to the token embedding; Llama 3 has its own.
  const std::uint32_t head_weight = gpt ? table : m.param("head.weight", shape.vocab * x.h);
  const std::uint32_t logits = m.activation("logits", x.tokens * shape.vocab);
  ModelOp& head = m.op("head", op_kind::kMm, -1, {final_norm, head_weight}, {logits},
                       {final_norm, head_weight});
  matmul_cost(head, x.tokens, x.h, shape.vocab, false, x.e);
  head.no_offload = true;

  const std::uint32_t loss = m.tensor("loss", 1, DType::F32, TensorRole::Activation);
  if (shape.float32_loss) {
    const std::int64_t elements = x.tokens * shape.vocab;
    const std::uint32_t wide =
        m.tensor("logits.float", elements, DType::F32, TensorRole::Activation);
    ModelOp& upcast = m.op("logits_float", op_kind::kToCopy, -1, {logits}, {wide}, {});
    cost(upcast, elements, m.bytes(logits) + m.bytes(wide));
    upcast.no_offload = true;
    const std::uint32_t log_probs =
        m.tensor("log_softmax.out", elements, DType::F32, TensorRole::Activation);
    ModelOp& softmax =
        m.op("log_softmax", op_kind::kLogSoftmax, -1, {wide}, {log_probs}, {log_probs});
    cost(softmax, kSoftmaxFlops * elements, 2 * m.bytes(wide));
    softmax.no_offload = true;
    ModelOp& nll = m.op("loss", op_kind::kNllLoss, -1, {log_probs, labels}, {loss}, {labels});
    cost(nll, elements, m.bytes(log_probs) + m.bytes(labels));
    nll.no_offload = true;
    return std::move(m).finish(loss);
  }
  ModelOp& loss_op =
      m.op("loss", op_kind::kCrossEntropy, -1, {logits, labels}, {loss}, {logits, labels});
  cost(loss_op, kCrossEntropyFlops * x.tokens * shape.vocab,
       m.bytes(logits) + m.bytes(labels) + m.bytes(loss));
  loss_op.no_offload = true;
  return std::move(m).finish(loss);
}

Bytes korthikanti_layer_bytes(const TransformerShape& shape) {
  const std::int64_t s = shape.sequence;
  const std::int64_t b = shape.micro_batch;
  const std::int64_t h = shape.hidden;
  const std::int64_t a = shape.heads;
  // s*b*h*(34 + 5*a*s/h), multiplied out so that a*s/h need not be whole.
  return Bytes(34 * s * b * h + 5 * a * s * s * b);
}

namespace {

TransformerShape gpt2_small(std::int64_t sequence) {
  TransformerShape shape;
  shape.kind = Kind::Gpt;
  shape.layers = 12;
  shape.hidden = 768;
  shape.heads = 12;
  shape.kv_heads = 12;
  shape.ffn = 4 * 768;
  shape.vocab = 50257;
  shape.sequence = sequence;
  return shape;
}

TransformerShape llama3_8b(std::int64_t sequence) {
  TransformerShape shape;
  shape.kind = Kind::Llama;
  shape.layers = 32;
  shape.hidden = 4096;
  shape.heads = 32;
  shape.kv_heads = 8;
  shape.ffn = 14336;
  shape.vocab = 128256;
  shape.sequence = sequence;
  shape.flash_attention = true;
  return shape;
}

// torchtitan's Llama 3 8B training step: the loss in float32 (its `cross_entropy` upcasts).
TransformerShape titan_llama3_8b(std::int64_t sequence) {
  TransformerShape shape = llama3_8b(sequence);
  shape.float32_loss = true;
  return shape;
}

TransformerShape llama_70b(std::int64_t sequence) {
  TransformerShape shape = llama3_8b(sequence);
  shape.layers = 80;
  shape.hidden = 8192;
  shape.heads = 64;
  shape.kv_heads = 8;
  shape.ffn = 28672;
  return shape;
}

/// Llama-3.2-3B (tied embeddings) at batch 2 as a trace lists it: torchtune's published
/// one-A100 set-up (docs/validation.md).
TransformerShape llama32_3b_traced(std::int64_t sequence, std::int64_t batch) {
  TransformerShape shape = llama3_8b(sequence);
  shape.kind = Kind::LlamaTraced;
  shape.layers = 28;
  shape.hidden = 3072;
  shape.heads = 24;
  shape.kv_heads = 8;
  shape.ffn = 8192;
  shape.micro_batch = batch;
  return shape;
}

/// Two small layers with a 4h MLP, for tests.
TransformerShape tiny_gpt() {
  TransformerShape shape;
  shape.kind = Kind::Gpt;
  shape.layers = 2;
  shape.hidden = 64;
  shape.heads = 4;
  shape.kv_heads = 4;
  shape.ffn = 256;
  shape.vocab = 512;
  shape.sequence = 128;
  shape.micro_batch = 2;
  return shape;
}

/// Two small Llama layers with grouped-query and flash attention, for tests.
TransformerShape tiny_llama() {
  TransformerShape shape = tiny_gpt();
  shape.kind = Kind::Llama;
  shape.kv_heads = 2;
  shape.ffn = 176;
  shape.flash_attention = true;
  return shape;
}

struct Preset {
  std::string_view name;
  TransformerShape shape;
};

std::vector<Preset> presets() {
  return {
      {"gpt2-small-s1024", gpt2_small(1024)},
      {"gpt2-small-s2048", gpt2_small(2048)},
      {"llama3-8b-s4096", llama3_8b(4096)},
      {"llama3-8b-s8192", llama3_8b(8192)},
      {"llama3-8b-s16384", llama3_8b(16384)},
      {"titan-llama3-8b-s8192", titan_llama3_8b(8192)},
      {"llama-70b-s4096", llama_70b(4096)},
      {"llama-70b-s8192", llama_70b(8192)},
      {"llama3.2-3b-traced-s4096-b2", llama32_3b_traced(4096, 2)},
      {"tiny-gpt", tiny_gpt()},
      {"tiny-llama", tiny_llama()},
  };
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const Preset& preset : presets()) names.emplace_back(preset.name);
  return names;
}

Result<TransformerShape> model_preset_shape(std::string_view name) {
  for (const Preset& preset : presets()) {
    if (preset.name == name) return preset.shape;
  }
  return Error{fmt::format("unknown model preset {} (presets: {})", json_quote(name),
                           fmt::join(model_preset_names(), ", "))};
}

Result<Model> model_preset(std::string_view name) {
  FERRY_JSON_TRY(const auto shape, model_preset_shape(name));
  return make_transformer(shape, std::string(name));
}

}  // namespace ferry::sim
