#include "ferry/failure.hpp"

namespace ferry {

const char* failure_kind_name(FailureKind kind) {
  switch (kind) {
    case FailureKind::OutOfMemory:
      return "out of memory";
    case FailureKind::Misuse:
      return "misuse";
    case FailureKind::Infeasible:
      return "infeasible";
  }
  return "?";
}

}  // namespace ferry
