// ferry probe, the device-independent half: statistics over repeats, the profile's figures
// from measurements and assumptions, and the profile, report and summary texts.

#include "ferry/real/probe.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "ferry/check.hpp"
#include "ferry/json_quote.hpp"

namespace ferry::real {

namespace {

constexpr std::int64_t kMaxBytes = std::int64_t{1} << 50;
constexpr std::int64_t kMinRate = 1'000'000;
constexpr std::int64_t kMaxRate = 1'000'000'000'000'000'000;
constexpr std::int64_t kMaxNanoseconds = 1'000'000'000'000'000;

constexpr std::array<std::string_view, 27> kProfileKeys = {
    "memory_bytes",
    "flops_per_s",
    "memory_bytes_per_s",
    "h2d.bytes_per_s",
    "h2d.latency_ns",
    "h2d.bidirectional_permille",
    "d2h.bytes_per_s",
    "d2h.latency_ns",
    "d2h.bidirectional_permille",
    "pageable.h2d_bytes_per_s",
    "pageable.d2h_bytes_per_s",
    "d2d.bytes_per_s",
    "d2d.latency_ns",
    "peer.bytes_per_s",
    "peer.latency_ns",
    "pinned_host_capacity_bytes",
    "blas_workspace_bytes",
    "overheads_ns.kernel",
    "overheads_ns.copy",
    "overheads_ns.event_record",
    "overheads_ns.stream_wait",
    "overheads_ns.event_query",
    "overheads_ns.synchronize",
    "overheads_ns.malloc",
    "overheads_ns.free",
    "overheads_ns.host_access",
    "overheads_ns.host_alloc",
};

struct Bounds {
  std::int64_t low;
  std::int64_t high;
};

// The format's bounds for `key` (docs/devices.md).
Bounds bounds_of(std::string_view key) {
  if (key == "memory_bytes") return {1, kMaxBytes};
  if (key == "pinned_host_capacity_bytes") return {0, kMaxBytes};
  if (key == "blas_workspace_bytes") return {0, std::int64_t{1} << 30};
  if (key.ends_with("_permille")) return {1, 1000};
  if (key.ends_with("_ns") || key.starts_with("overheads_ns.")) return {0, kMaxNanoseconds};
  return {kMinRate, kMaxRate};
}

const Measurement* find(std::span<const Measurement> measurements, std::string_view key) {
  for (const Measurement& m : measurements) {
    if (m.key == key && !m.samples.empty()) return &m;
  }
  return nullptr;
}

std::int64_t median_of(const Measurement& m) { return spread_of(m.samples).median; }

std::int64_t figure(const ProbeResult& result, std::string_view key) {
  for (const ProfileFigure& f : result.figures) {
    if (f.key == key) return f.value;
  }
  FERRY_CHECK(false, "profile key {} missing from the probe's figures", key);
  return 0;
}

std::string description_of(const ProbeResult& result) {
  const auto assumed = std::count_if(result.figures.begin(), result.figures.end(),
                                     [](const ProfileFigure& f) { return !f.measured; });
  return fmt::format(
      "measured by ferry probe on {} ({}), median of {} repeats; {} of {} keys assumed (see the "
      "probe report)",
      result.device_name, result.device, result.repeats, assumed, result.figures.size());
}

// The profile object, each line after the first prefixed with `indent`.
std::string profile_object(const ProbeResult& result, std::string_view name,
                           std::string_view indent) {
  const auto v = [&](std::string_view key) { return figure(result, key); };
  const auto path = [&](std::string_view prefix, bool permille) {
    const std::string p(prefix);
    std::string out = fmt::format(R"({{"bytes_per_s": {}, "latency_ns": {})", v(p + ".bytes_per_s"),
                                  v(p + ".latency_ns"));
    if (permille) {
      out += fmt::format(R"(, "bidirectional_permille": {})", v(p + ".bidirectional_permille"));
    }
    return out + "}";
  };
  std::string out = "{\n";
  const auto line = [&](std::string_view key, const std::string& value, bool last = false) {
    out += fmt::format("{}  \"{}\": {}{}\n", indent, key, value, last ? "" : ",");
  };
  line("name", json_quote(name));
  line("description", json_quote(description_of(result)));
  if (result.compute_capability.known()) {
    line("compute_capability", json_quote(result.compute_capability.text()));
  }
  line("memory_bytes", std::to_string(v("memory_bytes")));
  line("flops_per_s", std::to_string(v("flops_per_s")));
  // Optional in the format: written where the float32 matmul ran.
  if (const Measurement* fp32 = find(result.measurements, "matmul.fp32.flops_per_s")) {
    line("fp32_flops_per_s", std::to_string(median_of(*fp32)));
  }
  // And where TF32 did (compute capability 8.0 and later).
  if (const Measurement* tf32 = find(result.measurements, "matmul.tf32.flops_per_s")) {
    line("tf32_flops_per_s", std::to_string(median_of(*tf32)));
  }
  line("memory_bytes_per_s", std::to_string(v("memory_bytes_per_s")));
  line("h2d", path("h2d", true));
  line("d2h", path("d2h", true));
  line("pageable", fmt::format(R"({{"h2d_bytes_per_s": {}, "d2h_bytes_per_s": {}}})",
                               v("pageable.h2d_bytes_per_s"), v("pageable.d2h_bytes_per_s")));
  line("d2d", path("d2d", false));
  line("peer", path("peer", false));
  line("pinned_host_capacity_bytes", std::to_string(v("pinned_host_capacity_bytes")));
  line("blas_workspace_bytes", std::to_string(v("blas_workspace_bytes")));
  out += fmt::format("{}  \"overheads_ns\": {{\n", indent);
  constexpr std::array<std::string_view, 10> kOverheads = {
      "kernel",      "copy",   "event_record", "stream_wait", "event_query",
      "synchronize", "malloc", "free",         "host_access", "host_alloc"};
  for (std::size_t i = 0; i < kOverheads.size(); ++i) {
    out += fmt::format("{}    \"{}\": {}{}\n", indent, kOverheads[i],
                       v(fmt::format("overheads_ns.{}", kOverheads[i])),
                       i + 1 < kOverheads.size() ? "," : "");
  }
  out += fmt::format("{}  }}\n{}}}", indent, indent);
  return out;
}

std::string json_array(std::span<const std::int64_t> values) {
  return fmt::format("[{}]", fmt::join(values, ", "));
}

}  // namespace

Spread spread_of(std::span<const std::int64_t> samples) {
  FERRY_CHECK(!samples.empty(), "the spread of no samples");
  std::vector<std::int64_t> sorted(samples.begin(), samples.end());
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  const std::int64_t lower = sorted[(n - 1) / 2];
  const std::int64_t upper = sorted[n / 2];
  // Rounded down without overflow, whatever the signs.
  const std::int64_t median = lower + (upper - lower) / 2;
  return Spread{sorted.front(), median, sorted.back()};
}

std::optional<std::int64_t> median_of(std::span<const Measurement> measurements,
                                      std::string_view key) {
  const Measurement* m = find(measurements, key);
  if (m == nullptr) return std::nullopt;
  return median_of(*m);
}

std::span<const std::string_view> profile_keys() { return kProfileKeys; }

bool is_profile_name(std::string_view name) {
  if (name.empty() || name.front() == '.') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
  });
}

Result<std::vector<ProfileFigure>> profile_figures(std::span<const Measurement> measurements,
                                                   std::span<const Assumption> assumptions) {
  std::vector<ProfileFigure> figures;
  for (const std::string_view key : kProfileKeys) {
    ProfileFigure f{std::string(key), 0, true, ""};
    const Measurement* direct = find(measurements, key);
    const Measurement* bf16 = find(measurements, "matmul.bf16.flops_per_s");
    const Measurement* fp16 = find(measurements, "matmul.fp16.flops_per_s");
    if (direct != nullptr) {
      f.value = median_of(*direct);
      f.source = direct->key;
    } else if (key == "flops_per_s" && (bf16 != nullptr || fp16 != nullptr)) {
      const Measurement* best =
          fp16 == nullptr || (bf16 != nullptr && median_of(*bf16) >= median_of(*fp16)) ? bf16
                                                                                       : fp16;
      f.value = median_of(*best);
      f.source = best->key + " (the better 16-bit matmul)";
    } else if (key.ends_with(".bidirectional_permille")) {
      const std::string_view direction = key.substr(0, 3);
      const std::string alone_key = fmt::format("{}.bytes_per_s", direction);
      const std::string loaded_key = fmt::format("{}.bidirectional_bytes_per_s", direction);
      const Measurement* alone = find(measurements, alone_key);
      const Measurement* loaded = find(measurements, loaded_key);
      if (alone != nullptr && loaded != nullptr && median_of(*alone) > 0) {
        f.value = static_cast<std::int64_t>(
            std::llround(1000.0 * static_cast<double>(median_of(*loaded)) /
                         static_cast<double>(median_of(*alone))));
        f.source = fmt::format("{} / {}", loaded_key, alone_key);
      }
    }
    if (f.source.empty()) {
      const auto a = std::find_if(assumptions.begin(), assumptions.end(),
                                  [&](const Assumption& x) { return x.key == key; });
      if (a == assumptions.end()) {
        return Error{
            fmt::format("profile key {} has neither a measurement nor an assumption", key)};
      }
      f.value = a->value;
      f.measured = false;
      f.source = a->why;
    }
    const Bounds b = bounds_of(key);
    if (f.value < b.low || f.value > b.high) {
      f.source += fmt::format(" (clamped to the format's bounds from {})", f.value);
      f.value = std::clamp(f.value, b.low, b.high);
    }
    figures.push_back(std::move(f));
  }
  return figures;
}

std::string profile_json(const ProbeResult& result, std::string_view name) {
  return profile_object(result, name, "") + "\n";
}

std::string report_json(const ProbeResult& result, std::string_view name) {
  std::string out = "{\n";
  out += "  \"format\": \"ferry.probe/1\",\n";
  out += fmt::format("  \"name\": {},\n", json_quote(name));
  out += fmt::format("  \"device\": {},\n", json_quote(result.device));
  out += fmt::format("  \"device_name\": {},\n", json_quote(result.device_name));
  out += fmt::format("  \"loopback\": {},\n", result.loopback ? "true" : "false");
  out += fmt::format("  \"repeats\": {},\n", result.repeats);
  out += fmt::format("  \"copy_bytes\": {},\n", result.copy_bytes.count());
  out += fmt::format("  \"matmul\": {{\"m\": {}, \"k\": {}, \"n\": {}}},\n", result.matmul.m,
                     result.matmul.k, result.matmul.n);
  out += "  \"measurements\": [";
  for (std::size_t i = 0; i < result.measurements.size(); ++i) {
    const Measurement& m = result.measurements[i];
    const Spread s = spread_of(m.samples);
    out += fmt::format(
        "{}\n    {{\"key\": {}, \"unit\": {}, \"min\": {}, \"median\": {}, \"max\": {}, "
        "\"samples\": {}, \"method\": {}}}",
        i == 0 ? "" : ",", json_quote(m.key), json_quote(m.unit), s.min, s.median, s.max,
        json_array(m.samples), json_quote(m.method));
  }
  out += result.measurements.empty() ? "],\n" : "\n  ],\n";
  out += "  \"profile_keys\": [";
  for (std::size_t i = 0; i < result.figures.size(); ++i) {
    const ProfileFigure& f = result.figures[i];
    out += fmt::format("{}\n    {{\"key\": {}, \"value\": {}, \"measured\": {}, \"source\": {}}}",
                       i == 0 ? "" : ",", json_quote(f.key), f.value, f.measured ? "true" : "false",
                       json_quote(f.source));
  }
  out += result.figures.empty() ? "],\n" : "\n  ],\n";
  out += "  \"notes\": [";
  for (std::size_t i = 0; i < result.notes.size(); ++i) {
    out += fmt::format("{}\n    {}", i == 0 ? "" : ",", json_quote(result.notes[i]));
  }
  out += result.notes.empty() ? "],\n" : "\n  ],\n";
  out += fmt::format("  \"profile\": {}\n}}\n", profile_object(result, name, "  "));
  return out;
}

std::string probe_summary_text(const ProbeResult& result, std::string_view name) {
  std::string out = fmt::format(
      "ferry probe: {} ({}), {} repeats, copies of {}, matmul {}x{}x{}\n\n", result.device,
      result.device_name, result.repeats, format_bytes(result.copy_bytes), result.matmul.m,
      result.matmul.k, result.matmul.n);
  std::size_t width = std::string_view("measurement").size();
  for (const Measurement& m : result.measurements) width = std::max(width, m.key.size());
  out += fmt::format("{:<{}}  {:>22}  {:>22}  {:>22}  {}\n", "measurement", width, "min", "median",
                     "max", "unit");
  for (const Measurement& m : result.measurements) {
    const Spread s = spread_of(m.samples);
    out += fmt::format("{:<{}}  {:>22}  {:>22}  {:>22}  {}\n", m.key, width, s.min, s.median, s.max,
                       m.unit);
  }
  const auto measured = std::count_if(result.figures.begin(), result.figures.end(),
                                      [](const ProfileFigure& f) { return f.measured; });
  out += fmt::format("\nprofile \"{}\": {} keys measured, {} assumed\n", name, measured,
                     static_cast<std::ptrdiff_t>(result.figures.size()) - measured);
  for (const ProfileFigure& f : result.figures) {
    if (!f.measured) out += fmt::format("  assumed {} = {}: {}\n", f.key, f.value, f.source);
  }
  for (const std::string& note : result.notes) out += fmt::format("note: {}\n", note);
  return out;
}

}  // namespace ferry::real
