#include "ferry/units.hpp"

#include <fmt/format.h>

#include <iterator>

namespace ferry {

std::string format_bytes(Bytes bytes) {
  const std::int64_t n = bytes.count();
  if (n < 1024) return fmt::format("{} B", n);
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  std::int64_t unit = 1024;
  std::size_t i = 0;
  while (i + 1 < std::size(kUnits) && n >= unit * 1024) {
    unit *= 1024;
    ++i;
  }
  const std::int64_t hundredths = (n % unit) * 100 / unit;
  return fmt::format("{}.{:02} {}", n / unit, hundredths, kUnits[i]);
}

}  // namespace ferry
