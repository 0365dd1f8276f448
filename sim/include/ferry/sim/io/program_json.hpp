#pragma once
/// Reading device profiles and stream programs from JSON, with errors that name the JSON path.

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/program/program_json.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/engine/program.hpp"

namespace ferry::sim {

/// Parses a device profile document (scenarios/devices/*.json). `source` names the document in
/// error messages (usually its path).
Result<DeviceProfile> parse_device_profile(std::string_view text, std::string_view source);

/// Reads `<profile_dir>/<name>.json`. The error names the file and lists the bundled names.
Result<DeviceProfile> load_device_profile(const std::filesystem::path& profile_dir,
                                          std::string_view name);

/// Parses a stream program. A device's "profile" is either an inline profile object or the name
/// of a file in `profile_dir`. Every error names the source and the JSON path, e.g.
/// "prog.json: ops[3].duration_ns: expected a non-negative integer, got -5".
Result<Program> parse_program(std::string_view text, std::string_view source,
                              const std::filesystem::path& profile_dir);

/// Reads and parses a program file.
Result<Program> load_program(const std::filesystem::path& path,
                             const std::filesystem::path& profile_dir);

/// The bundled profile names in `profile_dir` (file names without ".json"), sorted.
[[nodiscard]] std::vector<std::string> list_device_profiles(
    const std::filesystem::path& profile_dir);

/// The writers are the core's (ferry/program/program_json.hpp): what they write, the
/// functions above read back equal.
using ferry::device_profile_to_json;
using ferry::program_to_json;

}  // namespace ferry::sim
