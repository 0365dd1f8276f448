#pragma once
/// Instrumentation hooks: what a trace writer or a metrics collector hears while the simulator
/// runs, instead of scanning its op log afterwards (taskflow's observer interface).

#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/records.hpp"
#include "ferry/sim/memory/allocator_event.hpp"

namespace ferry::sim {

// Note [Observers]
// An observer hears each op once, when its record is final: a host call when the host goes
// on, stream work when it completes on its engine (a wait when its event has completed). The
// order of those calls follows simulated time, not op order; an observer that writes op order
// files by OpId. Engines are announced before the first op that uses them; memory samples in
// the order they are taken. Observers only listen: they never call back into the simulator
// while it runs, so attaching one changes no result. Allocator actions are heard as the
// allocator takes them, in its order, inside the call that caused them (Note [Allocator
// tracking]); Simulator::replay has none to feed, since the simulator keeps none unless
// SimOptions::record_allocator asks it to.

/// Listens to a running Simulator. Every hook has an empty default.
class SimObserver {
 public:
  SimObserver() = default;
  SimObserver(const SimObserver&) = default;
  SimObserver& operator=(const SimObserver&) = default;
  SimObserver(SimObserver&&) = default;
  SimObserver& operator=(SimObserver&&) = default;
  virtual ~SimObserver() = default;

  /// A copy engine (or peer link) came into use.
  virtual void engine_added(EngineId /*engine*/, const EngineInfo& /*info*/) {}
  /// Op `op`'s record is final. See Note [Observers].
  virtual void op_finished(OpId /*op*/, const OpRecord& /*record*/) {}
  /// Device or pinned host memory in use changed.
  virtual void memory_sampled(const MemorySample& /*sample*/) {}
  /// `device`'s caching allocator took `event`, stamped with the host time and the call.
  virtual void allocator_action(DeviceId /*device*/, const AllocatorEvent& /*event*/) {}
};

/// The observers attached to one simulator, in attachment order; each hook goes to all.
class ObserverList {
 public:
  void attach(SimObserver& observer) { observers_.push_back(&observer); }
  [[nodiscard]] bool empty() const { return observers_.empty(); }

  void engine_added(EngineId engine, const EngineInfo& info) const {
    for (SimObserver* o : observers_) o->engine_added(engine, info);
  }
  void op_finished(OpId op, const OpRecord& record) const {
    for (SimObserver* o : observers_) o->op_finished(op, record);
  }
  void memory_sampled(const MemorySample& sample) const {
    for (SimObserver* o : observers_) o->memory_sampled(sample);
  }
  void allocator_action(DeviceId device, const AllocatorEvent& event) const {
    for (SimObserver* o : observers_) o->allocator_action(device, event);
  }

 private:
  std::vector<SimObserver*> observers_;  // not owned
};

}  // namespace ferry::sim
