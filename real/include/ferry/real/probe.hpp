#pragma once
/// ferry probe: measures the device this process runs on (a CUDA GPU, or the CPU loopback
/// device) and turns the measurements into a device profile (docs/devices.md, "Measuring a
/// device: ferry probe"), keeping the spread of every figure over its repeats.

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/program/device_profile.hpp"
#include "ferry/result.hpp"
#include "ferry/units.hpp"

namespace ferry::real {

/// The smallest, median and largest of a measurement's samples.
struct Spread {
  std::int64_t min = 0;
  std::int64_t median = 0;
  std::int64_t max = 0;
};

/// The spread of `samples` (at least one). The median of an even count is the mean of the two
/// middle samples, rounded down.
[[nodiscard]] Spread spread_of(std::span<const std::int64_t> samples);

/// One measured quantity: one integer sample per repeat, in the order taken.
struct Measurement {
  std::string key;     ///< "h2d.bytes_per_s", "matmul.bf16.flops_per_s", ...
  std::string unit;    ///< "bytes/s", "FLOP/s", "ns" or "bytes"
  std::string method;  ///< how it was taken, one line for people
  std::vector<std::int64_t> samples;
};

/// A profile figure the probe could not measure on this device, and why this value.
struct Assumption {
  std::string key;  ///< the profile key, e.g. "peer.bytes_per_s"
  std::int64_t value = 0;
  std::string why;
};

/// One key of the device profile: its value and where it came from.
struct ProfileFigure {
  std::string key;  ///< JSON path in the profile: "memory_bytes", "h2d.latency_ns", ...
  std::int64_t value = 0;
  bool measured = false;
  std::string source;  ///< measured: the measurements it derives from; assumed: the reason
};

/// The median of the measurement `key` of `measurements`; nullopt when it was not taken.
[[nodiscard]] std::optional<std::int64_t> median_of(std::span<const Measurement> measurements,
                                                    std::string_view key);

/// The profile keys in the order of the format (docs/devices.md), `name` and `description`
/// left out.
[[nodiscard]] std::span<const std::string_view> profile_keys();

/// Every profile key's figure: the median of the measurement of the same key where there is
/// one; `flops_per_s` from the better of the bf16 and fp16 matmul medians;
/// `bidirectional_permille` from the rate under load over the rate alone; otherwise the
/// assumption for the key. A value outside the format's bounds is clamped to them and the
/// source says so. An error names a key that has neither a measurement nor an assumption.
[[nodiscard]] Result<std::vector<ProfileFigure>> profile_figures(
    std::span<const Measurement> measurements, std::span<const Assumption> assumptions);

/// Whether `name` may name a profile: lower-case letters, digits, '-', '_' and '.', not
/// starting with '.' (the simulator's rule; the name doubles as a file name).
[[nodiscard]] bool is_profile_name(std::string_view name);

/// The shape of a timed matmul: (m x k) times (k x n).
struct MatmulShape {
  std::int64_t m = 0;
  std::int64_t k = 0;
  std::int64_t n = 0;
};

/// What `ferry probe` measures, and how much of it.
struct ProbeOptions {
  std::string device;        ///< "cpu", "cuda" or "cuda:N"; empty: cuda when present, else cpu
  std::int32_t repeats = 5;  ///< samples per measurement, after one warm-up run
  Bytes copy_bytes;          ///< size of each large copy; 0: 256 MiB on CUDA, 16 MiB on cpu
  MatmulShape matmul;        ///< all zero: the device's default transformer shape
  /// Called with one line per measurement as it starts (progress); may be empty.
  std::function<void(std::string_view)> progress;
};

/// What one probe run found.
struct ProbeResult {
  std::string device;       ///< "cpu" or "cuda:N"
  std::string device_name;  ///< the GPU's name, or "CPU loopback"
  bool loopback = false;
  std::int32_t repeats = 0;
  Bytes copy_bytes;
  MatmulShape matmul;
  std::vector<Measurement> measurements;  ///< in the order taken
  std::vector<ProfileFigure> figures;     ///< every profile key, in the format's order
  std::vector<std::string> notes;         ///< what could not be measured, and why
  /// The GPU's (`cudaDeviceProp`); not known on the loopback device.
  ComputeCapability compute_capability;
};

/// Measures the device. Errors: an unknown or absent device, or sizes out of range. CUDA and
/// torch failures during a measurement propagate as exceptions.
[[nodiscard]] Result<ProbeResult> run_probe(const ProbeOptions& options);

/// The device profile (docs/devices.md) of `result` under `name`: fixed key order, integers
/// only, ending in a newline.
[[nodiscard]] std::string profile_json(const ProbeResult& result, std::string_view name);

/// The `ferry.probe/1` report: the run's settings, every measurement with its samples and
/// spread, each profile key with its source, and the profile itself.
[[nodiscard]] std::string report_json(const ProbeResult& result, std::string_view name);

/// A table for people: each measurement's spread, then which profile keys were assumed.
[[nodiscard]] std::string probe_summary_text(const ProbeResult& result, std::string_view name);

/// `ferry probe [options]`: the command line of the `ferry-probe` executable and of
/// `python -m ferry probe`. `args` starts with the program name. Exit codes: 0 done, 1 a
/// measurement failed, 2 a bad option (the message names it).
int probe_main(std::span<const std::string> args);

}  // namespace ferry::real
