// ferry probe, the measuring half: one protocol over two targets, the CPU loopback device and
// a CUDA device. See Note [Probe protocol].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "ferry/check.hpp"
#include "ferry/real/device.hpp"
#include "ferry/real/probe.hpp"

#ifdef FERRY_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#endif

namespace ferry::real {

// Note [Probe protocol]
// Every measurement is a function returning one integer sample. The protocol runs it once to
// warm up (first touch of memory, allocator caches, library initialization), then `repeats`
// times, keeping every sample; the profile takes the median and the report the spread. Large
// copies and matmuls time one operation per sample. Small things (a 64-byte copy, one API
// call) take the mean over a batch of calls per sample, because one call is near the clock's
// resolution. Device work on CUDA is timed with CUDA events on the stream that runs it; what
// the host pays (API overheads, pageable copies, which block the host) is timed with the host's
// steady clock. The loopback device has no engine of its own: its "device" and "host" buffers
// are CPU tensors, a copy is std::memcpy as in LoopbackDevice::copy, and the opposite direction
// of a bidirectional measurement runs on a second thread.

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::int64_t kSmallCopy = 64;
constexpr std::int64_t kAllocBytes = std::int64_t{1} << 20;
constexpr std::int64_t kHostReserve = std::int64_t{1} << 30;  // RealOptions::host_reserve

std::int64_t since(Clock::time_point start) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start);
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(ns.count()));
}

/// `amount` (bytes or FLOP) per second, for `amount` done in `ns` nanoseconds.
std::int64_t per_second(std::int64_t amount, std::int64_t ns) {
  return static_cast<std::int64_t>(std::llround(
      static_cast<double>(amount) * 1e9 / static_cast<double>(std::max<std::int64_t>(ns, 1))));
}

/// The mean host time of one call of `fn`, over `count` calls, rounded to the nanosecond.
template <class Fn>
std::int64_t per_call_ns(std::int64_t count, Fn&& fn) {
  const auto start = Clock::now();
  for (std::int64_t i = 0; i < count; ++i) fn();
  const std::int64_t total = since(start);
  return (total + count / 2) / count;
}

std::uint8_t* bytes_of(const at::Tensor& t) { return static_cast<std::uint8_t*>(t.data_ptr()); }

/// One measurement to take (Note [Probe protocol]).
struct Probe {
  std::string key;
  std::string unit;
  std::string method;
  std::function<std::int64_t()> sample;
  bool may_be_unsupported = false;  ///< a torch error at warm-up skips it with a note
};

/// What a target found besides its probes: single readings (capacities) and notes.
struct Readings {
  std::vector<Measurement> once;
  std::vector<std::string> notes;
};

/// The mean host time of one allocation (`malloc`) or one free of a 1 MiB tensor with
/// `options`, over 100 of each.
std::int64_t alloc_or_free_ns(const at::TensorOptions& options, bool malloc) {
  std::vector<at::Tensor> held;
  held.reserve(100);
  const auto start = Clock::now();
  for (int i = 0; i < 100; ++i) held.push_back(at::empty({kAllocBytes}, options));
  const std::int64_t alloc = since(start);
  const auto freed = Clock::now();
  held.clear();
  const std::int64_t free = since(freed);
  return ((malloc ? alloc : free) + 50) / 100;
}

std::int64_t matmul_flops(const MatmulShape& s) { return 2 * s.m * s.k * s.n; }

std::string matmul_method(const MatmulShape& s, std::string_view how) {
  return fmt::format(
      "at::mm_out of ({}x{}) by ({}x{}), 2*m*k*n FLOP over the time of one matmul "
      "{}",
      s.m, s.k, s.k, s.n, how);
}

struct MatmulOperands {
  at::Tensor a;
  at::Tensor b;
  at::Tensor c;
};

MatmulOperands matmul_operands(const MatmulShape& s, at::ScalarType dtype, at::Device device) {
  // Constant operands: the values do not change a dense matmul's time, and no generator is
  // needed. 1/64 is exact in every dtype and far from denormals.
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  return {at::full({s.m, s.k}, 1.0 / 64, options), at::full({s.k, s.n}, 1.0 / 64, options),
          at::empty({s.m, s.n}, options)};
}

constexpr std::array<std::pair<std::string_view, at::ScalarType>, 3> kMatmulTypes = {
    std::pair{std::string_view("bf16"), at::kBFloat16},
    std::pair{std::string_view("fp16"), at::kHalf},
    std::pair{std::string_view("fp32"), at::kFloat}};

// --- loopback ----------------------------------------------------------------------------------

class LoopbackTarget {
 public:
  LoopbackTarget(std::int64_t bytes, MatmulShape shape) : bytes_(bytes), shape_(shape) {
    for (at::Tensor* t : {&host_a_, &device_a_, &host_b_, &device_b_}) {
      *t = at::empty({bytes_}, at::kByte);
      t->fill_(1);  // touch every page before any timing
    }
    small_src_ =
        device_.allocate(Place::Device, Bytes(kSmallCopy), device_.compute_stream(), "").value();
    small_dst_ =
        device_.allocate(Place::PinnedHost, Bytes(kSmallCopy), device_.compute_stream(), "")
            .value();
    tiny_ = at::zeros({1}, at::kFloat);
    event_ = device_.make_event();
  }

  [[nodiscard]] static std::string name() {
    return fmt::format("CPU loopback, {} threads", at::get_num_threads());
  }

  std::vector<Probe> probes() {
    std::vector<Probe> p;
    const std::string memcpy_method = fmt::format(
        "std::memcpy of {} bytes between CPU tensors (the loopback device's copy)", bytes_);
    p.push_back({"h2d.bytes_per_s", "bytes/s", memcpy_method,
                 [this] { return copy_rate(host_a_, device_a_); }});
    p.push_back({"d2h.bytes_per_s", "bytes/s", memcpy_method,
                 [this] { return copy_rate(device_b_, host_b_); }});
    const std::string loaded =
        "the same memcpy while a second thread copies the other way without pause";
    p.push_back({"h2d.bidirectional_bytes_per_s", "bytes/s", loaded,
                 [this] { return loaded_rate(host_a_, device_a_, device_b_, host_b_); }});
    p.push_back({"d2h.bidirectional_bytes_per_s", "bytes/s", loaded,
                 [this] { return loaded_rate(device_b_, host_b_, host_a_, device_a_); }});
    const std::string pageable =
        memcpy_method + "; loopback host memory is all alike, pinned and pageable copy the same";
    p.push_back({"pageable.h2d_bytes_per_s", "bytes/s", pageable,
                 [this] { return copy_rate(host_a_, device_a_); }});
    p.push_back({"pageable.d2h_bytes_per_s", "bytes/s", pageable,
                 [this] { return copy_rate(device_b_, host_b_); }});
    const std::string small =
        fmt::format("mean time of one std::memcpy of {} bytes over 1000 copies", kSmallCopy);
    p.push_back(
        {"h2d.latency_ns", "ns", small, [this] { return small_copy_ns(host_a_, device_a_); }});
    p.push_back(
        {"d2h.latency_ns", "ns", small, [this] { return small_copy_ns(device_b_, host_b_); }});
    p.push_back({"d2d.bytes_per_s", "bytes/s", memcpy_method,
                 [this] { return copy_rate(device_a_, device_b_); }});
    p.push_back(
        {"d2d.latency_ns", "ns", small, [this] { return small_copy_ns(device_a_, device_b_); }});
    p.push_back({"memory_bytes_per_s", "bytes/s",
                 fmt::format("at::neg_out over {} bytes of float, read once and written once "
                             "(2 x bytes moved)",
                             bytes_ / 4 * 4),
                 [this] { return memory_rate(); }});
    for (const auto& [label, dtype] : kMatmulTypes) {
      p.push_back({fmt::format("matmul.{}.flops_per_s", label), "FLOP/s",
                   matmul_method(shape_, "on the CPU"),
                   [this, d = dtype] { return matmul_rate(d); }, true});
    }
    p.push_back({"overheads_ns.kernel", "ns",
                 "mean time of one in-place add on a 1-element CPU tensor over 1000 (dispatch "
                 "and run)",
                 [this] { return per_call_ns(1000, [this] { tiny_.add_(1); }); }});
    p.push_back(
        {"overheads_ns.copy", "ns",
         fmt::format("mean time of one LoopbackDevice::copy of {} bytes over 1000", kSmallCopy),
         [this] {
           return per_call_ns(1000, [this] {
             device_.copy(device_.compute_stream(), small_src_, Bytes(0), small_dst_, Bytes(0),
                          Bytes(kSmallCopy), "");
           });
         }});
    p.push_back({"overheads_ns.event_record", "ns",
                 "mean time of one LoopbackDevice::record over 10000", [this] {
                   return per_call_ns(10000,
                                      [this] { device_.record(event_, device_.compute_stream()); });
                 }});
    p.push_back({"overheads_ns.stream_wait", "ns",
                 "mean time of one LoopbackDevice::wait over 10000", [this] {
                   return per_call_ns(10000,
                                      [this] { device_.wait(device_.compute_stream(), event_); });
                 }});
    p.push_back({"overheads_ns.synchronize", "ns",
                 "mean time of one LoopbackDevice::synchronize over 10000", [this] {
                   return per_call_ns(10000,
                                      [this] { device_.synchronize(device_.compute_stream()); });
                 }});
    p.push_back(
        {"overheads_ns.malloc", "ns",
         fmt::format("mean time of one at::empty of {} bytes on the CPU over 100", kAllocBytes),
         [] { return alloc_ns(true); }});
    p.push_back(
        {"overheads_ns.free", "ns",
         fmt::format("mean time of freeing one CPU tensor of {} bytes over 100", kAllocBytes),
         [] { return alloc_ns(false); }});
    return p;
  }

  static Readings readings() {
    Readings r;
    if (const auto available = host_available_bytes()) {
      r.once.push_back({"memory_bytes",
                        "bytes",
                        "MemAvailable of /proc/meminfo: loopback device memory is host memory",
                        {*available}});
      r.once.push_back({"pinned_host_capacity_bytes",
                        "bytes",
                        "MemAvailable of /proc/meminfo less the runtime's 1 GiB host reserve",
                        {std::max<std::int64_t>(0, *available - kHostReserve)}});
    } else {
      r.notes.push_back("/proc/meminfo has no MemAvailable: memory capacities assumed");
    }
    return r;
  }

  static std::vector<Assumption> assumptions(std::span<const Measurement> measured) {
    const auto median = [&](std::string_view key) { return median_of(measured, key); };
    const std::string same =
        "loopback: every device is this host's memory, so a peer copy is "
        "the measured d2d copy";
    std::vector<Assumption> a = {
        {"peer.bytes_per_s", median("d2d.bytes_per_s").value_or(1'000'000'000), same},
        {"peer.latency_ns", median("d2d.latency_ns").value_or(0), same},
        {"overheads_ns.event_query", 0,
         "loopback: the device has no event query; its streams run synchronously"},
        {"overheads_ns.host_access", 0,
         "loopback: host access is a plain load or store of CPU memory, the data aside"},
        // Only where /proc/meminfo is silent (readings() notes it).
        {"memory_bytes", 16 * kGiB.count(), "no MemAvailable in /proc/meminfo: 16 GiB assumed"},
        {"pinned_host_capacity_bytes", 8 * kGiB.count(),
         "no MemAvailable in /proc/meminfo: 8 GiB assumed"},
    };
    // flops_per_s needs a 16-bit matmul; a CPU without one falls back to fp32.
    a.push_back({"flops_per_s", median("matmul.fp32.flops_per_s").value_or(1'000'000),
                 "no 16-bit matmul ran on this CPU: the fp32 matmul rate"});
    return a;
  }

 private:
  [[nodiscard]] std::int64_t copy_rate(const at::Tensor& src, const at::Tensor& dst) const {
    const auto start = Clock::now();
    std::memcpy(bytes_of(dst), bytes_of(src), static_cast<std::size_t>(bytes_));
    return per_second(bytes_, since(start));
  }

  static std::int64_t small_copy_ns(const at::Tensor& src, const at::Tensor& dst) {
    return per_call_ns(1000, [&] {
      std::memcpy(bytes_of(dst), bytes_of(src), static_cast<std::size_t>(kSmallCopy));
    });
  }

  // The rate of src -> dst while another thread copies other_src -> other_dst throughout.
  [[nodiscard]] std::int64_t loaded_rate(const at::Tensor& src, const at::Tensor& dst,
                                         const at::Tensor& other_src,
                                         const at::Tensor& other_dst) const {
    std::atomic<bool> started{false};
    std::atomic<bool> stop{false};
    std::thread other([&] {
      const auto n = static_cast<std::size_t>(bytes_);
      std::memcpy(bytes_of(other_dst), bytes_of(other_src), n / 16);
      started.store(true);
      while (!stop.load()) std::memcpy(bytes_of(other_dst), bytes_of(other_src), n);
    });
    while (!started.load()) std::this_thread::yield();
    const std::int64_t rate = copy_rate(src, dst);
    stop.store(true);
    other.join();
    return rate;
  }

  [[nodiscard]] std::int64_t memory_rate() const {
    const std::int64_t n = bytes_ / 4;
    const at::Tensor src = device_a_.narrow(0, 0, n * 4).view(at::kFloat);
    at::Tensor dst = device_b_.narrow(0, 0, n * 4).view(at::kFloat);
    const auto start = Clock::now();
    at::neg_out(dst, src);
    return per_second(2 * n * 4, since(start));
  }

  [[nodiscard]] std::int64_t matmul_rate(at::ScalarType dtype) const {
    MatmulOperands o = matmul_operands(shape_, dtype, at::kCPU);
    const auto start = Clock::now();
    at::mm_out(o.c, o.a, o.b);
    return per_second(matmul_flops(shape_), since(start));
  }

  static std::int64_t alloc_ns(bool malloc) {
    return alloc_or_free_ns(at::TensorOptions().dtype(at::kByte), malloc);
  }

  std::int64_t bytes_;
  MatmulShape shape_;
  at::Tensor host_a_, device_a_, host_b_, device_b_;
  at::Tensor tiny_;
  LoopbackDevice device_;
  LoopbackDevice::Buffer small_src_, small_dst_;
  LoopbackDevice::Event event_;
};

// --- CUDA --------------------------------------------------------------------------------------

#ifdef FERRY_HAVE_CUDA

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

  std::vector<Probe> probes() {
    std::vector<Probe> p;
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
    return p;
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
  at::Tensor pinned_a_, pinned_b_, pageable_a_, pageable_b_, device_a_, device_b_;
  at::Tensor pinned_small_, device_small_, device_small_b_, tiny_;
  std::optional<c10::DeviceIndex> peer_;
  at::Tensor peer_buffer_, peer_small_;
};

#endif  // FERRY_HAVE_CUDA

// --- the protocol ------------------------------------------------------------------------------

struct DeviceChoice {
  bool cuda = false;
  std::int64_t index = 0;
};

bool have_cuda() {
#ifdef FERRY_HAVE_CUDA
  return c10::cuda::device_count() > 0;
#else
  return false;
#endif
}

Result<DeviceChoice> choose_device(std::string_view spec) {
  if (spec.empty()) return DeviceChoice{have_cuda(), 0};
  if (spec == "cpu") return DeviceChoice{false, 0};
  if (spec != "cuda" && !spec.starts_with("cuda:")) {
    return Error{fmt::format("--device: expected cpu, cuda or cuda:N, got \"{}\"", spec)};
  }
  std::int64_t index = 0;
  if (spec.starts_with("cuda:")) {
    const std::string_view digits = spec.substr(5);
    if (digits.empty() || digits.size() > 4 ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return Error{
          fmt::format("--device: expected cuda:N with N a device index, got \"{}\"", spec)};
    }
    index = std::stoll(std::string(digits));
  }
#ifdef FERRY_HAVE_CUDA
  const int count = c10::cuda::device_count();
  if (count == 0) {
    return Error{
        fmt::format("--device {}: no CUDA device is visible to this process (use "
                    "--device cpu for the loopback device)",
                    spec)};
  }
  if (index >= count) {
    return Error{
        fmt::format("--device {}: there are {} CUDA devices (0..{})", spec, count, count - 1)};
  }
  return DeviceChoice{true, index};
#else
  (void)index;
  return Error{
      fmt::format("--device {}: this build has no CUDA (its torch was built without "
                  "it); use --device cpu for the loopback device",
                  spec)};
#endif
}

template <class Target>
ProbeResult measure(Target& target, const ProbeOptions& options, ProbeResult result) {
  for (Probe& probe : target.probes()) {
    if (options.progress) {
      options.progress(fmt::format("probe: {} ({} repeats)", probe.key, options.repeats));
    }
    try {
      (void)probe.sample();  // warm-up (Note [Probe protocol])
    } catch (const c10::Error& e) {
      if (!probe.may_be_unsupported) throw;
      const std::string what = e.what_without_backtrace();
      result.notes.push_back(fmt::format("{} not measured: torch refused it on this device ({})",
                                         probe.key, what.substr(0, what.find('\n'))));
      continue;
    }
    Measurement m{probe.key, probe.unit, probe.method, {}};
    for (std::int32_t i = 0; i < options.repeats; ++i) m.samples.push_back(probe.sample());
    result.measurements.push_back(std::move(m));
  }
  return result;
}

// The single readings go first, then the profile's figures from all measurements.
Result<ProbeResult> finish(ProbeResult result, Readings readings,
                           std::vector<Assumption> (*assume)(std::span<const Measurement>)) {
  result.measurements.insert(result.measurements.begin(), readings.once.begin(),
                             readings.once.end());
  result.notes.insert(result.notes.end(), readings.notes.begin(), readings.notes.end());
  auto figures = profile_figures(result.measurements, assume(result.measurements));
  if (!figures) return figures.error();
  result.figures = std::move(figures).value();
  return result;
}

}  // namespace

Result<ProbeResult> run_probe(const ProbeOptions& options) {
  if (options.repeats < 1 || options.repeats > 1000) {
    return Error{fmt::format("--repeats: expected 1..1000, got {}", options.repeats)};
  }
  const std::int64_t copy = options.copy_bytes.count();
  if (copy != 0 && (copy < 4096 || copy > (std::int64_t{1} << 40))) {
    return Error{fmt::format("--bytes: expected 4 KiB .. 1 TiB, got {} bytes", copy)};
  }
  const MatmulShape& s = options.matmul;
  const bool default_shape = s.m == 0 && s.k == 0 && s.n == 0;
  for (const std::int64_t d : {s.m, s.k, s.n}) {
    if (!default_shape && (d < 1 || d > 65536)) {
      return Error{fmt::format("--matmul: each of M, K, N must be in 1..65536, got {}x{}x{}", s.m,
                               s.k, s.n)};
    }
  }
  auto choice = choose_device(options.device);
  if (!choice) return choice.error();
  ProbeResult result;
  result.repeats = options.repeats;
  result.loopback = !choice.value().cuda;
  if (result.loopback) {
    result.device = "cpu";
    result.device_name = LoopbackTarget::name();
    result.copy_bytes = copy == 0 ? 16 * kMiB : Bytes(copy);
    result.matmul = default_shape ? MatmulShape{256, 512, 512} : s;
    LoopbackTarget target(result.copy_bytes.count(), result.matmul);
    result = measure(target, options, std::move(result));
    return finish(std::move(result), LoopbackTarget::readings(), &LoopbackTarget::assumptions);
  }
#ifdef FERRY_HAVE_CUDA
  const auto index = static_cast<c10::DeviceIndex>(choice.value().index);
  result.device = fmt::format("cuda:{}", index);
  result.copy_bytes = copy == 0 ? 256 * kMiB : Bytes(copy);
  // A Llama-3-8B MLP projection over 8192 tokens: 8192 x 4096 by 4096 x 14336.
  result.matmul = default_shape ? MatmulShape{8192, 4096, 14336} : s;
  CudaTarget target(index, result.copy_bytes.count(), result.matmul);
  result.device_name = target.name();
  result = measure(target, options, std::move(result));
  return finish(std::move(result), target.readings(), &CudaTarget::assumptions);
#else
  FERRY_CHECK(false, "a CUDA device chosen in a build without CUDA");
  return Error{"unreachable"};
#endif
}

}  // namespace ferry::real
