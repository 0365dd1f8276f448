// ferry probe, the measuring half: the device chosen, the options checked, then the target's
// file measures it (probe_kit.hpp, Note [Probe protocol]).

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/check.hpp"
#include "ferry/real/probe.hpp"
#include "probe_kit.hpp"

#ifdef FERRY_HAVE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace ferry::real {
namespace {

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
  if (result.loopback) return probe_kit::probe_loopback(options, std::move(result));
#ifdef FERRY_HAVE_CUDA
  return probe_kit::probe_cuda(options, std::move(result), choice.value().index);
#else
  FERRY_CHECK(false, "a CUDA device chosen in a build without CUDA");
  return Error{"unreachable"};
#endif
}

}  // namespace ferry::real
