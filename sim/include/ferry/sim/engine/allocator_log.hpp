#pragma once
/// Every caching allocator action of a run, kept per device by an observer that the simulator
/// attaches to itself when SimOptions::record_allocator asks for it (memory snapshots).

#include <cstddef>
#include <span>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/observer.hpp"
#include "ferry/sim/memory/allocator_event.hpp"

namespace ferry::sim {

/// The allocator actions of each device in the order the allocator took them (Note
/// [Allocator tracking]).
class AllocatorLog final : public SimObserver {
 public:
  explicit AllocatorLog(std::size_t devices) : events_(devices) {}

  void allocator_action(DeviceId device, const AllocatorEvent& event) override {
    events_.at(device.value()).push_back(event);
  }

  /// The actions of `device`'s caching allocator so far.
  [[nodiscard]] std::span<const AllocatorEvent> events(DeviceId device) const {
    return events_.at(device.value());
  }

 private:
  std::vector<std::vector<AllocatorEvent>> events_;  // by device
};

}  // namespace ferry::sim
