#pragma once
// Private to the planner: how it reads a model's tensors.

#include <cstdint>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::planning {

/// The tensor whose storage `t` lies in (t itself when it is not a view).
inline std::uint32_t base_of(const Model& model, std::uint32_t t) {
  while (model.tensors[t].view_of >= 0) t = static_cast<std::uint32_t>(model.tensors[t].view_of);
  return t;
}

/// Whether `t`'s storage is an activation (not a parameter, buffer or the batch).
inline bool is_activation(const Model& model, std::uint32_t t) {
  return model.tensors[base_of(model, t)].role == TensorRole::Activation;
}

/// 128-bit products of bytes and nanoseconds (or pixels).
__extension__ using Wide = __int128;

}  // namespace ferry::sim::planning
