#pragma once
// Small hand-built models for the simulator's tests, and a builder to write more.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::testing {

/// A model written tensor by tensor and op by op: bf16 tensors with storage of their own.
struct ModelBuilder {
  Model m;

  /// Adds a tensor of `bytes` in `role`; returns its index.
  std::uint32_t tensor(std::string name, std::int64_t bytes, TensorRole role) {
    m.tensors.push_back(ModelTensor{std::move(name), Bytes(bytes), DType::BF16, role, -1, Bytes(0),
                                    false, Bytes(0), 0});
    return static_cast<std::uint32_t>(m.tensors.size() - 1);
  }

  /// Adds an op outside the layers that reads `inputs`, produces `outputs` and saves `saved`,
  /// taking `forward` and `backward`; returns it, for what else a test sets.
  ModelOp& op(std::string name, std::vector<std::uint32_t> inputs,
              std::vector<std::uint32_t> outputs, std::vector<std::uint32_t> saved, SimTime forward,
              SimTime backward) {
    ModelOp o;
    o.name = std::move(name);
    o.duration = forward;
    o.backward_duration = backward;
    o.inputs = std::move(inputs);
    o.outputs = std::move(outputs);
    o.saved = std::move(saved);
    m.ops.push_back(std::move(o));
    return m.ops.back();
  }
};

/// The tiny-gpt preset, its durations the roofline's on `device`.
inline Model tiny_gpt(const DeviceProfile& device) {
  Model model = model_preset("tiny-gpt").value();
  assign_roofline_durations(model, device);
  return model;
}

/// A chain of `layers` linear layers: x -> h1 -> ... -> loss, each saving its input and
/// weight, every layer `bytes` wide; durations set directly.
inline Model chain_model(int layers, std::int64_t bytes, std::int64_t ns = 100'000) {
  ModelBuilder b;
  b.m.name = "chain";
  std::uint32_t x = b.tensor("x", bytes, TensorRole::Input);
  for (int i = 0; i < layers; ++i) {
    const std::uint32_t w = b.tensor("w" + std::to_string(i), 4096, TensorRole::Param);
    const std::uint32_t y = b.tensor("h" + std::to_string(i + 1), bytes, TensorRole::Activation);
    b.op("linear" + std::to_string(i), {x, w}, {y}, {x, w}, SimTime(ns), SimTime(2 * ns)).layer = i;
    x = y;
  }
  const std::uint32_t loss = b.tensor("loss", 4, TensorRole::Activation);
  b.op("loss", {x}, {loss}, {x}, SimTime(1000), SimTime(1000)).no_offload = true;
  b.m.loss = loss;
  return b.m;
}

/// `layers` equal layers, the last one computing the loss: each reads the previous activation
/// (1 KiB) and its weight, saves both, and takes 1 ms forward and 2 ms backward. Split into
/// equal pipeline stages, the copies between them (about 1.5 us each on simple_profile's peer
/// link) are three orders of magnitude below a stage's compute.
inline Model equal_layers(std::uint32_t layers) {
  ModelBuilder b;
  b.m.name = "equal";
  std::uint32_t h = b.tensor("x", 1024, TensorRole::Input);
  for (std::uint32_t k = 0; k < layers; ++k) {
    const std::uint32_t w = b.tensor("w" + std::to_string(k), 2048, TensorRole::Param);
    const std::uint32_t out =
        b.tensor("h" + std::to_string(k + 1), k + 1 == layers ? 4 : 1024, TensorRole::Activation);
    b.op("layer" + std::to_string(k), {h, w}, {out}, {h, w}, SimTime(1'000'000),
         SimTime(2'000'000));
    h = out;
  }
  b.m.loss = h;
  return b.m;
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
