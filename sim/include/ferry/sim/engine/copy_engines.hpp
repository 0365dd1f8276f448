#pragma once
/// The copy engines (DMA engines and peer links) and how long a copy takes on them: a latency,
/// then a fluid transfer whose rate drops while the opposite direction also moves data. See
/// Note [Fluid copy engines].

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/engine/event_queue.hpp"
#include "ferry/sim/engine/records.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// One copy as an engine sees it.
struct CopyJob {
  OpId op;
  Bytes bytes;
  Bandwidth rate;  ///< uncontended
  SimTime latency;
};

/// Every copy engine of the machine; each runs one copy at a time, in the order streams hand
/// them over.
class CopyEngines {
 public:
  explicit CopyEngines(DeviceEventQueue& queue) : queue_(&queue) {}

  /// A new idle engine. `bidirectional_permille`: the share of its rate left while its
  /// partner transfers.
  EngineId add(EngineInfo info, std::int32_t bidirectional_permille);
  /// Makes `a` and `b` the two directions of one link: each slows while the other transfers.
  void pair(EngineId a, EngineId b);
  /// The engine of the peer link `from` -> `to`, if it exists yet.
  [[nodiscard]] std::optional<EngineId> peer(DeviceId from, DeviceId to) const;
  /// Adds the engine of the peer link `from` -> `to`.
  EngineId add_peer(DeviceId from, DeviceId to, EngineInfo info);

  /// Queues `job` on `engine`.
  void enqueue(EngineId engine, CopyJob job) { engines_[engine.value()].ready.push_back(job); }
  /// When `engine` is idle, starts its next copy at `now` and returns it.
  std::optional<OpId> try_start(EngineId engine, SimTime now);
  /// A phase timer of `engine` fired at `now`; returns the copy when its transfer completed.
  std::optional<OpId> phase_done(EngineId engine, std::uint32_t generation, SimTime now);

  /// The engines in creation order, EngineId order.
  [[nodiscard]] const std::vector<EngineInfo>& info() const { return info_; }

 private:
  enum class Phase : std::uint8_t { Idle, Latency, Transfer };
  __extension__ using Wide = __int128;

  struct Engine {
    std::deque<CopyJob> ready;
    CopyJob current;
    Phase phase = Phase::Idle;
    Wide remaining = 0;  // bytes * 1e9 still to move
    Bandwidth rate;      // now, with contention
    SimTime since;       // when `remaining` was last settled
    std::uint32_t generation = 0;
    EngineId partner;
    std::int32_t permille = 1000;
  };

  void set_rate(Engine& e) const;
  void schedule_transfer_end(EngineId id, SimTime now);
  void begin_transfer(EngineId id, SimTime now);
  void partner_changed(EngineId id, SimTime now);

  DeviceEventQueue* queue_;
  std::vector<Engine> engines_;
  std::vector<EngineInfo> info_;
  std::map<std::pair<DeviceId, DeviceId>, EngineId> peers_;
};

}  // namespace ferry::sim
