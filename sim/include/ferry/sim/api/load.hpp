#pragma once
/// What every entry point reads: a model and the device profile it runs on, each given as a
/// bundled name or a file (or, for a model, the text of one), checked against each other. The
/// `ferry` commands and the Python module `ferry._C` load through here; each error names the
/// file.

#include <filesystem>
#include <string>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// The device profile every entry point uses when none is named.
inline constexpr std::string_view kDefaultDevice = "h100-sxm-pcie5";

/// The whole of the `what` file at `path` ("plan", "model"): its error says which file it was.
Result<std::string> read_input(const std::string& path, std::string_view what);

/// A model preset name, or a path to a model file (`*.json`), checked (without durations).
Result<CheckedModel> load_model(const std::string& spec);

/// A bundled device profile's name (looked up in `scenarios`/devices), or a path to a profile
/// file (`*.json`).
Result<DeviceProfile> load_device(const std::string& spec, const std::filesystem::path& scenarios);

/// A model and the device it runs on, read and checked against each other, with the model's
/// durations taken from the device's roofline (the model checked once, as it was read, for
/// every run the request makes): what simulate, compare and plan run.
struct Workload {
  CheckedModel model;
  DeviceProfile device;
};

/// The workload of `model` (as load_model reads it) on `device`.
Result<Workload> load_workload(const std::string& model, const std::string& device,
                               const std::filesystem::path& scenarios);
/// The workload of an already read model (a preset, a parsed file, a traced document) on
/// `device`; `spec` names the model in errors.
Result<Workload> make_workload(Result<CheckedModel> model, std::string_view spec,
                               const std::string& device, const std::filesystem::path& scenarios);

}  // namespace ferry::sim
