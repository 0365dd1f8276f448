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
#include "ferry/sim/workload/rank_workload.hpp"

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

/// The workload of `model` (as load_model reads it) on `device`, as read: the model checked
/// once, not timed (rank_workload times the model a rank runs, once).
Result<Workload> load_workload(const std::string& model, const std::string& device,
                               const std::filesystem::path& scenarios);
/// The workload of an already read model (a preset, a parsed file, a traced document) on
/// `device`, as read.
Result<Workload> make_workload(Result<CheckedModel> model, const std::string& device,
                               const std::filesystem::path& scenarios);

}  // namespace ferry::sim
