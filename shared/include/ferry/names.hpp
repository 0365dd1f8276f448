#pragma once
/// The lists of accepted names that help texts and refusals print.

#include <cstddef>
#include <iterator>
#include <string>
#include <string_view>

namespace ferry {

/// The name of each of `values`, ", " between them and `last` before the last: the values
/// named "a", "b" and "c" with " or " give "a, b or c".
template <typename Values, typename NameOf>
[[nodiscard]] std::string names_of(const Values& values, NameOf name_of, std::string_view last) {
  std::string names;
  const std::size_t n = std::size(values);
  std::size_t i = 0;
  for (const auto& value : values) {
    if (i > 0) names += i + 1 == n ? last : std::string_view(", ");
    names += name_of(value);
    ++i;
  }
  return names;
}

}  // namespace ferry
