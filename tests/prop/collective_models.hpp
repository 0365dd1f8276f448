#pragma once
// Random models with collective ops (docs/model-format.md, Collective ops) for the properties of
// a rank's collectives: mesh_collectives_prop.cpp (one rank) and pipeline_mesh_prop.cpp (the
// stages of a pipeline).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::testing {

/// `model` with a collective op after each op `after` picks (bit i: op i, of the first 12) whose
/// first output is an activation with storage of its own that no view shares: it reads that
/// output and writes a new tensor of the same size, which every later op reads (and saves) in
/// its place. Two bits of `shapes` and of `axes` an op say what it runs, and over which axis.
inline Model with_collectives(const Model& model, std::uint64_t after, std::uint64_t shapes,
                              std::uint64_t axes) {
  Model out = model;
  out.ops.clear();
  std::vector<std::uint32_t> now(model.tensors.size());  // what a later op reads for each tensor
  for (std::uint32_t t = 0; t < now.size(); ++t) now[t] = t;
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    ModelOp op = model.ops[i];
    for (std::uint32_t& t : op.inputs) t = now[t];
    for (std::uint32_t& t : op.saved) t = now[t];
    out.ops.push_back(op);
    if (i >= 12 || ((after >> i) & 1U) == 0 || op.outputs.empty()) continue;
    const std::uint32_t t = op.outputs.front();
    const bool viewed = std::ranges::any_of(out.tensors, [t](const ModelTensor& v) {
      return v.view_of == static_cast<std::int32_t>(t);
    });
    if (out.tensors[t].view_of >= 0 || viewed) continue;
    const auto moved = static_cast<std::uint32_t>(out.tensors.size());
    ModelTensor tensor = out.tensors[t];
    tensor.name += "/collective";
    out.tensors.push_back(tensor);
    now.push_back(moved);
    now[t] = moved;
    ModelOp c;
    c.name = op.name + "/collective";
    c.layer = op.layer;
    c.no_offload = op.no_offload;
    c.inputs = {t};
    c.outputs = {moved};
    const std::uint64_t shape = (shapes >> (2 * i)) & 3U;
    const std::uint64_t axis = (axes >> (2 * i)) & 3U;
    // 0: an all-reduce forward (a rowwise output); 1: one backward (the identity forward before
    // a colwise operand); 2: both; 3: an all-to-all both ways.
    const CollectiveKind kind = shape == 3 ? CollectiveKind::AllToAll : CollectiveKind::AllReduce;
    if (shape != 1) c.collective.forward = kind;
    if (shape != 0) c.collective.backward = kind;
    c.collective.axis = axis == 1   ? MeshAxis::Context
                        : axis == 2 ? MeshAxis::Expert
                                    : MeshAxis::Tensor;
    c.collective.ranks = 2;
    c.kind = kind == CollectiveKind::AllToAll ? "_c10d_functional.all_to_all_single.default"
                                              : "_c10d_functional.all_reduce.default";
    c.duration = SimTime(c.collective.forward ? 500 + 3000 * static_cast<std::int64_t>(axis) : 1);
    c.backward_duration =
        SimTime(c.collective.backward ? 700 + 2000 * static_cast<std::int64_t>(shape) : 1);
    out.ops.push_back(c);
  }
  out.loss = now[model.loss];
  return out;
}

}  // namespace ferry::sim::testing
