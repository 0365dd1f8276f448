#pragma once
/// What an operator is to the simulator: its family (a matrix product, attention in one kernel,
/// a router's top-k...), looked up once in one table when a model op's operator is set. The
/// timing, the rank cuts and the trainers' checkpoint settings read the family, never the name.
/// See Note [Operator families] in op_family.cpp.

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace ferry::sim {

/// The family of an operator (ModelOp::kind). Operators outside the table are `Other`.
enum class OpFamily : std::uint8_t {
  Other,               ///< none below: timed by the flat roofline, no rule of its own
  Matmul,              ///< a matrix product: mm, addmm, _scaled_mm, matmul, linear
  BatchedMatmul,       ///< bmm, baddbmm: eager attention's scores and their product with V
  GroupedMatmul,       ///< _grouped_mm, _scaled_grouped_mm: a mixture's experts in one kernel
  Convolution,         ///< convolution: cuDNN's kernels (a vision model's patches and stages)
  Sdpa,                ///< SDPA's fused kernel, the one the device picks (the profile's
                       ///< `sdpa_backend`): the name a trace gives a fused SDPA call
  FlashAttention,      ///< attention in FlashAttention's kernel, called as such
  CudnnAttention,      ///< attention in cuDNN's kernel (SDPA's cuDNN backend)
  EfficientAttention,  ///< attention in the memory-efficient kernel (SDPA's efficient backend)
  FusedAttention,      ///< other attention in one kernel: flash for the CPU, overrideable, varlen,
                       ///< flex
  Softmax,             ///< _softmax, _safe_softmax: eager attention's scores normalized
  TopK,                ///< topk: a router's choice of experts
  Embedding,           ///< embedding: a table read by token ids
  Add,                 ///< add of two tensors (aten.add.Tensor): a residual sum
  Sum,                 ///< sum over dimensions
  Copy,                ///< _to_copy, clone: a copy, or a change of dtype or device
  Reshape,             ///< view, _unsafe_view, reshape
};

/// Number of OpFamily values.
inline constexpr std::size_t kOpFamilyCount = 17;

/// How a family's float32 product computes on a GPU (Note [Kernel timing] in kernel_timing.cpp).
enum class Float32Math : std::uint8_t {
  None,                  ///< not a product the tensor cores may run
  MatmulPrecision,       ///< TF32 where torch's matmul precision allows it (cuBLAS; flex's
                         ///< Triton kernel), else the CUDA cores
  ConvolutionPrecision,  ///< TF32 where torch's cuDNN convolution precision allows it
  ThreeTF32,             ///< SDPA's memory-efficient kernel: three TF32 products each, always
};

/// What the simulator knows of a family.
struct OpFamilyTraits {
  std::string_view name;  ///< "matmul", "flash_attention", ... (docs/model-format.md, Op kinds)
  /// A matrix product: timed at the profile's matmul figure, by tiles where it has a shape, and
  /// split by the tensor- and context-parallel cuts as one.
  bool matmul = false;
  /// Attention in one kernel, the whole core in one op: its first three inputs are the queries,
  /// keys and values.
  bool fused_attention = false;
  /// Linear in partial sums: an op of it that reads only partial sums writes one (tensor
  /// parallelism of a mixture of experts).
  bool linear_in_sums = false;
  /// How its float32 product computes (None: it is not a product).
  Float32Math float32_math = Float32Math::None;
};

/// The traits of `family`.
[[nodiscard]] const OpFamilyTraits& op_family_traits(OpFamily family);

/// "matmul", "grouped_matmul", ...; "other".
[[nodiscard]] inline std::string_view op_family_name(OpFamily family) {
  return op_family_traits(family).name;
}

/// The family of operator `kind` (`namespace.name.overload`): the table's row for that
/// overload, else its row for the operator (any overload), else Other.
[[nodiscard]] OpFamily op_family(std::string_view kind);

/// One row of the operator table: an operator (`namespace.name`, any overload) or one overload of
/// it (`namespace.name.overload`), and its family.
struct OpFamilyRow {
  std::string_view op;
  OpFamily family;
};

/// The operator table (kOpFamilies in op_family.cpp), one row per operator or overload.
[[nodiscard]] std::span<const OpFamilyRow> op_family_table();

[[nodiscard]] inline bool is_matmul(OpFamily family) { return op_family_traits(family).matmul; }
[[nodiscard]] inline bool is_fused_attention(OpFamily family) {
  return op_family_traits(family).fused_attention;
}
[[nodiscard]] inline bool is_linear_in_sums(OpFamily family) {
  return op_family_traits(family).linear_in_sums;
}

/// The operator a model op runs (`namespace.name.overload`, "aten.mm.default"; empty: not known)
/// with its family, looked up when it is set and carried with it.
class Operator {
 public:
  Operator() = default;
  // Implicit, as the string it replaces: `op.kind = "aten.mm.default"` sets the family too.
  Operator(std::string name) : name_(std::move(name)), family_(op_family(name_)) {}
  Operator(std::string_view name) : Operator(std::string(name)) {}
  Operator(const char* name) : Operator(std::string(name)) {}

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] OpFamily family() const { return family_; }
  [[nodiscard]] bool empty() const { return name_.empty(); }
  /// Not known: no name, family Other.
  void clear() { *this = Operator(); }

  operator const std::string&() const { return name_; }
  operator std::string_view() const { return name_; }

  friend bool operator==(const Operator&, const Operator&) = default;
  friend bool operator==(const Operator& a, std::string_view b) { return a.name_ == b; }
  friend bool operator==(const Operator& a, const std::string& b) { return a.name_ == b; }
  friend bool operator==(const Operator& a, const char* b) { return a.name_ == b; }
  friend std::ostream& operator<<(std::ostream& out, const Operator& op);

 private:
  std::string name_;
  OpFamily family_ = OpFamily::Other;
};

/// Whether `kind` is a matrix product's operator (OpFamilyTraits::matmul).
[[nodiscard]] inline bool is_matmul_kind(const Operator& kind) { return is_matmul(kind.family()); }

/// Whether `kind` is attention in one kernel (OpFamilyTraits::fused_attention).
[[nodiscard]] inline bool is_fused_attention_kind(const Operator& kind) {
  return is_fused_attention(kind.family());
}

/// Whether `kind` is a grouped matrix product, a mixture of experts' experts in one kernel: its
/// weights hold one matrix per expert, and it reads the routed rows and one offset per expert.
[[nodiscard]] inline bool is_grouped_matmul_kind(const Operator& kind) {
  return kind.family() == OpFamily::GroupedMatmul;
}

}  // namespace ferry::sim
