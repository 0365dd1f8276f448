#pragma once
/// The compute engine of each device: one kernel at a time, in the order streams hand them over.
/// A kernel takes the duration it was issued with (the resource model of compute). The same
/// model, with engines of its own, runs each device's collectives, one engine per lane
/// (Note [Collectives]).

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/event_queue.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// `lanes` engines per device, each one kernel at a time.
class ComputeEngines {
 public:
  /// Engines for `devices` devices, `lanes` each, all idle; a finished kernel is announced as
  /// `done`.
  explicit ComputeEngines(std::size_t devices, std::size_t lanes = 1,
                          DeviceEvent::Kind done = DeviceEvent::Kind::KernelDone)
      : engines_(devices * lanes), lanes_(lanes), done_(done) {}

  /// Queues kernel `op` on `device`'s engine `lane`.
  void enqueue(DeviceId device, std::uint8_t lane, OpId op, SimTime duration) {
    engine(device, lane).ready.push_back(Kernel{op, duration});
  }

  /// When the engine is idle, starts its next kernel at `now`, schedules its completion and
  /// returns it.
  std::optional<OpId> try_start(DeviceId device, std::uint8_t lane, SimTime now,
                                DeviceEventQueue& queue) {
    Engine& e = engine(device, lane);
    if (e.running || e.ready.empty()) return std::nullopt;
    const Kernel k = e.ready.front();
    e.ready.pop_front();
    e.running = k.op;
    queue.schedule(now + k.duration, DeviceEvent{.kind = done_, .lane = lane, .device = device});
    return k.op;
  }

  /// The engine's running kernel completed: the engine is idle; returns the kernel.
  OpId finish(DeviceId device, std::uint8_t lane) {
    Engine& e = engine(device, lane);
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
  Engine& engine(DeviceId device, std::uint8_t lane) {
    return engines_[device.value() * lanes_ + lane];
  }

  std::vector<Engine> engines_;
  std::size_t lanes_;
  DeviceEvent::Kind done_;
};

}  // namespace ferry::sim
