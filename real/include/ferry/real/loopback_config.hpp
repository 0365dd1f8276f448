#pragma once
/// How the loopback device runs its streams: a typed value, chosen by the caller. The text form
/// ("sync", "async:SEED[:MAX_DELAY_US]") is for front ends that take it from a flag or an
/// environment variable (the C++ example, the tests); the library itself reads no environment.

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace ferry::real {

/// How the loopback device runs its streams (Note [The asynchronous loopback device] in
/// loopback_streams.hpp).
struct LoopbackConfig {
  bool async = false;  ///< false: every copy runs at once on the host (deterministic)
  std::uint64_t seed = 0;
  /// Each copy starts up to this long after the stream reaches it, and each compute stream's
  /// work issued so far ends up to this long after it was issued (seeded, uniform).
  std::chrono::microseconds max_delay{1000};
  /// The stream named `slow_stream` runs `slow_by` behind: each copy on a copy stream of that
  /// name starts that much later (a congested link), and the work of a compute stream of that
  /// name ends that much later (a long kernel). A test's way to keep one stream far behind the
  /// others, so that a race it plants shows however fast or loaded the host is. C++ only.
  std::string slow_stream;
  std::chrono::microseconds slow_by{0};

  friend bool operator==(const LoopbackConfig&, const LoopbackConfig&) = default;
};

/// The longest max_delay accepted.
inline constexpr std::chrono::microseconds kMaxLoopbackDelay{1'000'000};

/// "sync", "async", "async:SEED" or "async:SEED:MAX_DELAY_US" ("" is "sync"); a malformed text
/// throws std::invalid_argument naming `where` (the option or variable it came from).
[[nodiscard]] LoopbackConfig parse_loopback_streams(std::string_view text, std::string_view where);
/// The text parse_loopback_streams() reads back.
[[nodiscard]] std::string to_string(const LoopbackConfig& config);

}  // namespace ferry::real
