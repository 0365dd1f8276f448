#include "ferry/offload/options.hpp"

namespace ferry {

const char* policy_name(Policy policy) {
  switch (policy) {
    case Policy::None:
      return "none";
    case Policy::Trl:
      return "trl";
    case Policy::TrlSeed:
      return "trl-seed";
    case Policy::Ferry:
      return "ferry";
  }
  return "?";
}

std::optional<Policy> parse_policy(std::string_view name) {
  for (const Policy p : {Policy::None, Policy::Trl, Policy::TrlSeed, Policy::Ferry}) {
    if (name == policy_name(p)) return p;
  }
  return std::nullopt;
}

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
  t.packed -= start.packed;
  t.offloaded -= start.offloaded;
  t.kept -= start.kept;
  t.deduplicated -= start.deduplicated;
  t.host_fallbacks -= start.host_fallbacks;
  t.prefetched -= start.prefetched;
  t.on_demand -= start.on_demand;
  t.stash_hits -= start.stash_hits;
  t.record_stream_fallbacks -= start.record_stream_fallbacks;
  t.past_horizon -= start.past_horizon;
  t.kept_as_is -= start.kept_as_is;
  t.bytes_d2h = now.bytes_d2h - start.bytes_d2h;
  t.bytes_h2d = now.bytes_h2d - start.bytes_h2d;
  return t;
}

}  // namespace ferry
