#pragma once
/// Memory sampling: after each call that changes an allocator, the memory in use, as a
/// timeline for traces and counters.

#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/observer.hpp"
#include "ferry/sim/engine/records.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/sim/memory/host_allocator.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// The timeline of memory in use, per device and for pinned host memory.
class MemorySampling {
 public:
  /// Samples `device`'s allocator at `time` and tells `observers`.
  void device(SimTime time, DeviceId device, const CachingAllocator& allocator,
              const ObserverList& observers) {
    const AllocatorStats& st = allocator.stats();
    take(MemorySample{time, device, st.allocated, st.reserved}, observers);
  }
  /// Samples the pinned host allocator at `time` and tells `observers`.
  void pinned(SimTime time, const PinnedHostAllocator& allocator, const ObserverList& observers) {
    const HostAllocatorStats& st = allocator.stats();
    take(MemorySample{time, DeviceId(), st.allocated, st.reserved}, observers);
  }
  /// Every sample so far, in the order taken.
  [[nodiscard]] const std::vector<MemorySample>& samples() const { return samples_; }

 private:
  void take(const MemorySample& sample, const ObserverList& observers) {
    samples_.push_back(sample);
    observers.memory_sampled(sample);
  }
  std::vector<MemorySample> samples_;
};

}  // namespace ferry::sim
