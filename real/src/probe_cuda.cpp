// ferry probe on a CUDA device (Note [Probe protocol]). Built only with CUDA.

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <stdexcept>

#include "probe_kit.hpp"

namespace ferry::real::probe_kit {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("ferry probe: ") + what + ": " +
                             cudaGetErrorString(status));
  }
}

class CudaTarget {
 public:
  CudaTarget(c10::DeviceIndex index, std::int64_t bytes, MatmulShape shape)
      : index_(index),
        guard_(index),
        bytes_(bytes),
        shape_(shape),
        stream_a_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)),
        stream_b_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {
    // Capacity first, before the probe's own buffers take their share.
    check_cuda(cudaFree(nullptr), "cudaFree (context creation)");
    check_cuda(cudaMemGetInfo(&free_, &total_), "cudaMemGetInfo");
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, index_), "cudaGetDeviceProperties");
    name_ = prop.name;
    tf32_ = prop.major >= 8;  // TF32 tensor cores: Ampere (compute capability 8.0) and later
    compute_capability_ = ComputeCapability{.major = prop.major, .minor = prop.minor};
    const auto device = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, index_);
    const auto pinned = at::TensorOptions().dtype(at::kByte).pinned_memory(true);
    for (at::Tensor* t : {&pinned_a_, &pinned_b_}) *t = at::empty({bytes_}, pinned).fill_(1);
    for (at::Tensor* t : {&pageable_a_, &pageable_b_}) *t = at::empty({bytes_}, at::kByte).fill_(1);
    for (at::Tensor* t : {&device_a_, &device_b_}) *t = at::empty({bytes_}, device).fill_(1);
    pinned_small_ = at::empty({kSmallCopy}, pinned).fill_(1);
    device_small_ = at::empty({kSmallCopy}, device).fill_(1);
    device_small_b_ = at::empty({kSmallCopy}, device).fill_(1);
    tiny_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, index_));
    const int count = c10::cuda::device_count();
    if (count > 1) {
      peer_ = static_cast<c10::DeviceIndex>((index_ + 1) % count);
      int can = 0;
      check_cuda(cudaDeviceCanAccessPeer(&can, index_, *peer_), "cudaDeviceCanAccessPeer");
      if (can != 0) {
        const cudaError_t status = cudaDeviceEnablePeerAccess(*peer_, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled) {
          (void)cudaGetLastError();
        } else {
          check_cuda(status, "cudaDeviceEnablePeerAccess");
        }
      }
      const auto there = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, *peer_);
      peer_buffer_ = at::empty({bytes_}, there);
      peer_small_ = at::empty({kSmallCopy}, there);
    }
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }

  [[nodiscard]] std::string name() const { return name_; }
  [[nodiscard]] ComputeCapability compute_capability() const { return compute_capability_; }

  std::vector<Probe> probes() {
    std::vector<Probe> p;
    add_copy_probes(p);
    add_compute_probes(p);
    add_overhead_probes(p);
    return p;
  }

  // The links: each direction alone and both at once, pageable copies, small copies' latency,
  // on-device and peer copies.
  void add_copy_probes(std::vector<Probe>& p) {
    const std::string ce =
        fmt::format("cudaMemcpyAsync of {} bytes on a side stream, timed with CUDA events", bytes_);
    p.push_back({"h2d.bytes_per_s", "bytes/s", "pinned host -> device: " + ce,
                 [this] { return copy_rate(device_a_, pinned_a_, cudaMemcpyHostToDevice); }});
    p.push_back({"d2h.bytes_per_s", "bytes/s", "device -> pinned host: " + ce,
                 [this] { return copy_rate(pinned_b_, device_b_, cudaMemcpyDeviceToHost); }});
    const std::string loaded =
        "the same copy while three copies the other way, started together on a second stream, "
        "keep the opposite direction busy";
    p.push_back({"h2d.bidirectional_bytes_per_s", "bytes/s", loaded, [this] {
                   return loaded_rate(device_a_, pinned_a_, cudaMemcpyHostToDevice, pinned_b_,
                                      device_b_, cudaMemcpyDeviceToHost);
                 }});
    p.push_back({"d2h.bidirectional_bytes_per_s", "bytes/s", loaded, [this] {
                   return loaded_rate(pinned_b_, device_b_, cudaMemcpyDeviceToHost, device_a_,
                                      pinned_a_, cudaMemcpyHostToDevice);
                 }});
    const std::string pageable = fmt::format(
        "cudaMemcpyAsync of {} bytes from or to pageable memory and a stream synchronize, timed "
        "on the host (the host blocks)",
        bytes_);
    p.push_back({"pageable.h2d_bytes_per_s", "bytes/s", pageable,
                 [this] { return pageable_rate(device_a_, pageable_a_, cudaMemcpyHostToDevice); }});
    p.push_back({"pageable.d2h_bytes_per_s", "bytes/s", pageable,
                 [this] { return pageable_rate(pageable_b_, device_b_, cudaMemcpyDeviceToHost); }});
    const std::string small = fmt::format(
        "CUDA-event time of one cudaMemcpyAsync of {} bytes (start to end on the stream)",
        kSmallCopy);
    p.push_back({"h2d.latency_ns", "ns", small, [this] {
                   return small_copy_ns(device_small_, pinned_small_, cudaMemcpyHostToDevice);
                 }});
    p.push_back({"d2h.latency_ns", "ns", small, [this] {
                   return small_copy_ns(pinned_small_, device_small_, cudaMemcpyDeviceToHost);
                 }});
    p.push_back({"d2d.bytes_per_s", "bytes/s", "device -> same device: " + ce,
                 [this] { return copy_rate(device_b_, device_a_, cudaMemcpyDeviceToDevice); }});
    p.push_back({"d2d.latency_ns", "ns", small, [this] {
                   return small_copy_ns(device_small_b_, device_small_, cudaMemcpyDeviceToDevice);
                 }});
    if (peer_) {
      p.push_back(
          {"peer.bytes_per_s", "bytes/s",
           fmt::format("cudaMemcpyPeerAsync of {} bytes to device {}, CUDA events", bytes_, *peer_),
           [this] { return peer_rate(); }});
      p.push_back(
          {"peer.latency_ns", "ns",
           fmt::format("CUDA-event time of one cudaMemcpyPeerAsync of {} bytes", kSmallCopy),
           [this] { return peer_small_ns(); }});
    }
  }

  // Memory bandwidth and the matmul rate of each dtype.
  void add_compute_probes(std::vector<Probe>& p) {
    p.push_back({"memory_bytes_per_s", "bytes/s",
                 fmt::format("at::neg_out over {} bytes of float on the device, read once and "
                             "written once (2 x bytes moved), CUDA events",
                             bytes_ / 4 * 4),
                 [this] { return memory_rate(); }});
    for (const auto& [label, dtype] : kMatmulTypes) {
      p.push_back({fmt::format("matmul.{}.flops_per_s", label), "FLOP/s",
                   matmul_method(shape_,
                                 "(cuBLAS through torch, default precision settings), "
                                 "CUDA events"),
                   [this, d = dtype] { return matmul_rate(d); }, true});
    }
    if (tf32_) {
      p.push_back({"matmul.tf32.flops_per_s", "FLOP/s",
                   matmul_method(shape_,
                                 "of float32 with torch's CUDA matmul precision at tf32 for the "
                                 "run (cuBLAS's TF32 tensor-op math), CUDA events"),
                   [this] { return tf32_matmul_rate(); }, true});
    }
  }

  // What the host pays per call: launch, copy submission, events, synchronize, the allocator.
  void add_overhead_probes(std::vector<Probe>& p) {
    p.push_back({"overheads_ns.kernel", "ns",
                 "host time of one in-place add on a 1-element device tensor (torch dispatch and "
                 "launch), mean over 200",
                 [this] {
                   c10::cuda::CUDAStreamGuard on(stream_a_);
                   return host_ns(200, [this] { tiny_.add_(1); });
                 }});
    p.push_back({"overheads_ns.copy", "ns",
                 fmt::format("host time of one cudaMemcpyAsync submission of {} pinned bytes, "
                             "mean over 200",
                             kSmallCopy),
                 [this] {
                   return host_ns(200, [this] {
                     enqueue_copy(device_small_, pinned_small_, cudaMemcpyHostToDevice, stream_a_);
                   });
                 }});
    p.push_back({"overheads_ns.event_record", "ns",
                 "host time of one CUDAEvent::record (timing disabled), mean over 1000", [this] {
                   at::cuda::CUDAEvent e(cudaEventDisableTiming);
                   return host_ns(1000, [&] { e.record(stream_a_); });
                 }});
    p.push_back({"overheads_ns.stream_wait", "ns",
                 "host time of one CUDAEvent::block (cudaStreamWaitEvent), mean over 1000", [this] {
                   at::cuda::CUDAEvent e(cudaEventDisableTiming);
                   e.record(stream_a_);
                   return host_ns(1000, [&] { e.block(stream_b_); });
                 }});
    p.push_back({"overheads_ns.event_query", "ns",
                 "host time of one CUDAEvent::query of a completed event, mean over 1000", [this] {
                   at::cuda::CUDAEvent e(cudaEventDisableTiming);
                   e.record(stream_a_);
                   e.synchronize();
                   return host_ns(1000, [&] { (void)e.query(); });
                 }});
    p.push_back({"overheads_ns.synchronize", "ns",
                 "host time of one synchronize of an idle stream, mean over 1000",
                 [this] { return host_ns(1000, [this] { stream_a_.synchronize(); }); }});
    p.push_back({"overheads_ns.malloc", "ns",
                 fmt::format("host time of one at::empty of {} bytes on the device (caching "
                             "allocator hit), mean over 100",
                             kAllocBytes),
                 [this] { return alloc_ns(true); }});
    p.push_back({"overheads_ns.free", "ns",
                 fmt::format("host time of freeing one device tensor of {} bytes (back to the "
                             "caching allocator), mean over 100",
                             kAllocBytes),
                 [this] { return alloc_ns(false); }});
    p.push_back({"overheads_ns.host_alloc", "ns",
                 fmt::format("host time of one cudaHostAlloc of {} bytes (a new page-locked "
                             "block; freed untimed), mean over {}",
                             kPinBytes, kPins),
                 [] { return host_alloc_ns(); }});
  }

  [[nodiscard]] Readings readings() const {
    Readings r;
    r.once.push_back({"memory_bytes",
                      "bytes",
                      "free bytes of cudaMemGetInfo before the probe allocated anything",
                      {static_cast<std::int64_t>(free_)}});
    r.once.push_back({"memory_total_bytes",
                      "bytes",
                      "total bytes of cudaMemGetInfo",
                      {static_cast<std::int64_t>(total_)}});
    if (const auto available = host_available_bytes()) {
      r.once.push_back({"pinned_host_capacity_bytes",
                        "bytes",
                        "MemAvailable of /proc/meminfo less the runtime's 1 GiB host reserve "
                        "(the most that could be pinned now, not a policy)",
                        {std::max<std::int64_t>(0, *available - kHostReserve)}});
    } else {
      r.notes.push_back("/proc/meminfo has no MemAvailable: pinned capacity assumed");
    }
    r.once.push_back({"blas_workspace_bytes",
                      "bytes",
                      "torch's cuBLAS workspace per handle and stream "
                      "(at::cuda::getChosenWorkspaceSize: CUBLAS_WORKSPACE_CONFIG or the "
                      "architecture's default)",
                      {static_cast<std::int64_t>(at::cuda::getChosenWorkspaceSize())}});
    if (!peer_) r.notes.push_back("one CUDA device: peer copies cannot be measured");
    return r;
  }

  static std::vector<Assumption> assumptions(std::span<const Measurement> measured) {
    const auto median = [&](std::string_view key) { return median_of(measured, key); };
    return {
        {"peer.bytes_per_s", median("h2d.bytes_per_s").value_or(1'000'000'000),
         "one device: a peer copy assumed to go no faster than the measured pinned h2d link"},
        {"peer.latency_ns", 2 * median("h2d.latency_ns").value_or(1000),
         "one device: twice the measured h2d latency (through the host, two hops)"},
        {"overheads_ns.host_access", 100,
         "not measured: 100 ns per host read or write call, as the bundled profiles assume"},
        {"pinned_host_capacity_bytes", 256 * kGiB.count(),
         "no MemAvailable in /proc/meminfo: 256 GiB, the bundled profiles' policy default"},
        {"flops_per_s", median("matmul.fp32.flops_per_s").value_or(1'000'000),
         "no 16-bit matmul ran: the fp32 matmul rate"},
    };
  }

 private:
  // Time of `enqueue`'s work on `stream`, from CUDA events around it.
  template <class Fn>
  std::int64_t device_ns(const c10::cuda::CUDAStream& stream, Fn&& enqueue) {
    at::cuda::CUDAEvent start(cudaEventDefault);
    at::cuda::CUDAEvent end(cudaEventDefault);
    start.record(stream);
    enqueue();
    end.record(stream);
    end.synchronize();
    return std::max<std::int64_t>(
        1, static_cast<std::int64_t>(std::llround(start.elapsed_time(end) * 1e6)));
  }

  template <class Fn>
  std::int64_t host_ns(std::int64_t count, Fn&& fn) {
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const std::int64_t ns = per_call_ns(count, std::forward<Fn>(fn));
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return ns;
  }

  static void enqueue_copy(const at::Tensor& dst, const at::Tensor& src, cudaMemcpyKind kind,
                           const c10::cuda::CUDAStream& stream) {
    check_cuda(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), kind, stream.stream()),
               "cudaMemcpyAsync");
  }

  std::int64_t copy_rate(const at::Tensor& dst, const at::Tensor& src, cudaMemcpyKind kind) {
    return per_second(bytes_,
                      device_ns(stream_a_, [&] { enqueue_copy(dst, src, kind, stream_a_); }));
  }

  std::int64_t small_copy_ns(const at::Tensor& dst, const at::Tensor& src, cudaMemcpyKind kind) {
    return device_ns(stream_a_, [&] { enqueue_copy(dst, src, kind, stream_a_); });
  }

  // The rate of one copy on stream a while stream b, released by the same event, runs three
  // copies the other way.
  std::int64_t loaded_rate(const at::Tensor& dst, const at::Tensor& src, cudaMemcpyKind kind,
                           const at::Tensor& other_dst, const at::Tensor& other_src,
                           cudaMemcpyKind other_kind) {
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    at::cuda::CUDAEvent go(cudaEventDisableTiming);
    go.record(stream_b_);
    go.block(stream_a_);
    for (int i = 0; i < 3; ++i) enqueue_copy(other_dst, other_src, other_kind, stream_b_);
    const std::int64_t ns = device_ns(stream_a_, [&] { enqueue_copy(dst, src, kind, stream_a_); });
    stream_b_.synchronize();
    return per_second(bytes_, ns);
  }

  std::int64_t pageable_rate(const at::Tensor& dst, const at::Tensor& src, cudaMemcpyKind kind) {
    stream_a_.synchronize();
    const auto start = Clock::now();
    enqueue_copy(dst, src, kind, stream_a_);
    stream_a_.synchronize();
    return per_second(bytes_, since(start));
  }

  std::int64_t peer_rate() {
    return per_second(
        bytes_, device_ns(stream_a_, [&] {
          check_cuda(
              cudaMemcpyPeerAsync(peer_buffer_.data_ptr(), *peer_, device_a_.data_ptr(), index_,
                                  static_cast<std::size_t>(bytes_), stream_a_.stream()),
              "cudaMemcpyPeerAsync");
        }));
  }

  std::int64_t peer_small_ns() {
    return device_ns(stream_a_, [&] {
      check_cuda(
          cudaMemcpyPeerAsync(peer_small_.data_ptr(), *peer_, device_small_.data_ptr(), index_,
                              static_cast<std::size_t>(kSmallCopy), stream_a_.stream()),
          "cudaMemcpyPeerAsync");
    });
  }

  std::int64_t memory_rate() {
    const std::int64_t n = bytes_ / 4;
    const at::Tensor src = device_a_.narrow(0, 0, n * 4).view(at::kFloat);
    at::Tensor dst = device_b_.narrow(0, 0, n * 4).view(at::kFloat);
    c10::cuda::CUDAStreamGuard on(stream_a_);
    return per_second(2 * n * 4, device_ns(stream_a_, [&] { at::neg_out(dst, src); }));
  }

  std::int64_t matmul_rate(at::ScalarType dtype) {
    c10::cuda::CUDAStreamGuard on(stream_a_);
    MatmulOperands o = matmul_operands(shape_, dtype, at::Device(at::kCUDA, index_));
    stream_a_.synchronize();
    return per_second(matmul_flops(shape_),
                      device_ns(stream_a_, [&] { at::mm_out(o.c, o.a, o.b); }));
  }

  // A float32 matmul with TF32 allowed, torch's setting restored after.
  std::int64_t tf32_matmul_rate() {
    at::Context& context = at::globalContext();
    const at::Float32Precision before =
        context.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL);
    context.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL,
                                at::Float32Precision::TF32);
    try {
      const std::int64_t rate = matmul_rate(at::kFloat);
      context.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL, before);
      return rate;
    } catch (...) {
      context.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL, before);
      throw;
    }
  }

  // cudaHostAlloc of an activation-sized block (8192 tokens x 4096 bf16), each freed before
  // the next: what a pinned pool pays for a block it has no cached one of.
  static constexpr std::int64_t kPinBytes = std::int64_t{64} << 20;
  static constexpr std::int64_t kPins = 5;
  static std::int64_t host_alloc_ns() {
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::int64_t total = 0;
    for (std::int64_t i = 0; i < kPins; ++i) {
      void* block = nullptr;
      total += per_call_ns(1, [&] {
        check_cuda(cudaHostAlloc(&block, static_cast<std::size_t>(kPinBytes), cudaHostAllocDefault),
                   "cudaHostAlloc");
      });
      check_cuda(cudaFreeHost(block), "cudaFreeHost");
    }
    return total / kPins;
  }

  std::int64_t alloc_ns(bool malloc) {
    c10::cuda::CUDAStreamGuard on(stream_a_);
    return alloc_or_free_ns(at::TensorOptions().dtype(at::kByte).device(at::kCUDA, index_), malloc);
  }

  c10::DeviceIndex index_;
  c10::cuda::CUDAGuard guard_;
  std::int64_t bytes_;
  MatmulShape shape_;
  c10::cuda::CUDAStream stream_a_;
  c10::cuda::CUDAStream stream_b_;
  std::size_t free_ = 0;
  std::size_t total_ = 0;
  std::string name_;
  bool tf32_ = false;
  ComputeCapability compute_capability_;
  at::Tensor pinned_a_, pinned_b_, pageable_a_, pageable_b_, device_a_, device_b_;
  at::Tensor pinned_small_, device_small_, device_small_b_, tiny_;
  std::optional<c10::DeviceIndex> peer_;
  at::Tensor peer_buffer_, peer_small_;
};

}  // namespace

Result<ProbeResult> probe_cuda(const ProbeOptions& options, ProbeResult result,
                               std::int64_t index) {
  const MatmulShape& s = options.matmul;
  const bool default_shape = s.m == 0 && s.k == 0 && s.n == 0;
  const std::int64_t copy = options.copy_bytes.count();
  const auto device = static_cast<c10::DeviceIndex>(index);
  result.device = fmt::format("cuda:{}", device);
  result.copy_bytes = copy == 0 ? 256 * kMiB : Bytes(copy);
  // A Llama-3-8B MLP projection over 8192 tokens: 8192 x 4096 by 4096 x 14336.
  result.matmul = default_shape ? MatmulShape{8192, 4096, 14336} : s;
  CudaTarget target(device, result.copy_bytes.count(), result.matmul);
  result.device_name = target.name();
  result.compute_capability = target.compute_capability();
  result = measure(target, options, std::move(result));
  return finish(std::move(result), target.readings(), &CudaTarget::assumptions);
}

}  // namespace ferry::real::probe_kit
