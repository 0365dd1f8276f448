#include "rank_cut.hpp"

#include <string>
#include <utility>
#include <vector>

namespace ferry::sim::rank_cut_detail {

std::uint32_t RankCut::add_tensor(Model& out, std::uint32_t like, std::string name) {
  ModelTensor t = out.tensors[like];
  t.name = std::move(name);
  t.view_of = -1;
  t.view_offset = Bytes(0);
  out.tensors.push_back(std::move(t));
  return static_cast<std::uint32_t>(out.tensors.size() - 1);
}

ModelOp RankCut::collective_op(std::string name, const Exchange& x,
                               std::vector<std::uint32_t> inputs,
                               std::vector<std::uint32_t> outputs, const ModelOp& near) const {
  ModelOp c;
  c.name = std::move(name);
  c.kind = x.kind;
  c.layer = near.layer;
  c.no_offload = near.no_offload;
  c.inputs = std::move(inputs);
  c.outputs = std::move(outputs);
  c.collective.forward = x.forward;
  c.collective.backward = x.backward;
  c.collective.axis = x.axis;
  c.collective.ranks = degree_;
  c.collective.nodes = x.nodes;
  c.collective.sharing = x.sharing;
  return c;
}

Result<Model> RankCut::checked(Model out) const {
  // The traced optimizer step is the whole model's: the rank steps its parameters' share
  // (Note [The optimizer step] in model.cpp).
  if (out.optimizer_step) {
    const Bytes whole = trainable_param_bytes(whole_);
    const Bytes part = trainable_param_bytes(out);
    if (whole > Bytes(0) && part > Bytes(0)) {
      out.optimizer_step = share_of(*out.optimizer_step, part, whole);
    }
  }
  if (!validate_) return out;
  if (auto valid = validate_model(out); !valid) {
    return refuse("the cut model is not valid ({})", valid.error().message);
  }
  return out;
}

}  // namespace ferry::sim::rank_cut_detail
