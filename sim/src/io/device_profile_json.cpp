// Device profiles (scenarios/devices/*.json): reading, and finding the bundled ones by name.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <string>
#include <system_error>
#include <utility>

#include "ferry/names.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/io/text_file.hpp"
#include "json_files.hpp"

namespace ferry::sim {
namespace {

// The required keys, then the optional one.
constexpr auto kOverheadKeys = [] {
  std::array<std::string_view, kOverheadFields.size() + 1> keys{};
  for (std::size_t i = 0; i < kOverheadFields.size(); ++i) keys[i] = kOverheadFields[i].key;
  keys.back() = kHostAllocKey;
  return keys;
}();

/// Profile names double as file names: lower-case letters, digits, '-', '_', '.', not leading '.'.
bool is_profile_name(std::string_view name) {
  if (name.empty() || name.front() == '.') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
  });
}

}  // namespace

namespace io_detail {

Result<std::int64_t> read_rate(const JsonObject& object, std::string_view key) {
  return object.required_integer(key, kMinJsonRate, kMaxJsonRate);
}

Result<std::int64_t> read_nanoseconds(const JsonObject& object, std::string_view key) {
  return object.required_integer(key, 0, kMaxJsonNanoseconds);
}

}  // namespace io_detail

namespace {

using io_detail::read_nanoseconds;
using io_detail::read_rate;

Result<CopyPath> read_copy_path(const JsonObject& parent, std::string_view key,
                                bool with_permille) {
  FERRY_JSON_TRY(const auto object,
                 with_permille ? parent.required_object(
                                     key, {"bytes_per_s", "latency_ns", "bidirectional_permille"})
                               : parent.required_object(key, {"bytes_per_s", "latency_ns"}));
  CopyPath path;
  FERRY_JSON_TRY(const auto rate, read_rate(object, "bytes_per_s"));
  FERRY_JSON_TRY(const auto latency, read_nanoseconds(object, "latency_ns"));
  path.bandwidth = Bandwidth(rate);
  path.latency = SimTime(latency);
  if (with_permille) {
    FERRY_JSON_TRY(const auto permille,
                   object.optional_integer("bidirectional_permille", 1000, 1, 1000));
    path.bidirectional_permille = static_cast<std::int32_t>(permille);
  }
  return path;
}

Result<CollectiveLink> read_collective_link(const JsonObject& parent, std::string_view key) {
  FERRY_JSON_TRY(const auto object, parent.required_object(key, {"bytes_per_s", "latency_ns"}));
  FERRY_JSON_TRY(const auto rate, read_rate(object, "bytes_per_s"));
  FERRY_JSON_TRY(const auto latency, read_nanoseconds(object, "latency_ns"));
  return CollectiveLink{Bandwidth(rate), SimTime(latency)};
}

// "collectives": {"gpus_per_node": 8, "intra_node": {...}, "inter_node": {...}}, optional.
Result<CollectiveLinks> read_collectives(const JsonObject& profile) {
  CollectiveLinks links;
  if (!profile.has("collectives")) return links;
  FERRY_JSON_TRY(
      const auto object,
      profile.required_object("collectives", {"gpus_per_node", "intra_node", "inter_node"}));
  FERRY_JSON_TRY(const auto gpus, object.required_integer("gpus_per_node", 1, 1024));
  links.gpus_per_node = static_cast<std::int32_t>(gpus);
  FERRY_JSON_TRY(links.intra_node, read_collective_link(object, "intra_node"));
  FERRY_JSON_TRY(links.inter_node, read_collective_link(object, "inter_node"));
  return links;
}

// The optional member `key` of `object`, one of `values` by its `name` (absent: `fallback`);
// anything else is refused listing them.
template <class Value, std::size_t N, class Name>
Result<Value> read_named(const JsonObject& object, std::string_view key, const Value (&values)[N],
                         Name name, Value fallback) {
  FERRY_JSON_TRY(const std::string given, object.optional_string(key, std::string(name(fallback))));
  const auto* found =
      std::find_if(std::begin(values), std::end(values), [&](Value v) { return name(v) == given; });
  if (found != std::end(values)) return *found;
  const auto quoted = [&](Value v) { return json_quote(name(v)); };
  return object.error("\"{}\" is {}, not {}", key, names_of(values, quoted, " or "),
                      json_quote(given));
}

// "compute_capability": "9.0", optional: a major of 1..99 without a leading zero, a minor digit.
Result<ComputeCapability> read_compute_capability(const JsonObject& profile) {
  if (!profile.has("compute_capability")) return ComputeCapability{};
  FERRY_JSON_TRY(const auto value, profile.required("compute_capability"));
  FERRY_JSON_TRY(const std::string text, value.string());
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  const std::size_t dot = text.find('.');
  const bool well_formed =
      dot != std::string::npos && (dot == 1 || dot == 2) && text.size() == dot + 2 &&
      text.front() != '0' &&
      std::all_of(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(dot), digit) &&
      digit(text.back());
  if (!well_formed) {
    return value.error(
        "a compute capability is major.minor as `nvidia-smi --query-gpu=compute_cap` prints it "
        "(\"8.0\" for an A100, \"9.0\" for an H100), not {}",
        json_quote(text));
  }
  return ComputeCapability{.major = std::stoi(text.substr(0, dot)), .minor = text.back() - '0'};
}

// "kernels": {"sm_count": 132, "matmul_tile_m": 128, "matmul_tile_n": 256, "matmul_permille":
// 801, ...}, optional, and every figure in it (0: none); the tile model's SMs and tile come
// together, with the matmul figure they scale.
// The kernel choices absent from the file are torch's on the GPU (`defaults`).
Result<KernelFigures> read_kernels(const JsonObject& profile, const TorchDefaults& defaults) {
  KernelFigures kernels;
  kernels.sdpa_backend = defaults.sdpa_backend;
  kernels.grouped_mm = defaults.grouped_mm;
  if (!profile.has("kernels")) return kernels;
  FERRY_JSON_TRY(
      const auto object,
      profile.required_object(
          "kernels",
          {"sm_count", "matmul_tile_m", "matmul_tile_n", "matmul_permille",
           "flash_forward_permille", "flash_backward_permille", "cudnn_forward_permille",
           "cudnn_backward_permille", "efficient_forward_permille", "efficient_backward_permille",
           "memory_permille", "collective_overlap_permille", "sdpa_backend", "grouped_mm"}));
  const auto read = [&](std::string_view key, std::int32_t& field, bool required, std::int64_t min,
                        std::int64_t max) -> Status {
    if (required) {
      FERRY_JSON_TRY(const auto value, object.required_integer(key, min, max));
      field = static_cast<std::int32_t>(value);
    } else {
      FERRY_JSON_TRY(const auto value, object.optional_integer(key, 0, min, max));
      field = static_cast<std::int32_t>(value);
    }
    return Ok{};
  };
  const bool tiled =
      object.has("sm_count") || object.has("matmul_tile_m") || object.has("matmul_tile_n");
  if (tiled && !(object.has("sm_count") && object.has("matmul_tile_m") &&
                 object.has("matmul_tile_n") && object.has("matmul_permille"))) {
    return object.error(
        "the tile model takes \"sm_count\", \"matmul_tile_m\", \"matmul_tile_n\" and "
        "\"matmul_permille\" together: give all four, or none for the flat roofline's matmuls");
  }
  FERRY_JSON_RETURN_IF_ERROR(read("sm_count", kernels.sm_count, tiled, 1, 1024));
  FERRY_JSON_RETURN_IF_ERROR(read("matmul_tile_m", kernels.matmul_tile_m, tiled, 1, 1024));
  FERRY_JSON_RETURN_IF_ERROR(read("matmul_tile_n", kernels.matmul_tile_n, tiled, 1, 1024));
  FERRY_JSON_RETURN_IF_ERROR(read("matmul_permille", kernels.matmul_permille, tiled, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(
      read("flash_forward_permille", kernels.flash_forward_permille, false, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(
      read("flash_backward_permille", kernels.flash_backward_permille, false, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(
      read("cudnn_forward_permille", kernels.cudnn_forward_permille, false, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(
      read("cudnn_backward_permille", kernels.cudnn_backward_permille, false, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(
      read("efficient_forward_permille", kernels.efficient_forward_permille, false, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(
      read("efficient_backward_permille", kernels.efficient_backward_permille, false, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(read("memory_permille", kernels.memory_permille, false, 1, 1000));
  FERRY_JSON_RETURN_IF_ERROR(
      read("collective_overlap_permille", kernels.collective_overlap_permille, false, 1, 1000));
  FERRY_JSON_TRY(kernels.sdpa_backend, read_named(object, "sdpa_backend", kSdpaBackends,
                                                  sdpa_backend_name, defaults.sdpa_backend));
  FERRY_JSON_TRY(kernels.grouped_mm, read_named(object, "grouped_mm", kGroupedMmKernels,
                                                grouped_mm_kernel_name, defaults.grouped_mm));
  return kernels;
}

}  // namespace

namespace io_detail {

// The largest cuBLAS workspace a profile may name: 1 GiB, 32 times torch's largest default.
constexpr std::int64_t kMaxBlasWorkspaceBytes = std::int64_t{1} << 30;

Result<DeviceProfile> read_profile(const JsonValue& value) {
  FERRY_JSON_TRY(
      const auto object,
      value.object({"name", "description", "compute_capability", "memory_bytes", "flops_per_s",
                    "fp32_flops_per_s", "tf32_flops_per_s", "memory_bytes_per_s", "h2d", "d2h",
                    "pageable", "d2d", "peer", "pinned_host_capacity_bytes", "blas_workspace_bytes",
                    "overheads_ns", "collectives", "kernels"}));
  DeviceProfile profile;
  FERRY_JSON_TRY(const auto name_value, object.required("name"));
  FERRY_JSON_TRY(profile.name, name_value.name());
  if (!is_profile_name(profile.name)) {
    return name_value.error(
        "profile names use lower-case letters, digits, '-', '_' and '.', got {}",
        json_quote(profile.name));
  }
  FERRY_JSON_TRY(profile.description, object.optional_string("description", {}));
  FERRY_JSON_TRY(profile.compute_capability, read_compute_capability(object));
  const TorchDefaults defaults = torch_defaults_on(profile.compute_capability);
  FERRY_JSON_TRY(const auto memory, object.required_integer("memory_bytes", 1, kMaxJsonBytes));
  profile.memory = Bytes(memory);
  FERRY_JSON_TRY(profile.flops_per_s, read_rate(object, "flops_per_s"));
  if (object.has("fp32_flops_per_s")) {
    FERRY_JSON_TRY(profile.fp32_flops_per_s, read_rate(object, "fp32_flops_per_s"));
  }
  if (object.has("tf32_flops_per_s")) {
    FERRY_JSON_TRY(profile.tf32_flops_per_s, read_rate(object, "tf32_flops_per_s"));
  }
  FERRY_JSON_TRY(const auto hbm, read_rate(object, "memory_bytes_per_s"));
  profile.memory_bandwidth = Bandwidth(hbm);
  FERRY_JSON_TRY(profile.h2d, read_copy_path(object, "h2d", true));
  FERRY_JSON_TRY(profile.d2h, read_copy_path(object, "d2h", true));
  FERRY_JSON_TRY(const auto pageable,
                 object.required_object("pageable", {"h2d_bytes_per_s", "d2h_bytes_per_s"}));
  FERRY_JSON_TRY(const auto pageable_h2d, read_rate(pageable, "h2d_bytes_per_s"));
  FERRY_JSON_TRY(const auto pageable_d2h, read_rate(pageable, "d2h_bytes_per_s"));
  profile.pageable_h2d = Bandwidth(pageable_h2d);
  profile.pageable_d2h = Bandwidth(pageable_d2h);
  FERRY_JSON_TRY(profile.d2d, read_copy_path(object, "d2d", false));
  FERRY_JSON_TRY(profile.peer, read_copy_path(object, "peer", false));
  FERRY_JSON_TRY(const auto pinned,
                 object.required_integer("pinned_host_capacity_bytes", 0, kMaxJsonBytes));
  profile.pinned_host_capacity = Bytes(pinned);
  FERRY_JSON_TRY(const auto workspace,
                 object.optional_integer("blas_workspace_bytes", defaults.blas_workspace.count(), 0,
                                         kMaxBlasWorkspaceBytes));
  profile.blas_workspace = Bytes(workspace);
  FERRY_JSON_TRY(const auto overheads_value, object.required("overheads_ns"));
  FERRY_JSON_TRY(const auto overheads,
                 overheads_value.object(std::span<const std::string_view>(kOverheadKeys)));
  for (const OverheadField& field : kOverheadFields) {
    FERRY_JSON_TRY(const auto ns, read_nanoseconds(overheads, field.key));
    profile.overheads.*field.field = SimTime(ns);
  }
  FERRY_JSON_TRY(const auto host_alloc,
                 overheads.optional_integer(kHostAllocKey, 0, 0, kMaxJsonNanoseconds));
  profile.overheads.host_alloc = SimTime(host_alloc);
  FERRY_JSON_TRY(profile.collectives, read_collectives(object));
  FERRY_JSON_TRY(profile.kernels, read_kernels(object, defaults));
  return profile;
}

}  // namespace io_detail

Result<DeviceProfile> parse_device_profile(std::string_view text, std::string_view source) {
  FERRY_JSON_TRY(const auto document, parse_json_text(text, source));
  return io_detail::read_profile(JsonValue(document, source));
}

std::vector<std::string> list_device_profiles(const std::filesystem::path& profile_dir) {
  std::vector<std::string> names;
  std::error_code error;
  std::filesystem::directory_iterator it(profile_dir, error);
  for (; !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    const auto& path = it->path();
    if (path.extension() != ".json") continue;
    std::string stem = path.stem().string();
    if (is_profile_name(stem)) names.push_back(std::move(stem));
  }
  std::sort(names.begin(), names.end());
  return names;
}

Result<DeviceProfile> load_device_profile(const std::filesystem::path& profile_dir,
                                          std::string_view name) {
  const auto bundled = [&] {
    const auto names = list_device_profiles(profile_dir);
    if (names.empty()) return fmt::format("no profiles in {}", profile_dir.string());
    return fmt::format("bundled: {}", fmt::join(names, ", "));
  };
  if (!is_profile_name(name)) {
    return Error{fmt::format(
        "invalid device profile name {}: use lower-case letters, digits, '-', '_', '.' ({})",
        json_quote(name), bundled())};
  }
  const auto path = profile_dir / (std::string(name) + ".json");
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return Error{fmt::format("unknown device profile {} ({})", json_quote(name), bundled())};
  }
  FERRY_JSON_TRY(const auto text, read_text_file(path));
  const std::string source = path.string();
  FERRY_JSON_TRY(auto profile, parse_device_profile(text, source));
  if (profile.name != name) {
    return Error{fmt::format("{}: name: {} does not match the file name {}", source,
                             json_quote(profile.name), json_quote(name))};
  }
  return profile;
}

}  // namespace ferry::sim
