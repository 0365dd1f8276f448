// expert_parallel_model (Note [An expert-parallel rank] in expert_parallel_cut.cpp), on Mixtral
// 8x7B's config cut to two layers (tests/data/traced/sized): 8 experts of 4096 -> 14336, top 2,
// 4096 tokens.

#include "ferry/sim/workload/rank_model.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "rank_cut_test_support.hpp"

namespace ferry::sim::rank_cut_test {
namespace {

TEST(ExpertParallelModel, AMixtralRankHoldsItsExpertsAndExchangesTheRoutedRows) {
  const Model whole = balanced_mixtral();
  Bytes experts(0);
  for (const ModelTensor& t : whole.tensors) {
    if (t.role == TensorRole::Param && t.view_of < 0 && t.name.ends_with("_proj") &&
        t.name.find(".experts.") != std::string::npos) {
      experts += t.bytes;
    }
  }
  ASSERT_EQ(experts, Bytes(2 * 8 * 3 * std::int64_t{4096} * 14336 * 2));  // 2 layers, bf16
  for (const std::int32_t ep : {2, 4, 8}) {
    SCOPED_TRACE(ep);
    auto cut = expert_parallel_model(whole, ep, 1);
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    EXPECT_EQ(param_bytes(rank), param_bytes(whole) - experts + Bytes(experts.count() / ep));
    for (const std::int32_t layer : {0, 1}) {
      // Balanced routing: every GPU computes as many rows as it routes.
      EXPECT_EQ(flops_of_layer(rank, layer), flops_of_layer(whole, layer));
      EXPECT_EQ(collectives(rank, MeshAxis::Expert).at(layer),
                (std::map<std::string, int>{{"all_to_all/all_to_all", 2}}));
    }
    for (const ModelOp& op : rank.ops) {
      if (!op.collective.any()) continue;
      EXPECT_EQ(op.collective.ranks, ep);
      // Each exchange moves the routed rows: 4096 tokens x top 2 x 4096 features, bf16.
      EXPECT_EQ(rank.tensors[op.inputs.at(0)].bytes, Bytes(std::int64_t{4096} * 2 * 4096 * 2));
      EXPECT_EQ(rank.tensors[op.outputs.at(0)].bytes, rank.tensors[op.inputs.at(0)].bytes);
    }
  }
  auto odd = expert_parallel_model(whole, 3);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.error().message,
            R"(--ep 3: 8 experts (op "model.layers.0.mlp.experts/_grouped_mm") do not split )"
            R"(among 3 ranks)");
  auto dense = expert_parallel_model(testing::sized_family("llama"), 2);
  ASSERT_FALSE(dense.ok());
  EXPECT_NE(dense.error().message.find("has no grouped expert matmul"), std::string::npos);
  auto one = expert_parallel_model(whole, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one.value(), whole);
}

// The routed rows of Mixtral's first layer as a trace under routing loads=6,2,2,2,1,1,1,1 gives
// them (ModelOp::group_rows): 8192 rows, 4096 tokens x top 2. A rank of ep holds 8/ep experts
// and receives ep x their rows, so the busiest rank (the first) computes 1.5 (ep 2), 2 (ep 4)
// or 3 (ep 8) times the traced rows.
TEST(ExpertParallelModel, TheBusiestRankOfAnUnevenRoutingComputesItsRows) {
  Model whole = balanced_mixtral();
  const std::vector<std::int64_t> rows{3072, 1024, 1024, 1024, 512, 512, 512, 512};
  for (ModelOp& op : whole.ops) {
    if (op.layer == 0 && is_grouped_matmul_kind(op.kind)) op.group_rows = rows;
  }
  ASSERT_TRUE(validate_model(whole).ok());
  const auto grouped_flops = [](const Model& m, std::int32_t layer) {
    std::int64_t flops = 0;
    for (const ModelOp& op : m.ops) {
      if (op.layer == layer && is_grouped_matmul_kind(op.kind)) flops += op.flops;
    }
    return flops;
  };
  const auto exchanged = [](const Model& m, std::int32_t layer) {
    std::vector<std::pair<Bytes, Bytes>> sizes;  // each all-to-all's input and output
    for (const ModelOp& op : m.ops) {
      if (op.layer == layer && op.collective.any()) {
        sizes.emplace_back(m.tensors[op.inputs.at(0)].bytes, m.tensors[op.outputs.at(0)].bytes);
      }
    }
    return sizes;
  };
  const Bytes routed(std::int64_t{4096} * 2 * 4096 * 2);  // the layer's routed rows, bf16
  for (const auto& [ep, times] : {std::pair{2, 3}, std::pair{4, 4}, std::pair{8, 6}}) {
    SCOPED_TRACE(ep);
    auto cut = expert_parallel_model(whole, ep, 1);
    ASSERT_TRUE(cut.ok()) << cut.error().message;
    const Model& rank = cut.value();
    // times / 2 the rows: the grouped matmuls' FLOPs, the rows dispatched in and out.
    EXPECT_EQ(2 * grouped_flops(rank, 0), times * grouped_flops(whole, 0));
    using Sizes = std::vector<std::pair<Bytes, Bytes>>;
    const Bytes busiest(routed.count() * times / 2);
    EXPECT_EQ(exchanged(rank, 0), (Sizes{{routed, busiest}, {busiest, routed}}));
    for (const ModelOp& op : rank.ops) {
      if (op.layer != 0 || !is_grouped_matmul_kind(op.kind)) continue;
      EXPECT_EQ(2 * op.gemm.m, times * 8192) << op.name;
    }
    EXPECT_GT(saved_activation_bytes(rank, 0), saved_activation_bytes(whole, 0));
    // The second layer's trace gives no rows: balanced, as before.
    EXPECT_EQ(grouped_flops(rank, 1), grouped_flops(whole, 1));
    EXPECT_EQ(exchanged(rank, 1), (Sizes{{routed, routed}, {routed, routed}}));
    EXPECT_GT(step_time(rank), step_time(expert_parallel_model(balanced_mixtral(), ep, 1).value()));
  }
  trains_clean(expert_parallel_model(whole, 2, 1).value(), "ep comm");

  // Balanced rows price as no rows do.
  Model balanced = whole;
  for (ModelOp& op : balanced.ops) {
    if (!op.group_rows.empty()) op.group_rows.assign(8, 1024);
  }
  Model unknown = whole;
  for (ModelOp& op : unknown.ops) op.group_rows.clear();
  auto even = expert_parallel_model(balanced, 4, 1);
  ASSERT_TRUE(even.ok());
  for (ModelOp& op : even.value().ops) op.group_rows.clear();
  EXPECT_EQ(even.value(), expert_parallel_model(unknown, 4, 1).value());

  // The fixture's own rows, traced under random routing with a capacity factor of 1.25: the
  // busiest of 8 ranks holds the expert of 1082 rows of 8192.
  const Model traced = testing::sized_family("mixtral");
  EXPECT_EQ(expert_routing(traced), ExpertRouting::BusiestRank);
  EXPECT_EQ(expert_routing(balanced_mixtral()), ExpertRouting::Balanced);
  EXPECT_EQ(expert_routing_name(ExpertRouting::BusiestRank), "busiest_rank");
  EXPECT_EQ(expert_routing_name(ExpertRouting::Balanced), "balanced");
  auto eight = expert_parallel_model(traced, 8, 1);
  ASSERT_TRUE(eight.ok()) << eight.error().message;
  for (const std::int32_t layer : {0, 1}) {
    std::int64_t most = 0;
    for (const ModelOp& op : traced.ops) {
      if (op.layer == layer && !op.group_rows.empty()) most = std::ranges::max(op.group_rows);
    }
    EXPECT_GT(most, 1024);
    EXPECT_EQ(grouped_flops(eight.value(), layer) * 1024, grouped_flops(traced, layer) * most)
        << layer;
  }

  Model wrong = whole;
  for (ModelOp& op : wrong.ops) {
    if (!op.group_rows.empty()) op.group_rows.resize(4);
  }
  auto refused = expert_parallel_model(wrong, 2, 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message,
            R"(--ep 2: op "model.layers.0.mlp.experts/_grouped_mm" gives the rows of 4 groups, )"
            "but its weights hold 8 experts");
}

// A static dispatcher's capacity (Note [Static capacity] in expert_parallel_cut.cpp) on the Mixtral
// above with the first layer's uneven rows: at ep 2 its busiest rank receives 1.5 times the traced
// 8192 rows, the second layer's 8192. With a factor of 2 every routed base activation is allocated
// for twice its traced elements and names its rows of data, and nothing else of the cut changes; a
// factor that does not hold the busiest rank's rows is refused with one that does.
TEST(ExpertParallelModel, AStaticCapacityPadsTheRoutedRowsAndNothingElse) {
  Model whole = balanced_mixtral();
  const std::vector<std::int64_t> rows{3072, 1024, 1024, 1024, 512, 512, 512, 512};
  for (ModelOp& op : whole.ops) {
    if (op.layer == 0 && is_grouped_matmul_kind(op.kind)) op.group_rows = rows;
  }
  const Model dynamic = expert_parallel_model(whole, 2, 1).value();
  auto cut = expert_parallel_model(whole, 2, 1, 2.0);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  Model padded = cut.value();
  ASSERT_TRUE(validate_model(padded).ok());
  std::map<std::string, std::int64_t> padded_rows;  // tensor -> rows
  for (std::uint32_t t = 0; t < padded.tensors.size(); ++t) {
    ModelTensor& tensor = padded.tensors[t];
    if (tensor.capacity.count() == 0) continue;
    EXPECT_EQ(tensor.view_of, -1) << tensor.name;
    EXPECT_EQ(tensor.role, TensorRole::Activation) << tensor.name;
    const std::int32_t layer = tensor.name.find("layers.0.") != std::string::npos ? 0 : 1;
    // Twice the traced elements: the busiest rank's bytes over its share of the rows.
    const std::int64_t traced = tensor.bytes.count() * 2 / (layer == 0 ? 3 : 2);
    EXPECT_EQ(tensor.capacity.count(), 2 * traced) << tensor.name;
    EXPECT_EQ(tensor.rows, layer == 0 ? 12288 : 8192) << tensor.name;
    padded_rows[tensor.name] = tensor.rows;
    tensor.capacity = Bytes(0);
    tensor.rows = 0;
  }
  EXPECT_EQ(padded, dynamic);  // nothing but the capacities
  // Per layer: the rows dispatched in, and what the experts compute from them (the first
  // grouped matmul's output, the activation's, the second's).
  for (const std::string layer : {"model.layers.0.", "model.layers.1."}) {
    const auto in_layer = std::ranges::count_if(
        padded_rows, [&](const auto& named) { return named.first.starts_with(layer); });
    EXPECT_GE(in_layer, 4) << layer;
    EXPECT_TRUE(padded_rows.contains(layer + "mlp.experts/_grouped_mm/ep.dispatch.out")) << layer;
    EXPECT_FALSE(padded_rows.contains(layer + "mlp.experts/_grouped_mm#1/ep.combine.out")) << layer;
  }
  trains_clean(padded, "ep comm");

  const auto refused = [&](std::int32_t ep, double capacity) {
    auto r = expert_parallel_model(whole, ep, 1, capacity);
    return r.ok() ? std::string("accepted") : r.error().message;
  };
  const std::string small = refused(2, 1.25);
  EXPECT_NE(small.find("--ep 2: --expert-capacity 1.25: the busiest rank receives "),
            std::string::npos)
      << small;
  EXPECT_NE(small.find(R"("model.layers.0.mlp.experts/_grouped_mm.out", more than its )"
                       "capacity"),
            std::string::npos)
      << small;
  EXPECT_NE(small.find("a factor of 1.50 holds them"), std::string::npos) << small;
  EXPECT_EQ(refused(2, 1.5), "accepted");
  EXPECT_EQ(refused(1, 2.0),
            "--expert-capacity 2 needs --ep 2 or more: one GPU's routed rows are static without "
            "padding");
  EXPECT_EQ(refused(2, 0.5), "--expert-capacity 0.5: use a factor from 1 to 1024");
}

// Two layers whose experts read one tensor (found by FsdpProperty): each layer dispatches it
// into a tensor of its own, named by its exchange.
constexpr std::string_view kSharedRows = R"({
  "format": "ferry.model/1", "name": "shared-rows",
  "tensors": [
    {"name": "x", "bytes": 4096, "dtype": "bf16", "role": "input"},
    {"name": "w0", "bytes": 4096, "dtype": "bf16", "role": "param"},
    {"name": "w1", "bytes": 4096, "dtype": "bf16", "role": "param"},
    {"name": "a", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "y0", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "y1", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "s", "bytes": 4096, "dtype": "bf16", "role": "activation"},
    {"name": "loss", "bytes": 4, "dtype": "f32", "role": "activation"}
  ],
  "ops": [
    {"name": "in", "flops": 2048, "bytes": 8192, "backward_flops": 2048, "backward_bytes": 8192,
     "inputs": ["x"], "outputs": ["a"], "saved": []},
    {"name": "e0", "kind": "aten._grouped_mm.default", "layer": 0, "flops": 131072,
     "bytes": 12288, "backward_flops": 262144, "backward_bytes": 24576, "inputs": ["a", "w0"],
     "outputs": ["y0"], "saved": ["a", "w0"], "gemm": {"m": 128, "n": 16, "k": 32},
     "group_rows": [64, 32, 16, 16]},
    {"name": "e1", "kind": "aten._grouped_mm.default", "layer": 1, "flops": 131072,
     "bytes": 12288, "backward_flops": 262144, "backward_bytes": 24576, "inputs": ["a", "w1"],
     "outputs": ["y1"], "saved": ["a", "w1"], "gemm": {"m": 128, "n": 16, "k": 32}},
    {"name": "add", "flops": 2048, "bytes": 12288, "backward_flops": 0, "backward_bytes": 8192,
     "inputs": ["y0", "y1"], "outputs": ["s"], "saved": []},
    {"name": "sum", "flops": 2048, "bytes": 4100, "backward_flops": 2048, "backward_bytes": 4100,
     "inputs": ["s"], "outputs": ["loss"], "saved": []}
  ],
  "loss": "loss"
})";

TEST(ExpertParallelModel, TwoLayersExpertsMayReadOneTensor) {
  auto model = parse_model(kSharedRows, "shared-rows.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  // w0 and w1: 2048 elements, 4 experts of 32 x 16.
  auto cut = expert_parallel_model(model.value(), 2, 1);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  std::set<std::string> exchanged;
  for (const ModelOp& op : cut.value().ops) {
    if (op.collective.any()) exchanged.insert(cut.value().tensors[op.outputs.at(0)].name);
  }
  EXPECT_EQ(exchanged, (std::set<std::string>{"e0/ep.dispatch.out", "e0/ep.combine.out",
                                              "e1/ep.dispatch.out", "e1/ep.combine.out"}));
  // The first layer's routing loads the first GPU with 2 x 96 of 128 rows; the second is
  // balanced.
  EXPECT_EQ(cut.value().ops[2].gemm.m, 192);
  EXPECT_EQ(cut.value().ops[5].gemm.m, 128);
  trains_clean(cut.value(), "ep comm");
}

// A file whose busiest GPU would compute more rows than a product may have is refused, naming
// the place, not priced with counts that overflow.
TEST(ExpertParallelModel, RowsPastTheLimitsAreRefused) {
  std::string text(kSharedRows);
  const auto replace = [&](std::string_view from, std::string_view to) {
    text.replace(text.find(from), from.size(), to);
  };
  replace(R"("flops": 131072,)", R"("flops": 1125899906842624,)");  // 2 x 2^40 x 16 x 32
  replace(R"("m": 128,)", R"("m": 1099511627776,)");
  replace("[64, 32, 16, 16]", "[1099511627776, 0, 0, 0]");
  auto model = parse_model(text, "huge-rows.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  auto cut = expert_parallel_model(model.value(), 2, 1);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.error().message,
            "--ep 2: the cut model is not valid (ops[2].gemm.m: expected an integer in [1, "
            "1099511627776], got 2199023255552)");
}

TEST(ExpertParallelModel, ARankTrainsHazardFreeWithCheckpointingAndOffload) {
  auto cut = expert_parallel_model(testing::sized_family("mixtral"), 2);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  trains_clean(cut.value(), "ep comm");
}

}  // namespace
}  // namespace ferry::sim::rank_cut_test
