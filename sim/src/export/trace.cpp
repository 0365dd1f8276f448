#include <fmt/format.h>

#include "ferry/sim/export/trace.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim {

namespace {

// Trace-event timestamps are microseconds; print integer nanoseconds exactly as "us.nnn".
std::string micros(SimTime t) { return fmt::format("{}.{:03}", t.ns() / 1000, t.ns() % 1000); }

constexpr int kHostPid = 0;
constexpr int kEngineTidBase = 1000;

int device_pid(DeviceId d) { return static_cast<int>(d.value()) + 1; }

class TraceWriter {
 public:
  void event(std::string_view body) {
    out_ += first_ ? "\n" : ",\n";
    first_ = false;
    out_ += body;
  }
  std::string finish() { return "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[" + out_ + "\n]}\n"; }

 private:
  std::string out_;
  bool first_ = true;
};

void name_track(TraceWriter& w, int pid, int tid, std::string_view name, int sort) {
  w.event(fmt::format(R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":{}}}}})",
                      pid, tid, json_quote(name)));
  w.event(fmt::format(
      R"({{"ph":"M","name":"thread_sort_index","pid":{},"tid":{},"args":{{"sort_index":{}}}}})",
      pid, tid, sort));
}

}  // namespace

void ChromeTrace::engine_added(EngineId engine, const EngineInfo& info) {
  if (engine.value() >= engines_.size()) engines_.resize(engine.value() + 1);
  engines_[engine.value()] = info;
}

void ChromeTrace::op_finished(OpId op, const OpRecord& record) {
  if (op.value() >= ops_.size()) ops_.resize(op.value() + 1);
  ops_[op.value()] = record;
}

void ChromeTrace::memory_sampled(const MemorySample& sample) { samples_.push_back(sample); }

std::string ChromeTrace::json(const Simulator& sim) const {
  TraceWriter w;
  w.event(fmt::format(R"({{"ph":"M","name":"process_name","pid":{},"args":{{"name":"host"}}}})",
                      kHostPid));
  name_track(w, kHostPid, 0, "host thread", 0);
  for (std::size_t d = 0; d < sim.device_count(); ++d) {
    const DeviceId id(static_cast<std::uint32_t>(d));
    w.event(fmt::format(R"({{"ph":"M","name":"process_name","pid":{},"args":{{"name":{}}}}})",
                        device_pid(id), json_quote(sim.device_name(id))));
  }
  for (std::size_t s = 0; s < sim.stream_count(); ++s) {
    const StreamId id(static_cast<std::uint32_t>(s));
    name_track(w, device_pid(sim.stream_device(id)), static_cast<int>(s) + 1,
               "stream " + sim.stream_name(id), static_cast<int>(s) + 1);
  }
  for (std::size_t e = 0; e < engines_.size(); ++e) {
    const EngineInfo& info = engines_[e];
    name_track(w, device_pid(info.device), kEngineTidBase + static_cast<int>(e),
               "engine " + info.name, kEngineTidBase + static_cast<int>(e));
  }

  const auto& ops = ops_;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const OpRecord& r = ops[i];
    const std::string name =
        r.label != 0 ? std::string(sim.label(r.label)) : std::string(op_kind_name(r.kind));
    const std::string args = fmt::format(R"({{"op":{},"kind":"{}"{}}})", i, op_kind_name(r.kind),
                                         r.kind == OpKind::Copy || r.kind == OpKind::Alloc
                                             ? fmt::format(R"(,"bytes":{})", r.bytes.count())
                                             : std::string());
    // Stream work refused before it reached a stream (it named a buffer with no memory) has
    // no stream: it is drawn on the host's track like a host call.
    if ((r.kind == OpKind::Kernel || r.kind == OpKind::Copy) && r.stream.valid()) {
      auto slice = [&](int pid, int tid) {
        return fmt::format(
            R"({{"ph":"X","name":{},"cat":"{}","pid":{},"tid":{},"ts":{},"dur":{},"args":{}}})",
            json_quote(name), op_kind_name(r.kind), pid, tid, micros(r.start),
            micros(r.end - r.start), args);
      };
      w.event(
          slice(device_pid(sim.stream_device(r.stream)), static_cast<int>(r.stream.value()) + 1));
      if (r.kind == OpKind::Copy) {
        const EngineInfo& engine = engines_[r.engine.value()];
        w.event(
            slice(device_pid(engine.device), kEngineTidBase + static_cast<int>(r.engine.value())));
      }
    } else if ((r.kind == OpKind::Record || r.kind == OpKind::Wait) && r.stream.valid()) {
      w.event(fmt::format(
          R"({{"ph":"i","s":"t","name":{},"cat":"{}","pid":{},"tid":{},"ts":{},"args":{}}})",
          json_quote(name), op_kind_name(r.kind), device_pid(sim.stream_device(r.stream)),
          r.stream.value() + 1, micros(r.kind == OpKind::Wait ? r.end : r.issued), args));
    } else {
      w.event(fmt::format(
          R"({{"ph":"X","name":{},"cat":"host","pid":{},"tid":0,"ts":{},"dur":{},"args":{}}})",
          json_quote(name), kHostPid, micros(r.issued), micros(r.end - r.issued), args));
    }
  }

  for (const Hazard& h : sim.hazards()) {
    const OpRecord& r = ops.at(h.second.value());
    w.event(fmt::format(
        R"({{"ph":"i","s":"g","name":"hazard: op {} vs op {}","cat":"hazard","pid":{},"tid":0,"ts":{}}})",
        h.first.valid() ? static_cast<std::int64_t>(h.first.value()) : -1, h.second.value(),
        kHostPid, micros(r.start)));
  }

  for (const MemorySample& m : samples_) {
    const int pid = m.device.valid() ? device_pid(m.device) : kHostPid;
    const char* what = m.device.valid() ? "device memory" : "pinned host memory";
    w.event(fmt::format(
        R"({{"ph":"C","name":"{}","pid":{},"ts":{},"args":{{"allocated":{},"reserved":{}}}}})",
        what, pid, micros(m.time), m.allocated.count(), m.reserved.count()));
  }
  return w.finish();
}

std::string chrome_trace(const Simulator& sim) {
  ChromeTrace trace;
  sim.replay(trace);
  return trace.json(sim);
}

}  // namespace ferry::sim
