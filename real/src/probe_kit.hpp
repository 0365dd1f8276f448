#pragma once
// ferry probe, the measuring half: the protocol every target follows and the pieces the targets
// share. One file per target: probe_loopback.cpp (the CPU loopback device), probe_cuda.cpp (a
// CUDA device); probe_run.cpp chooses the target and runs it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/real/device.hpp"
#include "ferry/real/probe.hpp"

namespace ferry::real::probe_kit {

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

using Clock = std::chrono::steady_clock;

inline constexpr std::int64_t kSmallCopy = 64;
inline constexpr std::int64_t kAllocBytes = std::int64_t{1} << 20;
inline constexpr std::int64_t kHostReserve = std::int64_t{1} << 30;  // RealOptions::host_reserve

inline std::int64_t since(Clock::time_point start) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start);
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(ns.count()));
}

/// `amount` (bytes or FLOP) per second, for `amount` done in `ns` nanoseconds.
inline std::int64_t per_second(std::int64_t amount, std::int64_t ns) {
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

inline std::uint8_t* bytes_of(const at::Tensor& t) {
  return static_cast<std::uint8_t*>(t.data_ptr());
}

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
inline std::int64_t alloc_or_free_ns(const at::TensorOptions& options, bool malloc) {
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

inline std::int64_t matmul_flops(const MatmulShape& s) { return 2 * s.m * s.k * s.n; }

inline std::string matmul_method(const MatmulShape& s, std::string_view how) {
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

inline MatmulOperands matmul_operands(const MatmulShape& s, at::ScalarType dtype,
                                      at::Device device) {
  // Constant operands: the values do not change a dense matmul's time, and no generator is
  // needed. 1/64 is exact in every dtype and far from denormals.
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  return {at::full({s.m, s.k}, 1.0 / 64, options), at::full({s.k, s.n}, 1.0 / 64, options),
          at::empty({s.m, s.n}, options)};
}

inline constexpr std::array<std::pair<std::string_view, at::ScalarType>, 3> kMatmulTypes = {
    std::pair{std::string_view("bf16"), at::kBFloat16},
    std::pair{std::string_view("fp16"), at::kHalf},
    std::pair{std::string_view("fp32"), at::kFloat}};

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
inline Result<ProbeResult> finish(ProbeResult result, Readings readings,
                                  std::vector<Assumption> (*assume)(std::span<const Measurement>)) {
  result.measurements.insert(result.measurements.begin(), readings.once.begin(),
                             readings.once.end());
  result.notes.insert(result.notes.end(), readings.notes.begin(), readings.notes.end());
  auto figures = profile_figures(result.measurements, assume(result.measurements));
  if (!figures) return figures.error();
  result.figures = std::move(figures).value();
  return result;
}

/// Measures the loopback device (`result` has the options' repeats): every measurement, the
/// figures, the notes.
Result<ProbeResult> probe_loopback(const ProbeOptions& options, ProbeResult result);
/// Measures CUDA device `index` (builds with CUDA only), as probe_loopback.
Result<ProbeResult> probe_cuda(const ProbeOptions& options, ProbeResult result, std::int64_t index);

}  // namespace ferry::real::probe_kit
