#include "ferry/units.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <utility>

namespace ferry {

namespace {

__extension__ using Wide = unsigned __int128;

/// `count` / `unit` rounded half up to `decimals` decimals, as an integer of that many
/// decimal places.
std::int64_t scaled(std::int64_t count, std::int64_t unit, int decimals) {
  Wide scale = 1;
  for (int i = 0; i < decimals; ++i) scale *= 10;
  const Wide n = static_cast<Wide>(count) * scale * 2 + static_cast<Wide>(unit);
  return static_cast<std::int64_t>(n / (static_cast<Wide>(unit) * 2));
}

/// Three significant digits of `count` / `unit` (at least 1), or the rounded integer when it
/// reaches 100. Returns the text and the rounded value in whole units.
std::pair<std::string, std::int64_t> significant(std::int64_t count, std::int64_t unit) {
  const std::int64_t hundredths = scaled(count, unit, 2);
  if (hundredths < 1000) return {fmt::format("{}.{:02}", hundredths / 100, hundredths % 100), 0};
  const std::int64_t tenths = scaled(count, unit, 1);
  if (tenths < 1000) return {fmt::format("{}.{}", tenths / 10, tenths % 10), 0};
  const std::int64_t whole = scaled(count, unit, 0);
  return {fmt::format("{}", whole), whole};
}

struct Unit {
  const char* name;
  std::int64_t size;
};

/// Picks the largest unit that `count` reaches after rounding; `next` is the ratio between
/// neighbouring units (1000 or 1024).
template <std::size_t N>
std::string format_units(std::int64_t count, const Unit (&units)[N], std::int64_t next) {
  if (count < units[1].size) return fmt::format("{} {}", count, units[0].name);
  std::size_t i = 1;
  while (i + 1 < N && count >= units[i + 1].size) ++i;
  auto [text, whole] = significant(count, units[i].size);
  if (whole >= next && i + 1 < N) {  // rounding carried into the next unit
    ++i;
    text = significant(count, units[i].size).first;
  }
  return fmt::format("{} {}", text, units[i].name);
}

}  // namespace

std::string format_bytes(Bytes bytes) {
  static constexpr Unit kUnits[] = {{"B", 1},           {"KiB", 1LL << 10}, {"MiB", 1LL << 20},
                                    {"GiB", 1LL << 30}, {"TiB", 1LL << 40}, {"PiB", 1LL << 50}};
  return format_units(bytes.count(), kUnits, 1024);
}

std::string format_time(SimTime time) {
  static constexpr Unit kUnits[] = {
      {"ns", 1}, {"us", 1'000}, {"ms", 1'000'000}, {"s", 1'000'000'000}};
  return format_units(time.ns(), kUnits, 1000);
}

}  // namespace ferry
