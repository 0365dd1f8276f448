#include "ferry/sim/export/memory_snapshot.hpp"

#include <string>
#include <string_view>
#include <unordered_map>

#include "ferry/sim/engine/program.hpp"
#include "ferry/sim/export/pickle.hpp"

namespace ferry::sim {

namespace {

using Action = AllocatorEvent::Action;

/// PyTorch's roundup_power2_divisions has one entry per power of two from 1 to this (16).
constexpr std::int64_t kRoundupIntervalsEnd = std::int64_t{1} << 15;

// Note [Snapshot frames]
// PyTorch gives each allocation the Python stack that made it, innermost frame first, each a
// {filename, line, name} dict. A simulated run has no stack; its frames name ferry's call:
// the innermost frame is the call itself (filename: its kind, "alloc" or "empty_cache";
// line: its op index, the "op" of the Chrome trace; name: its label, for an allocation the
// tensor it holds). The frames after it are the label's dotted prefixes, outermost last
// ("layers.1.fc1.out" is inside "layers.1.fc1", "layers.1" and "layers"), with filename
// "model" and line 0, so that the flame graphs group memory by layer. A free carries the
// frames of the allocation it ends, as PyTorch's do by default.
void write_frames(PickleWriter& p, std::string_view kind, OpId op, std::string_view label) {
  p.begin_list();
  auto frame = [&](std::string_view filename, std::int64_t line, std::string_view name) {
    p.begin_dict();
    p.str("filename");
    p.str(filename);
    p.str("line");
    p.integer(line);
    p.str("name");
    p.str(name);
    p.end_dict();
  };
  frame(kind, op.value(), label.empty() ? kind : label);
  // The dotted path is the label's last word ("reload layers.3.out" -> "layers.3.out").
  const auto space = label.rfind(' ');
  std::string_view path = space == std::string_view::npos ? label : label.substr(space + 1);
  for (auto dot = path.rfind('.'); dot != std::string_view::npos && dot > 0;
       dot = path.rfind('.')) {
    path = path.substr(0, dot);
    frame("model", 0, path);
  }
  p.end_list();
}

const char* action_name(Action a) {
  switch (a) {
    case Action::Alloc:
      return "alloc";
    case Action::FreeRequested:
      return "free_requested";
    case Action::FreeCompleted:
      return "free_completed";
    case Action::SegmentAlloc:
      return "segment_alloc";
    case Action::SegmentFree:
      return "segment_free";
    case Action::SegmentMap:
      return "segment_map";
    case Action::SegmentUnmap:
      return "segment_unmap";
    case Action::Oom:
      return "oom";
  }
  return "?";
}

const char* state_name(BlockInfo::State s) {
  switch (s) {
    case BlockInfo::State::Allocated:
      return "active_allocated";
    case BlockInfo::State::PendingFree:
      return "active_pending_free";
    case BlockInfo::State::Free:
      return "inactive";
  }
  return "?";
}

class SnapshotWriter {
 public:
  explicit SnapshotWriter(const Simulator& sim) : sim_(sim) {}

  std::string write(const std::vector<AllocatorHistory>& histories) {
    p_.begin_dict();
    p_.str("segments");
    p_.begin_list();
    for (const AllocatorHistory& h : histories) {
      for (const SegmentInfo& s : h.segments) segment(h, s);
    }
    p_.end_list();
    p_.str("device_traces");
    p_.begin_list();
    for (const AllocatorHistory& h : histories) {
      p_.begin_list();
      for (const AllocatorEvent& e : h.events) event(e);
      p_.end_list();
    }
    p_.end_list();
    p_.str("allocator_settings");
    allocator_settings(!histories.empty() && histories.front().mode == AllocatorMode::Expandable);
    p_.str("external_annotations");
    p_.begin_list();
    p_.end_list();
    p_.end_dict();
    return p_.finish();
  }

 private:
  // One dict entry: its key, then its value.
  void int_item(std::string_view key, std::int64_t value) {
    p_.str(key);
    p_.integer(value);
  }
  void str_item(std::string_view key, std::string_view value) {
    p_.str(key);
    p_.str(value);
  }

  // The frames of the call `op` (Note [Snapshot frames]); written once, then recalled.
  void frames_of(OpId op) {
    if (const auto it = frames_.find(op.value()); it != frames_.end()) {
      p_.recall(it->second);
      return;
    }
    const OpRecord& r = sim_.ops().at(op.value());
    write_frames(p_, op_kind_name(r.kind), op, sim_.label(r.label));
    frames_.emplace(op.value(), p_.remember());
  }
  // The frames of the allocation `buffer` holds.
  void frames_of(BufferId buffer) { frames_of(sim_.buffers().at(buffer.value()).allocated_by); }

  void segment(const AllocatorHistory& h, const SegmentInfo& s) {
    Bytes allocated, active, requested;
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockInfo::State::Allocated) allocated += b.size;
      if (b.state != BlockInfo::State::Free) {
        active += b.size;
        requested += b.requested;
      }
    }
    p_.begin_dict();
    int_item("device", h.device.value());
    int_item("address", s.address.count());
    int_item("total_size", s.size.count());
    int_item("allocated_size", allocated.count());
    int_item("active_size", active.count());
    int_item("requested_size", requested.count());
    int_item("stream", s.stream.value());
    str_item("segment_type", s.pool == PoolKind::Large ? "large" : "small");
    p_.str("segment_pool_id");
    p_.begin_tuple();
    p_.integer(0);
    p_.integer(0);
    p_.end_tuple();
    p_.str("is_expandable");
    p_.boolean(s.expandable);
    p_.str("frames");
    // An expandable segment's mapped range starts where a map started, or where an unmap
    // ended inside an earlier map: the frames are those of the map it lies in.
    frames_of(s.expandable ? std::prev(h.segment_ops.upper_bound(s.address))->second
                           : h.segment_ops.at(s.address));
    p_.str("blocks");
    p_.begin_list();
    for (const BlockInfo& b : s.blocks) {
      p_.begin_dict();
      int_item("address", b.address.count());
      int_item("size", b.size.count());
      int_item("requested_size", b.requested.count());
      str_item("state", state_name(b.state));
      p_.str("frames");
      if (b.state == BlockInfo::State::Free) {
        p_.begin_list();
        p_.end_list();
      } else {
        frames_of(h.block_buffers.at(b.address));
      }
      p_.end_dict();
    }
    p_.end_list();
    p_.end_dict();
  }

  void event(const AllocatorEvent& e) {
    p_.begin_dict();
    str_item("action", action_name(e.action));
    // PyTorch puts the bytes the device still has free where other actions have the address.
    p_.str(e.action == Action::Oom ? "device_free" : "addr");
    p_.integer(e.address.count());
    int_item("size", e.size.count());
    int_item("stream", e.stream.value());
    str_item("compile_context", "");
    str_item("user_metadata", "");
    int_item("time_us", e.time.ns() / 1000);
    p_.str("frames");
    if (e.buffer.valid()) {
      frames_of(e.buffer);
    } else {
      frames_of(e.op);
    }
    p_.end_dict();
  }

  // The caching allocator's settings as PyTorch reports them without PYTORCH_CUDA_ALLOC_CONF
  // (or, with `expandable`, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): no split
  // limit (max_split_size is SIZE_MAX, -1 as a signed integer), no garbage collection, no
  // power-of-two rounding in any of the 16 size intervals. The simulated allocator models
  // exactly that configuration (docs/allocators.md).
  void allocator_settings(bool expandable) {
    p_.begin_dict();
    p_.str("PYTORCH_CUDA_ALLOC_CONF");
    p_.str(expandable ? "expandable_segments:True" : "");
    int_item("max_split_size", -1);
    p_.str("garbage_collection_threshold");
    p_.real(0.0);
    p_.str("expandable_segments");
    p_.boolean(expandable);
    int_item("pinned_num_register_threads", 1);
    p_.str("release_lock_on_cudamalloc");
    p_.boolean(false);
    p_.str("pinned_use_cuda_host_register");
    p_.boolean(false);
    p_.str("graph_capture_record_stream_reuse");
    p_.boolean(false);
    p_.str("roundup_power2_divisions");
    p_.begin_dict();
    for (std::int64_t interval = 1; interval <= kRoundupIntervalsEnd; interval *= 2) {
      p_.str(std::to_string(interval));
      p_.integer(0);
    }
    p_.end_dict();
    p_.end_dict();
  }

  const Simulator& sim_;
  PickleWriter p_;
  std::unordered_map<std::uint32_t, std::uint32_t> frames_;  // op -> memo; lookup only
};

}  // namespace

Result<std::string> memory_snapshot(const Simulator& sim) {
  auto histories = allocator_history(sim);
  if (!histories) return histories.error();
  return SnapshotWriter(sim).write(histories.value());
}

}  // namespace ferry::sim
