#pragma once
/// The measured characteristics of one GPU and its host link, as the simulator times them.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "ferry/units.hpp"

namespace ferry {

/// One direction of a copy path: rate, fixed per-copy latency, and slowdown under contention.
struct CopyPath {
  Bandwidth bandwidth;  ///< sustained rate of a large copy, bytes per second
  SimTime latency;      ///< fixed cost of each copy before data moves
  /// Rate multiplier, in thousandths, while the opposite direction also moves data
  /// (1000 = no slowdown). See docs/devices.md for where the figures come from.
  std::int32_t bidirectional_permille = 1000;
};

/// Host-side cost of each API call: the host thread is busy for this long per call.
struct LaunchOverheads {
  SimTime kernel;        ///< kernel launch
  SimTime copy;          ///< cudaMemcpyAsync submission
  SimTime event_record;  ///< cudaEventRecord (timing disabled)
  SimTime stream_wait;   ///< cudaStreamWaitEvent
  SimTime event_query;   ///< cudaEventQuery
  SimTime synchronize;   ///< stream, event or device synchronize (on top of the wait itself)
  SimTime malloc;        ///< caching-allocator malloc (a cache hit)
  SimTime free;          ///< caching-allocator free
  SimTime host_access;   ///< a host read or write of a buffer, per call
  /// cudaHostAlloc: pinning a new block of page-locked host memory, when neither pinned pool
  /// has a cached block of the size (on top of `malloc`). Optional in the file ("host_alloc");
  /// absent, 0: not modelled.
  SimTime host_alloc;
};

/// A link collectives run over, as a ring uses it: the bus bandwidth (NCCL's "busbw": the
/// rate each GPU's share of a ring all-gather or reduce-scatter moves at) and the latency of
/// one ring step. Zero bandwidth: not known for this device. See docs/fsdp.md.
struct CollectiveLink {
  Bandwidth bandwidth;
  SimTime latency;
  [[nodiscard]] bool known() const { return bandwidth.bytes_per_s() > 0; }
  friend bool operator==(const CollectiveLink&, const CollectiveLink&) = default;
};

/// The links collectives use, apart from the PCIe host link of the offload copies.
struct CollectiveLinks {
  CollectiveLink intra_node;       ///< NVLink / NVSwitch between the GPUs of one node
  CollectiveLink inter_node;       ///< the network between nodes: a ring over the node's NICs
  std::int32_t gpus_per_node = 8;  ///< GPUs that share a node's NVLink domain and host
};

/// The kernel torch's scaled_dot_product_attention runs on a GPU where it may run either: cuDNN's
/// or flash's (TorchDefaults; docs/devices.md, Kernel figures).
enum class SdpaBackend : std::uint8_t { Flash, Cudnn };

/// Every SdpaBackend, in the order refusals list them.
inline constexpr SdpaBackend kSdpaBackends[] = {SdpaBackend::Flash, SdpaBackend::Cudnn};

/// "flash", "cudnn": the value of a profile's `sdpa_backend`.
[[nodiscard]] constexpr std::string_view sdpa_backend_name(SdpaBackend backend) {
  return backend == SdpaBackend::Cudnn ? "cudnn" : "flash";
}

/// How torch 2.11 runs a bfloat16 grouped matmul (`aten._grouped_mm`, a mixture's experts) on a
/// GPU: CUTLASS's grouped kernel, one launch for every group, or its fallback, which copies the
/// groups' offsets to the host and waits for them, then launches one `mm` a group (TorchDefaults;
/// docs/devices.md, Kernel figures). A float32 or float16 grouped matmul takes the fallback on
/// every GPU.
enum class GroupedMmKernel : std::uint8_t { Cutlass, Loop };

/// Every GroupedMmKernel, in the order refusals list them.
inline constexpr GroupedMmKernel kGroupedMmKernels[] = {GroupedMmKernel::Cutlass,
                                                        GroupedMmKernel::Loop};

/// "cutlass", "loop": the value of a profile's `grouped_mm`.
[[nodiscard]] constexpr std::string_view grouped_mm_kernel_name(GroupedMmKernel kernel) {
  return kernel == GroupedMmKernel::Loop ? "loop" : "cutlass";
}

/// A GPU's compute capability, major.minor, as `nvidia-smi --query-gpu=compute_cap` prints it
/// ("9.0"); torch picks some of its kernels and workspaces by it. Major 0: not given.
struct ComputeCapability {
  std::int32_t major = 0;
  std::int32_t minor = 0;
  [[nodiscard]] constexpr bool known() const { return major > 0; }
  /// "9.0": the value of a profile's `compute_capability`.
  [[nodiscard]] std::string text() const {
    return std::to_string(major) + "." + std::to_string(minor);
  }
  friend bool operator==(const ComputeCapability&, const ComputeCapability&) = default;
};

/// What torch 2.11 (CUDA 13 build) chooses by itself on a GPU, by its compute capability
/// (docs/devices.md): the cuBLAS workspace each handle takes on each stream
/// (`parseChosenWorkspaceSize`: `:4096:8` on 9.0, `:4096:2:16:8` elsewhere), the kernel a fused
/// SDPA call runs (`check_prefer_cudnn_attention`: cuDNN's on 9.0, 10.0 and 10.3, flash's
/// elsewhere) and a bfloat16 grouped matmul's (CUTLASS's on 9.x and 10.x, the fallback
/// elsewhere). A profile's own `blas_workspace_bytes`, `sdpa_backend` and `grouped_mm` override
/// them; without a compute capability: no workspace, flash, CUTLASS.
struct TorchDefaults {
  Bytes blas_workspace;
  SdpaBackend sdpa_backend = SdpaBackend::Flash;
  GroupedMmKernel grouped_mm = GroupedMmKernel::Cutlass;
};

[[nodiscard]] constexpr TorchDefaults torch_defaults_on(ComputeCapability cc) {
  if (!cc.known()) return {};
  const bool hopper_or_blackwell = cc.major == 9 || cc.major == 10;
  const bool sm90 = cc.major == 9 && cc.minor == 0;
  return TorchDefaults{
      .blas_workspace = sm90 ? Bytes(std::int64_t{4096} * 8 * 1024)
                             : Bytes(std::int64_t{4096} * 2 * 1024 + std::int64_t{16} * 8 * 1024),
      .sdpa_backend = hopper_or_blackwell && (cc.minor == 0 || cc.minor == 3) ? SdpaBackend::Cudnn
                                                                              : SdpaBackend::Flash,
      .grouped_mm = hopper_or_blackwell ? GroupedMmKernel::Cutlass : GroupedMmKernel::Loop,
  };
}

/// What the kernels of one GPU reach, each figure from a published measurement (docs/devices.md):
/// the SM count and the tile of a large matmul, large-GEMM and attention (flash, cuDNN,
/// memory-efficient) efficiencies against `flops_per_s`, and the fraction of HBM bandwidth a
/// streaming kernel reaches. Optional in the file ("kernels"), and each figure in it; an op whose
/// kernel has no figure is timed by the flat roofline. A zero: no figure.
struct KernelFigures {
  std::int32_t sm_count = 0;                     ///< streaming multiprocessors; 0: no tile model
  std::int32_t matmul_tile_m = 0;                ///< output rows of one thread block's matmul tile
  std::int32_t matmul_tile_n = 0;                ///< output columns of one tile
  std::int32_t matmul_permille = 0;              ///< large-GEMM FLOP/s over the peak, x 1000
  std::int32_t flash_forward_permille = 0;       ///< flash attention forward, x 1000
  std::int32_t flash_backward_permille = 0;      ///< flash attention backward, x 1000
  std::int32_t cudnn_forward_permille = 0;       ///< cuDNN attention forward, x 1000
  std::int32_t cudnn_backward_permille = 0;      ///< cuDNN attention backward, x 1000
  std::int32_t efficient_forward_permille = 0;   ///< memory-efficient attention forward, x 1000
  std::int32_t efficient_backward_permille = 0;  ///< memory-efficient attention backward, x 1000
  std::int32_t memory_permille = 0;              ///< streaming kernels' HBM bandwidth, x 1000
  /// Compute kernels' rate while a collective's kernel runs on the device (its SMs are NCCL's),
  /// x 1000 of their own; 0: unslowed.
  std::int32_t collective_overlap_permille = 0;
  SdpaBackend sdpa_backend = SdpaBackend::Flash;  ///< the kernel a fused SDPA call runs
  /// What a bfloat16 grouped matmul runs (`grouped_mm`).
  GroupedMmKernel grouped_mm = GroupedMmKernel::Cutlass;
  /// Whether matmuls with a shape run as tiles in waves (SMs, tile and matmul figure given).
  [[nodiscard]] bool tiled() const { return sm_count > 0; }
  friend bool operator==(const KernelFigures&, const KernelFigures&) = default;
};

/// A device profile: everything the simulator needs to time work on one GPU.
struct DeviceProfile {
  std::string name;                      ///< short id, e.g. "h100-sxm-pcie5"
  std::string description;               ///< one line for humans, with the source of the figures
  ComputeCapability compute_capability;  ///< optional in the file; gives TorchDefaults
  Bytes memory;                          ///< device memory the caching allocator may reserve
  std::int64_t flops_per_s = 0;  ///< dense 16-bit peak, FLOP per second (for roofline timing)
  /// Dense float32 peak of the CUDA cores, FLOP per second: a float32 matmul's under torch's
  /// default float32 matmul precision ("highest", no TF32); optional in the file, 0: such a
  /// matmul is timed at flops_per_s.
  std::int64_t fp32_flops_per_s = 0;
  /// Dense TF32 peak of the tensor cores, FLOP per second: a float32 matmul's where the model
  /// was traced with TF32 allowed (Model::matmul_tf32); optional in the file, 0: no TF32, such a
  /// matmul runs on the CUDA cores.
  std::int64_t tf32_flops_per_s = 0;
  Bandwidth memory_bandwidth;  ///< device memory bandwidth (HBM)
  CopyPath h2d;                ///< pinned host -> device copy engine
  CopyPath d2h;                ///< device -> pinned host copy engine
  Bandwidth pageable_h2d;      ///< host -> device rate from pageable memory (host blocks)
  Bandwidth pageable_d2h;      ///< device -> host rate into pageable memory (host blocks)
  CopyPath d2d;                ///< copy within this device's memory
  CopyPath peer;               ///< default link to another device (per direction)
  Bytes pinned_host_capacity;  ///< cap on page-locked host memory (the node's, with FSDP)
  /// What one cuBLAS handle takes from the caching allocator on one stream for its workspace;
  /// optional in the file, absent: TorchDefaults'.
  Bytes blas_workspace;
  LaunchOverheads overheads;
  CollectiveLinks collectives{};  ///< optional in the file ("collectives")
  KernelFigures kernels{};        ///< optional in the file ("kernels")
};

/// The required keys of LaunchOverheads in the profile format ("overheads_ns"), in file order;
/// the optional "host_alloc" (kHostAllocKey) follows them.
struct OverheadField {
  std::string_view key;
  SimTime LaunchOverheads::*field;
};
inline constexpr std::array kOverheadFields{
    OverheadField{"kernel", &LaunchOverheads::kernel},
    OverheadField{"copy", &LaunchOverheads::copy},
    OverheadField{"event_record", &LaunchOverheads::event_record},
    OverheadField{"stream_wait", &LaunchOverheads::stream_wait},
    OverheadField{"event_query", &LaunchOverheads::event_query},
    OverheadField{"synchronize", &LaunchOverheads::synchronize},
    OverheadField{"malloc", &LaunchOverheads::malloc},
    OverheadField{"free", &LaunchOverheads::free},
    OverheadField{"host_access", &LaunchOverheads::host_access},
};
inline constexpr std::string_view kHostAllocKey = "host_alloc";

}  // namespace ferry
