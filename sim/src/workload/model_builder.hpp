#pragma once
// Private to the transformer generators: a builder that appends tensors and ops to a Model,
// the cost helpers, and the sizes shared by every block of a stack.

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::workload_detail {

using Kind = TransformerShape::Kind;
using Tensors = std::initializer_list<std::uint32_t>;

/// The operators the generated ops run (ModelOp::kind): what a trace of the same module records,
/// or, for a fused op torch has no operator for, one of ferry's own (docs/model-format.md).
namespace op_kind {
inline constexpr std::string_view kMm = "aten.mm.default";
inline constexpr std::string_view kAddmm = "aten.addmm.default";
inline constexpr std::string_view kBmm = "aten.bmm.default";
inline constexpr std::string_view kFlashAttention =
    "aten._scaled_dot_product_flash_attention.default";
inline constexpr std::string_view kSoftmax = "aten._softmax.default";
inline constexpr std::string_view kLogSoftmax = "aten._log_softmax.default";
inline constexpr std::string_view kDropout = "aten.native_dropout.default";
inline constexpr std::string_view kLayerNorm = "aten.native_layer_norm.default";
inline constexpr std::string_view kRmsNorm = "aten._fused_rms_norm.default";
inline constexpr std::string_view kAdd = "aten.add.Tensor";
inline constexpr std::string_view kMul = "aten.mul.Tensor";
inline constexpr std::string_view kNeg = "aten.neg.default";
inline constexpr std::string_view kPow = "aten.pow.Tensor_Scalar";
inline constexpr std::string_view kMean = "aten.mean.dim";
inline constexpr std::string_view kRsqrt = "aten.rsqrt.default";
inline constexpr std::string_view kCat = "aten.cat.default";
inline constexpr std::string_view kCos = "aten.cos.default";
inline constexpr std::string_view kSin = "aten.sin.default";
inline constexpr std::string_view kGelu = "aten.gelu.default";
inline constexpr std::string_view kSilu = "aten.silu.default";
inline constexpr std::string_view kToCopy = "aten._to_copy.default";
inline constexpr std::string_view kEmbedding = "aten.embedding.default";
inline constexpr std::string_view kCrossEntropy = "aten.cross_entropy_loss.default";
inline constexpr std::string_view kNllLoss = "aten.nll_loss_forward.default";
inline constexpr std::string_view kT = "aten.t.default";
inline constexpr std::string_view kView = "aten.view.default";
inline constexpr std::string_view kUnsafeView = "aten._unsafe_view.default";
inline constexpr std::string_view kTranspose = "aten.transpose.int";
inline constexpr std::string_view kSlice = "aten.slice.Tensor";
inline constexpr std::string_view kUnsqueeze = "aten.unsqueeze.default";
/// Rotary embedding of Q and K in one kernel: no torch operator does it.
inline constexpr std::string_view kRotary = "ferry.rotary.default";
}  // namespace op_kind

/// Forward FLOPs per element of the elementwise and normalization kernels. Rough counts; they
/// only matter where an op is compute-bound, which these never are.
constexpr std::int64_t kNormFlops = 5;
constexpr std::int64_t kSoftmaxFlops = 5;
constexpr std::int64_t kGeluFlops = 8;
constexpr std::int64_t kSiluFlops = 4;
constexpr std::int64_t kRotaryFlops = 3;
constexpr std::int64_t kDropoutFlops = 2;
constexpr std::int64_t kCrossEntropyFlops = 5;

/// Appends tensors and ops to a Model, tracking indices so that nothing is looked up by name.
class ModelBuilder {
 public:
  ModelBuilder(std::string name, DType dtype) : element_(dtype_size(dtype)), dtype_(dtype) {
    model_.name = std::move(name);
  }

  /// A tensor of `elements` elements of the model's dtype.
  std::uint32_t tensor(std::string name, std::int64_t elements, TensorRole role) {
    return tensor(std::move(name), elements, dtype_, role);
  }

  std::uint32_t tensor(std::string name, std::int64_t elements, DType dtype, TensorRole role) {
    ModelTensor tensor;
    tensor.name = std::move(name);
    tensor.bytes = Bytes(elements * dtype_size(dtype));
    tensor.dtype = dtype;
    tensor.role = role;
    model_.tensors.push_back(std::move(tensor));
    return static_cast<std::uint32_t>(model_.tensors.size() - 1);
  }

  std::uint32_t activation(std::string name, std::int64_t elements) {
    return tensor(std::move(name), elements, TensorRole::Activation);
  }

  std::uint32_t param(std::string name, std::int64_t elements) {
    return tensor(std::move(name), elements, TensorRole::Param);
  }

  /// A view of `elements` elements starting `offset_elements` into `base`.
  std::uint32_t view(std::string name, std::uint32_t base, std::int64_t offset_elements,
                     std::int64_t elements) {
    const std::uint32_t index = activation(std::move(name), elements);
    ModelTensor& tensor = model_.tensors[index];
    tensor.view_of = static_cast<std::int32_t>(base);
    tensor.view_offset = Bytes(offset_elements * element_);
    return index;
  }

  /// Appends an op running operator `kind` (Op kinds in docs/model-format.md); costs are set by
  /// the caller (see cost()).
  ModelOp& op(std::string name, std::string_view kind, std::int32_t layer, Tensors inputs,
              Tensors outputs, Tensors saved) {
    ModelOp op;
    op.name = std::move(name);
    op.kind = kind;
    op.layer = layer;
    op.inputs = inputs;
    op.outputs = outputs;
    op.saved = saved;
    model_.ops.push_back(std::move(op));
    return model_.ops.back();
  }

  /// The op appended last.
  ModelOp& last_op() { return model_.ops.back(); }
  /// The ops so far (a trace lists a view as an output of the op that wrote its storage).
  std::vector<ModelOp>& ops() { return model_.ops; }
  [[nodiscard]] const Model& model() const { return model_; }
  [[nodiscard]] DType dtype() const { return dtype_; }

  /// Makes parameter `tensor` a view of parameter `base`, from its start (a transposed weight).
  void view_param(std::uint32_t tensor, std::uint32_t base) {
    model_.tensors[tensor].view_of = static_cast<std::int32_t>(base);
  }

  [[nodiscard]] std::int64_t element() const { return element_; }
  [[nodiscard]] std::int64_t bytes(std::uint32_t tensor) const {
    return model_.tensors[tensor].bytes.count();
  }

  Model finish(std::uint32_t loss) && {
    model_.loss = loss;
    return std::move(model_);
  }

  void reserve(std::size_t tensors, std::size_t ops) {
    model_.tensors.reserve(tensors);
    model_.ops.reserve(ops);
  }

 private:
  Model model_;
  std::int64_t element_;
  DType dtype_;
};

/// Sets an op's forward cost and the backward as twice the forward (see docs/model-format.md).
inline void cost(ModelOp& op, std::int64_t flops, std::int64_t bytes) {
  op.flops = flops;
  op.bytes = Bytes(bytes);
  op.backward_flops = 2 * flops;
  op.backward_bytes = Bytes(2 * bytes);
}

/// A [m, k] x [k, n] matmul (plus a bias of n): 2mkn FLOPs, every operand read or written once.
inline void matmul_cost(ModelOp& op, std::int64_t m, std::int64_t k, std::int64_t n, bool bias,
                        std::int64_t element) {
  cost(op, 2 * m * k * n, (m * k + k * n + m * n + (bias ? n : 0)) * element);
  op.gemm = GemmShape{.m = m, .n = n, .k = k, .batch = 1};
}

/// Sizes shared by every block of one stack.
struct Dims {
  std::int64_t s;       ///< sequence
  std::int64_t b;       ///< micro-batch
  std::int64_t h;       ///< hidden
  std::int64_t a;       ///< heads
  std::int64_t kv;      ///< key/value heads (Llama)
  std::int64_t d;       ///< head size h / a
  std::int64_t f;       ///< MLP inner size
  std::int64_t tokens;  ///< s x b
  std::int64_t e;       ///< bytes per element
};

inline Dims dims_of(const TransformerShape& shape) {
  Dims dims{};
  dims.s = shape.sequence;
  dims.b = shape.micro_batch;
  dims.h = shape.hidden;
  dims.a = shape.heads;
  dims.kv = shape.kind == Kind::Gpt ? shape.heads : shape.kv_heads;
  dims.d = shape.hidden / shape.heads;
  dims.f = shape.ffn;
  dims.tokens = shape.sequence * shape.micro_batch;
  dims.e = dtype_size(shape.dtype);
  return dims;
}

/// FLOPs of one of causal FlashAttention's s x s matmuls (Q K^T, or P V): 2 x (multiply-adds) over
/// the s(s+1)/2 (query, key) pairs at or below the diagonal, which are all the kernel computes;
/// it skips the masked blocks above. Counted as the trace counts them (docs/trace.md, Costs).
inline std::int64_t causal_flash_matmul_flops(const Dims& x) {
  return x.b * x.h * x.s * (x.s + 1);  // 2 b a (s(s+1)/2) d
}

/// A Llama stack as `python -m ferry trace` lists a Hugging Face LlamaForCausalLM
/// (transformer_traced.cpp).
Model make_traced_llama(const TransformerShape& shape, std::string name);

}  // namespace ferry::sim::workload_detail
