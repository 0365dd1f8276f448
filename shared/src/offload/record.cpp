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

// The table of Note [Record lifecycle].
bool record_transition_allowed(RecordState from, RecordState to) {
  using S = RecordState;
  switch (from) {
    case S::Free:
      return to == S::Kept || to == S::Offloading;
    case S::Kept:
      return to == S::Dropped;
    case S::Offloading:
      return to == S::OnHost || to == S::Original || to == S::Dropped;
    case S::Original:
      return to == S::Dropped;
    case S::OnHost:
      return to == S::Reloading || to == S::Returned || to == S::Dropped;
    case S::Reloading:
      return to == S::Reloaded || to == S::OnHost;
    case S::Reloaded:
      return to == S::OnHost;
    case S::Returned:
      return to == S::Dropped;
    case S::Dropped:
      return to == S::Free;
  }
  return false;
}

}  // namespace ferry
