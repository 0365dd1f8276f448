// ferry probe on the CPU loopback device (Note [Probe protocol]).

#include "probe_kit.hpp"

namespace ferry::real::probe_kit {
namespace {

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
        {"overheads_ns.host_alloc", 0,
         "loopback: its pinned buffers are ordinary host memory; nothing is page-locked"},
        {"blas_workspace_bytes", 0,
         "loopback: CPU matmuls take no cuBLAS workspace from the device's allocator"},
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

}  // namespace

Result<ProbeResult> probe_loopback(const ProbeOptions& options, ProbeResult result) {
  const MatmulShape& s = options.matmul;
  const bool default_shape = s.m == 0 && s.k == 0 && s.n == 0;
  const std::int64_t copy = options.copy_bytes.count();
  result.device = "cpu";
  result.device_name = LoopbackTarget::name();
  result.copy_bytes = copy == 0 ? 16 * kMiB : Bytes(copy);
  result.matmul = default_shape ? MatmulShape{256, 512, 512} : s;
  LoopbackTarget target(result.copy_bytes.count(), result.matmul);
  result = measure(target, options, std::move(result));
  return finish(std::move(result), LoopbackTarget::readings(), &LoopbackTarget::assumptions);
}

}  // namespace ferry::real::probe_kit
