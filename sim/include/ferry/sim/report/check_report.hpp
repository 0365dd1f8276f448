#pragma once
/// What `ferry check` prints: a summary of a program run as text or JSON (its Chrome/Perfetto
/// trace is export/trace.hpp's).

#include <string>
#include <string_view>

#include "ferry/sim/runs/run_program.hpp"

namespace ferry::sim {

/// Human-readable summary: hazards with both ops and a hint, makespan, memory peaks, copies.
[[nodiscard]] std::string summary_text(const ProgramRun& run, std::string_view source);

/// The same facts as one JSON document with a fixed key order (docs/program-format.md).
[[nodiscard]] std::string summary_json(const ProgramRun& run, std::string_view source);

}  // namespace ferry::sim
