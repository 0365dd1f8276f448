// Collective ops of a rank's model (Note [Collective ops] in model.cpp): read and written back,
// refused where they do not fit their op, and timed by their links; the fused attention and
// grouped matmul kinds.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model_test_support.hpp"

namespace ferry::sim {
namespace {

using model_test::BadCase;
using model_test::replaced;
using model_test::round_device;

// A sequence-parallel step of one rank of two: a local op, an all-gather of its output (a
// reduce-scatter in backward), and the loss over the gathered tensor.
constexpr std::string_view kCollectiveModel = R"({
  "format": "ferry.model/1",
  "name": "sp",
  "tensors": [
    {"name": "x", "bytes": 64, "dtype": "bf16", "role": "input"},
    {"name": "h", "bytes": 64, "dtype": "bf16", "role": "activation"},
    {"name": "g", "bytes": 128, "dtype": "bf16", "role": "activation"},
    {"name": "y", "bytes": 4, "dtype": "f32", "role": "activation"}
  ],
  "ops": [
    {"name": "norm", "flops": 100, "bytes": 128, "backward_flops": 200, "backward_bytes": 256,
     "inputs": ["x"], "outputs": ["h"], "saved": ["x"]},
    {"name": "gather", "kind": "_c10d_functional.all_gather_into_tensor.default", "flops": 0,
     "bytes": 0, "backward_flops": 0, "backward_bytes": 0,
     "collective": {"forward": "all_gather", "backward": "reduce_scatter", "axis": "tp",
                    "ranks": 2, "nodes": 1},
     "inputs": ["h"], "outputs": ["g"], "saved": []},
    {"name": "sum", "flops": 64, "bytes": 132, "backward_flops": 64, "backward_bytes": 132,
     "inputs": ["g"], "outputs": ["y"], "saved": []}
  ],
  "loss": "y"
})";

std::string collective_with(std::string_view from, std::string_view to) {
  return replaced(kCollectiveModel, from, to);
}

DeviceProfile linked_device() {
  DeviceProfile device = round_device(1'000'000'000'000'000, 1'000'000'000'000);
  device.collectives.intra_node = {Bandwidth(100'000'000'000), SimTime(1000)};
  device.collectives.inter_node = {Bandwidth(10'000'000'000), SimTime(5000)};
  return device;
}

TEST(OpKinds, FusedAttentionIsTheKernelNotItsBackwardNorItsParts) {
  for (const std::string_view kind :
       {"aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default", "aten._flash_attention_forward.default",
        "higher_order.flex_attention", "torch_attn._varlen_attn.default"}) {
    EXPECT_TRUE(is_fused_attention_kind(kind)) << kind;
  }
  for (const std::string_view kind : {"aten._scaled_dot_product_flash_attention_backward.default",
                                      "higher_order.flex_attention_backward", "aten.bmm.default",
                                      "aten._softmax.default", "aten.mm.default", ""}) {
    EXPECT_FALSE(is_fused_attention_kind(kind)) << kind;
  }
  EXPECT_TRUE(is_grouped_matmul_kind("aten._grouped_mm.default"));
  EXPECT_FALSE(is_grouped_matmul_kind("aten.mm.default"));
}

TEST(CollectiveOps, AreReadAndWrittenBack) {
  auto model = parse_model(kCollectiveModel, "sp.json");
  ASSERT_TRUE(model.ok()) << model.error().message;
  const OpCollective& c = model.value().ops[1].collective;
  EXPECT_EQ(c.forward, CollectiveKind::AllGather);
  EXPECT_EQ(c.backward, CollectiveKind::ReduceScatter);
  EXPECT_EQ(c.axis, MeshAxis::Tensor);
  EXPECT_EQ(c.ranks, 2);
  EXPECT_EQ(c.nodes, 1);
  EXPECT_FALSE(model.value().ops[0].collective.any());
  const std::string written = model_to_json(model.value());
  EXPECT_NE(written.find(R"("collective": {
        "forward": "all_gather",
        "backward": "reduce_scatter",
        "axis": "tp",
        "ranks": 2,
        "nodes": 1
      })"),
            std::string::npos)
      << written;
  EXPECT_EQ(std::count(written.begin(), written.end(), '{'),
            std::count(kCollectiveModel.begin(), kCollectiveModel.end(), '{'))
      << "an op without a collective writes none";
  auto again = parse_model(written, "again.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), model.value());
  // Either direction may run none; nodes default to one.
  std::string text = collective_with(R"("backward": "reduce_scatter", )", "");
  text.erase(text.find(R"(, "nodes": 1)"), std::string_view(R"(, "nodes": 1)").size());
  auto forward_only = parse_model(text, "sp.json");
  ASSERT_TRUE(forward_only.ok()) << forward_only.error().message;
  EXPECT_EQ(forward_only.value().ops[1].collective.backward, std::nullopt);
  EXPECT_EQ(forward_only.value().ops[1].collective.nodes, 1);
  EXPECT_EQ(forward_only.value().ops[1].collective.sharing, 1);
  // Groups sharing a node's links: read, and written back when more than one.
  auto shared =
      parse_model(collective_with(R"("nodes": 1)", R"("nodes": 2, "sharing": 4)"), "sp.json");
  ASSERT_TRUE(shared.ok()) << shared.error().message;
  EXPECT_EQ(shared.value().ops[1].collective.sharing, 4);
  const std::string shared_written = model_to_json(shared.value());
  EXPECT_NE(shared_written.find(R"("nodes": 2,
        "sharing": 4)"),
            std::string::npos)
      << shared_written;
  auto shared_again = parse_model(shared_written, "again.json");
  ASSERT_TRUE(shared_again.ok()) << shared_again.error().message;
  EXPECT_EQ(shared_again.value(), shared.value());
}

TEST(CollectiveOps, RejectsACollectiveThatDoesNotFitItsOp) {
  const std::vector<BadCase> cases = {
      {"one rank", collective_with(R"("ranks": 2)", R"("ranks": 1)"),
       "sp.json: ops[1].collective.ranks: expected an integer in [2, 1048576], got 1"},
      {"more nodes than ranks", collective_with(R"("nodes": 1)", R"("nodes": 3)"),
       "sp.json: ops[1].collective.nodes: 3 is above the limit of 2"},
      {"unknown kind", collective_with(R"("forward": "all_gather")", R"("forward": "gather")"),
       R"(sp.json: ops[1].collective.forward: expected "all_gather", "reduce_scatter", )"
       R"("all_reduce" or "all_to_all", got "gather")"},
      {"unknown axis", collective_with(R"("axis": "tp")", R"("axis": "dp")"),
       R"(sp.json: ops[1].collective.axis: expected "tp", "cp" or "ep", got "dp")"},
      {"no direction",
       collective_with(R"("forward": "all_gather", "backward": "reduce_scatter", )", ""),
       "sp.json: ops[1].collective: a collective op runs a collective in its forward, its "
       "backward or both"},
      {"computes",
       collective_with(R"("flops": 0,
     "bytes": 0)",
                       R"("flops": 5,
     "bytes": 0)"),
       "sp.json: ops[1].collective: a collective op computes nothing: its time is its link's, so "
       "flops, bytes, backward_flops and backward_bytes must be 0 and it has no gemm"},
      {"forward does not fit",
       collective_with(R"("forward": "all_gather")", R"("forward": "all_reduce")"),
       "sp.json: ops[1].collective.forward: all_reduce over 2 ranks cannot turn 64 bytes into "
       "128 (the op's inputs into its outputs)"},
      {"backward does not fit",
       collective_with(R"("backward": "reduce_scatter")", R"("backward": "all_gather")"),
       "sp.json: ops[1].collective.backward: all_gather over 2 ranks cannot turn 128 bytes into "
       "64 (the op's outputs' gradients into its inputs' gradients)"},
      {"unknown key", collective_with(R"("nodes": 1)", R"("nodes": 1, "stride": 2)"),
       R"(sp.json: ops[1].collective: unknown key "stride" (allowed: forward, backward, axis, )"
       R"(ranks, nodes, sharing))"},
      {"no group shares", collective_with(R"("nodes": 1)", R"("nodes": 2, "sharing": 0)"),
       "sp.json: ops[1].collective.sharing: expected an integer in [1, 1024], got 0"},
  };
  for (const BadCase& bad : cases) {
    SCOPED_TRACE(bad.name);
    Result<Model> result = Error{"not run"};
    ASSERT_NO_THROW(result = parse_model(bad.text, "sp.json"));
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.error().message, bad.expected);
  }
}

TEST(CollectiveOps, TakeTheirLinksTimeInEachDirection) {
  auto parsed = parse_model(kCollectiveModel, "sp.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  const DeviceProfile device = linked_device();
  for (const auto& [nodes, sharing] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{2, 4}}) {
    SCOPED_TRACE(testing::Message() << nodes << " nodes, " << sharing << " sharing them");
    Model model = parsed.value();
    model.ops[1].collective.nodes = nodes;
    model.ops[1].collective.sharing = sharing;
    ASSERT_TRUE(check_roofline(model, device).ok());
    assign_roofline_durations(model, device);
    // Forward: an all-gather whose output is 128 bytes; backward: a reduce-scatter of the
    // output's 128-byte gradient.
    EXPECT_EQ(collective_op_bytes(model, model.ops[1], false), Bytes(128));
    EXPECT_EQ(collective_op_bytes(model, model.ops[1], true), Bytes(128));
    const GroupPlacement group{2, nodes, sharing};
    EXPECT_EQ(model.ops[1].duration,
              collective_time(CollectiveKind::AllGather, Bytes(128), group, device.collectives));
    EXPECT_EQ(
        model.ops[1].backward_duration,
        collective_time(CollectiveKind::ReduceScatter, Bytes(128), group, device.collectives));
    EXPECT_GT(model.ops[1].duration, SimTime(1));
  }
  // A direction that runs none takes the shortest time an op may.
  Model forward_only = parsed.value();
  forward_only.ops[1].collective.backward.reset();
  assign_roofline_durations(forward_only, device);
  EXPECT_EQ(forward_only.ops[1].backward_duration, SimTime(1));
  EXPECT_EQ(collective_op_bytes(forward_only, forward_only.ops[1], true), Bytes(0));
}

TEST(CollectiveOps, ADeviceWithoutTheGroupsLinkIsRefused) {
  auto parsed = parse_model(kCollectiveModel, "sp.json");
  ASSERT_TRUE(parsed.ok()) << parsed.error().message;
  DeviceProfile device = linked_device();
  device.collectives.inter_node = {};
  EXPECT_TRUE(check_roofline(parsed.value(), device).ok());
  Model across = parsed.value();
  across.ops[1].collective.nodes = 2;
  const Status refused = check_roofline(across, device);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().message,
            R"(ops[1].collective: device "round" has no inter_node link for a collective over 2 )"
            R"(ranks on 2 nodes (its profile's "collectives" section, docs/devices.md))");
  // A link too slow for the format's longest duration is refused, not wrapped.
  device.collectives.intra_node = {Bandwidth(1), SimTime(0)};
  Model huge = parsed.value();
  for (const std::uint32_t t : {1U, 2U}) huge.tensors[t].bytes = Bytes(std::int64_t{1} << (t + 40));
  const Status slow = check_roofline(huge, device);
  ASSERT_FALSE(slow.ok());
  EXPECT_NE(slow.error().message.find("ops[1].collective.forward: "), std::string::npos)
      << slow.error().message;
}

}  // namespace
}  // namespace ferry::sim
