#pragma once
/// The compute engine of each device: one kernel at a time, in the order streams hand them over.
/// A kernel takes the duration it was issued with (the resource model of compute), longer while
/// the device runs a collective where its profile says so (Note [Contended compute]). The same
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

/// `lanes` engines per device, each one kernel at a time, at a rate its device may lower while
/// it runs (Note [Contended compute]).
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

  /// When the engine is idle, starts its next kernel at `now` at the engine's rate, schedules
  /// its completion and returns it.
  std::optional<OpId> try_start(DeviceId device, std::uint8_t lane, SimTime now,
                                DeviceEventQueue& queue) {
    Engine& e = engine(device, lane);
    if (e.running || e.ready.empty()) return std::nullopt;
    const Kernel k = e.ready.front();
    e.ready.pop_front();
    e.running = k.op;
    e.remaining = static_cast<Wide>(k.duration.ns()) * kFullRate;
    e.since = now;
    if (e.permille == kFullRate) {  // the common case, without a wide division
      queue.schedule(
          now + k.duration,
          DeviceEvent{.kind = done_, .lane = lane, .device = device, .generation = ++e.generation});
    } else {
      schedule_end(e, device, lane, now, queue);
    }
    return k.op;
  }

  /// Runs the engine's kernels at `permille` of their full rate from `now` on: the running
  /// kernel keeps the work it has done and ends later or sooner.
  void set_rate(DeviceId device, std::uint8_t lane, std::int32_t permille, SimTime now,
                DeviceEventQueue& queue) {
    Engine& e = engine(device, lane);
    if (e.permille == permille) return;
    if (e.running) {
      e.remaining -= static_cast<Wide>((now - e.since).ns()) * e.permille;
      if (e.remaining < 0) e.remaining = 0;
      e.since = now;
    }
    e.permille = permille;
    if (e.running) schedule_end(e, device, lane, now, queue);
  }

  /// Whether any of `device`'s engines runs a kernel.
  [[nodiscard]] bool busy(DeviceId device) const {
    for (std::size_t l = 0; l < lanes_; ++l) {
      if (engines_[device.value() * lanes_ + l].running) return true;
    }
    return false;
  }

  /// The engine's running kernel completed (its end event of `generation`): the engine is idle;
  /// returns the kernel. None for an end a change of rate superseded.
  std::optional<OpId> finish(DeviceId device, std::uint8_t lane, std::uint32_t generation) {
    Engine& e = engine(device, lane);
    if (generation != e.generation || !e.running) return std::nullopt;
    const OpId op = *e.running;
    e.running.reset();
    return op;
  }

 private:
  __extension__ using Wide = __int128;
  static constexpr std::int32_t kFullRate = 1000;
  struct Kernel {
    OpId op;
    SimTime duration;
  };
  struct Engine {
    std::deque<Kernel> ready;
    std::optional<OpId> running;
    Wide remaining = 0;  // the running kernel's work left: ns at the full rate x 1000
    SimTime since;       // when `remaining` was settled
    std::int32_t permille = kFullRate;  // the rate kernels run at now
    std::uint32_t generation = 0;       // of the running kernel's end event
  };
  Engine& engine(DeviceId device, std::uint8_t lane) {
    return engines_[device.value() * lanes_ + lane];
  }
  void schedule_end(Engine& e, DeviceId device, std::uint8_t lane, SimTime now,
                    DeviceEventQueue& queue) {
    const auto wait = static_cast<std::int64_t>((e.remaining + e.permille - 1) / e.permille);
    queue.schedule(
        now + SimTime(wait),
        DeviceEvent{.kind = done_, .lane = lane, .device = device, .generation = ++e.generation});
  }

  std::vector<Engine> engines_;
  std::size_t lanes_;
  DeviceEvent::Kind done_;
};

}  // namespace ferry::sim
