// The operator table (op_family.hpp): each row's operator and its overloads resolve to the row's
// family, unknown operators are Other, a model op's operator carries its family, and the
// decisions that read a family (the kernel timing, the attention cores, a tensor-parallel
// rank's partial sums) change with it.
#include "ferry/sim/workload/op_family.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <string_view>

#include "ferry/sim/autograd/checkpoint_plan.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/workload/model.hpp"
#include "model_test_support.hpp"

namespace ferry::sim {
namespace {

TEST(OpFamily, EachRowResolvesToItsFamilyForItsOverloads) {
  for (const OpFamilyRow& row : op_family_table()) {
    EXPECT_EQ(op_family(row.op), row.family) << row.op;
    const auto dots = std::count(row.op.begin(), row.op.end(), '.');
    if (dots == 1) {
      // A row for an operator holds for every overload of it.
      for (const std::string_view overload : {"default", "out", "Tensor", "dtype"}) {
        const std::string kind = std::string(row.op) + "." + std::string(overload);
        EXPECT_EQ(op_family(kind), row.family) << kind;
      }
    }
    EXPECT_NE(row.family, OpFamily::Other) << row.op << ": a row names a family";
  }
}

TEST(OpFamily, TheTableNamesEachOperatorOnce) {
  std::set<std::string_view> seen;
  std::set<OpFamily> families;
  for (const OpFamilyRow& row : op_family_table()) {
    EXPECT_TRUE(seen.insert(row.op).second) << row.op << " has two rows";
    families.insert(row.family);
  }
  // Every family but Other has a row, and each has a name of its own.
  EXPECT_EQ(families.size(), kOpFamilyCount - 1);
  std::set<std::string_view> names;
  for (std::size_t f = 0; f < kOpFamilyCount; ++f) {
    EXPECT_TRUE(names.insert(op_family_name(static_cast<OpFamily>(f))).second);
  }
}

TEST(OpFamily, TheRowsGiveEachFamilyItsOperators) {
  EXPECT_EQ(op_family("aten.mm.default"), OpFamily::Matmul);
  EXPECT_EQ(op_family("aten.addmm.default"), OpFamily::Matmul);
  EXPECT_EQ(op_family("aten._scaled_mm.default"), OpFamily::Matmul);
  EXPECT_EQ(op_family("aten.linear.default"), OpFamily::Matmul);
  EXPECT_EQ(op_family("aten.matmul.default"), OpFamily::Matmul);
  EXPECT_EQ(op_family("aten.bmm.default"), OpFamily::BatchedMatmul);
  EXPECT_EQ(op_family("aten.baddbmm.default"), OpFamily::BatchedMatmul);
  EXPECT_EQ(op_family("aten._grouped_mm.default"), OpFamily::GroupedMatmul);
  EXPECT_EQ(op_family("aten._scaled_grouped_mm.default"), OpFamily::GroupedMatmul);
  // The name a trace gives every fused SDPA call: the kernel is the device's choice.
  EXPECT_EQ(op_family("aten._scaled_dot_product_flash_attention.default"), OpFamily::Sdpa);
  EXPECT_EQ(op_family("aten._flash_attention_forward.default"), OpFamily::FlashAttention);
  EXPECT_EQ(op_family("aten._scaled_dot_product_cudnn_attention.default"),
            OpFamily::CudnnAttention);
  EXPECT_EQ(op_family("aten._scaled_dot_product_efficient_attention.default"),
            OpFamily::EfficientAttention);
  EXPECT_EQ(op_family("aten._efficient_attention_forward.default"), OpFamily::EfficientAttention);
  // Flash attention's CPU kernel is a kernel of its own, with no measured figure.
  EXPECT_EQ(op_family("aten._scaled_dot_product_flash_attention_for_cpu.default"),
            OpFamily::FusedAttention);
  EXPECT_EQ(op_family("aten._scaled_dot_product_fused_attention_overrideable.default"),
            OpFamily::FusedAttention);
  EXPECT_EQ(op_family("torch_attn._varlen_attn.default"), OpFamily::FusedAttention);
  EXPECT_EQ(op_family("higher_order.flex_attention"), OpFamily::FusedAttention);
  EXPECT_EQ(op_family("aten.convolution.default"), OpFamily::Convolution);
  EXPECT_EQ(op_family("aten._softmax.default"), OpFamily::Softmax);
  EXPECT_EQ(op_family("aten._safe_softmax.default"), OpFamily::Softmax);
  EXPECT_EQ(op_family("aten.topk.default"), OpFamily::TopK);
  EXPECT_EQ(op_family("aten.topk.values"), OpFamily::TopK);
  EXPECT_EQ(op_family("aten.embedding.default"), OpFamily::Embedding);
  EXPECT_EQ(op_family("aten.sum.dim_IntList"), OpFamily::Sum);
  EXPECT_EQ(op_family("aten._to_copy.default"), OpFamily::Copy);
  EXPECT_EQ(op_family("aten.clone.default"), OpFamily::Copy);
  EXPECT_EQ(op_family("aten.view.default"), OpFamily::Reshape);
  EXPECT_EQ(op_family("aten._unsafe_view.default"), OpFamily::Reshape);
  EXPECT_EQ(op_family("aten.reshape.default"), OpFamily::Reshape);
}

TEST(OpFamily, AnOverloadRowHoldsForThatOverloadOnly) {
  EXPECT_EQ(op_family("aten.add.Tensor"), OpFamily::Add);
  // Adding a number to each element is no residual sum, and not linear in partial sums.
  EXPECT_EQ(op_family("aten.add.Scalar"), OpFamily::Other);
  EXPECT_EQ(op_family("aten.add.out"), OpFamily::Other);
  EXPECT_EQ(op_family("aten.add"), OpFamily::Other);
}

TEST(OpFamily, UnknownOperatorsAreOther) {
  for (const std::string_view kind :
       {"", "mm", "aten", "aten.mul.Tensor", "aten._scaled_dot_product_attention_math.default",
        "aten.mm_like.default", "aten.mmx.default", "custom.mm.default", "aten.topk_x.default",
        "aten.mm.default.extra", "aten..default", "ferry.rotary.default"}) {
    EXPECT_EQ(op_family(kind), OpFamily::Other) << '"' << kind << '"';
  }
}

TEST(OpFamily, TraitsGroupTheFamilies) {
  for (const OpFamily f : {OpFamily::Matmul, OpFamily::BatchedMatmul, OpFamily::GroupedMatmul}) {
    EXPECT_TRUE(is_matmul(f)) << op_family_name(f);
  }
  for (const OpFamily f : {OpFamily::Sdpa, OpFamily::FlashAttention, OpFamily::CudnnAttention,
                           OpFamily::EfficientAttention, OpFamily::FusedAttention}) {
    EXPECT_TRUE(is_fused_attention(f)) << op_family_name(f);
    EXPECT_FALSE(is_matmul(f)) << op_family_name(f);
  }
  for (const OpFamily f : {OpFamily::Add, OpFamily::Sum, OpFamily::Copy, OpFamily::Reshape}) {
    EXPECT_TRUE(is_linear_in_sums(f)) << op_family_name(f);
  }
  // A convolution is no matmul: it keeps its own kernels' timing and no parallel cut splits it.
  for (const OpFamily f : {OpFamily::Other, OpFamily::Softmax, OpFamily::TopK, OpFamily::Embedding,
                           OpFamily::Matmul, OpFamily::Convolution}) {
    EXPECT_FALSE(is_linear_in_sums(f)) << op_family_name(f);
    EXPECT_FALSE(is_fused_attention(f)) << op_family_name(f);
  }
  EXPECT_FALSE(is_matmul(OpFamily::Convolution));
  EXPECT_TRUE(is_grouped_matmul_kind("aten._grouped_mm.default"));
  EXPECT_FALSE(is_grouped_matmul_kind("aten.mm.default"));
}

TEST(Operator, CarriesTheFamilyOfItsName) {
  ModelOp op;
  EXPECT_TRUE(op.kind.empty());
  EXPECT_EQ(op.kind.family(), OpFamily::Other);
  op.kind = "aten.mm.default";
  EXPECT_EQ(op.kind.family(), OpFamily::Matmul);
  EXPECT_EQ(op.kind, "aten.mm.default");
  const ModelOp copy = op;
  EXPECT_EQ(copy.kind.family(), OpFamily::Matmul);
  op.kind = std::string("aten.topk.default");
  EXPECT_EQ(op.kind.family(), OpFamily::TopK);
  op.kind = std::string_view("aten.mul.Tensor");
  EXPECT_EQ(op.kind.family(), OpFamily::Other);
  op.kind = "aten._grouped_mm.default";
  op.kind.clear();
  EXPECT_TRUE(op.kind.empty());
  EXPECT_EQ(op.kind.family(), OpFamily::Other);
}

TEST(Operator, AModelReadFromAFileCarriesItsOpsFamilies) {
  const std::filesystem::path path =
      std::filesystem::path(FERRY_TESTS_DIR) / "data" / "traced" / "mixtral-4layer.json";
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const auto model = parse_model(text.str(), path.string());
  ASSERT_TRUE(model.ok()) << model.error().message;
  std::set<OpFamily> found;
  for (const ModelOp& op : model.value().ops) {
    EXPECT_EQ(op.kind.family(), op_family(op.kind.name())) << op.name;
    found.insert(op.kind.family());
  }
  for (const OpFamily f : {OpFamily::Matmul, OpFamily::GroupedMatmul, OpFamily::TopK, OpFamily::Add,
                           OpFamily::Embedding}) {
    EXPECT_TRUE(found.contains(f)) << op_family_name(f);
  }
}

TEST(OpFamily, AWrongFamilyTimesAnAttentionKernelAtAnotherFigure) {
  Model model;
  ModelOp attention;
  attention.name = "attn";
  attention.kind = "aten._scaled_dot_product_flash_attention.default";
  attention.flops = 256'000'000;  // 1 us at a quarter of 1.024 PFLOP/s
  model.ops = {attention};
  assign_roofline_durations(model, model_test::kernel_device());
  EXPECT_EQ(model.ops[0].duration, SimTime(1000));
  // The same kernel taken for flash attention on the CPU, which has no figure: the flat 60 %.
  model.ops[0].kind = "aten._scaled_dot_product_flash_attention_for_cpu.default";
  assign_roofline_durations(model, model_test::kernel_device());
  EXPECT_EQ(model.ops[0].duration, SimTime(417));
}

TEST(OpFamily, AWrongFamilyLosesAnAttentionCore) {
  auto model = model_preset("llama3-8b-s8192");
  ASSERT_TRUE(model.ok());
  Model m = std::move(model).value();
  const std::size_t cores = attention_cores(m).size();
  ASSERT_GT(cores, 0U);
  std::size_t retagged = 0;
  for (ModelOp& op : m.ops) {
    if (op.layer == 0 && op.kind.family() == OpFamily::Sdpa) {
      op.kind = "aten._scaled_dot_product_attention_math.default";  // not one kernel
      ++retagged;
    }
  }
  ASSERT_EQ(retagged, 1U);
  EXPECT_EQ(attention_cores(m).size(), cores - 1);
}

}  // namespace
}  // namespace ferry::sim
