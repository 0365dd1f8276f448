#include "prop/random_model.hpp"

#include <algorithm>
#include <string>

namespace ferry::sim::testing {

namespace {

constexpr std::int64_t kSizes[] = {600, 4096, 64 * 1024, 512 * 1024, 1536 * 1024, 3 << 20};

std::uint32_t add_tensor(Model& m, std::string name, std::int64_t bytes, TensorRole role,
                         std::int32_t view_of = -1, std::int64_t offset = 0) {
  m.tensors.push_back(ModelTensor{std::move(name), Bytes(bytes), DType::BF16, role, view_of,
                                  Bytes(offset), false, Bytes(0), 0});
  return static_cast<std::uint32_t>(m.tensors.size() - 1);
}

}  // namespace

Model build_random_model(const std::vector<LayerChoice>& choices, const ModelOptions& options) {
  Model m;
  m.name = "random";
  std::vector<std::uint32_t> main;  // activations on the path to the loss, newest last
  main.push_back(add_tensor(m, "x", 64 * 1024, TensorRole::Input));
  const std::uint32_t param = add_tensor(m, "w", 8192, TensorRole::Param);
  for (std::size_t i = 0; i < choices.size(); ++i) {
    const LayerChoice& c = choices[i];
    const std::string name = "op" + std::to_string(i);
    ModelOp op;
    op.name = name;
    op.layer = static_cast<std::int32_t>(i);
    op.duration = SimTime(1000 + 20'000 * static_cast<std::int64_t>(c.time % 8));
    op.backward_duration = SimTime(2 * op.duration.ns());
    // Without side branches every output feeds the next op, so every node runs in backward.
    const std::uint32_t in =
        options.side_branches ? main[main.size() - 1 - c.input % main.size()] : main.back();
    op.inputs.push_back(in);
    if (c.extra % 3 == 1 && main.size() > 1)
      op.inputs.push_back(main[main.size() - 1 - (c.extra / 3) % main.size()]);
    // A grouped matmul's largest parameter is its experts' weights: it reads no shared one.
    const bool grouped = options.param_per_layer && options.experts && i % 2 == 1;
    if (c.extra % 3 == 2 && !grouped) op.inputs.push_back(param);
    std::uint32_t own = param;
    if (options.param_per_layer) {
      own = add_tensor(m, "w" + std::to_string(i), 4096, TensorRole::Param);
      op.inputs.push_back(own);
    }
    if (grouped) {
      // 8 experts of 16 x 16 bf16 weights (4096 bytes), one row through each.
      op.kind = "aten._grouped_mm.default";
      op.gemm = GemmShape{.m = kExperts, .n = 16, .k = 16, .batch = 1};
    }
    const std::int64_t bytes = kSizes[c.size % std::size(kSizes)];
    const std::uint32_t out = add_tensor(m, name + ".out", bytes, TensorRole::Activation);
    op.outputs.push_back(out);
    std::uint32_t view = out;
    if ((c.flags & 1U) != 0 && bytes >= 4096 && !grouped) {
      view = add_tensor(m, name + ".view", bytes / 2, TensorRole::Activation,
                        static_cast<std::int32_t>(out), bytes / 4);
      op.outputs.push_back(view);
    }
    if ((c.flags & 4U) != 0) m.tensors[out].no_offload = true;
    if ((c.save & 1U) != 0) op.saved.push_back(in);
    if ((c.save & 2U) != 0) op.saved.push_back(out);
    if ((c.save & 4U) != 0 && view != out) op.saved.push_back(view);
    if ((c.save & 8U) != 0 &&
        std::find(op.inputs.begin(), op.inputs.end(), param) != op.inputs.end()) {
      op.saved.push_back(param);
    }
    if ((c.save & 8U) != 0 && own != param) op.saved.push_back(own);
    op.no_offload = (c.flags & 2U) != 0;
    op.draws_rng = (c.flags & 16U) != 0;
    op.draws_cpu_rng = (c.flags & 32U) != 0;
    op.flops = grouped ? 2 * op.gemm.m * op.gemm.n * op.gemm.k : 1;
    m.ops.push_back(op);
    const bool side = options.side_branches && (c.flags & 8U) != 0 && i + 1 < choices.size();
    if (!side) main.push_back(view);
  }
  const std::uint32_t loss = add_tensor(m, "loss", 4, TensorRole::Activation);
  ModelOp head;
  head.name = "loss";
  head.duration = SimTime(500);
  head.backward_duration = SimTime(500);
  head.inputs = {main.back()};
  head.outputs = {loss};
  head.saved = {main.back()};
  head.no_offload = true;
  head.flops = 1;
  m.ops.push_back(head);
  m.loss = loss;
  return m;
}

}  // namespace ferry::sim::testing
