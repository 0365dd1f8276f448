#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/check.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/model.hpp"
#include "model_paths.hpp"

namespace ferry::sim {
namespace {

using workload_detail::error_at;
using workload_detail::op_member;
using workload_detail::op_path;
using workload_detail::tensor_bytes;

__extension__ using Wide = unsigned __int128;

/// ceil(amount x 10^9 x 1000 / (rate x permille)) nanoseconds: `amount` FLOPs or bytes moved at
/// `permille` thousandths of `rate` per second. 128-bit: amount x 10^12 overflows 64 bits above
/// ~9.2e6 FLOPs, and the result does too for the slowest rates a profile may give.
Wide roofline_ns_wide(std::int64_t amount, std::int64_t rate, std::int64_t permille) {
  const Wide scaled = static_cast<Wide>(amount) * 1'000'000'000U * 1000U;
  const Wide divisor = static_cast<Wide>(rate) * static_cast<Wide>(permille);
  return (scaled + divisor - 1) / divisor;
}

std::int64_t roofline_ns(std::int64_t amount, std::int64_t rate, std::int64_t permille) {
  const Wide ns = roofline_ns_wide(amount, rate, permille);
  FERRY_CHECK(ns <= static_cast<Wide>(kMaxJsonNanoseconds),
              "roofline time of {} at rate {} is above {} ns: check_roofline first", amount, rate,
              kMaxJsonNanoseconds);
  return static_cast<std::int64_t>(ns);
}

// Note [Kernel timing]
// ~~~~~~~~~~~~~~~~~~~~
// A profile without kernel figures times every op by the flat roofline: FLOPs at 60 % of the
// peak, bytes at 80 % of the HBM bandwidth, the longer of the two. A profile with them
// ("kernels", docs/devices.md) times each op whose kernel class has a figure by what that class
// is measured to reach, and every other op by the flat roofline:
//
// * Where the profile gives the tile model (SMs, tile, large-GEMM figure), a matmul with a shape
//   (ModelOp::gemm) runs as cuBLAS and CUTLASS do: the output is cut into Tm x Tn tiles, one
//   thread block each, and the blocks run in waves of one per SM. A wave costs one tile's work,
//   Tm Tn k 2 FLOPs, at one SM's share of the large-GEMM rate (peak x matmul_permille /
//   sm_count), so a product whose tiles fill 1.1 waves pays for 2 and a product smaller than a
//   tile pays for a whole one. Backward's two products, dX (m x k over n) and dW (k x n over m),
//   are timed the same way and scaled by the op's backward FLOPs over their nominal 4 m n k
//   batch (a frozen weight's op has no dW).
// * Flash, cuDNN and memory-efficient attention run at their kernel's measured fraction of the
//   peak, forward and backward apart; a fused SDPA call (the name a trace gives it is flash's)
//   runs the kernel torch picks on the device, the profile's `sdpa_backend`. Attention kernels
//   without a figure (flex, or a backend the profile gives none) and every other op with FLOPs run
//   at the flat 60 %, or, for a matmul kind without a shape or without the tile model, at
//   matmul_permille where given. SDPA's math backend is no kernel of its own: its bmm and softmax
//   ops are timed as matmuls with shapes and as streaming ops.
// * Bytes move at memory_permille of the bandwidth where the profile gives it, else 80 %.
// * A float32 product (a matmul, convolution or fused attention whose first output is float32;
//   its family's OpFamilyTraits::float32_math says which of the rules below it follows)
//   runs on the CUDA cores, not the tensor cores, unless torch lets it use TF32: where the
//   profile gives fp32_flops_per_s, at the flat 60 % of it, whatever its kernel figures.
//   torch's default float32 matmul precision ("highest") uses no TF32; a model traced with TF32
//   allowed (Model::matmul_tf32: precision "high" or "medium", cuBLAS's TF32 math for every
//   matrix product) runs its float32 matmuls at the flat 60 % of tf32_flops_per_s where the
//   profile gives it, and its float32 flex attention too (its Triton kernel follows the same
//   setting). A float32 convolution is cuDNN's, whose TF32 torch allows by default
//   (Model::conv_tf32, torch.backends.cudnn.conv.fp32_precision): the flat 60 % of
//   tf32_flops_per_s, or of fp32_flops_per_s for a model traced with it at "ieee".
// * A float32 SDPA call (and flash's or cuDNN's name for one: neither kernel takes float32) runs
//   the memory-efficient kernel, which on a GPU with TF32 tensor cores (a profile with
//   tf32_flops_per_s) computes each float32 product as three TF32 products (CUTLASS's 3xTF32,
//   built in whatever torch's settings say): the flat 60 % of a third of tf32_flops_per_s,
//   forward and backward; without TF32, the CUDA cores' rate.
// * A grouped matmul of rows against one weight matrix a group (a mixture's experts; a gemm of
//   batch 1) runs as torch 2.11's `_grouped_mm` does: bfloat16 on a profile whose `grouped_mm`
//   is "cutlass" (compute capability 9.x and 10.x) as one kernel, timed as any matmul; anything
//   else as its fallback (Note [The grouped matmul's fallback]).
//
// The figures are the sources' and no row of docs/validation.md's table set any of them.

// Note [The grouped matmul's fallback]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Where torch has no grouped kernel for the GPU or the dtype, `_grouped_mm` copies the groups'
// offsets to the host, waits for them, and launches one `mm` a group on that group's rows
// (GroupedMMUtils.h's fallback; the backward's two products the same, each its own wait). The
// simulator times the op as that loop on its stream: the wait (the copy's submission and
// latency, the synchronize, the first launch), then the groups one after the other, each a
// product of its own rows (the tile model's waves, or the flat roofline's rate) and none shorter
// than the host takes to launch it. The groups are the trace's rows per group where they are
// one a weight matrix, else the weights' matrices (the largest parameter the op reads) with the
// rows spread evenly. The wait stalls only the op: the host's own delay is not modelled.

/// `a` x `b`, or kSaturated when the product would pass it.
constexpr Wide kSaturated = Wide{1} << 120;
Wide saturating_mul(Wide a, Wide b) {
  if (a == 0 || b == 0) return 0;
  if (a > kSaturated / b) return kSaturated;
  return a * b;
}

Wide ceil_div(Wide a, Wide b) { return (a + b - 1) / b; }

/// Flash, cuDNN or memory-efficient attention's figure for `family` (forward or backward), 0:
/// none. A fused SDPA call runs the kernel the profile's `sdpa_backend` names.
std::int64_t attention_permille(OpFamily family, const KernelFigures& k, bool backward) {
  if (family == OpFamily::Sdpa) {
    family =
        k.sdpa_backend == SdpaBackend::Cudnn ? OpFamily::CudnnAttention : OpFamily::FlashAttention;
  }
  if (family == OpFamily::FlashAttention) {
    return backward ? k.flash_backward_permille : k.flash_forward_permille;
  }
  if (family == OpFamily::CudnnAttention) {
    return backward ? k.cudnn_backward_permille : k.cudnn_forward_permille;
  }
  if (family == OpFamily::EfficientAttention) {
    return backward ? k.efficient_backward_permille : k.efficient_forward_permille;
  }
  return 0;
}

/// One product's waves, ceil(tiles / sm), times a tile's Tm Tn depth 2 FLOPs times the SMs:
/// the FLOPs the chip could have done in that time.
Wide product_work(std::int64_t rows, std::int64_t cols, std::int64_t depth, std::int64_t batch,
                  const KernelFigures& k) {
  const Wide tiles = saturating_mul(
      saturating_mul(ceil_div(static_cast<Wide>(rows), static_cast<Wide>(k.matmul_tile_m)),
                     ceil_div(static_cast<Wide>(cols), static_cast<Wide>(k.matmul_tile_n))),
      static_cast<Wide>(batch));
  const Wide waves = ceil_div(tiles, static_cast<Wide>(k.sm_count));
  const Wide tile_flops = static_cast<Wide>(k.matmul_tile_m) * static_cast<Wide>(k.matmul_tile_n) *
                          static_cast<Wide>(depth) * 2U;
  return saturating_mul(saturating_mul(waves, tile_flops), static_cast<Wide>(k.sm_count));
}

/// Nanoseconds of `work` (a product's waves x one tile's FLOPs x SMs: each wave runs one tile
/// per SM at its share of the rate) at `permille` of the device's peak.
Wide work_ns(Wide work, const DeviceProfile& device, std::int64_t permille) {
  const Wide scaled = saturating_mul(work, Wide{1'000'000'000'000U});
  const Wide divisor = static_cast<Wide>(device.flops_per_s) * static_cast<Wide>(permille);
  return ceil_div(scaled, divisor);
}

/// The TF32 products the memory-efficient attention kernel computes for one float32 product on
/// a GPU with TF32 tensor cores (CUTLASS's 3xTF32, Note [Kernel timing]).
constexpr std::int64_t kTF32ProductsPerFloat32 = 3;

/// The rate at which `op` computes a float32 product on `device` (Note [Kernel timing]): for an
/// op whose family computes products (Float32Math) and whose first output is float32, the TF32
/// tensor cores' where its family and the model's settings use them (a third of it for three
/// TF32 products each) and the profile gives that rate, else the CUDA cores'; 0 for any other
/// op, or a profile without the rate.
std::int64_t float32_product_rate(const Model& model, const ModelOp& op,
                                  const DeviceProfile& device) {
  const Float32Math math = op_family_traits(op.kind.family()).float32_math;
  if (math == Float32Math::None || op.outputs.empty()) return 0;
  if (model.tensors.at(op.outputs.front()).dtype != DType::F32) return 0;
  const bool tf32 = math == Float32Math::ThreeTF32 ||
                    (math == Float32Math::MatmulPrecision && model.matmul_tf32) ||
                    (math == Float32Math::ConvolutionPrecision && model.conv_tf32);
  if (!tf32 || device.tf32_flops_per_s == 0) return device.fp32_flops_per_s;
  return math == Float32Math::ThreeTF32 ? device.tf32_flops_per_s / kTF32ProductsPerFloat32
                                        : device.tf32_flops_per_s;
}

/// 2 x rows x cols x depth: one product's FLOPs (saturating).
Wide product_flops(std::int64_t rows, std::int64_t cols, std::int64_t depth) {
  return saturating_mul(
      saturating_mul(saturating_mul(2, static_cast<Wide>(rows)), static_cast<Wide>(cols)),
      static_cast<Wide>(depth));
}

/// The fraction of the peak an op with FLOPs runs at on the flat roofline: a matmul kind at the
/// profile's matmul figure where it gives one, everything else at the flat 60 %.
std::int64_t flat_permille(const ModelOp& op, const KernelFigures& k) {
  return is_matmul(op.kind.family()) && k.matmul_permille > 0 ? k.matmul_permille
                                                              : kRooflineFlopsPermille;
}

/// The time of one product of a matmul `op`'s dtype, `rows` x `cols` over `depth`, as its op
/// would run it alone (Note [Kernel timing]).
Wide product_ns(const Model& model, const ModelOp& op, std::int64_t rows, std::int64_t cols,
                std::int64_t depth, const DeviceProfile& device) {
  const KernelFigures& k = device.kernels;
  // No larger than the op's own product, whose FLOPs the model validated.
  const auto flops = static_cast<std::int64_t>(
      std::min<Wide>(product_flops(rows, cols, depth), std::numeric_limits<std::int64_t>::max()));
  if (const std::int64_t rate = float32_product_rate(model, op, device); rate > 0) {
    return roofline_ns_wide(flops, rate, kRooflineFlopsPermille);
  }
  if (k.tiled()) return work_ns(product_work(rows, cols, depth, 1, k), device, k.matmul_permille);
  return roofline_ns_wide(flops, device.flops_per_s, flat_permille(op, k));
}

/// The groups of a grouped matmul `op` run as torch's fallback on `device`, each group's rows;
/// empty where it runs as one kernel (Note [The grouped matmul's fallback]).
struct Groups {
  std::span<const std::int64_t> rows;  // each group's, where the trace gives them
  std::int64_t count = 0;              // else this many groups, the rows spread evenly
};

std::optional<Groups> fallback_groups(const Model& model, const ModelOp& op,
                                      const DeviceProfile& device) {
  if (op.kind.family() != OpFamily::GroupedMatmul || op.gemm.batch != 1 || op.outputs.empty() ||
      op.gemm.n <= 0 || op.gemm.k <= 0) {
    return std::nullopt;
  }
  // A float8 product (its operands recorded as bytes) is the scaled kernel's, never the loop.
  const auto is_float = [](DType d) {
    return d == DType::F32 || d == DType::F16 || d == DType::BF16;
  };
  const DType dtype = model.tensors.at(op.outputs.front()).dtype;
  if (!is_float(dtype) ||
      (!op.inputs.empty() && !is_float(model.tensors.at(op.inputs.front()).dtype)) ||
      (dtype == DType::BF16 && device.kernels.grouped_mm == GroupedMmKernel::Cutlass)) {
    return std::nullopt;
  }
  const std::int64_t matrices = grouped_matmul_experts(model, op).value_or(0);
  Groups groups;
  std::int64_t given = 0;
  for (const std::int64_t r : op.group_rows) given += r;
  if (!op.group_rows.empty() && given <= op.gemm.m &&
      (matrices == 0 || std::cmp_equal(op.group_rows.size(), matrices))) {
    groups.rows = op.group_rows;
  } else {
    groups.count = std::max<std::int64_t>(1, matrices);
  }
  return groups;
}

/// The products the fallback runs a group (Note [The grouped matmul's fallback]): the forward's,
/// and backward's dX (the group's rows x k over n) and dW (k x n over its rows).
enum class GroupProduct : std::uint8_t { Forward, InputGradient, WeightGradient };

/// The fallback's loop of `product` over `groups`: the wait, then each group's product.
Wide loop_ns(const Model& model, const ModelOp& op, const Groups& groups, GroupProduct product,
             const DeviceProfile& device) {
  const LaunchOverheads& o = device.overheads;
  const Wide launch = static_cast<Wide>(o.kernel.ns());
  const GemmShape& g = op.gemm;
  const auto one = [&](std::int64_t rows) {
    Wide ns = 0;
    switch (product) {
      case GroupProduct::Forward:
        ns = product_ns(model, op, rows, g.n, g.k, device);
        break;
      case GroupProduct::InputGradient:
        ns = product_ns(model, op, rows, g.k, g.n, device);
        break;
      case GroupProduct::WeightGradient:
        ns = product_ns(model, op, g.k, g.n, rows, device);
        break;
    }
    return std::max(ns, launch);
  };
  Wide ns = static_cast<Wide>(o.copy.ns()) + static_cast<Wide>(device.d2h.latency.ns()) +
            static_cast<Wide>(o.synchronize.ns()) + launch;
  if (!groups.rows.empty()) {
    for (const std::int64_t rows : groups.rows) ns = std::min(ns + one(rows), kSaturated);
    return ns;
  }
  // Balanced: m / count rows a group, the remainder's groups one row more.
  const std::int64_t each = g.m / groups.count;
  const std::int64_t more = g.m % groups.count;
  ns += saturating_mul(one(each), static_cast<Wide>(groups.count - more));
  if (more > 0) ns += saturating_mul(one(each + 1), static_cast<Wide>(more));
  return std::min(ns, kSaturated);
}

/// The compute time of an op's forward or backward on `device` (Note [Kernel timing]), the
/// permille it ran at and of which rate (0: the tile model, which has no single one).
struct ComputeTime {
  Wide ns = 0;
  std::int64_t permille = 0;
  std::int64_t rate = 0;
};

ComputeTime compute_time(const Model& model, const ModelOp& op, bool backward,
                         const DeviceProfile& device) {
  const std::int64_t flops = backward ? op.backward_flops : op.flops;
  const KernelFigures& k = device.kernels;
  if (flops == 0) return {};
  if (const std::optional<Groups> groups = fallback_groups(model, op, device)) {
    if (!backward) return {loop_ns(model, op, *groups, GroupProduct::Forward, device)};
    // dX; and dW unless the weights are frozen (the backward's FLOPs one product's).
    Wide ns = loop_ns(model, op, *groups, GroupProduct::InputGradient, device);
    if (static_cast<Wide>(flops) > product_flops(op.gemm.m, op.gemm.n, op.gemm.k)) {
      ns += loop_ns(model, op, *groups, GroupProduct::WeightGradient, device);
    }
    return {std::min(ns, kSaturated)};
  }
  if (const std::int64_t rate = float32_product_rate(model, op, device); rate > 0) {
    return {roofline_ns_wide(flops, rate, kRooflineFlopsPermille), kRooflineFlopsPermille, rate};
  }
  if (const std::int64_t permille = attention_permille(op.kind.family(), k, backward);
      permille > 0) {
    return {roofline_ns_wide(flops, device.flops_per_s, permille), permille, device.flops_per_s};
  }
  if (!op.gemm.known() || !k.tiled()) {
    const std::int64_t permille = flat_permille(op, k);
    return {roofline_ns_wide(flops, device.flops_per_s, permille), permille, device.flops_per_s};
  }
  const GemmShape& g = op.gemm;
  if (!backward)
    return {work_ns(product_work(g.m, g.n, g.k, g.batch, k), device, k.matmul_permille)};
  const Wide pair =
      work_ns(product_work(g.m, g.k, g.n, g.batch, k) + product_work(g.k, g.n, g.m, g.batch, k),
              device, k.matmul_permille);
  // 4 m n k batch: the two products' nominal FLOPs (at most 2^123 with dims below 2^40 each, and
  // the validated FLOPs keep it near 2 x 10^18).
  const Wide nominal =
      saturating_mul(saturating_mul(2, product_flops(g.m, g.n, g.k)), static_cast<Wide>(g.batch));
  return {ceil_div(saturating_mul(pair, static_cast<Wide>(flops)), nominal)};
}

SimTime op_time(const Model& model, const ModelOp& op, bool backward, const DeviceProfile& device) {
  const Wide compute = compute_time(model, op, backward, device).ns;
  FERRY_CHECK(compute <= static_cast<Wide>(kMaxJsonNanoseconds),
              "compute time of op {} is above {} ns: check_roofline first", op.name,
              kMaxJsonNanoseconds);
  const Bytes bytes = backward ? op.backward_bytes : op.bytes;
  const std::int64_t memory =
      roofline_ns(bytes.count(), device.memory_bandwidth.bytes_per_s(), memory_permille(device));
  return SimTime(std::max({static_cast<std::int64_t>(compute), memory, std::int64_t{1}}));
}

/// An error when `amount` (the op's member `key`) takes longer than the format's longest
/// duration at `permille` of `rate` (`unit` per second), naming the least rate that times it
/// (the roofline solved for the rate: the same ceiling with the longest duration for the rate).
Status check_roofline_term(std::string_view path, std::string_view key, std::int64_t amount,
                           std::int64_t rate, std::int64_t permille, std::string_view unit,
                           const DeviceProfile& device) {
  const Wide ns = roofline_ns_wide(amount, rate, permille);
  if (ns <= static_cast<Wide>(kMaxJsonNanoseconds)) return Ok{};
  const auto least =
      static_cast<std::uint64_t>(roofline_ns_wide(amount, kMaxJsonNanoseconds, permille));
  return error_at(json_member_path(path, key),
                  "{} {} at {} {}/s x {}/1000 on device {} take over {} ns, the longest duration "
                  "a model op may have; a profile of {} {}/s or more times it",
                  amount, unit, rate, unit, permille, json_quote(device.name), kMaxJsonNanoseconds,
                  least, unit);
}

/// The same for the FLOPs of an op's forward or backward under Note [Kernel timing].
Status check_compute_term(std::string_view path, const Model& model, const ModelOp& op,
                          bool backward, const DeviceProfile& device) {
  const std::string_view key = backward ? "backward_flops" : "flops";
  const std::int64_t flops = backward ? op.backward_flops : op.flops;
  const ComputeTime time = compute_time(model, op, backward, device);
  if (time.permille > 0) {
    return check_roofline_term(path, key, flops, time.rate, time.permille, "FLOP", device);
  }
  if (time.ns <= static_cast<Wide>(kMaxJsonNanoseconds)) return Ok{};
  if (fallback_groups(model, op, device)) {
    return error_at(json_member_path(path, key),
                    "{} FLOP of a {} x {} x {} grouped matmul, a matmul a group (torch's "
                    "fallback on device {}), take over {} ns, the longest duration a model op "
                    "may have",
                    flops, op.gemm.m, op.gemm.n, op.gemm.k, json_quote(device.name),
                    kMaxJsonNanoseconds);
  }
  return error_at(json_member_path(path, key),
                  "{} FLOP of a {} x {} x {} (batch {}) matmul in {} x {} tiles on {} SMs of "
                  "device {} take over {} ns, the longest duration a model op may have",
                  flops, op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch,
                  device.kernels.matmul_tile_m, device.kernels.matmul_tile_n,
                  device.kernels.sm_count, json_quote(device.name), kMaxJsonNanoseconds);
}

}  // namespace

Bytes collective_op_bytes(const Model& model, const ModelOp& op, bool backward) {
  const std::optional<CollectiveKind>& kind =
      backward ? op.collective.backward : op.collective.forward;
  if (!op.collective.any() || !kind) return Bytes(0);
  const std::int64_t in = tensor_bytes(model, op.inputs);
  const std::int64_t out = tensor_bytes(model, op.outputs);
  const std::int64_t from = backward ? out : in;
  const std::int64_t to = backward ? in : out;
  switch (*kind) {
    case CollectiveKind::AllGather:
      return Bytes(to);
    case CollectiveKind::ReduceScatter:
      return Bytes(from);
    case CollectiveKind::AllReduce:
    case CollectiveKind::AllToAll:
      break;
  }
  return Bytes(std::max(from, to));
}

namespace {

/// Op `op`'s collective time in its forward or backward on `device` (1 ns where that direction
/// runs none); the link must be known.
SimTime collective_op_time(const Model& model, const ModelOp& op, bool backward,
                           const DeviceProfile& device) {
  const std::optional<CollectiveKind>& kind =
      backward ? op.collective.backward : op.collective.forward;
  if (!kind) return SimTime(1);
  const SimTime t = collective_time(
      *kind, collective_op_bytes(model, op, backward),
      GroupPlacement{op.collective.ranks, op.collective.nodes, op.collective.sharing},
      device.collectives);
  return std::max(t, SimTime(1));
}

/// Whether `device` has the link op `index`'s collective runs over, and its times fit the
/// format.
Status check_collective_time(const Model& model, std::size_t index, const DeviceProfile& device) {
  const ModelOp& op = model.ops[index];
  const bool inter = op.collective.nodes > 1;
  const CollectiveLink& link =
      inter ? device.collectives.inter_node : device.collectives.intra_node;
  const std::string at = op_member(index, "collective");
  if (!link.known()) {
    return error_at(at,
                    "device {} has no {} link for a collective over {} ranks on {} node{} (its "
                    "profile's \"collectives\" section, docs/devices.md)",
                    json_quote(device.name), inter ? "inter_node" : "intra_node",
                    op.collective.ranks, op.collective.nodes, op.collective.nodes > 1 ? "s" : "");
  }
  for (const bool backward : {false, true}) {
    const SimTime t = collective_op_time(model, op, backward, device);
    if (t.ns() > kMaxJsonNanoseconds) {
      return error_at(json_member_path(at, backward ? "backward" : "forward"),
                      "{} bytes over device {}'s {} link take over {} ns, the longest duration a "
                      "model op may have",
                      collective_op_bytes(model, op, backward).count(), json_quote(device.name),
                      inter ? "inter_node" : "intra_node", kMaxJsonNanoseconds);
    }
  }
  return Ok{};
}

}  // namespace

Status check_roofline(const Model& model, const DeviceProfile& device) {
  const std::int64_t flops_rate = device.flops_per_s;
  const std::int64_t byte_rate = device.memory_bandwidth.bytes_per_s();
  if (flops_rate <= 0 || byte_rate <= 0) {
    return Error{fmt::format("device profile {} needs positive flops_per_s and memory bandwidth",
                             json_quote(device.name))};
  }
  const std::int64_t bytes_permille = memory_permille(device);
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const ModelOp& op = model.ops[i];
    if (op.collective.any()) {
      FERRY_JSON_RETURN_IF_ERROR(check_collective_time(model, i, device));
      continue;
    }
    const std::string path = op_path(i);
    FERRY_JSON_RETURN_IF_ERROR(check_compute_term(path, model, op, false, device));
    FERRY_JSON_RETURN_IF_ERROR(check_roofline_term(path, "bytes", op.bytes.count(), byte_rate,
                                                   bytes_permille, "bytes", device));
    FERRY_JSON_RETURN_IF_ERROR(check_compute_term(path, model, op, true, device));
    FERRY_JSON_RETURN_IF_ERROR(check_roofline_term(path, "backward_bytes",
                                                   op.backward_bytes.count(), byte_rate,
                                                   bytes_permille, "bytes", device));
  }
  return Ok{};
}

Result<CheckedModel> with_roofline_durations(CheckedModel model, const DeviceProfile& device) {
  if (auto fits = check_roofline(*model, device); !fits.ok()) return fits.error();
  std::shared_ptr<Model> owned = model.model_.use_count() == 1
                                     ? std::move(model.model_)
                                     : std::make_shared<Model>(*model.model_);
  assign_roofline_durations(*owned, device);
  return CheckedModel(std::move(owned));
}

void assign_roofline_durations(Model& model, const DeviceProfile& device) {
  FERRY_CHECK(device.flops_per_s > 0 && device.memory_bandwidth.bytes_per_s() > 0,
              "device profile {} needs positive flops_per_s and memory bandwidth", device.name);
  for (ModelOp& op : model.ops) {
    FERRY_CHECK(op.flops >= 0 && op.bytes.count() >= 0 && op.backward_flops >= 0 &&
                    op.backward_bytes.count() >= 0,
                "op {} has a negative FLOP or byte count", op.name);
    if (op.collective.any()) {
      op.duration = collective_op_time(model, op, false, device);
      op.backward_duration = collective_op_time(model, op, true, device);
      continue;
    }
    op.duration = op_time(model, op, false, device);
    op.backward_duration = op_time(model, op, true, device);
  }
}

}  // namespace ferry::sim
