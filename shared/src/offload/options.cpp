#include "ferry/offload/options.hpp"

#include "ferry/names.hpp"

namespace ferry {

const char* policy_name(Policy policy) {
  switch (policy) {
    case Policy::None:
      return "none";
    case Policy::Trl:
      return "trl";
    case Policy::TrlSeed:
      return "trl-seed";
    case Policy::Trl17:
      return "trl-1.7";
    case Policy::Ferry:
      return "ferry";
  }
  return "?";
}

std::optional<Policy> parse_policy(std::string_view name) {
  for (const Policy p : kPolicies) {
    if (name == policy_name(p)) return p;
  }
  return std::nullopt;
}

std::string policy_names(std::string_view last) { return names_of(kPolicies, policy_name, last); }

void check_offload_options(const OffloadOptions& options) {
  if (is_trl(options.policy) && options.use_streams && options.trl_stash_count < 1) {
    throw OffloadError("max_fwd_stash_size should be at least 1");
  }
  if (options.policy == Policy::Ferry && options.min_in_flight < 1) {
    throw OffloadError(
        fmt::format("min_in_flight should be at least 1 (got {})", options.min_in_flight));
  }
}

OffloadTelemetry telemetry_since(const OffloadTelemetry& now, const OffloadTelemetry& start) {
  OffloadTelemetry t = now;
  for (const TelemetryCount& c : kTelemetryCounts) t.*c.field -= start.*c.field;
  for (const TelemetryBytes& b : kTelemetryBytes) {
    if (!b.gauge) t.*b.field -= start.*b.field;
  }
  return t;
}

}  // namespace ferry
