// The command line of ferry probe: the ferry-probe executable, `ferry probe` (which runs it) and
// `python -m ferry probe` (which calls probe_main through ferry._C).

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/real/probe.hpp"

namespace ferry::real {

namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

struct ProbeArgs {
  std::string device;
  std::string out;
  std::string report;
  std::string name;
  std::string bytes;
  std::string matmul;
  std::int32_t repeats = 5;
  bool json = false;
  bool quiet = false;
};

// Why `path` cannot be written ("" when its folder exists).
std::string unwritable(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path parent = fs::path(path).parent_path();
  std::error_code error;
  if (!parent.empty() && !fs::is_directory(parent, error)) {
    return fmt::format("the folder {} does not exist", parent.string());
  }
  if (fs::is_directory(path, error)) return fmt::format("{} is a folder", path);
  return "";
}

// "MxKxN" as a shape; nullopt when it is not three positive integers.
std::optional<MatmulShape> parse_shape(const std::string& text) {
  MatmulShape shape;
  std::int64_t* dims[] = {&shape.m, &shape.k, &shape.n};
  std::size_t at = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    const std::size_t end = i < 2 ? text.find('x', at) : text.size();
    if (end == std::string::npos || end == at || end - at > 6) return std::nullopt;
    std::int64_t value = 0;
    for (std::size_t j = at; j < end; ++j) {
      if (text[j] < '0' || text[j] > '9') return std::nullopt;
      value = value * 10 + (text[j] - '0');
    }
    *dims[i] = value;
    at = end + 1;
  }
  return shape;
}

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary);
  file.write(text.data(), static_cast<std::streamsize>(text.size()));
  file.close();
  return static_cast<bool>(file);
}

int usage_error(const std::string& message) {
  fmt::print(stderr, "ferry probe: error: {}\n", message);
  return kExitUsage;
}

int run(const ProbeArgs& args) {
  ProbeOptions options;
  options.device = args.device;
  options.repeats = args.repeats;
  if (!args.bytes.empty()) {
    auto bytes = parse_bytes(args.bytes, "--bytes");
    if (!bytes) return usage_error(bytes.error().message);
    options.copy_bytes = bytes.value();
  }
  if (!args.matmul.empty()) {
    const auto shape = parse_shape(args.matmul);
    if (!shape) {
      return usage_error(fmt::format(
          "--matmul: expected MxKxN with three positive integers, got \"{}\"", args.matmul));
    }
    options.matmul = *shape;
  }
  if (!args.name.empty() && !is_profile_name(args.name)) {
    return usage_error(fmt::format(
        "--name: \"{}\" is no profile name: use lower-case letters, digits, '-', '_' and '.', "
        "not starting with '.'",
        args.name));
  }
  for (const auto& [flag, path] : {std::pair{"--out", &args.out}, {"--report", &args.report}}) {
    if (path->empty()) continue;
    if (const std::string why = unwritable(*path); !why.empty()) {
      return usage_error(fmt::format("{}: cannot write {}: {}", flag, *path, why));
    }
  }
  if (!args.quiet) {
    options.progress = [](std::string_view line) {
      fmt::print(stderr, "{}\n", line);
      std::fflush(stderr);
    };
  }
  auto result = run_probe(options);
  if (!result) return usage_error(result.error().message);
  const ProbeResult& r = result.value();
  // The profile's name: --name, else the --out file's name where it is a valid one.
  std::string name = args.name;
  if (name.empty() && !args.out.empty()) {
    const std::string stem = std::filesystem::path(args.out).stem().string();
    if (std::filesystem::path(args.out).extension() == ".json" && is_profile_name(stem)) {
      name = stem;
    }
  }
  if (name.empty()) {
    name = r.loopback ? "probe-cpu" : "probe-cuda" + r.device.substr(r.device.find(':') + 1);
  }
  const std::string text = args.json ? report_json(r, name) : probe_summary_text(r, name);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  if (!args.out.empty()) {
    if (!write_file(args.out, profile_json(r, name))) {
      fmt::print(stderr, "ferry probe: error: --out: cannot write {}\n", args.out);
      return kExitFailed;
    }
    if (!args.quiet) fmt::print(stderr, "profile \"{}\" written to {}\n", name, args.out);
  }
  if (!args.report.empty()) {
    if (!write_file(args.report, report_json(r, name))) {
      fmt::print(stderr, "ferry probe: error: --report: cannot write {}\n", args.report);
      return kExitFailed;
    }
    if (!args.quiet) fmt::print(stderr, "report written to {}\n", args.report);
  }
  return 0;
}

}  // namespace

int probe_main(std::span<const std::string> args) {
  CLI::App app{
      "ferry probe: measure this device (a CUDA GPU, or the CPU loopback device) and write a "
      "device profile for ferry simulate, compare and plan (docs/devices.md)",
      "ferry probe"};
  ProbeArgs a;
  app.add_option("--device", a.device,
                 "cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
      ->type_name("DEVICE");
  app.add_option("--out", a.out, "Write the device profile (JSON) to FILE")->type_name("FILE");
  app.add_option("--report", a.report, "Write the ferry.probe/1 report (every sample) to FILE")
      ->type_name("FILE");
  app.add_flag("--json", a.json, "Print the ferry.probe/1 report instead of the table");
  app.add_option("--name", a.name, "The profile's name (default: the --out file's name)")
      ->type_name("NAME");
  app.add_option("--repeats", a.repeats, "Samples per measurement, after one warm-up")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--bytes", a.bytes,
                 "Size of each large copy, e.g. 64MiB (default: 256 MiB on CUDA, 16 MiB on cpu)")
      ->type_name("SIZE");
  app.add_option("--matmul", a.matmul,
                 "Matmul shape MxKxN (default: 8192x4096x14336 on CUDA, 256x512x512 on cpu)")
      ->type_name("MxKxN");
  app.add_flag("--quiet", a.quiet, "No progress on stderr");
  std::vector<const char*> argv;
  argv.reserve(args.size());
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }
  try {
    return run(a);
  } catch (const std::exception& e) {
    fmt::print(stderr, "ferry probe: error: a measurement failed: {}\n", e.what());
    return kExitFailed;
  }
}

}  // namespace ferry::real
