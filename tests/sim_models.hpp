#pragma once
// Small hand-built models for autograd tests.

#include <string>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::testing {

/// A chain of `layers` linear layers: x -> h1 -> ... -> loss, each saving its input and
/// weight, every layer `bytes` wide; durations set directly.
inline Model chain_model(int layers, std::int64_t bytes, std::int64_t ns = 100'000) {
  Model m;
  m.name = "chain";
  auto tensor = [&](std::string name, std::int64_t size, TensorRole role) {
    m.tensors.push_back(ModelTensor{std::move(name), Bytes(size), DType::BF16, role, -1, Bytes(0),
                                    false, Bytes(0), 0});
    return static_cast<std::uint32_t>(m.tensors.size() - 1);
  };
  std::uint32_t x = tensor("x", bytes, TensorRole::Input);
  for (int i = 0; i < layers; ++i) {
    const std::uint32_t w = tensor("w" + std::to_string(i), 4096, TensorRole::Param);
    const std::uint32_t y = tensor("h" + std::to_string(i + 1), bytes, TensorRole::Activation);
    ModelOp op;
    op.name = "linear" + std::to_string(i);
    op.layer = i;
    op.duration = SimTime(ns);
    op.backward_duration = SimTime(2 * ns);
    op.inputs = {x, w};
    op.outputs = {y};
    op.saved = {x, w};
    m.ops.push_back(op);
    x = y;
  }
  const std::uint32_t loss = tensor("loss", 4, TensorRole::Activation);
  ModelOp head;
  head.name = "loss";
  head.duration = SimTime(1000);
  head.backward_duration = SimTime(1000);
  head.inputs = {x};
  head.outputs = {loss};
  head.saved = {x};
  head.no_offload = true;
  m.ops.push_back(head);
  m.loss = loss;
  return m;
}

/// Two training steps under `policy`, with a 2 MiB forward window and a 16 MiB prefetch
/// budget: small enough that originals leave and reloads come back in the chain models.
inline TrainingOptions two_steps(Policy policy) {
  TrainingOptions o;
  o.offload.policy = policy;
  o.offload.window_bytes = Bytes(2LL << 20);
  o.offload.prefetch_bytes = Bytes(16LL << 20);
  o.steps = 2;
  return o;
}

}  // namespace ferry::sim::testing
