#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/sim/analysis/memory_snapshot.hpp"
#include "ferry/sim/memory/stream_markers.hpp"

namespace ferry::sim {

namespace {

using Action = AllocatorEvent::Action;

// Answers the allocator's marker questions from the run's op records (Note [Allocator
// replay]): a marker completes when the work it captured did, at `ready`.
class ReplayMarkers final : public StreamMarkers {
 public:
  explicit ReplayMarkers(const std::vector<SimTime>& stream_done) : stream_done_(stream_done) {}

  MarkerId record(StreamId stream) override {
    ready_.push_back(stream_done_.at(stream.value()));
    return MarkerId(static_cast<std::uint32_t>(ready_.size() - 1));
  }
  bool query(MarkerId marker) override { return ready_.at(marker.value()) <= now_; }
  void synchronize(MarkerId marker) override {
    synchronized_ = true;
    now_ = std::max(now_, ready_.at(marker.value()));
  }

  /// Starts a call at `time`.
  void begin_call(SimTime time) {
    now_ = time;
    synchronized_ = false;
  }
  /// The call waited for markers (an out-of-memory retry or empty_cache did).
  [[nodiscard]] bool synchronized() const { return synchronized_; }

 private:
  const std::vector<SimTime>& stream_done_;  // per stream: when its work so far completes
  std::vector<SimTime> ready_;               // per marker
  SimTime now_;
  bool synchronized_ = false;
};

// One device's allocator, replayed.
class DeviceReplay {
 public:
  DeviceReplay(DeviceId device, const CachingAllocator& original, std::size_t buffers,
               const std::vector<SimTime>& stream_done)
      : allocator_(original.capacity(), original.base()),
        stream_done_(stream_done),
        markers_(stream_done),
        live_(buffers) {
    history_.device = device;
  }

  void alloc(OpId op, const OpRecord& rec, const std::vector<BufferInfo>& buffers) {
    const CallStart start = begin(rec.issued);
    auto got = allocator_.malloc(rec.stream, rec.bytes, markers_);
    std::optional<DeviceAllocation> block;
    if (got) block = got.value();
    settle(op, start, block, true);
    if (!block) {
      FERRY_CHECK(!rec.buffer.valid(),
                  "allocator replay: op {} allocated in the run but not in the replay", op.value());
      const AllocatorStats& st = allocator_.stats();
      emit(Action::Oom, allocator_.capacity() - st.reserved, round_size(rec.bytes), rec.stream, op,
           BufferId());
      return;
    }
    FERRY_CHECK(rec.buffer.valid() && rec.buffer.value() < buffers.size(),
                "allocator replay: op {} failed in the run but not in the replay", op.value());
    FERRY_CHECK(buffers[rec.buffer.value()].address == block->address,
                "allocator replay: op {} got {:#x} in the run, {:#x} in the replay", op.value(),
                buffers[rec.buffer.value()].address.count(), block->address.count());
    live_[rec.buffer.value()] = Live{block->block, rec.stream};
    emit(Action::Alloc, block->address, block->size, rec.stream, op, rec.buffer);
  }

  void free(OpId op, const OpRecord& rec) {
    const BufferId buffer = rec.buffer;
    const BlockId block = live_.at(buffer.value()).block;
    FERRY_CHECK(block.valid(), "allocator replay: op {} frees buffer {}, not live in the replay",
                op.value(), buffer.value());
    now_ = rec.issued;
    const DeviceAllocation a = allocator_.describe(block);
    SimTime ready;
    for (const StreamId s : allocator_.deferring_streams(block)) {
      ready = std::max(ready, stream_done_.at(s.value()));
    }
    const bool deferred = !allocator_.deferring_streams(block).empty();
    const StreamId stream = live_[buffer.value()].stream;
    emit(Action::FreeRequested, a.address, a.size, stream, op, buffer);
    allocator_.free(block, markers_);
    live_[buffer.value()] = Live{};
    if (deferred) {
      pending_.push_back(Pending{a.address, a.size, stream, buffer, ready});
    } else {
      emit(Action::FreeCompleted, a.address, a.size, stream, op, buffer);
    }
  }

  void record_stream(const OpRecord& rec) {
    const BlockId block = live_.at(rec.buffer.value()).block;
    if (block.valid()) allocator_.record_stream(block, rec.stream);
  }

  void empty_cache(OpId op, const OpRecord& rec) {
    const CallStart start = begin(rec.issued);
    allocator_.empty_cache(markers_);
    settle(op, start, std::nullopt, false);
  }

  AllocatorHistory finish(const CachingAllocator& original) {
    const AllocatorStats& mine = allocator_.stats();
    const AllocatorStats& run = original.stats();
    FERRY_CHECK(
        mine.allocated == run.allocated && mine.requested == run.requested &&
            mine.reserved == run.reserved && mine.allocated_peak == run.allocated_peak &&
            mine.reserved_peak == run.reserved_peak && mine.requested_peak == run.requested_peak &&
            mine.segment_allocs == run.segment_allocs && mine.segment_frees == run.segment_frees &&
            mine.ooms == run.ooms,
        "allocator replay of device {}: counters differ from the run's", history_.device.value());
    check_events(run);
    history_.segments = allocator_.segments();
    const std::vector<SegmentInfo> expected = original.segments();
    FERRY_CHECK(same_segments(history_.segments, expected),
                "allocator replay of device {}: segments differ from the run's",
                history_.device.value());
    for (std::uint32_t b = 0; b < live_.size(); ++b) {
      if (live_[b].block.valid()) {
        history_.block_buffers[allocator_.describe(live_[b].block).address] = BufferId(b);
      }
    }
    for (const Pending& p : pending_) history_.block_buffers[p.address] = p.buffer;
    for (const auto& [address, segment] : segments_) history_.segment_ops[address] = segment.op;
    return std::move(history_);
  }

 private:
  struct Pending {
    Bytes address;
    Bytes size;
    StreamId stream;
    BufferId buffer;
    SimTime ready;  // when every stream it waits for has done the work submitted before the free
  };
  struct Live {
    BlockId block;    // the replayed block, while the buffer is allocated
    StreamId stream;  // its allocation stream
  };
  struct Segment {
    Bytes size;
    StreamId stream;
    OpId op;
  };
  struct CallStart {
    SimTime time;
    std::int64_t segment_allocs = 0;
    std::int64_t segment_frees = 0;
  };

  static bool same_segments(const std::vector<SegmentInfo>& a, const std::vector<SegmentInfo>& b) {
    auto same_block = [](const BlockInfo& x, const BlockInfo& y) {
      return x.address == y.address && x.size == y.size && x.requested == y.requested &&
             x.stream == y.stream && x.state == y.state;
    };
    return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                      [&](const SegmentInfo& x, const SegmentInfo& y) {
                        return x.address == y.address && x.size == y.size && x.stream == y.stream &&
                               x.pool == y.pool &&
                               std::equal(x.blocks.begin(), x.blocks.end(), y.blocks.begin(),
                                          y.blocks.end(), same_block);
                      });
  }

  // The events must add up to the run's counters: what a reader of the trace sees as the
  // allocated and reserved bytes over time, and their peaks.
  void check_events(const AllocatorStats& run) const {
    Bytes allocated, reserved, allocated_peak, reserved_peak;
    for (const AllocatorEvent& e : history_.events) {
      switch (e.action) {
        case Action::Alloc:
          allocated += e.size;
          allocated_peak = std::max(allocated_peak, allocated);
          break;
        case Action::FreeCompleted:
          allocated -= e.size;
          break;
        case Action::SegmentAlloc:
          reserved += e.size;
          reserved_peak = std::max(reserved_peak, reserved);
          break;
        case Action::SegmentFree:
          reserved -= e.size;
          break;
        default:
          break;
      }
    }
    FERRY_CHECK(allocated == run.allocated && reserved == run.reserved &&
                    allocated_peak == run.allocated_peak && reserved_peak == run.reserved_peak,
                "allocator replay of device {}: the events add up to {} B allocated (peak {} B) "
                "and {} B reserved (peak {} B), the run to {} ({}) and {} ({})",
                history_.device.value(), allocated.count(), allocated_peak.count(),
                reserved.count(), reserved_peak.count(), run.allocated.count(),
                run.allocated_peak.count(), run.reserved.count(), run.reserved_peak.count());
  }

  CallStart begin(SimTime time) {
    now_ = time;
    markers_.begin_call(time);
    const AllocatorStats& st = allocator_.stats();
    return CallStart{time, st.segment_allocs, st.segment_frees};
  }

  void emit(Action action, Bytes address, Bytes size, StreamId stream, OpId op, BufferId buffer) {
    history_.events.push_back(AllocatorEvent{action, address, size, stream, now_, op, buffer});
  }

  // What a malloc or empty_cache did besides handing out `block`: the deferred frees it
  // completed, then the segments it returned and obtained. A malloc first hands back the frees
  // whose markers are done at its start (`queried`), and waits for the rest only when it
  // synchronized; empty_cache waits for all of them, in order of free.
  void settle(OpId op, const CallStart& start, const std::optional<DeviceAllocation>& block,
              bool queried) {
    std::vector<Pending> still;
    if (queried) {
      for (const Pending& p : pending_) {
        if (p.ready <= start.time) {
          emit(Action::FreeCompleted, p.address, p.size, p.stream, op, p.buffer);
        }
      }
    }
    for (const Pending& p : pending_) {
      if (queried && p.ready <= start.time) continue;
      if (markers_.synchronized()) {
        now_ = std::max(now_, p.ready);
        emit(Action::FreeCompleted, p.address, p.size, p.stream, op, p.buffer);
      } else {
        still.push_back(p);
      }
    }
    pending_ = std::move(still);

    const AllocatorStats& st = allocator_.stats();
    const std::int64_t freed = st.segment_frees - start.segment_frees;
    const std::int64_t obtained = st.segment_allocs - start.segment_allocs;
    if (freed == 0 && obtained == 0) return;
    // Diff the segments. A segment returned and obtained again in the same call, at the same
    // address with the same size, is the new block's.
    std::map<Bytes, Segment> now;
    for (const SegmentInfo& s : allocator_.segments()) now[s.address] = {s.size, s.stream, op};
    const auto holds = [&](const std::pair<const Bytes, Segment>& s) {
      return obtained == 1 && block && block->address >= s.first &&
             block->address < s.first + s.second.size;
    };
    std::vector<std::pair<Bytes, Segment>> returned;
    std::vector<std::pair<Bytes, Segment>> added;
    for (const auto& old : segments_) {
      const auto it = now.find(old.first);
      const bool kept = it != now.end() && it->second.size == old.second.size &&
                        it->second.stream == old.second.stream;
      if (!kept || holds(*it)) returned.emplace_back(old);
    }
    for (const auto& s : now) {
      const auto it = segments_.find(s.first);
      const bool existed = it != segments_.end() && it->second.size == s.second.size &&
                           it->second.stream == s.second.stream;
      if (!existed || holds(s)) added.emplace_back(s);
    }
    FERRY_CHECK(static_cast<std::int64_t>(returned.size()) == freed &&
                    static_cast<std::int64_t>(added.size()) == obtained,
                "allocator replay: op {} returned {} and obtained {} segments, the diff shows {} "
                "and {}",
                op.value(), freed, obtained, returned.size(), added.size());
    for (const auto& [address, s] : returned) {
      emit(Action::SegmentFree, address, s.size, s.stream, op, BufferId());
      segments_.erase(address);
    }
    for (const auto& [address, s] : added) {
      emit(Action::SegmentAlloc, address, s.size, s.stream, op, BufferId());
      segments_[address] = s;
    }
  }

  CachingAllocator allocator_;
  const std::vector<SimTime>& stream_done_;
  ReplayMarkers markers_;
  AllocatorHistory history_;
  SimTime now_;
  std::vector<Live> live_;             // by buffer
  std::vector<Pending> pending_;       // deferred frees, in order of free
  std::map<Bytes, Segment> segments_;  // by address
};

}  // namespace

Result<std::vector<AllocatorHistory>> allocator_history(const Simulator& sim) {
  const std::vector<OpRecord>& ops = sim.ops();
  const std::vector<BufferInfo>& buffers = sim.buffers();
  std::vector<SimTime> stream_done(sim.stream_count());
  std::vector<DeviceReplay> devices;
  devices.reserve(sim.device_count());
  for (std::uint32_t d = 0; d < sim.device_count(); ++d) {
    devices.emplace_back(DeviceId(d), sim.device_allocator(DeviceId(d)), buffers.size(),
                         stream_done);
  }
  for (std::uint32_t i = 0; i < ops.size(); ++i) {
    const OpId op(i);
    const OpRecord& r = ops[i];
    switch (r.kind) {
      case OpKind::Kernel:
      case OpKind::Copy:
      case OpKind::Wait:
        // Stream work completes in stream order, so the latest end is the last op's. A wait
        // that never reached its stream (its event was never recorded) ended when it was
        // issued, before any later free could ask about the stream: it changes no answer.
        if (r.stream.valid()) {
          SimTime& done = stream_done[r.stream.value()];
          done = std::max(done, r.end);
        }
        break;
      case OpKind::Alloc:
        if (r.stream.valid()) devices[sim.stream_device(r.stream).value()].alloc(op, r, buffers);
        break;
      case OpKind::Free:
        if (r.buffer.valid()) {
          const BufferInfo& b = buffers[r.buffer.value()];
          // A second free of a buffer is a hazard the allocator never sees.
          if (b.kind == MemoryKind::Device && b.freed_by == op) {
            devices[b.device.value()].free(op, r);
          }
        }
        break;
      case OpKind::RecordStream:
        if (r.buffer.valid() && buffers[r.buffer.value()].kind == MemoryKind::Device) {
          devices[buffers[r.buffer.value()].device.value()].record_stream(r);
        }
        break;
      case OpKind::EmptyCache:
        // The op record names no device; with one there is no doubt.
        if (devices.size() != 1) {
          return Error{fmt::format(
              "op {} empties a device's cache on a machine of {} devices, and the op log does "
              "not say which; a memory snapshot needs one device or no empty_cache",
              i, devices.size())};
        }
        devices[0].empty_cache(op, r);
        break;
      default:
        break;
    }
  }
  std::vector<AllocatorHistory> out;
  for (std::uint32_t d = 0; d < devices.size(); ++d) {
    out.push_back(devices[d].finish(sim.device_allocator(DeviceId(d))));
  }
  return out;
}

}  // namespace ferry::sim
