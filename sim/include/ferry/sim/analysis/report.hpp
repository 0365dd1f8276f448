#pragma once
/// What `ferry check` prints: a summary as text or JSON, and a Chrome/Perfetto trace.

#include <string>
#include <string_view>

#include "ferry/sim/analysis/run_program.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// Human-readable summary: hazards with both ops and a hint, makespan, memory peaks, copies.
[[nodiscard]] std::string summary_text(const ProgramRun& run, std::string_view source);

/// The same facts as one JSON document with a fixed key order (docs/program-format.md).
[[nodiscard]] std::string summary_json(const ProgramRun& run, std::string_view source);

/// Chrome trace-event JSON: a process per device (plus the host), a track per stream and per
/// copy engine, instant marks for event records and hazards, memory counters.
[[nodiscard]] std::string chrome_trace(const Simulator& sim);

}  // namespace ferry::sim
