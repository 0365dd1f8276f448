#include "ferry/units.hpp"

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <cstddef>
#include <utility>

namespace ferry {

namespace {

// 128-bit intermediates: a count scaled to decimals, or a parsed mantissa of 18 digits times a
// unit, overflows 64 bits.
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

namespace {

// Largest byte count parse_bytes accepts: 2^50 (1 PiB), as the JSON formats do.
constexpr std::int64_t kMaxParsedBytes = std::int64_t{1} << 50;

struct ParseUnit {
  std::string_view name;
  std::int64_t factor;
};

constexpr std::array kParseUnits{
    ParseUnit{"", 1},
    ParseUnit{"B", 1},
    ParseUnit{"kB", 1000},
    ParseUnit{"KB", 1000},
    ParseUnit{"MB", 1000LL * 1000},
    ParseUnit{"GB", 1000LL * 1000 * 1000},
    ParseUnit{"TB", 1000LL * 1000 * 1000 * 1000},
    ParseUnit{"KiB", 1LL << 10},
    ParseUnit{"MiB", 1LL << 20},
    ParseUnit{"GiB", 1LL << 30},
    ParseUnit{"TiB", 1LL << 40},
};

Error bytes_error(std::string_view text, std::string_view what, std::string_view why) {
  return Error{fmt::format(
      "{}: \"{}\" is not a byte count ({}); write e.g. 40GiB, \"40 GiB\", 1.5GiB, 512MiB, 40GB or "
      "4e10 (bytes)",
      what, text, why)};
}

}  // namespace

Result<Bytes> parse_bytes(std::string_view text, std::string_view what) {
  std::size_t i = 0;
  auto skip_spaces = [&] {
    while (i < text.size() && text[i] == ' ') ++i;
  };
  skip_spaces();
  // mantissa digits (with an optional fraction), then an optional exponent
  Wide digits = 0;
  int decimal_exponent = 0;
  int significant = 0;
  bool any_digit = false;
  bool point = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '.' && !point) {
      point = true;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c)) == 0) break;
    any_digit = true;
    if (digits == 0 && c == '0') {
      if (point) --decimal_exponent;
      continue;
    }
    if (++significant > 18) return bytes_error(text, what, "too many digits");
    digits = digits * 10 + static_cast<unsigned>(c - '0');
    if (point) --decimal_exponent;
  }
  if (!any_digit) return bytes_error(text, what, "no number");
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    bool negative = false;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) negative = text[i++] == '-';
    int exponent = 0;
    bool exponent_digit = false;
    for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0; ++i) {
      exponent_digit = true;
      if (exponent > 100) return bytes_error(text, what, "exponent too large");
      exponent = exponent * 10 + (text[i] - '0');
    }
    if (!exponent_digit) return bytes_error(text, what, "no digits after the exponent");
    decimal_exponent += negative ? -exponent : exponent;
  }
  skip_spaces();
  const std::string_view unit_text = text.substr(i);
  const ParseUnit* unit = nullptr;
  for (const ParseUnit& u : kParseUnits) {
    if (unit_text == u.name) unit = &u;
  }
  if (unit == nullptr) {
    return bytes_error(text, what, fmt::format("unknown unit \"{}\"", unit_text));
  }
  const Wide limit = kMaxParsedBytes;
  Wide value = digits * static_cast<Wide>(unit->factor);
  for (; decimal_exponent > 0 && value != 0; --decimal_exponent) {
    value *= 10;
    if (value > limit) break;
  }
  // A fraction of a unit is rounded down to whole bytes ("35.74GiB"); of a byte, refused.
  for (; decimal_exponent < 0; ++decimal_exponent) {
    if (value % 10 != 0 && unit->factor == 1) {
      return bytes_error(text, what, "not a whole number of bytes");
    }
    value /= 10;
  }
  if (value > limit) return bytes_error(text, what, "above 2^50 bytes");
  return Bytes(static_cast<std::int64_t>(value));
}

}  // namespace ferry
