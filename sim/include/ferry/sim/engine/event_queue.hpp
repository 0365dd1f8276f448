#pragma once
/// The discrete-event queue: events ordered by (time, sequence number). See Note [Simulated time].

#include <cstdint>
#include <queue>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/records.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// A priority queue of `Payload`s by simulated time; events at equal times come out in the
/// order they were scheduled (simcpp20's (time, id) order), never by address.
template <class Payload>
class EventQueue {
 public:
  /// An event taken from the queue.
  struct Entry {
    SimTime time;
    std::uint64_t seq = 0;
    Payload payload;
  };

  /// Schedules `payload` at `time`, after everything already scheduled at that time.
  void schedule(SimTime time, Payload payload) { heap_.push(Entry{time, seq_++, payload}); }

  [[nodiscard]] bool empty() const { return heap_.empty(); }
  /// True when an event is due at or before `time`.
  [[nodiscard]] bool due(SimTime time) const { return !heap_.empty() && heap_.top().time <= time; }

  /// Removes and returns the earliest event; the queue must not be empty (see `due`, `empty`).
  Entry pop() {
    Entry e = heap_.top();
    heap_.pop();
    return e;
  }

 private:
  struct Later {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.time != b.time ? a.time > b.time : a.seq > b.seq;
    }
  };
  std::priority_queue<Entry, std::vector<Entry>, Later> heap_;
  std::uint64_t seq_ = 0;
};

/// What wakes the device side: a kernel finishing on a device's compute engine, or a phase
/// (latency or transfer) of a copy engine ending.
/// 16 bytes, the lane beside the kind: the queue's heap moves these on every event.
struct DeviceEvent {
  enum class Kind : std::uint8_t { KernelDone, CopyPhaseDone, CollectiveDone };
  Kind kind = Kind::KernelDone;
  std::uint8_t lane = 0;         ///< CollectiveDone: the device's engine (CollectiveLane)
  DeviceId device{};             ///< KernelDone, CollectiveDone
  EngineId engine{};             ///< CopyPhaseDone
  std::uint32_t generation = 0;  ///< stale when the engine re-rated since it was scheduled
};
static_assert(sizeof(DeviceEvent) == 16);

/// The simulator's queue of device events.
using DeviceEventQueue = EventQueue<DeviceEvent>;

}  // namespace ferry::sim
