#pragma once
/// Options, facts, telemetry and errors of the offload scheduler.

#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "ferry/failure.hpp"
#include "ferry/ids.hpp"
#include "ferry/units.hpp"

namespace ferry {

enum class Policy : std::uint8_t {
  None,     ///< keep every saved tensor on the device
  Trl,      ///< a faithful model of the reference hook-based offloader as TRL ships it today
  TrlSeed,  ///< the same, as first released (no dedup, no state cleared on entry)
  Trl17,    ///< the same, as TRL 1.0 to 1.7.1 released it (dedup keyed by device address)
  Ferry,    ///< ferry's scheduler (the default)
};

/// Every policy, in the order `--policy` and errors list them.
inline constexpr Policy kPolicies[] = {Policy::None, Policy::Trl, Policy::TrlSeed, Policy::Trl17,
                                       Policy::Ferry};

/// "none", "trl", "trl-seed", "trl-1.7", "ferry".
[[nodiscard]] const char* policy_name(Policy policy);
/// The policy named `name` (as policy_name() spells it), or nullopt.
[[nodiscard]] std::optional<Policy> parse_policy(std::string_view name);
/// Every policy's name, ", " between them and `last` before the last: "none, trl, trl-seed,
/// trl-1.7 or ferry" with " or ".
[[nodiscard]] std::string policy_names(std::string_view last);
/// Whether `policy` models the reference offloader (either version).
[[nodiscard]] constexpr bool is_trl(Policy policy) {
  return policy == Policy::Trl || policy == Policy::TrlSeed || policy == Policy::Trl17;
}

struct OffloadOptions {
  Policy policy = Policy::Ferry;
  Bytes min_bytes{1024};              ///< smaller tensors stay on the device
  std::int32_t trl_stash_count = 5;   ///< trl: forward stash size, in tensors (>= 1)
  Bytes window_bytes{512LL << 20};    ///< ferry: device bytes of offloads in flight in forward
  Bytes prefetch_bytes{512LL << 20};  ///< ferry: bytes of reloads issued ahead of demand
  /// ferry: a window or prefetch budget of more than zero bytes always admits this many
  /// tensors, whatever their bytes (Note [Tensors in flight] in ferry_policy.hpp); >= 1.
  std::int32_t min_in_flight = 3;
  Bytes host_cap{1LL << 40};  ///< ferry: pinned host memory the pool may hold
  bool dedup = true;          ///< ferry: one copy per storage for views sharing it
  bool prefetch = true;       ///< ferry: reload ahead of demand
  /// ferry: bytes of saved storages one forward may copy to the host, counted in pack order;
  /// the first pack that would copy past it, and every later pack of that forward, stay on the
  /// device (Note [Offload horizon] in ferry_policy.hpp). Unset: no limit. The simulator
  /// derives it from the link's speed and the work left in forward (sim::offload_horizon).
  std::optional<Bytes> horizon_bytes = std::nullopt;
  /// Copies on their own streams (overlapping compute); false: on the compute stream, in order
  /// with the kernels (the reference's `use_streams=False`).
  bool use_streams = true;
};

/// What the autograd knows about a saved tensor when it packs it.
struct TensorFacts {
  Bytes bytes;                ///< logical bytes of the tensor
  Bytes storage_bytes;        ///< bytes of its storage (>= bytes + view_offset)
  Bytes view_offset;          ///< where the tensor starts in its storage
  std::uint64_t storage = 0;  ///< identity of the storage (dedup key)
  /// The tensor's version counter when saved: packs of one storage deduplicate only at one
  /// version (an in-place change between two saves makes the second a different tensor).
  std::uint32_t version = 0;
  std::uint64_t address = 0;  ///< where the storage starts in device memory (trl-1.7's dedup key)
  std::uint32_t dtype = 0;    ///< element type, as the backend numbers it (trl-1.7's dedup key)
  bool on_device = true;
  bool is_param = false;    ///< parameters and module buffers are never offloaded
  bool no_offload = false;  ///< per-tensor opt-out
  NodeId node;              ///< the backward node that saves it
};

/// Counters of one offloader; bytes are storage bytes moved.
struct OffloadTelemetry {
  std::int64_t packed = 0;
  std::int64_t offloaded = 0;       ///< storages copied to the host
  std::int64_t kept = 0;            ///< saved tensors left on the device (by rule)
  std::int64_t deduplicated = 0;    ///< packs that shared an already tracked storage
  std::int64_t host_fallbacks = 0;  ///< kept on the device because the host cap was reached
  std::int64_t prefetched = 0;      ///< reloads issued ahead of demand
  std::int64_t on_demand = 0;       ///< reloads issued at unpack
  std::int64_t stash_hits = 0;      ///< unpacks served by a still-resident original
  std::int64_t record_stream_fallbacks = 0;
  std::int64_t past_horizon = 0;  ///< of `kept`: saved after the forward's offload horizon
  /// Saved tensors a backend kept as they are without asking the scheduler, for want of a
  /// storage it can copy (the real backend: tensor subclasses whose data lives in other
  /// tensors, sparse and quantized tensors). Not counted in `packed`.
  std::int64_t kept_as_is = 0;
  Bytes bytes_d2h;
  Bytes bytes_h2d;
  Bytes pinned_bytes;  ///< host bytes held now
  Bytes pinned_peak;
};

/// A field of OffloadTelemetry by name. Every report writes the fields by these tables, in
/// their order (`ferry simulate`/`compare --json`, `ferry.offload`'s `telemetry()`), and
/// telemetry_since takes them from here, so a new field is added in one place.
struct TelemetryCount {
  std::string_view name;
  std::int64_t OffloadTelemetry::*field;
};
struct TelemetryBytes {
  std::string_view name;
  Bytes OffloadTelemetry::*field;
  bool gauge;  ///< a level (held now, the peak), not a running total
};
inline constexpr std::array kTelemetryCounts = {
    TelemetryCount{"packed", &OffloadTelemetry::packed},
    TelemetryCount{"offloaded", &OffloadTelemetry::offloaded},
    TelemetryCount{"kept", &OffloadTelemetry::kept},
    TelemetryCount{"deduplicated", &OffloadTelemetry::deduplicated},
    TelemetryCount{"host_fallbacks", &OffloadTelemetry::host_fallbacks},
    TelemetryCount{"prefetched", &OffloadTelemetry::prefetched},
    TelemetryCount{"on_demand", &OffloadTelemetry::on_demand},
    TelemetryCount{"stash_hits", &OffloadTelemetry::stash_hits},
    TelemetryCount{"record_stream_fallbacks", &OffloadTelemetry::record_stream_fallbacks},
    TelemetryCount{"past_horizon", &OffloadTelemetry::past_horizon},
    TelemetryCount{"kept_as_is", &OffloadTelemetry::kept_as_is},
};
inline constexpr std::array kTelemetryBytes = {
    TelemetryBytes{"bytes_d2h", &OffloadTelemetry::bytes_d2h, false},
    TelemetryBytes{"bytes_h2d", &OffloadTelemetry::bytes_h2d, false},
    TelemetryBytes{"pinned_bytes", &OffloadTelemetry::pinned_bytes, true},
    TelemetryBytes{"pinned_peak", &OffloadTelemetry::pinned_peak, true},
};

/// What the offloader counted since `start` (an earlier reading of the same counters): the
/// counts and bytes moved are differences; the gauges (`pinned_bytes`, `pinned_peak`) are
/// `now`'s.
[[nodiscard]] OffloadTelemetry telemetry_since(const OffloadTelemetry& now,
                                               const OffloadTelemetry& start);

/// Misuse the reference offloader also rejects (an untracked id, a tracker not empty at the
/// next forward, a bad option).
class OffloadError : public std::runtime_error {
 public:
  explicit OffloadError(const std::string& message, FailureKind kind = FailureKind::Misuse)
      : std::runtime_error(message), kind_(kind) {}
  /// OutOfMemory when an allocation found no room; Misuse otherwise.
  [[nodiscard]] FailureKind kind() const { return kind_; }

 private:
  FailureKind kind_;
};

/// Throws OffloadError for options the reference offloader rejects (a trl stash below one
/// tensor, checked only when copies have their own stream, as the reference does).
void check_offload_options(const OffloadOptions& options);

}  // namespace ferry
