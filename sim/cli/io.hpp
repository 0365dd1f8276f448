#pragma once
// What the commands read and write: models, device profiles and plans given on the command line
// (a bundled name or a file), and their output files. Each error names the file.

#include <filesystem>
#include <string>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::cli {

/// The bundled scenarios (devices/, programs/, models/), the default of every --scenarios: those
/// installed beside this executable (`bin/ferry` of a CMake install: `share/ferry/scenarios`;
/// `ferry/bin/ferry` of the Python package: `ferry/scenarios`), else the source tree's the
/// build was made from.
[[nodiscard]] std::string default_scenarios();

/// The whole of the `what` file at `path` ("plan", "model"): its error says which file it was.
Result<std::string> read_input(const std::string& path, std::string_view what);

/// A model preset name, or a path to a model file (`*.json`).
Result<sim::Model> load_model(const std::string& spec);

/// A bundled device profile's name (looked up in `scenarios`/devices), or a path to a profile
/// file (`*.json`).
Result<sim::DeviceProfile> load_device(const std::string& spec,
                                       const std::filesystem::path& scenarios);

/// A model and the device it runs on, read and checked against each other, with the model's
/// durations taken from the device's roofline: what simulate, compare and plan run.
struct Workload {
  sim::Model model;
  sim::DeviceProfile device;
};
Result<Workload> load_workload(const std::string& model, const std::string& device,
                               const std::filesystem::path& scenarios);

/// Writes `text` to stdout and flushes it.
void print(std::string_view text);

/// Writes `bytes` to the file at `path`; false when it could not.
[[nodiscard]] bool write_output(const std::string& path, std::string_view bytes);

/// Empty when a file can be created at `path`, else why not: checked before a long run.
[[nodiscard]] std::string unwritable(const std::string& path);

/// Writes the PyTorch memory snapshot of the finished run `sim` to `path` for `command`, and
/// says so on stderr unless `quiet`; 0, or the exit code of the failure (2).
int write_memory_snapshot(const sim::Simulator& sim, const std::string& path,
                          std::string_view command, bool quiet);

}  // namespace ferry::cli
