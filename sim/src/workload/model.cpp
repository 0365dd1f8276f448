#include "ferry/sim/workload/model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ferry/check.hpp"

namespace ferry::sim {

std::int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::U8:
      return 1;
    case DType::I64:
      return 8;
  }
  fail_check(__FILE__, __LINE__, "dtype", fmt::format("unknown dtype {}", static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::U8:
      return "u8";
    case DType::I64:
      return "i64";
  }
  return "?";
}

const char* tensor_role_name(TensorRole role) {
  switch (role) {
    case TensorRole::Input:
      return "input";
    case TensorRole::Param:
      return "param";
    case TensorRole::Buffer:
      return "buffer";
    case TensorRole::Activation:
      return "activation";
    case TensorRole::OptimizerState:
      return "optimizer_state";
  }
  return "?";
}

// Note [Counting saved bytes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Korthikanti et al. (2022, Section 4.1) count what each op of a layer keeps for backward, term
// by term: the LayerNorm input (the residual stream, produced by the layer before) is a term of
// this layer; Q and K are 2sbh each although both live inside the QKV output; the dropout
// output and V are separate terms. saved_activation_bytes reproduces that accounting:
//
//   * the tensors saved by the ops whose `layer` is the given one, whoever produced them;
//   * activations only (params, buffers and the batch are not activation memory);
//   * each tensor once, however many ops save it (o_proj and flash attention both save the
//     attention output: it is one tensor and one term);
//   * a view with its own bytes, not its base's. Q, K and V are views of the QKV output, and the
//     formula counts exactly those slices.
//
// This is a logical count. Storage can be shared (a view and its base, or two views of one
// base, both saved), so an offloader that moves storages may move fewer or more bytes; the
// transformer generator never saves both a view and its base, so here the two counts agree.

Bytes saved_activation_bytes(const Model& model, std::int32_t layer) {
  std::vector<bool> counted(model.tensors.size(), false);
  Bytes total;
  for (const ModelOp& op : model.ops) {
    if (op.layer != layer) continue;
    for (const std::uint32_t t : op.saved) {
      FERRY_CHECK(t < model.tensors.size(), "op {} saves tensor {} of {}", op.name, t,
                  model.tensors.size());
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.role != TensorRole::Activation || counted[t]) continue;
      counted[t] = true;
      total += tensor.bytes;
    }
  }
  return total;
}

bool has_static_capacity(const Model& model) {
  return std::ranges::any_of(model.tensors, [](const ModelTensor& t) { return t.rows > 0; });
}

}  // namespace ferry::sim
