#include "io.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <utility>

#include "ferry/sim/export/memory_snapshot.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/io/text_file.hpp"

namespace ferry::cli {

std::string default_scenarios() {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path self = fs::read_symlink("/proc/self/exe", error);
  if (!error) {
    const fs::path prefix = self.parent_path().parent_path();
    for (const fs::path& installed :
         {prefix / "share" / "ferry" / "scenarios", prefix / "scenarios"}) {
      if (fs::is_directory(installed / "devices", error)) return installed.string();
    }
  }
  return FERRY_DEFAULT_SCENARIOS_DIR;
}

Result<std::string> read_input(const std::string& path, std::string_view what) {
  auto text = sim::read_text_file(path);
  if (!text) return Error{fmt::format("{} file {}", what, text.error().message)};
  return text;
}

Result<sim::Model> load_model(const std::string& spec) {
  if (!spec.ends_with(".json")) return sim::model_preset(spec);
  auto text = read_input(spec, "model");
  if (!text) return text.error();
  return sim::parse_model(text.value(), spec);
}

Result<sim::DeviceProfile> load_device(const std::string& spec,
                                       const std::filesystem::path& scenarios) {
  if (!spec.ends_with(".json")) return sim::load_device_profile(scenarios / "devices", spec);
  auto text = read_input(spec, "device");
  if (!text) return text.error();
  return sim::parse_device_profile(text.value(), spec);
}

Result<Workload> load_workload(const std::string& model, const std::string& device,
                               const std::filesystem::path& scenarios) {
  auto m = load_model(model);
  if (!m) return m.error();
  auto d = load_device(device, scenarios);
  if (!d) return d.error();
  if (auto fits = sim::check_roofline(m.value(), d.value()); !fits.ok()) {
    return Error{fmt::format("{}: {}", model, fits.error().message)};
  }
  Workload workload{std::move(m).value(), std::move(d).value()};
  sim::assign_roofline_durations(workload.model, workload.device);
  return workload;
}

void print(std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

bool write_output(const std::string& path, std::string_view bytes) {
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  return !file.fail();
}

std::string unwritable(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return fmt::format("cannot write {}: no folder {}", path, dir.string());
  if (fs::is_directory(p, ec)) return fmt::format("cannot write {}: it is a folder", path);
  return {};
}

int write_memory_snapshot(const sim::Simulator& sim, const std::string& path,
                          std::string_view command, bool quiet) {
  constexpr int kExitBadInput = 2;
  auto pickle = sim::memory_snapshot(sim);
  if (!pickle) {
    fmt::print(stderr, "ferry {}: error: --memory-snapshot: {}\n", command, pickle.error().message);
    return kExitBadInput;
  }
  if (!write_output(path, pickle.value())) {
    fmt::print(stderr, "ferry {}: error: --memory-snapshot: cannot write {}\n", command, path);
    return kExitBadInput;
  }
  if (!quiet) fmt::print(stderr, "memory snapshot written to {} (pytorch.org/memory_viz)\n", path);
  return 0;
}

}  // namespace ferry::cli
