#pragma once
/// The offload scheduler's bookkeeping: one record per storage on its way off the device and
/// back, with an explicit lifecycle, and the table from packed ids to records.

#include <cstdint>
#include <deque>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/ids.hpp"
#include "ferry/units.hpp"

namespace ferry {

/// Index of a record in its table.
using RecordId = StrongId<struct RecordTag>;

// Note [Record lifecycle]
// A record's state says which copies of its bytes the scheduler holds a reference to:
//
//   state       device reference             host copy
//   Kept        the original                 -
//   Offloading  the original (in a window)   yes (D2H issued, d2h_done recorded)
//   Original    the original (trl stash)     - (freed when trl's unpack took it)
//   OnHost      -                            yes
//   Reloading   a reloaded copy              yes (compute has not waited for h2d_done yet)
//   Reloaded    a reloaded copy              yes (compute waited)
//   Returned    a reloaded copy (trl)        - (freed when trl's unpack took it)
//   Dropped     -                            -
//   Free        (slot unused)
//
// Transitions, each made by exactly one place in a policy:
//
//   Free -> Kept | Offloading                          pack
//   Kept -> Dropped                                    last id released; trl: unpacked
//   Offloading -> OnHost                               original let go: the window retires
//                                                      it, backward consumed it (ferry), the
//                                                      stash retires it (trl)
//   Offloading -> Original                             trl: unpacked from the forward stash
//   Offloading -> Dropped                              trl today: a step left it, and entering
//                                                      the context clears it
//   Original -> Dropped                                trl: the stash retires it
//   OnHost -> Reloading                                reload issued (prefetch or unpack)
//   Reloading -> Reloaded                              unpack: compute waits for the copy
//   Reloading | Reloaded -> OnHost                     ferry: last use done, or backward ends
//   OnHost -> Returned                                 trl: unpack reloads, frees the host copy
//   Returned -> Dropped                                trl: next node, escape, or drain
//   OnHost -> Dropped                                  ferry: last id released (a device
//                                                      reference is let go first, as above)
//   Dropped -> Free                                    no queue names the record any more
//
// Reloading lasts from a prefetch to the first unpack: an on-demand reload is waited for in
// the same unpack that issued it. So a record in Reloading is exactly one whose bytes count
// against the prefetch budget.

enum class RecordState : std::uint8_t {
  Free,
  Kept,
  Offloading,
  Original,
  OnHost,
  Reloading,
  Reloaded,
  Returned,
  Dropped,
};

/// The state's name, for messages.
[[nodiscard]] const char* record_state_name(RecordState state);
/// Whether Note [Record lifecycle] allows `from` -> `to` (its table of transitions).
[[nodiscard]] constexpr bool record_transition_allowed(RecordState from, RecordState to) {
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

/// The scheduler holds a reference to a device buffer in this state.
[[nodiscard]] constexpr bool holds_device(RecordState s) {
  return s == RecordState::Kept || s == RecordState::Offloading || s == RecordState::Original ||
         s == RecordState::Reloading || s == RecordState::Reloaded || s == RecordState::Returned;
}
/// The scheduler holds the host copy in this state.
[[nodiscard]] constexpr bool holds_host(RecordState s) {
  return s == RecordState::Offloading || s == RecordState::OnHost || s == RecordState::Reloading ||
         s == RecordState::Reloaded;
}

/// One storage on its way off the device and back (trl: one tensor).
template <class Buffer, class Event>
struct Record {
  RecordState state = RecordState::Free;
  Buffer device{};  ///< the original or the reloaded copy; see holds_device()
  Buffer host{};    ///< see holds_host()
  Event d2h_done{};
  Event h2d_done{};  ///< the last reload's copy; meaningful once host_read
  Bytes bytes;       ///< bytes moved
  std::uint64_t storage = 0;
  long snapshot = 0;     ///< use count right after the reload (escape check)
  std::int32_t ids = 0;  ///< live packed ids sharing this record
  std::int32_t unpacks_left = 0;
  bool host_read = false;  ///< a reload has read the host copy

  /// Moves to `next`, which Note [Record lifecycle] must allow.
  void move_to(RecordState next) {
    FERRY_CHECK(record_transition_allowed(state, next), "offload record: {} -> {}",
                record_state_name(state), record_state_name(next));
    state = next;
  }
};

/// The records of one scheduler. A record no id refers to any more (retired) may still be
/// named by a policy's queues, so its slot is reused only after reclaim() is told it is not.
template <class Buffer, class Event>
class RecordTable {
 public:
  using Rec = Record<Buffer, Event>;

  /// Stores `rec` (state Kept or Offloading) in a free slot.
  RecordId add(Rec rec) {
    FERRY_CHECK(rec.state == RecordState::Kept || rec.state == RecordState::Offloading,
                "a new offload record starts Kept or Offloading, not {}",
                record_state_name(rec.state));
    if (!free_.empty()) {
      const RecordId r = free_.back();
      free_.pop_back();
      records_[r.value()] = rec;
      return r;
    }
    records_.push_back(rec);
    return RecordId(static_cast<std::uint32_t>(records_.size() - 1));
  }

  Rec& operator[](RecordId r) { return records_[r.value()]; }
  const Rec& operator[](RecordId r) const { return records_[r.value()]; }
  [[nodiscard]] std::size_t size() const { return records_.size(); }
  /// Every slot, free ones included (their state says so).
  std::vector<Rec>& all() { return records_; }

  /// No id refers to `r` any more; its slot may be reused once reclaim() allows it.
  void retire(RecordId r) { retired_.push_back(r); }

  /// Frees the slots of retired records that are Dropped and not `named(r)` by a queue.
  template <class Named>
  void reclaim(Named named) {
    std::erase_if(retired_, [&](RecordId r) {
      if (records_[r.value()].state != RecordState::Dropped || named(r)) return false;
      records_[r.value()].move_to(RecordState::Free);
      free_.push_back(r);
      return true;
    });
  }

 private:
  std::vector<Rec> records_;
  std::vector<RecordId> free_;
  std::vector<RecordId> retired_;
};

/// Packed ids and the records they name. Ids grow monotonically (the reference retires its
/// stash by id distance); the table keeps only the span from the oldest id still tracked.
class IdTable {
 public:
  /// A new id naming `r`, for a tensor starting at `offset` in its storage.
  TensorId add(RecordId r, Bytes offset) {
    const TensorId id = next();
    records_.push_back(r);
    offsets_.push_back(offset);
    ++tracked_;
    return id;
  }
  /// The oldest id the table may still track (ids below it are forgotten).
  [[nodiscard]] TensorId oldest() const { return TensorId(base_); }
  /// The id that add() will return next.
  [[nodiscard]] TensorId next() const {
    return TensorId(static_cast<std::uint32_t>(base_ + records_.size()));
  }
  /// The record `id` names; invalid when the id is unknown or forgotten.
  [[nodiscard]] RecordId find(TensorId id) const {
    if (!id.valid() || id.value() < base_ || slot(id) >= records_.size()) return RecordId();
    return records_[slot(id)];
  }
  /// Where the tensor behind a tracked `id` starts in its storage.
  [[nodiscard]] Bytes offset(TensorId id) const { return offsets_[slot(id)]; }
  /// Stops tracking a tracked `id`.
  void forget(TensorId id) {
    records_[slot(id)] = RecordId();
    --tracked_;
    while (!records_.empty() && !records_.front().valid()) {
      records_.pop_front();
      offsets_.pop_front();
      ++base_;
    }
  }
  /// Ids added and not forgotten.
  [[nodiscard]] std::size_t tracked() const { return tracked_; }
  /// Forgets every id; later ids still never repeat an earlier one.
  void clear() {
    base_ += static_cast<std::uint32_t>(records_.size());
    records_.clear();
    offsets_.clear();
    tracked_ = 0;
  }

 private:
  [[nodiscard]] std::size_t slot(TensorId id) const { return id.value() - base_; }

  std::deque<RecordId> records_;  // from base_ on
  std::deque<Bytes> offsets_;
  std::uint32_t base_ = 0;
  std::size_t tracked_ = 0;
};

}  // namespace ferry
