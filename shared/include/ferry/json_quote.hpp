#pragma once
/// JSON string literals for the writers of ferry's documents (programs, probe reports).

#include <string>
#include <string_view>

namespace ferry {

/// `text` as a JSON string literal: quotes, backslashes and control characters escaped, other
/// bytes as they are (callers pass UTF-8 or ASCII).
[[nodiscard]] std::string json_quote(std::string_view text);

}  // namespace ferry
