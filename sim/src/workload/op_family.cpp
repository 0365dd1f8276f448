#include "ferry/sim/workload/op_family.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>
#include <ostream>
#include <span>
#include <string_view>

#include "ferry/check.hpp"

namespace ferry::sim {

// Note [Operator families]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A model op names the operator it runs (ModelOp::kind, "aten.mm.default": what torch's
// dispatcher ran, as `ferry.trace` records it). Several parts of the simulator act on what an
// operator is: the kernel timing (a matmul by tiles, flash and cuDNN attention at their kernels'
// figures), the rank cuts (which products split, where a router chooses experts, which ops
// carry a partial sum), the trainers' checkpoint settings (a layer's residual sums, its
// experts) and the attention cores of selective checkpointing. They read the op's family, which
// kOpFamilies gives: the one place an operator's name is matched. A row names an operator,
// `namespace.name`, for all its overloads, or one overload, `namespace.name.overload`, where
// the overloads differ in what they are (aten.add.Tensor sums two tensors; aten.add.Scalar adds
// a number to each element, which a residual sum and a partial sum are not). The family is
// looked up once, when the op's operator is set (read from a model file, built by a preset, or
// assigned), and travels with it (Operator). A kernel the simulator should know is one row.
//
// torch's own lists keyed by exact overloads (the save list of torchtitan's op-level selective
// checkpointing, checkpoint_plan.cpp) stay such lists: they mirror torch's, which compare
// OpOverload objects.

namespace {

constexpr std::array kTraits{
    OpFamilyTraits{.name = "other"},
    OpFamilyTraits{.name = "matmul", .matmul = true, .float32_math = Float32Math::MatmulPrecision},
    OpFamilyTraits{
        .name = "batched_matmul", .matmul = true, .float32_math = Float32Math::MatmulPrecision},
    OpFamilyTraits{
        .name = "grouped_matmul", .matmul = true, .float32_math = Float32Math::MatmulPrecision},
    OpFamilyTraits{.name = "convolution", .float32_math = Float32Math::ConvolutionPrecision},
    // Flash and cuDNN take no float32: SDPA runs such a call on the memory-efficient kernel.
    OpFamilyTraits{.name = "sdpa", .fused_attention = true, .float32_math = Float32Math::ThreeTF32},
    OpFamilyTraits{
        .name = "flash_attention", .fused_attention = true, .float32_math = Float32Math::ThreeTF32},
    OpFamilyTraits{
        .name = "cudnn_attention", .fused_attention = true, .float32_math = Float32Math::ThreeTF32},
    OpFamilyTraits{.name = "efficient_attention",
                   .fused_attention = true,
                   .float32_math = Float32Math::ThreeTF32},
    // Of the others only flex takes float32 on a GPU, and its Triton kernel follows cuBLAS's
    // setting.
    OpFamilyTraits{.name = "fused_attention",
                   .fused_attention = true,
                   .float32_math = Float32Math::MatmulPrecision},
    OpFamilyTraits{.name = "softmax"},
    OpFamilyTraits{.name = "topk"},
    OpFamilyTraits{.name = "embedding"},
    OpFamilyTraits{.name = "add", .linear_in_sums = true},
    OpFamilyTraits{.name = "sum", .linear_in_sums = true},
    OpFamilyTraits{.name = "copy", .linear_in_sums = true},
    OpFamilyTraits{.name = "reshape", .linear_in_sums = true},
};
static_assert(kTraits.size() == kOpFamilyCount);

// The operators by family (Note [Operator families]).
constexpr std::array kOpFamilies{
    OpFamilyRow{"aten.mm", OpFamily::Matmul},
    OpFamilyRow{"aten.addmm", OpFamily::Matmul},
    OpFamilyRow{"aten._scaled_mm", OpFamily::Matmul},
    OpFamilyRow{"aten.matmul", OpFamily::Matmul},
    OpFamilyRow{"aten.linear", OpFamily::Matmul},
    OpFamilyRow{"aten.bmm", OpFamily::BatchedMatmul},
    OpFamilyRow{"aten.baddbmm", OpFamily::BatchedMatmul},
    OpFamilyRow{"aten._grouped_mm", OpFamily::GroupedMatmul},
    OpFamilyRow{"aten._scaled_grouped_mm", OpFamily::GroupedMatmul},
    OpFamilyRow{"aten.convolution", OpFamily::Convolution},
    OpFamilyRow{"aten._scaled_dot_product_flash_attention", OpFamily::Sdpa},
    OpFamilyRow{"aten._flash_attention_forward", OpFamily::FlashAttention},
    OpFamilyRow{"aten._scaled_dot_product_cudnn_attention", OpFamily::CudnnAttention},
    OpFamilyRow{"aten._scaled_dot_product_efficient_attention", OpFamily::EfficientAttention},
    OpFamilyRow{"aten._efficient_attention_forward", OpFamily::EfficientAttention},
    OpFamilyRow{"aten._scaled_dot_product_flash_attention_for_cpu", OpFamily::FusedAttention},
    OpFamilyRow{"aten._scaled_dot_product_fused_attention_overrideable", OpFamily::FusedAttention},
    OpFamilyRow{"torch_attn._varlen_attn", OpFamily::FusedAttention},
    OpFamilyRow{"higher_order.flex_attention", OpFamily::FusedAttention},
    OpFamilyRow{"aten._softmax", OpFamily::Softmax},
    OpFamilyRow{"aten._safe_softmax", OpFamily::Softmax},
    OpFamilyRow{"aten.topk", OpFamily::TopK},
    OpFamilyRow{"aten.embedding", OpFamily::Embedding},
    OpFamilyRow{"aten.add.Tensor", OpFamily::Add},
    OpFamilyRow{"aten.sum", OpFamily::Sum},
    OpFamilyRow{"aten._to_copy", OpFamily::Copy},
    OpFamilyRow{"aten.clone", OpFamily::Copy},
    OpFamilyRow{"aten.view", OpFamily::Reshape},
    OpFamilyRow{"aten._unsafe_view", OpFamily::Reshape},
    OpFamilyRow{"aten.reshape", OpFamily::Reshape},
};

// The rows in the order of their names, for a binary search: a model's every op is looked up
// when its kind is set.
constexpr auto kRowsByName = [] {
  auto rows = kOpFamilies;
  std::sort(rows.begin(), rows.end(),
            [](const OpFamilyRow& a, const OpFamilyRow& b) { return a.op < b.op; });
  return rows;
}();

std::optional<OpFamily> row_for(std::string_view op) {
  const auto it =
      std::lower_bound(kRowsByName.begin(), kRowsByName.end(), op,
                       [](const OpFamilyRow& row, std::string_view name) { return row.op < name; });
  if (it == kRowsByName.end() || it->op != op) return std::nullopt;
  return it->family;
}

}  // namespace

const OpFamilyTraits& op_family_traits(OpFamily family) {
  const auto index = static_cast<std::size_t>(family);
  FERRY_CHECK(index < kTraits.size(), "unknown op family {}", index);
  return kTraits[index];
}

std::span<const OpFamilyRow> op_family_table() { return kOpFamilies; }

OpFamily op_family(std::string_view kind) {
  if (kind.empty()) return OpFamily::Other;
  if (const auto overload = row_for(kind)) return *overload;
  // `namespace.name.overload`: the operator's row, for any overload. A two-part name
  // (`higher_order.flex_attention`, which has no overloads) was looked up whole above.
  const std::size_t first = kind.find('.');
  const std::size_t last = kind.rfind('.');
  if (first == std::string_view::npos || first == last) return OpFamily::Other;
  return row_for(kind.substr(0, last)).value_or(OpFamily::Other);
}

std::ostream& operator<<(std::ostream& out, const Operator& op) { return out << op.name(); }

}  // namespace ferry::sim
