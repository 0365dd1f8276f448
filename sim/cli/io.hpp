#pragma once
// Where the commands find the bundled scenarios, and how they write their outputs (models,
// devices and plans are read through ferry/sim/api/load.hpp).

#include <filesystem>
#include <string>
#include <string_view>

#include "ferry/sim/engine/simulator.hpp"

namespace ferry::cli {

/// The bundled scenarios (devices/, programs/, models/), the default of every --scenarios: those
/// installed beside this executable (`bin/ferry` of a CMake install: `share/ferry/scenarios`;
/// `ferry/bin/ferry` of the Python package: `ferry/scenarios`), else the source tree's the
/// build was made from.
[[nodiscard]] std::string default_scenarios();

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
