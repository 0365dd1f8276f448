#include "ferry/sim/report/check_report.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <map>
#include <utility>
#include <vector>

#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim {

namespace {

using Json = nlohmann::ordered_json;

const char* kind_name(HazardKind kind) {
  switch (kind) {
    case HazardKind::Race:
      return "race";
    case HazardKind::Reuse:
      return "reuse";
    case HazardKind::HostBeforeCopy:
      return "host-before-copy";
    case HazardKind::UseAfterFree:
      return "use-after-free";
    case HazardKind::DoubleFree:
      return "double-free";
    case HazardKind::UseBeforeAlloc:
      return "use-before-alloc";
    case HazardKind::LatentReuse:
      return "latent-reuse";
  }
  return "?";
}

const char* conflict_name(Conflict conflict) {
  switch (conflict) {
    case Conflict::None:
      return "none";
    case Conflict::ReadAfterWrite:
      return "read-after-write";
    case Conflict::WriteAfterRead:
      return "write-after-read";
    case Conflict::WriteAfterWrite:
      return "write-after-write";
  }
  return "?";
}

// Stream work that ran. A kernel or copy refused before it reached a stream (it named a
// buffer with no memory) has no stream and is described as a host call.
bool is_stream_work(const OpRecord& r) {
  return (r.kind == OpKind::Kernel || r.kind == OpKind::Copy || r.kind == OpKind::Wait) &&
         r.stream.valid();
}

std::string space_name(const Simulator& sim, SpaceIndex space) {
  return space < sim.device_count() ? sim.device_name(DeviceId(space)) : std::string("host");
}

std::string buffer_name(const Simulator& sim, BufferId id) {
  if (!id.valid()) return "?";
  return std::string(sim.label(sim.buffers()[id.value()].label));
}

// "op 5 copy "reload" on stream h2d (gpu0), 10.000 us .. 29.000 us"
std::string describe_op(const Simulator& sim, OpId id) {
  if (!id.valid()) return "(none)";
  const OpRecord& r = sim.ops()[id.value()];
  std::string out = fmt::format("op {} {}", id.value(), op_kind_name(r.kind));
  if (r.label != 0) out += fmt::format(" {}", json_quote(sim.label(r.label)));
  if (is_stream_work(r)) {
    out += fmt::format(" on stream {} ({}), {} .. {}", sim.stream_name(r.stream),
                       sim.device_name(sim.stream_device(r.stream)), format_time(r.start),
                       format_time(r.end));
  } else {
    out += fmt::format(" on the host at {}", format_time(r.issued));
  }
  return out;
}

std::string hint(const Simulator& sim, const Hazard& h) {
  const auto& ops = sim.ops();
  switch (h.kind) {
    case HazardKind::Race: {
      const OpRecord& a = ops[h.first.value()];
      const OpRecord& b = ops[h.second.value()];
      if (is_stream_work(a) && is_stream_work(b)) {
        return fmt::format(
            "record an event on stream {} after op {} and make stream {} wait "
            "for it before op {}",
            sim.stream_name(a.stream), h.first.value(), sim.stream_name(b.stream),
            h.second.value());
      }
      if (is_stream_work(a)) {
        return fmt::format(
            "synchronize with stream {} (or an event recorded after op {}) "
            "before op {}",
            sim.stream_name(a.stream), h.first.value(), h.second.value());
      }
      return "order the two accesses";
    }
    case HazardKind::Reuse: {
      const BufferInfo& old = sim.buffers()[h.first_buffer.value()];
      const OpRecord& a = ops[h.first.value()];
      std::string who = is_stream_work(a) ? fmt::format("stream {}", sim.stream_name(a.stream))
                                          : std::string("the host");
      return fmt::format(
          "buffer {} was freed by op {} while {} could still use it: call "
          "record_stream for that stream before the free, or order the free "
          "after that work",
          json_quote(sim.label(old.label)), old.freed_by.value(), who);
    }
    case HazardKind::HostBeforeCopy:
      return fmt::format(
          "synchronize on an event recorded after op {} (or on its stream) "
          "before the host touches the buffer",
          h.first.value());
    case HazardKind::UseAfterFree:
      return fmt::format("the buffer was freed by op {}; free it after its last use",
                         h.first.value());
    case HazardKind::DoubleFree:
      return fmt::format("the buffer was already freed by op {}", h.first.value());
    case HazardKind::UseBeforeAlloc:
      return "the buffer holds no memory here: alloc it first";
    case HazardKind::LatentReuse: {
      const BufferInfo& b = sim.buffers()[h.first_buffer.value()];
      const OpRecord& a = ops[h.first.value()];
      const std::string name = json_quote(sim.label(b.label));
      const std::string used = fmt::format(
          "op {} on stream {} may still {} it", h.first.value(), sim.stream_name(a.stream),
          h.conflict == Conflict::WriteAfterRead ? "read" : "write");
      if (b.kind == MemoryKind::Device) {
        const StreamId owner = ops[b.allocated_by.value()].stream;
        return fmt::format(
            "buffer {} is freed by op {} while {}, and the allocator may hand these bytes to the "
            "next allocation on stream {} at once: call record_stream({}, {}) before the free, "
            "or record an event on stream {} after op {} and make stream {} wait for it before "
            "the free",
            name, h.second.value(), used, sim.stream_name(owner), name, sim.stream_name(a.stream),
            sim.stream_name(a.stream), h.first.value(), sim.stream_name(owner));
      }
      return fmt::format(
          "pinned buffer {} is freed by op {} while {}, and the pool may hand these bytes to the "
          "host's next request at once: call record_stream({}, {}) before the free, or "
          "synchronize the host with an event recorded on stream {} after op {} before the free",
          name, h.second.value(), used, name, sim.stream_name(a.stream), sim.stream_name(a.stream),
          h.first.value());
    }
  }
  return "";
}

struct PeakMemory {
  Bytes allocated;
  Bytes reserved;
  Bytes small_reserved;
  Bytes large_reserved;
  std::int64_t segment_allocs = 0;
  std::int64_t deferred_frees = 0;
  std::int64_t ooms = 0;
};

PeakMemory device_peaks(const Simulator& sim, DeviceId d) {
  const AllocatorStats& st = sim.device_allocator(d).stats();
  return PeakMemory{st.allocated_peak,
                    st.reserved_peak,
                    st.pool_reserved_peak[static_cast<std::size_t>(PoolKind::Small)],
                    st.pool_reserved_peak[static_cast<std::size_t>(PoolKind::Large)],
                    st.segment_allocs,
                    st.deferred_frees,
                    st.ooms};
}

std::string hex(Bytes address) { return fmt::format("{:#x}", address.count()); }

// A label with every run of digits replaced by '#': "offload layer 12" -> "offload layer #".
std::string label_shape(std::string_view label) {
  std::string out;
  bool in_digits = false;
  for (const char c : label) {
    const bool digit = c >= '0' && c <= '9';
    if (!digit) out += c;
    if (digit && !in_digits) out += '#';
    in_digits = digit;
  }
  return out;
}

// What makes two reports the same defect repeated (in every layer, or every step): the same
// kind and conflict, the same streams, and op and buffer labels equal but for their numbers.
std::string defect_key(const Simulator& sim, const Hazard& h) {
  auto op_part = [&](OpId id) -> std::string {
    if (!id.valid()) return "-";
    const OpRecord& r = sim.ops()[id.value()];
    const std::string stream = is_stream_work(r) ? sim.stream_name(r.stream) : "host";
    return fmt::format("{}|{}|{}", op_kind_name(r.kind), stream, label_shape(sim.label(r.label)));
  };
  auto buffer_part = [&](BufferId id) -> std::string {
    return id.valid() ? label_shape(buffer_name(sim, id)) : "-";
  };
  return fmt::format("{}|{}|{}|{}|{}|{}|{}", static_cast<int>(h.kind), static_cast<int>(h.conflict),
                     h.space, op_part(h.first), op_part(h.second), buffer_part(h.first_buffer),
                     buffer_part(h.second_buffer));
}

Json op_json(const Simulator& sim, OpId id, BufferId buffer) {
  Json j = Json::object();
  if (!id.valid()) return j;
  const OpRecord& r = sim.ops()[id.value()];
  j["op"] = id.value();
  j["kind"] = op_kind_name(r.kind);
  j["label"] = std::string(sim.label(r.label));
  if (is_stream_work(r)) {
    j["stream"] = sim.stream_name(r.stream);
    j["device"] = sim.device_name(sim.stream_device(r.stream));
  } else {
    j["stream"] = "host";
    j["device"] = "host";
  }
  j["start_ns"] = r.start.ns();
  j["end_ns"] = r.end.ns();
  j["buffer"] = buffer.valid() ? buffer_name(sim, buffer) : std::string();
  return j;
}

}  // namespace

namespace {

// One entry per defect, in order of its first report (see defect_key): (first report, count).
std::vector<std::pair<std::size_t, std::size_t>> defect_groups(const Simulator& sim) {
  const auto& hazards = sim.hazards();
  std::vector<std::pair<std::size_t, std::size_t>> groups;
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < hazards.size(); ++i) {
    const auto [it, fresh] = index.emplace(defect_key(sim, hazards[i]), groups.size());
    if (fresh) {
      groups.emplace_back(i, 1);
    } else {
      ++groups[it->second].second;
    }
  }
  return groups;
}

// The hazards section of the summary: the count, then each defect, up to 50.
std::string hazards_text(const Simulator& sim) {
  const auto& hazards = sim.hazards();
  const auto groups = defect_groups(sim);
  std::string out = fmt::format("hazards: {}", hazards.size());
  if (groups.size() < hazards.size()) out += fmt::format(" ({} distinct)", groups.size());
  out += '\n';
  constexpr std::size_t kShown = 50;
  for (std::size_t g = 0; g < groups.size() && g < kShown; ++g) {
    const Hazard& h = hazards[groups[g].first];
    out += fmt::format("  {}. {}", g + 1, kind_name(h.kind));
    if (h.conflict != Conflict::None) out += fmt::format(", {}", conflict_name(h.conflict));
    if (h.hi > h.lo) {
      out += fmt::format(", {} [{}, {}) {} of buffer {}", space_name(sim, h.space), hex(h.lo),
                         hex(h.hi), format_bytes(h.hi - h.lo),
                         json_quote(buffer_name(sim, h.second_buffer)));
    }
    out += '\n';
    if (h.first.valid()) out += fmt::format("     earlier: {}\n", describe_op(sim, h.first));
    out += fmt::format("     later:   {}\n", describe_op(sim, h.second));
    if (h.reused_by.valid()) {
      out += fmt::format("     reused:  {} (the simulated run did hand the bytes out again)\n",
                         describe_op(sim, h.reused_by));
    }
    out += fmt::format("     fix: {}\n", hint(sim, h));
    if (groups[g].second > 1) {
      out += fmt::format(
          "     repeated: {} times in all, the same ops on the same buffer but for their "
          "numbers (layers or steps); this is the first, --json lists each\n",
          groups[g].second);
    }
  }
  if (groups.size() > kShown) {
    out += fmt::format("  ... and {} more distinct\n", groups.size() - kShown);
  }
  return out;
}

// The memory and copies sections of the summary.
std::string memory_text(const Simulator& sim) {
  std::string out = "memory:\n";
  for (std::size_t d = 0; d < sim.device_count(); ++d) {
    const PeakMemory p = device_peaks(sim, DeviceId(static_cast<std::uint32_t>(d)));
    out += fmt::format(
        "  {}: allocated peak {}, reserved peak {} (small pool {}, large pool {}), "
        "{} segment(s), {} deferred free(s)\n",
        sim.device_name(DeviceId(static_cast<std::uint32_t>(d))), format_bytes(p.allocated),
        format_bytes(p.reserved), format_bytes(p.small_reserved), format_bytes(p.large_reserved),
        p.segment_allocs, p.deferred_frees);
  }
  const HostAllocatorStats& pinned = sim.pinned_allocator().stats();
  out += fmt::format("  host pinned: allocated peak {}, reserved peak {}\n",
                     format_bytes(pinned.allocated_peak), format_bytes(pinned.reserved_peak));
  const CopyTotals c = sim.copied();
  out += fmt::format("copies: H2D {}, D2H {}, D2D {}, peer {}\n", format_bytes(c.h2d),
                     format_bytes(c.d2h), format_bytes(c.d2d), format_bytes(c.peer));
  return out;
}

}  // namespace

std::string summary_text(const ProgramRun& run, std::string_view source) {
  const Simulator& sim = run.sim;
  std::size_t kernels = 0;
  std::size_t copies = 0;
  for (const OpRecord& r : sim.ops()) {
    kernels += r.kind == OpKind::Kernel;
    copies += r.kind == OpKind::Copy;
  }
  std::string out = fmt::format("ferry check: {}\n", source);
  out += fmt::format("ops: {} (kernels {}, copies {}, other {}) on {} device(s), {} stream(s)\n",
                     sim.ops().size(), kernels, copies, sim.ops().size() - kernels - copies,
                     sim.device_count(), sim.stream_count());
  out += fmt::format("makespan: {} ({} ns)\n", format_time(sim.makespan()), sim.makespan().ns());
  if (run.failure) out += fmt::format("failure: {}\n", run.failure->message);
  out += hazards_text(sim);
  out += memory_text(sim);
  out += fmt::format("result: {}\n", run.failure             ? "failed (out of memory)"
                                     : sim.hazards().empty() ? "no hazards"
                                                             : "hazards found");
  return out;
}

std::string summary_json(const ProgramRun& run, std::string_view source) {
  const Simulator& sim = run.sim;
  Json j;
  j["format"] = "ferry.check/1";
  j["source"] = std::string(source);
  j["ops"] = sim.ops().size();
  j["makespan_ns"] = sim.makespan().ns();
  j["failure"] = run.failure ? Json(run.failure->message) : Json(nullptr);
  Json hazards = Json::array();
  for (const Hazard& h : sim.hazards()) {
    Json hj;
    hj["kind"] = kind_name(h.kind);
    hj["conflict"] = conflict_name(h.conflict);
    hj["space"] = space_name(sim, h.space);
    hj["lo"] = h.lo.count();
    hj["hi"] = h.hi.count();
    hj["bytes"] = (h.hi - h.lo).count();
    hj["first"] = op_json(sim, h.first, h.first_buffer);
    hj["second"] = op_json(sim, h.second, h.second_buffer);
    if (h.kind == HazardKind::LatentReuse) {
      hj["reused_by"] =
          h.reused_by.valid() ? op_json(sim, h.reused_by, h.reused_buffer) : Json(nullptr);
    }
    hj["fix"] = hint(sim, h);
    hazards.push_back(std::move(hj));
  }
  j["hazards"] = std::move(hazards);
  Json devices = Json::array();
  for (std::size_t d = 0; d < sim.device_count(); ++d) {
    const DeviceId id(static_cast<std::uint32_t>(d));
    const PeakMemory p = device_peaks(sim, id);
    Json dj;
    dj["name"] = sim.device_name(id);
    dj["profile"] = sim.device_profile(id).name;
    dj["allocated_peak_bytes"] = p.allocated.count();
    dj["reserved_peak_bytes"] = p.reserved.count();
    dj["small_pool_reserved_peak_bytes"] = p.small_reserved.count();
    dj["large_pool_reserved_peak_bytes"] = p.large_reserved.count();
    dj["segment_allocs"] = p.segment_allocs;
    dj["deferred_frees"] = p.deferred_frees;
    dj["ooms"] = p.ooms;
    devices.push_back(std::move(dj));
  }
  const HostAllocatorStats& pinned = sim.pinned_allocator().stats();
  j["memory"]["devices"] = std::move(devices);
  j["memory"]["pinned"]["allocated_peak_bytes"] = pinned.allocated_peak.count();
  j["memory"]["pinned"]["reserved_peak_bytes"] = pinned.reserved_peak.count();
  const CopyTotals c = sim.copied();
  j["copies"]["h2d_bytes"] = c.h2d.count();
  j["copies"]["d2h_bytes"] = c.d2h.count();
  j["copies"]["d2d_bytes"] = c.d2d.count();
  j["copies"]["peer_bytes"] = c.peer.count();
  return j.dump(2) + "\n";
}

}  // namespace ferry::sim
