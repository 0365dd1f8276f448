#pragma once
/// Quantities with units: bytes, simulated time, bandwidth. They do not mix with ids or each other.

#include <compare>
#include <cstdint>
#include <string>
#include <string_view>

#include "ferry/result.hpp"

namespace ferry {

/// A byte count or byte offset (signed so that differences are safe; never negative when valid).
class Bytes {
 public:
  constexpr Bytes() = default;
  constexpr explicit Bytes(std::int64_t count) : count_(count) {}
  [[nodiscard]] constexpr std::int64_t count() const { return count_; }

  friend constexpr auto operator<=>(Bytes, Bytes) = default;
  friend constexpr Bytes operator+(Bytes a, Bytes b) { return Bytes(a.count_ + b.count_); }
  friend constexpr Bytes operator-(Bytes a, Bytes b) { return Bytes(a.count_ - b.count_); }
  constexpr Bytes& operator+=(Bytes b) {
    count_ += b.count_;
    return *this;
  }
  constexpr Bytes& operator-=(Bytes b) {
    count_ -= b.count_;
    return *this;
  }

 private:
  std::int64_t count_ = 0;
};

constexpr Bytes kKiB{1024};
constexpr Bytes kMiB{1024LL * 1024};
constexpr Bytes kGiB{1024LL * 1024 * 1024};
constexpr Bytes operator*(std::int64_t n, Bytes b) { return Bytes(n * b.count()); }

/// A point in, or span of, simulated time in integer nanoseconds. Never a floating-point value.
class SimTime {
 public:
  constexpr SimTime() = default;
  constexpr explicit SimTime(std::int64_t ns) : ns_(ns) {}
  [[nodiscard]] constexpr std::int64_t ns() const { return ns_; }

  friend constexpr auto operator<=>(SimTime, SimTime) = default;
  friend constexpr SimTime operator+(SimTime a, SimTime b) { return SimTime(a.ns_ + b.ns_); }
  friend constexpr SimTime operator-(SimTime a, SimTime b) { return SimTime(a.ns_ - b.ns_); }
  constexpr SimTime& operator+=(SimTime b) {
    ns_ += b.ns_;
    return *this;
  }

 private:
  std::int64_t ns_ = 0;
};

/// A transfer rate in bytes per second.
class Bandwidth {
 public:
  constexpr Bandwidth() = default;
  constexpr explicit Bandwidth(std::int64_t bytes_per_s) : bytes_per_s_(bytes_per_s) {}
  [[nodiscard]] constexpr std::int64_t bytes_per_s() const { return bytes_per_s_; }
  friend constexpr auto operator<=>(Bandwidth, Bandwidth) = default;

 private:
  std::int64_t bytes_per_s_ = 0;
};

/// Time to move `bytes` at `rate`, rounded up to the next nanosecond. `rate` must be positive.
[[nodiscard]] constexpr SimTime transfer_time(Bytes bytes, Bandwidth rate) {
  // 128-bit intermediate: bytes * 1e9 overflows 64 bits above ~9.2 GB.
  __extension__ using Wide = unsigned __int128;
  const Wide scaled = static_cast<Wide>(bytes.count()) * 1'000'000'000U;
  const Wide r = static_cast<Wide>(rate.bytes_per_s());
  return SimTime(static_cast<std::int64_t>((scaled + r - 1) / r));
}

/// Note [Units for people]: text output shows a quantity with three significant digits in
/// the largest unit it reaches ("1.50 KiB", "34.9 GiB", "904 ms", "2.02 s"), the unit in the
/// string. Rounding is half up on the exact integer, in integer arithmetic (no locale, no
/// floating point), and carries into the next unit: 999.5 ms prints "1.00 s", 1023.5 KiB
/// prints "1.00 MiB". A value at or above 1000 of the largest unit keeps all its integer
/// digits; so does a count of the smallest unit (bytes below 1 KiB, nanoseconds below 1 us).
/// Bytes between 1000 and 1023 of a unit print with four digits ("1020 KiB"). JSON output
/// keeps the exact integers.

/// "512 B", "1.50 KiB", "34.9 GiB", "1020 MiB" (Note [Units for people]).
[[nodiscard]] std::string format_bytes(Bytes bytes);

/// "512 ns", "8.10 us", "904 ms", "2.02 s" (Note [Units for people]).
[[nodiscard]] std::string format_time(SimTime time);

/// Parses a byte count written for people: "40GiB", "40 GiB", "1.5 GiB", "512MiB", "4e10",
/// "4e10 B", "40GB" (decimal units: kB, MB, GB, TB; binary: KiB, MiB, GiB, TiB; B or none for
/// bytes). A fraction of a unit is rounded down to whole bytes; a fraction of a byte is an
/// error, and so is anything above 2^50. The error quotes the text and names the accepted
/// forms; `what` names the argument.
Result<Bytes> parse_bytes(std::string_view text, std::string_view what);

}  // namespace ferry
