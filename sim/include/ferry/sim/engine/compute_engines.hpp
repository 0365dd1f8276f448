#pragma once
/// The compute engine of each device: one kernel at a time, in the order streams hand them over.
/// A kernel takes the duration it was issued with (the resource model of compute). The same
/// model, with its own engines, runs each device's collectives (Note [Collectives]).

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
  /// Engines for `devices` devices, all idle; a finished kernel is announced as `done`.
  explicit ComputeEngines(std::size_t devices,
                          DeviceEvent::Kind done = DeviceEvent::Kind::KernelDone)
      : engines_(devices), done_(done) {}

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
    queue.schedule(now + k.duration, DeviceEvent{.kind = done_, .device = device});
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
  DeviceEvent::Kind done_;
};

}  // namespace ferry::sim
