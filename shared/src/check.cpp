#include "ferry/check.hpp"

namespace ferry {

void fail_check(const char* file, int line, const char* condition, const std::string& message) {
  throw InvariantError(fmt::format("{}:{}: check failed: {}: {}", file, line, condition, message));
}

}  // namespace ferry
