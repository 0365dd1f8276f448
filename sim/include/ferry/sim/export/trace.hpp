#pragma once
/// The Chrome/Perfetto trace of a simulation, written by an observer of the simulator.

#include <string>
#include <vector>

#include "ferry/sim/engine/observer.hpp"
#include "ferry/sim/engine/simulator.hpp"

namespace ferry::sim {

/// Collects what a simulation does (attach it with Simulator::observe before the run, or feed
/// it a finished run with Simulator::replay) and writes it as Chrome trace-event JSON: a
/// process per device (plus the host), a track per stream and per copy engine, instant marks
/// for event records and hazards, memory counters.
class ChromeTrace final : public SimObserver {
 public:
  void engine_added(EngineId engine, const EngineInfo& info) override;
  void op_finished(OpId op, const OpRecord& record) override;
  void memory_sampled(const MemorySample& sample) override;

  /// The trace JSON; `sim` (the observed simulator) names devices, streams, labels, hazards.
  [[nodiscard]] std::string json(const Simulator& sim) const;

 private:
  std::vector<EngineInfo> engines_;    // by EngineId
  std::vector<OpRecord> ops_;          // by OpId
  std::vector<MemorySample> samples_;  // in the order taken
};

/// The Chrome trace-event JSON of the finished run `sim` (a ChromeTrace fed with
/// Simulator::replay): a process per device (plus the host), a track per stream and per
/// copy engine, instant marks for event records and hazards, memory counters.
[[nodiscard]] std::string chrome_trace(const Simulator& sim);

}  // namespace ferry::sim
