#include <fmt/format.h>

#include <string>
#include <utility>
#include <vector>

#include "model_builder.hpp"

namespace ferry::sim::workload_detail {

// Note [A Llama as a trace lists it]
// `python -m ferry trace` lists a Hugging Face LlamaForCausalLM op by op at the aten level, and
// the presets' Llama (one op per module) hides what such a trace shows the planner and the
// offloader: RMSNorm computed in float32 through eight ops whose intermediates nobody saves
// (pow, mean, the float product), separate Q, K and V projections whose outputs nobody saves,
// rotary embedding through slices, negations and concatenations, the grouped key and value
// heads repeated for attention, the rotary cos and sin of every layer listed as views of one
// storage written by one op, transposed weights as views of the parameters, the loss computed
// in float32 outside the output head (a log-softmax saving batch x sequence x vocabulary
// floats), and the optimizer's state. This generator lists the same ops, in the
// same order, with the same saved tensors, and names them as the trace does, so that the
// planner's benchmark and tests can run a model of that shape without tracing one. Costs come
// from the same roofline as the other generators (backward twice forward), not from the trace.

namespace {

class Tracer {
 public:
  Tracer(ModelBuilder& m, const Dims& x) : m_(m), x_(x) {}

  /// An elementwise op (`elements` outputs of `dtype`), reading every input once.
  std::uint32_t eltwise(const std::string& name, std::string_view kind, std::int32_t layer,
                        Tensors inputs, std::int64_t elements, DType dtype, Tensors saved) {
    const std::uint32_t out = m_.tensor(name + ".out", elements, dtype, TensorRole::Activation);
    ModelOp& op = m_.op(name, kind, layer, inputs, {out}, saved);
    std::int64_t bytes = m_.bytes(out);
    for (const std::uint32_t t : inputs) bytes += m_.bytes(t);
    cost(op, elements, bytes);
    return out;
  }

  /// An op that only makes a view (the trace lists it with no output: the view is an output
  /// of the op that wrote its storage, added there by `view_of`).
  void view_op(const std::string& name, std::string_view kind, std::int32_t layer,
               std::uint32_t in) {
    m_.op(name, kind, layer, {in}, {}, {});
  }

  /// A view of `base` (`elements` at `offset`), listed as an output of `producer`.
  std::uint32_t view_of(const std::string& name, std::size_t producer, std::uint32_t base,
                        std::int64_t offset, std::int64_t elements) {
    const std::uint32_t v = m_.view(name, base, offset, elements);
    ModelOp& op = ops()[producer];
    op.outputs.push_back(v);
    return v;
  }

  /// RMSNorm in float32 as Hugging Face computes it; returns the normalized output.
  std::uint32_t rms_norm(const std::string& p, std::int32_t layer, std::uint32_t in,
                         std::size_t& producer) {
    const std::int64_t n = x_.tokens * x_.h;
    const std::uint32_t weight = m_.param(p + ".weight", x_.h);
    const std::uint32_t wide =
        eltwise(p + "/_to_copy", op_kind::kToCopy, layer, {in}, n, DType::F32, {});
    const std::uint32_t squared =
        eltwise(p + "/pow", op_kind::kPow, layer, {wide}, n, DType::F32, {wide});
    const std::uint32_t mean =
        eltwise(p + "/mean", op_kind::kMean, layer, {squared}, x_.tokens, DType::F32, {});
    const std::uint32_t eps =
        eltwise(p + "/add", op_kind::kAdd, layer, {mean}, x_.tokens, DType::F32, {});
    const std::uint32_t rstd =
        m_.tensor(p + "/rsqrt.out", x_.tokens, DType::F32, TensorRole::Activation);
    cost(m_.op(p + "/rsqrt", op_kind::kRsqrt, layer, {eps}, {rstd}, {rstd}), x_.tokens,
         2 * m_.bytes(rstd));
    const std::uint32_t scaled =
        eltwise(p + "/mul", op_kind::kMul, layer, {wide, rstd}, n, DType::F32, {rstd, wide});
    const std::uint32_t narrow =
        eltwise(p + "/_to_copy#1", op_kind::kToCopy, layer, {scaled}, n, x_dtype(), {});
    const std::uint32_t out = eltwise(p + "/mul#1", op_kind::kMul, layer, {weight, narrow}, n,
                                      x_dtype(), {narrow, weight});
    producer = ops().size() - 1;
    return out;
  }

  /// A bias-free linear layer as the trace lists it (t, view, mm, _unsafe_view) over `input`,
  /// which op `producer` wrote: the view it saves is its own tensor, an output of `producer`.
  /// Returns mm's output and its producer.
  std::pair<std::uint32_t, std::size_t> linear(const std::string& p, std::int32_t layer,
                                               std::uint32_t input, std::size_t producer,
                                               std::int64_t in_features,
                                               std::int64_t out_features) {
    const std::uint32_t in = view_of(p + "/view.out", producer, input, 0, x_.tokens * in_features);
    const std::uint32_t weight = m_.param(p + ".weight", in_features * out_features);
    const std::uint32_t t =
        m_.tensor(p + "/t.out", in_features * out_features, x_dtype(), TensorRole::Param);
    m_.view_param(t, weight);
    m_.op(p + "/t", op_kind::kT, layer, {weight}, {}, {});
    view_op(p + "/view", op_kind::kView, layer, input);
    const std::uint32_t out = m_.activation(p + "/mm.out", x_.tokens * out_features);
    matmul_cost(m_.op(p + "/mm", op_kind::kMm, layer, {in, t}, {out}, {t, in}), x_.tokens,
                in_features, out_features, false, m_.element());
    const std::size_t mm = ops().size() - 1;
    view_op(p + "/_unsafe_view", op_kind::kUnsafeView, layer, out);
    return {out, mm};
  }

  [[nodiscard]] DType x_dtype() const { return m_.dtype(); }
  std::vector<ModelOp>& ops() { return m_.ops(); }
  [[nodiscard]] const Model& model() const { return m_.model(); }
  ModelBuilder& builder() { return m_; }

 private:
  ModelBuilder& m_;
  const Dims& x_;
};

/// Layer `layer`'s self-attention over `normed` (which op `normed_by` wrote): the Q, K and V
/// projections, rotary embedding with `cos` and `sin`, the repeated key and value heads, flash
/// attention and the output projection. Returns o_proj's output.
std::uint32_t traced_attention(Tracer& tr, const Dims& x, std::int32_t layer, std::uint32_t normed,
                               std::size_t normed_by, std::uint32_t cos, std::uint32_t sin) {
  ModelBuilder& m = tr.builder();
  const std::string a = fmt::format("model.layers.{}.self_attn", layer);
  const std::int64_t kv_width = x.kv * x.d;
  const std::int64_t half = x.tokens * x.h / 2;
  const std::int64_t kv_half = x.tokens * kv_width / 2;
  const DType e = tr.x_dtype();

  auto [q, q_by] = tr.linear(a + ".q_proj", layer, normed, normed_by, x.h, x.h);
  const std::uint32_t qt = tr.view_of(a + "/transpose.out", q_by, q, 0, x.tokens * x.h);
  const std::uint32_t q1 = tr.view_of(a + "/slice.out", q_by, q, 0, half);
  const std::uint32_t q2 = tr.view_of(a + "/slice#1.out", q_by, q, half, half);
  tr.view_op(a + "/view", op_kind::kView, layer, q);
  tr.view_op(a + "/transpose", op_kind::kTranspose, layer, q);
  auto [k, k_by] = tr.linear(a + ".k_proj", layer, normed, normed_by, x.h, kv_width);
  const std::uint32_t kt = tr.view_of(a + "/transpose#1.out", k_by, k, 0, x.tokens * kv_width);
  const std::uint32_t k1 = tr.view_of(a + "/slice#2.out", k_by, k, 0, kv_half);
  const std::uint32_t k2 = tr.view_of(a + "/slice#3.out", k_by, k, kv_half, kv_half);
  tr.view_op(a + "/view#1", op_kind::kView, layer, k);
  tr.view_op(a + "/transpose#1", op_kind::kTranspose, layer, k);
  auto [v, v_by] = tr.linear(a + ".v_proj", layer, normed, normed_by, x.h, kv_width);
  const std::uint32_t vt = tr.view_of(a + "/transpose#2.out", v_by, v, 0, x.tokens * kv_width);
  tr.view_op(a + "/view#2", op_kind::kView, layer, v);
  tr.view_op(a + "/transpose#2", op_kind::kTranspose, layer, v);

  // Rotary: q * cos + rotate_half(q) * sin, and the same for k.
  const std::uint32_t qc =
      tr.eltwise(a + "/mul", op_kind::kMul, layer, {qt, cos}, x.tokens * x.h, e, {cos});
  tr.view_op(a + "/slice", op_kind::kSlice, layer, q);
  tr.view_op(a + "/slice#1", op_kind::kSlice, layer, q);
  const std::uint32_t qn = tr.eltwise(a + "/neg", op_kind::kNeg, layer, {q2}, half, e, {});
  const std::uint32_t qr =
      tr.eltwise(a + "/cat", op_kind::kCat, layer, {qn, q1}, x.tokens * x.h, e, {});
  const std::uint32_t qs =
      tr.eltwise(a + "/mul#1", op_kind::kMul, layer, {qr, sin}, x.tokens * x.h, e, {sin});
  const std::uint32_t q_rot =
      tr.eltwise(a + "/add", op_kind::kAdd, layer, {qc, qs}, x.tokens * x.h, e, {});
  const std::uint32_t kc =
      tr.eltwise(a + "/mul#2", op_kind::kMul, layer, {kt, cos}, x.tokens * kv_width, e, {cos});
  tr.view_op(a + "/slice#2", op_kind::kSlice, layer, k);
  tr.view_op(a + "/slice#3", op_kind::kSlice, layer, k);
  const std::uint32_t kn = tr.eltwise(a + "/neg#1", op_kind::kNeg, layer, {k2}, kv_half, e, {});
  const std::uint32_t kr =
      tr.eltwise(a + "/cat#1", op_kind::kCat, layer, {kn, k1}, x.tokens * kv_width, e, {});
  const std::uint32_t ks =
      tr.eltwise(a + "/mul#3", op_kind::kMul, layer, {kr, sin}, x.tokens * kv_width, e, {sin});
  const std::uint32_t k_rot =
      tr.eltwise(a + "/add#1", op_kind::kAdd, layer, {kc, ks}, x.tokens * kv_width, e, {});
  // The grouped key and value heads as the trace lists them (Hugging Face's repeat_kv).
  const std::uint32_t k_rep =
      tr.eltwise(a + "/cat#2", op_kind::kCat, layer, {k_rot}, x.tokens * kv_width, e, {});
  const std::uint32_t v_rep =
      tr.eltwise(a + "/cat#3", op_kind::kCat, layer, {vt}, x.tokens * kv_width, e, {});

  const std::string sdpa = a + "/_scaled_dot_product_flash_attention";
  const std::uint32_t out = m.activation(sdpa + ".out0", x.tokens * x.h);
  const std::uint32_t lse =
      m.tensor(sdpa + ".out1", x.a * x.s * x.b, DType::F32, TensorRole::Activation);
  const std::int64_t causal = causal_flash_matmul_flops(x);
  ModelOp& attn = m.op(sdpa, op_kind::kFlashAttention, layer, {q_rot, k_rep, v_rep}, {out, lse},
                       {k_rep, q_rot, v_rep, lse, out});
  cost(attn, 2 * causal,
       m.bytes(q_rot) + m.bytes(k_rep) + m.bytes(v_rep) + m.bytes(out) + m.bytes(lse));
  attn.backward_flops = 5 * causal;
  const std::size_t attn_by = tr.ops().size() - 1;
  tr.view_op(a + "/view#3", op_kind::kView, layer, out);
  tr.view_op(a + "/transpose#3", op_kind::kTranspose, layer, out);
  tr.view_op(a + "/view#4", op_kind::kView, layer, out);
  return tr.linear(a + ".o_proj", layer, out, attn_by, x.h, x.h).first;
}

/// Layer `layer`'s MLP over `normed` (which op `normed_by` wrote): gate and up projections,
/// SiLU, their product, the down projection. Returns down_proj's output.
std::uint32_t traced_mlp(Tracer& tr, const Dims& x, std::int32_t layer, std::uint32_t normed,
                         std::size_t normed_by) {
  const std::string p = fmt::format("model.layers.{}.mlp", layer);
  const DType e = tr.x_dtype();
  auto [gate, gate_by] = tr.linear(p + ".gate_proj", layer, normed, normed_by, x.h, x.f);
  const std::uint32_t gate_v =
      tr.view_of(p + ".gate_proj/_unsafe_view.out", gate_by, gate, 0, x.tokens * x.f);
  const std::uint32_t silu =
      tr.eltwise(p + ".act_fn/silu", op_kind::kSilu, layer, {gate_v}, x.tokens * x.f, e, {gate_v});
  auto [up, up_by] = tr.linear(p + ".up_proj", layer, normed, normed_by, x.h, x.f);
  const std::uint32_t up_v =
      tr.view_of(p + ".up_proj/_unsafe_view.out", up_by, up, 0, x.tokens * x.f);
  const std::uint32_t product =
      tr.eltwise(p + "/mul", op_kind::kMul, layer, {silu, up_v}, x.tokens * x.f, e, {up_v, silu});
  return tr.linear(p + ".down_proj", layer, product, tr.ops().size() - 1, x.f, x.h).first;
}

/// One decoder layer over the residual `stream`, which it advances.
void traced_layer(Tracer& tr, const Dims& x, std::int32_t layer, std::uint32_t& stream,
                  std::uint32_t cos, std::uint32_t sin) {
  const std::string p = fmt::format("model.layers.{}", layer);
  const DType e = tr.x_dtype();
  std::size_t normed_by = 0;
  const std::uint32_t normed = tr.rms_norm(p + ".input_layernorm", layer, stream, normed_by);
  const std::uint32_t o = traced_attention(tr, x, layer, normed, normed_by, cos, sin);
  const std::uint32_t resid =
      tr.eltwise(p + "/add", op_kind::kAdd, layer, {stream, o}, x.tokens * x.h, e, {});
  const std::uint32_t normed2 =
      tr.rms_norm(p + ".post_attention_layernorm", layer, resid, normed_by);
  const std::uint32_t down = traced_mlp(tr, x, layer, normed2, normed_by);
  stream = tr.eltwise(p + "/add#1", op_kind::kAdd, layer, {resid, down}, x.tokens * x.h, e, {});
}

/// The rotary cos and sin tables from `inv_freq` (float32, then the model's dtype); returns
/// one view of each per layer.
std::vector<std::pair<std::uint32_t, std::uint32_t>> traced_rotary(Tracer& tr, const Dims& x,
                                                                   std::int64_t layers,
                                                                   std::uint32_t inv_freq) {
  const DType e = tr.x_dtype();
  const std::uint32_t freqs = tr.eltwise("model.rotary_emb/mul", op_kind::kMul, -1, {inv_freq},
                                         x.s * x.d / 2, DType::F32, {});
  const std::uint32_t angles =
      tr.eltwise("model.rotary_emb/cat", op_kind::kCat, -1, {freqs}, x.s * x.d, DType::F32, {});
  const std::uint32_t cos32 =
      tr.eltwise("model.rotary_emb/cos", op_kind::kCos, -1, {angles}, x.s * x.d, DType::F32, {});
  const std::uint32_t sin32 =
      tr.eltwise("model.rotary_emb/sin", op_kind::kSin, -1, {angles}, x.s * x.d, DType::F32, {});
  const std::uint32_t cos =
      tr.eltwise("model.rotary_emb/_to_copy#2", op_kind::kToCopy, -1, {cos32}, x.s * x.d, e, {});
  const std::size_t cos_by = tr.ops().size() - 1;
  const std::uint32_t sin =
      tr.eltwise("model.rotary_emb/_to_copy#3", op_kind::kToCopy, -1, {sin32}, x.s * x.d, e, {});
  const std::size_t sin_by = tr.ops().size() - 1;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> rope;
  for (std::int64_t layer = 0; layer < layers; ++layer) {
    const std::string a = fmt::format("model.layers.{}.self_attn", layer);
    rope.emplace_back(tr.view_of(a + "/unsqueeze.out", cos_by, cos, 0, x.s * x.d),
                      tr.view_of(a + "/unsqueeze#1.out", sin_by, sin, 0, x.s * x.d));
  }
  return rope;
}

/// The output head (tied to the embedding `table`) in the no-offload region over the final
/// norm's output `normed` (written by op `normed_by`), then the loss in float32. Returns the
/// loss.
std::uint32_t traced_head_and_loss(Tracer& tr, const Dims& x, std::int64_t vocab,
                                   std::uint32_t table, std::uint32_t labels, std::uint32_t normed,
                                   std::size_t normed_by) {
  ModelBuilder& m = tr.builder();
  const std::uint32_t head_in =
      tr.view_of("lm_head/view.out", normed_by, normed, 0, x.tokens * x.h);
  const std::uint32_t t = m.tensor("lm_head/t.out", vocab * x.h, tr.x_dtype(), TensorRole::Param);
  m.view_param(t, table);
  m.op("lm_head/t", op_kind::kT, -1, {table}, {}, {}).no_offload = true;
  m.op("lm_head/view", op_kind::kView, -1, {head_in}, {}, {}).no_offload = true;
  const std::uint32_t logits = m.activation("lm_head/mm.out", x.tokens * vocab);
  ModelOp& head = m.op("lm_head/mm", op_kind::kMm, -1, {head_in, t}, {logits}, {t, head_in});
  matmul_cost(head, x.tokens, x.h, vocab, false, x.e);
  head.no_offload = true;
  m.op("lm_head/_unsafe_view", op_kind::kUnsafeView, -1, {logits}, {}, {}).no_offload = true;
  const std::uint32_t wide =
      tr.eltwise("_to_copy", op_kind::kToCopy, -1, {logits}, x.tokens * vocab, DType::F32, {});
  const std::uint32_t log_probs =
      m.tensor("_log_softmax.out", x.tokens * vocab, DType::F32, TensorRole::Activation);
  cost(m.op("_log_softmax", op_kind::kLogSoftmax, -1, {wide}, {log_probs}, {log_probs}),
       kCrossEntropyFlops * x.tokens * vocab, 2 * m.bytes(wide));
  const std::uint32_t loss =
      m.tensor("nll_loss_forward.out0", 1, DType::F32, TensorRole::Activation);
  const std::uint32_t total =
      m.tensor("nll_loss_forward.out1", 1, DType::F32, TensorRole::Activation);
  cost(m.op("nll_loss_forward", op_kind::kNllLoss, -1, {log_probs, labels}, {loss, total},
            {log_probs, labels, total}),
       x.tokens, m.bytes(log_probs) + m.bytes(labels));
  return loss;
}

/// AdamW's two moments per parameter, held for the whole step.
void add_optimizer_state(ModelBuilder& m) {
  const std::size_t count = m.model().tensors.size();
  for (std::size_t i = 0; i < count; ++i) {
    const ModelTensor& tensor = m.model().tensors[i];
    if (tensor.role != TensorRole::Param || tensor.view_of >= 0) continue;
    const std::int64_t elements = tensor.bytes.count() / dtype_size(tensor.dtype);
    const std::string param = tensor.name;
    m.tensor("optimizer." + param + ".exp_avg", elements, TensorRole::OptimizerState);
    m.tensor("optimizer." + param + ".exp_avg_sq", elements, TensorRole::OptimizerState);
  }
}

}  // namespace

Model make_traced_llama(const TransformerShape& shape, std::string name) {
  const Dims x = dims_of(shape);
  ModelBuilder m(std::move(name), shape.dtype);
  Tracer tr(m, x);
  const auto layers = static_cast<std::size_t>(shape.layers);
  m.reserve(layers * 110 + 80, layers * 80 + 30);

  const std::uint32_t tokens = m.tensor("input.0", x.tokens, DType::I64, TensorRole::Input);
  const std::uint32_t labels = m.tensor("input.labels", x.tokens, DType::I64, TensorRole::Input);
  const std::uint32_t table = m.param("model.embed_tokens.weight", shape.vocab * x.h);
  const std::uint32_t inv_freq =
      m.tensor("model.rotary_emb.inv_freq", x.d / 2, DType::F32, TensorRole::Buffer);
  std::uint32_t stream = m.activation("model.embed_tokens/embedding.out", x.tokens * x.h);
  cost(m.op("model.embed_tokens/embedding", op_kind::kEmbedding, -1, {table, tokens}, {stream},
            {tokens}),
       0, m.bytes(tokens) + 2 * m.bytes(stream));
  const auto rope = traced_rotary(tr, x, shape.layers, inv_freq);
  for (std::int64_t layer = 0; layer < shape.layers; ++layer) {
    const auto l = static_cast<std::size_t>(layer);
    traced_layer(tr, x, static_cast<std::int32_t>(layer), stream, rope[l].first, rope[l].second);
  }
  std::size_t normed_by = 0;
  const std::uint32_t normed = tr.rms_norm("model.norm", -1, stream, normed_by);
  const std::uint32_t loss =
      traced_head_and_loss(tr, x, shape.vocab, table, labels, normed, normed_by);
  add_optimizer_state(m);
  return std::move(m).finish(loss);
}

}  // namespace ferry::sim::workload_detail
