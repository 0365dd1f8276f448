#pragma once
/// The figures of one measured row (RowResult) as JSON members and as text lines, each written
/// once for every report that shows them: `ferry simulate`, `ferry compare` and the plan
/// report. Each report picks the fields and their order, so its bytes stay as they are.

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

/// One JSON member of a row; its key is in the comment.
enum class RowField : std::uint8_t {
  Name,           ///< "name"
  Policy,         ///< "policy"
  Fits,           ///< "fits"
  Failure,        ///< "failure": the message, or null
  StepTime,       ///< "step_time_ns"
  ForwardTime,    ///< "forward_time_ns"
  ForwardStall,   ///< "forward_stall_ns"
  BackwardStall,  ///< "backward_stall_ns"
  Recompute,      ///< "recompute_ns"
  Overlap,        ///< "overlap_permille"
  PeakAllocated,  ///< "peak_allocated_bytes"
  PeakReserved,   ///< "peak_reserved_bytes"
  PinnedPeak,     ///< "pinned_peak_bytes"
  D2h,            ///< "d2h_bytes"
  H2d,            ///< "h2d_bytes"
  Hazards,        ///< "hazards"
  Horizon,        ///< "horizon_bytes": the bytes, or null
  Telemetry,      ///< "telemetry": the counts of kTelemetryCounts, in its order
};

/// Sets the members `fields` of `row` on `j`, in that order (after the members `j` has).
void put_row(nlohmann::ordered_json& j, const RowResult& row,
             std::initializer_list<RowField> fields);

/// One line of a one-run summary.
enum class RowLine : std::uint8_t {
  PeakAllocatedReserved,  ///< "peak device memory: allocated A, reserved R"
  PeakReservedAllocated,  ///< "peak device memory: reserved R, allocated A"
  PinnedPeak,             ///< "peak pinned host memory: P"
  Moved,                  ///< "moved: D2H D, H2D H"
  Recompute,              ///< "recompute: T"
  Stall,                  ///< "stall (compute stream waiting on copies): forward F, backward B"
  StallOverlap,           ///< the stall line, then "; copy/compute overlap O%"
};

/// The lines `lines` of `row`, in that order, each ending in a newline.
[[nodiscard]] std::string row_lines(const RowResult& row, std::initializer_list<RowLine> lines);

/// value / base in thousandths, half up, as "1.234" followed by `suffix`; "-" without a base
/// (base <= 0).
[[nodiscard]] std::string ratio_text(std::int64_t value, std::int64_t base,
                                     std::string_view suffix = {});

/// Thousandths as a percentage with one decimal: 537 -> "53.7%".
[[nodiscard]] std::string percent_text(std::int64_t permille);

}  // namespace ferry::sim
