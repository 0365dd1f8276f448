#include "ferry/sim/report/row_fields.hpp"

#include <fmt/format.h>

#include <utility>

#include "ferry/offload/options.hpp"

namespace ferry::sim {

namespace {

using Json = nlohmann::ordered_json;

}  // namespace

void put_row(Json& j, const RowResult& r, std::initializer_list<RowField> fields) {
  for (const RowField field : fields) {
    switch (field) {
      case RowField::Name:
        j["name"] = r.name;
        break;
      case RowField::Policy:
        j["policy"] = policy_name(r.policy);
        break;
      case RowField::Fits:
        // No consumer takes a failed run's figures as a fit.
        j["fits"] = r.completed_within_memory();
        break;
      case RowField::Failure:
        j["failure"] = r.failure ? Json(r.failure->message) : Json(nullptr);
        break;
      case RowField::StepTime:
        j["step_time_ns"] = r.step_time.ns();
        break;
      case RowField::ForwardTime:
        j["forward_time_ns"] = r.forward_time.ns();
        break;
      case RowField::ForwardStall:
        j["forward_stall_ns"] = r.forward_stall.ns();
        break;
      case RowField::BackwardStall:
        j["backward_stall_ns"] = r.backward_stall.ns();
        break;
      case RowField::Recompute:
        j["recompute_ns"] = r.recompute_time.ns();
        break;
      case RowField::Overlap:
        j["overlap_permille"] = r.overlap_permille;
        break;
      case RowField::PeakAllocated:
        j["peak_allocated_bytes"] = r.peak_allocated.count();
        break;
      case RowField::PeakReserved:
        j["peak_reserved_bytes"] = r.peak_reserved.count();
        break;
      case RowField::PinnedPeak:
        j["pinned_peak_bytes"] = r.pinned_peak.count();
        break;
      case RowField::D2h:
        j["d2h_bytes"] = r.d2h.count();
        break;
      case RowField::H2d:
        j["h2d_bytes"] = r.h2d.count();
        break;
      case RowField::Hazards:
        j["hazards"] = r.hazards;
        break;
      case RowField::Horizon:
        j["horizon_bytes"] = r.horizon ? Json(r.horizon->count()) : Json(nullptr);
        break;
      case RowField::Telemetry: {
        Json counts = Json::object();
        for (const TelemetryCount& c : kTelemetryCounts) {
          counts[std::string(c.name)] = r.telemetry.*c.field;
        }
        j["telemetry"] = std::move(counts);
        break;
      }
    }
  }
}

std::string row_lines(const RowResult& r, std::initializer_list<RowLine> lines) {
  std::string out;
  for (const RowLine line : lines) {
    switch (line) {
      case RowLine::PeakAllocatedReserved:
        out += fmt::format("peak device memory: allocated {}, reserved {}\n",
                           format_bytes(r.peak_allocated), format_bytes(r.peak_reserved));
        break;
      case RowLine::PeakReservedAllocated:
        out += fmt::format("peak device memory: reserved {}, allocated {}\n",
                           format_bytes(r.peak_reserved), format_bytes(r.peak_allocated));
        break;
      case RowLine::PinnedPeak:
        out += fmt::format("peak pinned host memory: {}\n", format_bytes(r.pinned_peak));
        break;
      case RowLine::Moved:
        out += fmt::format("moved: D2H {}, H2D {}\n", format_bytes(r.d2h), format_bytes(r.h2d));
        break;
      case RowLine::Recompute:
        out += fmt::format("recompute: {}\n", format_time(r.recompute_time));
        break;
      case RowLine::Stall:
      case RowLine::StallOverlap:
        out += fmt::format("stall (compute stream waiting on copies): forward {}, backward {}",
                           format_time(r.forward_stall), format_time(r.backward_stall));
        if (line == RowLine::StallOverlap) {
          out += fmt::format("; copy/compute overlap {}", percent_text(r.overlap_permille));
        }
        out += "\n";
        break;
    }
  }
  return out;
}

std::string ratio_text(std::int64_t value, std::int64_t base, std::string_view suffix) {
  if (base <= 0) return "-";
  const std::int64_t thousandths = (value * 1000 + base / 2) / base;
  return fmt::format("{}.{:03}{}", thousandths / 1000, thousandths % 1000, suffix);
}

std::string percent_text(std::int64_t permille) {
  return fmt::format("{}.{}%", permille / 10, permille % 10);
}

}  // namespace ferry::sim
