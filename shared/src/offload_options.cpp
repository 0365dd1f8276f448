#include "ferry/offload_options.hpp"

namespace ferry {

const char* policy_name(Policy policy) {
  switch (policy) {
    case Policy::None:
      return "none";
    case Policy::Trl:
      return "trl";
    case Policy::Ferry:
      return "ferry";
  }
  return "?";
}

}  // namespace ferry
