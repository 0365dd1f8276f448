#include "graph.hpp"

namespace ferry::sim {

Graph make_graph(const Model& model) {
  Graph g;
  const std::size_t tensors = model.tensors.size();
  const std::size_t ops = model.ops.size();
  g.base.resize(tensors);
  for (std::uint32_t t = 0; t < tensors; ++t) {
    const std::int32_t view_of = model.tensors[t].view_of;
    g.base[t] = view_of >= 0 ? static_cast<std::uint32_t>(view_of) : t;
  }
  g.producer.assign(tensors, -1);
  for (std::uint32_t k = 0; k < ops; ++k) {
    for (const std::uint32_t t : model.ops[k].outputs) {
      if (model.tensors[t].view_of < 0) g.producer[t] = static_cast<std::int32_t>(k);
    }
  }
  g.needed.assign(ops, false);
  g.grad_flows.assign(tensors, false);
  g.grad_flows[g.base[model.loss]] = true;
  for (std::size_t k = ops; k-- > 0;) {
    const ModelOp& op = model.ops[k];
    for (const std::uint32_t t : op.outputs) g.needed[k] = g.needed[k] || g.grad_flows[g.base[t]];
    if (!g.needed[k]) continue;
    for (const std::uint32_t t : op.inputs) {
      if (model.tensors[g.base[t]].role == TensorRole::Activation) g.grad_flows[g.base[t]] = true;
    }
  }
  return g;
}

}  // namespace ferry::sim
