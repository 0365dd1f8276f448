#pragma once
// Output files of the commands that write a run's PyTorch memory snapshot (simulate, check,
// plan).

#include <string>
#include <string_view>

#include "ferry/sim/engine/simulator.hpp"

namespace ferry::cli {

/// Empty when a file can be created at `path`, else why not: checked before a long run.
[[nodiscard]] std::string unwritable(const std::string& path);

/// Writes the PyTorch memory snapshot of the finished run `sim` to `path` for `command`, and
/// says so on stderr unless `quiet`; 0, or the exit code of the failure (2).
int write_memory_snapshot(const sim::Simulator& sim, const std::string& path,
                          std::string_view command, bool quiet);

}  // namespace ferry::cli
