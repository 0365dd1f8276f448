#pragma once
/// The compute engine of each device: one kernel at a time, in the order streams hand them over.
/// A kernel takes the duration it was issued with (the resource model of compute).

#include <deque>
#include <optional>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/event_queue.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// One compute engine per device.
class ComputeEngines {
 public:
  /// Engines for `devices` devices, all idle.
  explicit ComputeEngines(std::size_t devices) : engines_(devices) {}

  /// Queues kernel `op` on `device`'s engine.
  void enqueue(DeviceId device, OpId op, SimTime duration) {
    engines_[device.value()].ready.push_back(Kernel{op, duration});
  }

  /// When `device`'s engine is idle, starts its next kernel at `now`, schedules its completion
  /// and returns it.
  std::optional<OpId> try_start(DeviceId device, SimTime now, DeviceEventQueue& queue) {
    Engine& e = engines_[device.value()];
    if (e.running || e.ready.empty()) return std::nullopt;
    const Kernel k = e.ready.front();
    e.ready.pop_front();
    e.running = k.op;
    queue.schedule(now + k.duration,
                   DeviceEvent{.kind = DeviceEvent::Kind::KernelDone, .device = device});
    return k.op;
  }

  /// The running kernel of `device` completed: the engine is idle; returns the kernel.
  OpId finish(DeviceId device) {
    Engine& e = engines_[device.value()];
    const OpId op = *e.running;
    e.running.reset();
    return op;
  }

 private:
  struct Kernel {
    OpId op;
    SimTime duration;
  };
  struct Engine {
    std::deque<Kernel> ready;
    std::optional<OpId> running;
  };
  std::vector<Engine> engines_;
};

}  // namespace ferry::sim
