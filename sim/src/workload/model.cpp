#include "ferry/sim/workload/model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <utility>
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

std::optional<std::int64_t> grouped_matmul_experts(const Model& model, const ModelOp& op) {
  if (!op.gemm.known() || op.gemm.n <= 0 || op.gemm.k <= 0) return std::nullopt;
  std::optional<std::uint32_t> weights;
  for (const std::uint32_t t : op.inputs) {
    const ModelTensor& tensor = model.tensors.at(t);
    const std::uint32_t base = tensor.view_of >= 0 ? static_cast<std::uint32_t>(tensor.view_of) : t;
    if (model.tensors.at(base).role != TensorRole::Param) continue;
    if (!weights || tensor.bytes > model.tensors.at(*weights).bytes) weights = t;
  }
  if (!weights) return std::nullopt;
  const ModelTensor& w = model.tensors.at(*weights);
  __extension__ using Wide = unsigned __int128;
  const Wide matrix = static_cast<Wide>(op.gemm.n) * static_cast<Wide>(op.gemm.k);
  return static_cast<std::int64_t>(static_cast<Wide>(w.bytes.count() / dtype_size(w.dtype)) /
                                   matrix);
}

Bytes trainable_param_bytes(const Model& model) {
  Bytes total;
  for (const ModelTensor& t : model.tensors) {
    if (t.role == TensorRole::Param && t.view_of < 0) total += t.bytes;
  }
  return total;
}

// Note [The optimizer step]
// torch's optimizers step over the parameters after backward, a pass bound by memory bandwidth.
// What it moves and what it allocates depend on the implementation the loop runs, which a trace
// measures (Note [The optimizer step as the device runs it] in ferry/_trace). For AdamW the fused
// kernel reads the parameters, gradients and both moments and writes the parameters and moments
// once (7 bytes a parameter byte; a trace counts 8, the schema marking the gradients written
// too); the foreach kernels make eight passes, 20 bytes a parameter byte, and hold
// `exp_avg_sq_sqrt`, a tensor per parameter, all at once: one parameter set more at the step's
// peak, as torch.optim.AdamW's documentation says of foreach; the loop over the parameters holds
// two tensors of the parameter it is at. The trace records those tensors and the simulated step
// makes each, so the caching allocator places them as it places torch's, in the blocks backward
// left free. The figures are the whole model's: a rank that steps part of the parameters (a
// shard under FSDP, a pipeline stage, a tensor-parallel slice) pays the part's share by bytes, of
// each tensor too. Without figures (a preset, a file written by hand) a model with optimizer
// state steps as fused AdamW does.

StepCost optimizer_step_cost(const Model& model, Bytes params, Bytes grads, Bytes state) {
  if (!model.optimizer_step) {
    if (state <= Bytes(0)) return {};
    return StepCost{.moved = std::int64_t{2} * params + grads + std::int64_t{2} * state,
                    .temporaries = {}};
  }
  const Bytes whole = trainable_param_bytes(model);
  if (whole <= Bytes(0) || params <= Bytes(0)) return {};
  OptimizerStep share = share_of(*model.optimizer_step, params, whole);
  return StepCost{.moved = share.bytes, .temporaries = std::move(share.temporaries)};
}

OptimizerStep share_of(const OptimizerStep& step, Bytes part, Bytes whole) {
  OptimizerStep out = step;
  out.bytes = share_of(step.bytes, part, whole);
  for (Bytes& t : out.temporaries) t = share_of(t, part, whole);
  return out;
}

Bytes share_of(Bytes figure, Bytes part, Bytes whole) {
  FERRY_CHECK(part.count() > 0 && whole.count() > 0, "a share of {} in {} bytes", part.count(),
              whole.count());
  // Exact: figure and part are at most 2^50 (kMaxJsonBytes), their product fits 128 bits.
  __extension__ using Wide = __int128;
  const Wide product = static_cast<Wide>(figure.count()) * part.count();
  return Bytes(static_cast<std::int64_t>((product + whole.count() - 1) / whole.count()));
}

SimTime streaming_time(const DeviceProfile& device, Bytes bytes) {
  const std::int64_t rate = device.memory_bandwidth.bytes_per_s() * memory_permille(device) / 1000;
  return std::max(SimTime(1), transfer_time(bytes, Bandwidth(std::max<std::int64_t>(rate, 1))));
}

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

std::size_t saved_before_running(const ModelOp& op) {
  const auto has = [](const std::vector<std::uint32_t>& list, std::uint32_t t) {
    return std::find(list.begin(), list.end(), t) != list.end();
  };
  std::size_t n = 0;
  while (n < op.saved.size() && has(op.inputs, op.saved[n]) && !has(op.outputs, op.saved[n])) ++n;
  return n;
}

}  // namespace ferry::sim
