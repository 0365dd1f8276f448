#include "ferry/offload/record.hpp"

namespace ferry {

const char* record_state_name(RecordState state) {
  switch (state) {
    case RecordState::Free:
      return "Free";
    case RecordState::Kept:
      return "Kept";
    case RecordState::Offloading:
      return "Offloading";
    case RecordState::Original:
      return "Original";
    case RecordState::OnHost:
      return "OnHost";
    case RecordState::Reloading:
      return "Reloading";
    case RecordState::Reloaded:
      return "Reloaded";
    case RecordState::Returned:
      return "Returned";
    case RecordState::Dropped:
      return "Dropped";
  }
  return "?";
}

}  // namespace ferry
