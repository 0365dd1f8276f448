#pragma once
// Random models for offload property tests, built from lists of small choices so that
// shrinking a list shrinks the model.

#include <cstdint>
#include <ostream>
#include <vector>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::testing {

struct LayerChoice {
  std::uint32_t input = 0;  ///< which earlier activation to read (from the newest back)
  std::uint32_t extra = 0;  ///< a second input, a param, or none
  std::uint32_t size = 0;   ///< output size class
  std::uint32_t save = 0;   ///< bit set: save input, save output, save a view, save the param
  /// bit set: view output, no-offload op, opt-out tensor, side branch, draws from the device
  /// generator, draws from the CPU generator
  std::uint32_t flags = 0;
  std::uint32_t time = 0;  ///< duration class
};

struct ModelOptions {
  /// Allow outputs that never reach the loss (unused branches) and ops reading older
  /// activations; without, every op reads the previous op's output.
  bool side_branches = true;
  /// Every op also reads a parameter of its own (so each layer is an FSDP unit with
  /// parameters), saved for backward when the op saves its parameter.
  bool param_per_layer = false;
  /// With param_per_layer, every second op is a mixture of experts' grouped matmul
  /// (aten._grouped_mm) whose own parameter stacks kExperts experts' weights: what expert
  /// parallelism splits, and FSDP2 then shards as a unit of its own.
  bool experts = false;
};

/// The experts of a grouped matmul of build_random_model (ModelOptions::experts).
inline constexpr std::int32_t kExperts = 8;

inline void showValue(const LayerChoice& c, std::ostream& os) {
  os << "{in " << c.input << ", extra " << c.extra << ", size " << c.size << ", save " << c.save
     << ", flags " << c.flags << ", time " << c.time << "}";
}

/// Interprets `choices` as a model: every choice adds one op.
Model build_random_model(const std::vector<LayerChoice>& choices, const ModelOptions& options);

}  // namespace ferry::sim::testing
