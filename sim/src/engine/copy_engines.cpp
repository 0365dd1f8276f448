#include "ferry/sim/engine/copy_engines.hpp"

#include <algorithm>

namespace ferry::sim {

// Note [Fluid copy engines]
// Copies use a fluid model: a copy in its transfer phase drains its bytes at its engine's
// rate, and when the opposite direction starts or stops moving data both rates change (the
// profile's bidirectional factor). Remaining work is kept exactly, in byte-nanoseconds per
// second (bytes * 1e9), in 128-bit integers, so no rounding accumulates. A re-rate settles
// the progress made since the last one and schedules a new end; the superseded end event
// still fires, and its stale generation makes it a no-op.

namespace {

constexpr std::int64_t kNsPerSecond = 1'000'000'000;

}  // namespace

EngineId CopyEngines::add(EngineInfo info, std::int32_t bidirectional_permille) {
  Engine e;
  e.permille = bidirectional_permille;
  engines_.push_back(std::move(e));
  info_.push_back(std::move(info));
  return EngineId(static_cast<std::uint32_t>(engines_.size() - 1));
}

void CopyEngines::pair(EngineId a, EngineId b) {
  engines_[a.value()].partner = b;
  engines_[b.value()].partner = a;
}

std::optional<EngineId> CopyEngines::peer(DeviceId from, DeviceId to) const {
  auto it = peers_.find({from, to});
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

EngineId CopyEngines::add_peer(DeviceId from, DeviceId to, EngineInfo info) {
  const EngineId id = add(std::move(info), 1000);
  peers_.emplace(std::make_pair(from, to), id);
  return id;
}

std::optional<OpId> CopyEngines::try_start(EngineId id, SimTime now) {
  Engine& e = engines_[id.value()];
  if (e.phase != Phase::Idle || e.ready.empty()) return std::nullopt;
  e.current = e.ready.front();
  e.ready.pop_front();
  if (e.current.latency > SimTime(0)) {
    e.phase = Phase::Latency;
    queue_->schedule(now + e.current.latency, DeviceEvent{.kind = DeviceEvent::Kind::CopyPhaseDone,
                                                          .engine = id,
                                                          .generation = ++e.generation});
  } else {
    begin_transfer(id, now);
  }
  return e.current.op;
}

void CopyEngines::set_rate(Engine& e) const {
  const std::int64_t base = e.current.rate.bytes_per_s();
  const bool contended = e.partner.valid() && engines_[e.partner.value()].phase == Phase::Transfer;
  e.rate = Bandwidth(contended ? std::max<std::int64_t>(
                                     1, base / 1000 * e.permille + base % 1000 * e.permille / 1000)
                               : base);
}

void CopyEngines::schedule_transfer_end(EngineId id, SimTime now) {
  Engine& e = engines_[id.value()];
  const Wide r = e.rate.bytes_per_s();
  const auto wait = static_cast<std::int64_t>((e.remaining + r - 1) / r);
  queue_->schedule(now + SimTime(wait), DeviceEvent{.kind = DeviceEvent::Kind::CopyPhaseDone,
                                                    .engine = id,
                                                    .generation = ++e.generation});
}

void CopyEngines::begin_transfer(EngineId id, SimTime now) {
  Engine& e = engines_[id.value()];
  e.phase = Phase::Transfer;
  e.remaining = static_cast<Wide>(e.current.bytes.count()) * kNsPerSecond;
  e.since = now;
  set_rate(e);
  schedule_transfer_end(id, now);
  if (e.partner.valid()) partner_changed(e.partner, now);
}

// The opposite direction started or stopped moving data: settle progress, re-rate.
void CopyEngines::partner_changed(EngineId id, SimTime now) {
  Engine& e = engines_[id.value()];
  if (e.phase != Phase::Transfer) return;
  e.remaining -= static_cast<Wide>((now - e.since).ns()) * e.rate.bytes_per_s();
  if (e.remaining < 0) e.remaining = 0;
  e.since = now;
  set_rate(e);
  schedule_transfer_end(id, now);
}

std::optional<OpId> CopyEngines::phase_done(EngineId id, std::uint32_t generation, SimTime now) {
  Engine& e = engines_[id.value()];
  if (generation != e.generation) return std::nullopt;  // superseded by a re-rate
  if (e.phase == Phase::Latency) {
    begin_transfer(id, now);
    return std::nullopt;
  }
  e.phase = Phase::Idle;
  if (e.partner.valid()) partner_changed(e.partner, now);
  return e.current.op;
}

}  // namespace ferry::sim
