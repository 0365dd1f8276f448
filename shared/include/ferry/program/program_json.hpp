#pragma once
/// Writing programs and device profiles as JSON (`ferry.program/1`, docs/program-format.md).
/// The simulator's reader (sim/io/program_json.hpp) is the inverse: a written document reads
/// back equal, and written again gives the same bytes.

#include <string>

#include "ferry/program/device_profile.hpp"
#include "ferry/program/program.hpp"

namespace ferry {

/// The format tag of program documents.
inline constexpr const char* kProgramFormat = "ferry.program/1";

/// A device profile as a JSON document: fixed key order, integers only.
[[nodiscard]] std::string device_profile_to_json(const DeviceProfile& profile);

/// A program as a JSON document, one op per line: fixed key order, so the same program always
/// gives the same bytes. A device whose profile_name is set is written with that name, else
/// with its profile inline. The program must be well formed (every id in range), as the reader
/// returns them and the recorder builds them.
[[nodiscard]] std::string program_to_json(const Program& program);

}  // namespace ferry
