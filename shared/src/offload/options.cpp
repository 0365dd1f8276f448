#include "ferry/offload/options.hpp"

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

void check_offload_options(const OffloadOptions& options) {
  if (options.policy == Policy::Trl && options.use_streams && options.trl_stash_count < 1) {
    throw OffloadError("max_fwd_stash_size should be at least 1");
  }
}

}  // namespace ferry
