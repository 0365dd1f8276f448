#pragma once
// Private to the simulated autograd: what both drivers (the single-device Trainer and the
// pipeline Executor) derive from a model's graph before they run it.

#include <cstdint>
#include <vector>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// The model's graph as autograd sees it: which tensor owns each storage, which op produces
/// each storage, and which backward nodes run.
struct Graph {
  std::vector<std::uint32_t> base;     ///< per tensor: the tensor owning its storage (itself)
  std::vector<std::int32_t> producer;  ///< per tensor with storage: the op producing it, or -1
  std::vector<bool> needed;            ///< per op: its backward node runs (an output needs grad)
  std::vector<bool> grad_flows;        ///< per base tensor: a gradient reaches it

  /// The tensor owning `t`'s storage: `t` itself, or the tensor it is a view of.
  [[nodiscard]] std::uint32_t base_of(std::uint32_t t) const { return base[t]; }
};

/// Resolves views to their bases and walks back from the loss: a node runs when one of its
/// outputs is on a path to the loss; a gradient then flows to each activation it read.
[[nodiscard]] Graph make_graph(const Model& model);

/// Whether `t`'s storage is a parameter, a module buffer or an optimizer's state (resident,
/// never an activation).
[[nodiscard]] inline bool is_resident(const Model& model, std::uint32_t base) {
  return is_resident(model.tensors[base].role);
}

}  // namespace ferry::sim
