#pragma once
/// FERRY_CHECK: the one way broken invariants are reported. Stays on in release builds.

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace ferry {

/// Thrown when an internal invariant does not hold: a bug in ferry or a misuse of its API.
class InvariantError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] void fail_check(const char* file, int line, const char* condition,
                             const std::string& message);

}  // namespace ferry

/// Throws ferry::InvariantError naming the place when `cond` is false. The message is
/// fmt-formatted.
#define FERRY_CHECK(cond, ...)                                                    \
  do {                                                                            \
    if (!(cond)) [[unlikely]] {                                                   \
      ::ferry::fail_check(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
    }                                                                             \
  } while (false)
