#pragma once
// A Backend that checks what it is asked to do for every timing the streams allow: it keeps a
// vector clock per stream and for the host, stamps each access to a buffer, and reports a
// hazard when an access is not ordered after a conflicting one, or when a buffer is freed while
// an access by another stream may still run. It also carries content values through copies,
// so a test can tell that unpack hands back the bytes that were packed.

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "backend_handles.hpp"
#include "ferry/backend.hpp"

namespace ferry::testing {

// Note [Checked backend]
// Timelines: index 0 is the host, index s + 1 is stream s (stream 0 is compute). Each access
// to a buffer ticks its stream's own component and is stamped (timeline, tick). An access A is
// ordered before the current point of timeline t when clock[t][A.timeline] >= A.tick; events
// carry a copy of the recording stream's clock, and a wait joins it (waiting on a never-recorded
// event does nothing, as in CUDA). A write must be ordered after the buffer's last write and
// every read since; a read after the last write. A buffer is freed when its last reference
// goes; its memory may then be reused by its owner (the stream it was allocated on; the host
// for pinned memory, which the caching host allocator hands out again at once), so every
// access by another timeline must be ordered before the owner's current point, or be covered
// by record_stream: the free then waits for all work the recorded stream has been given.
class CheckedBackend {
 public:
  using Stream = StreamHandle;
  using Event = EventHandle;
  using Buffer = BufferHandle;

  CheckedBackend() { clocks_.assign(2, Clock(2, 0)); }

  Stream compute_stream() const { return Stream{0}; }
  Stream make_stream(std::string_view) {
    const int id = static_cast<int>(clocks_.size()) - 1;
    for (Clock& c : clocks_) c.push_back(0);
    for (Clock& c : events_) c.push_back(0);
    clocks_.emplace_back(clocks_.size() + 1, 0);
    return Stream{id};
  }
  Event make_event() {
    events_.push_back(Clock(clocks_.size(), 0));
    recorded_.push_back(false);
    return Event{static_cast<int>(events_.size()) - 1};
  }
  std::optional<Buffer> allocate(Place place, Bytes, Stream stream, std::string_view) {
    const int owner = place == Place::Device ? timeline(stream) : kHost;
    return Buffer{add(owner, place != Place::Device)};
  }
  void copy(Stream s, Buffer src, Bytes so, Buffer dst, Bytes dso, Bytes n, std::string_view) {
    access(timeline(s), src, false, "copy reads");
    access(timeline(s), dst, true, "copy writes");
    std::map<std::int64_t, std::uint64_t> moved;
    for (const auto& [off, value] : info(src).content) {
      if (off >= so.count() && off < so.count() + n.count()) {
        moved[off - so.count() + dso.count()] = value;
      }
    }
    for (const auto& [off, value] : moved) info(dst).content[off] = value;
  }
  void record(Event e, Stream s) {
    events_.at(static_cast<std::size_t>(e.id)) = clocks_[static_cast<std::size_t>(timeline(s))];
    recorded_.at(static_cast<std::size_t>(e.id)) = true;
  }
  void wait(Stream s, Event e) {
    if (!recorded_.at(static_cast<std::size_t>(e.id))) return;
    Clock& c = clocks_[static_cast<std::size_t>(timeline(s))];
    const Clock& ev = events_[static_cast<std::size_t>(e.id)];
    for (std::size_t i = 0; i < c.size(); ++i) c[i] = std::max(c[i], ev[i]);
  }
  void hold(Buffer b) { ++info(b).refs; }
  void drop(Buffer b) {
    Info& i = info(b);
    if (i.refs <= 0) {
      hazards.push_back(fmt::format("b{} dropped with no reference left", b.id));
      return;
    }
    if (--i.refs == 0) free(b);
  }
  long use_count(Buffer b) const { return buffers_.at(static_cast<std::size_t>(b.id)).refs; }
  void record_stream(Buffer b, Stream s) { info(b).recorded.insert(timeline(s)); }
  /// The host waits for the stream: it knows all the stream's work so far is done.
  void synchronize(Stream s) { join(kHost, timeline(s)); }

  /// A storage the autograd produces on the compute stream (one reference), holding `values`
  /// at their offsets.
  Buffer produce(const std::map<std::int64_t, std::uint64_t>& values) {
    const Buffer b{add(timeline(compute_stream()), false)};
    access(timeline(compute_stream()), b, true, "compute writes");
    info(b).content = values;
    return b;
  }
  /// Compute reads `b` (a backward node uses an unpacked tensor).
  void compute_reads(Buffer b) { access(timeline(compute_stream()), b, false, "compute reads"); }
  /// The content value at `offset` of `b`, if any was written there.
  std::optional<std::uint64_t> value(Buffer b, Bytes offset) const {
    const auto& content = buffers_.at(static_cast<std::size_t>(b.id)).content;
    auto it = content.find(offset.count());
    if (it == content.end()) return std::nullopt;
    return it->second;
  }
  /// Buffers with references left: device ones and pinned host ones.
  [[nodiscard]] int live(bool host) const {
    return static_cast<int>(std::count_if(buffers_.begin(), buffers_.end(), [&](const Info& i) {
      return i.refs > 0 && i.host == host;
    }));
  }

  std::vector<std::string> hazards;

 private:
  using Clock = std::vector<std::uint64_t>;
  static constexpr int kHost = 0;

  struct Stamp {
    int timeline;
    std::uint64_t tick;
    std::string what;
  };
  struct Info {
    int owner;
    bool host;
    long refs = 1;
    std::optional<Stamp> last_write;
    std::vector<Stamp> reads;  // since the last write
    std::set<int> recorded;    // timelines given by record_stream
    std::map<std::int64_t, std::uint64_t> content;
  };

  static int timeline(Stream s) { return s.id + 1; }
  Info& info(Buffer b) { return buffers_.at(static_cast<std::size_t>(b.id)); }

  int add(int owner, bool host) {
    buffers_.push_back(Info{owner, host, 1, std::nullopt, {}, {}, {}});
    return static_cast<int>(buffers_.size()) - 1;
  }

  [[nodiscard]] bool ordered(const Stamp& a, int t) const {
    return a.timeline == t ||
           clocks_[static_cast<std::size_t>(t)][static_cast<std::size_t>(a.timeline)] >= a.tick;
  }

  void join(int into, int from) {
    Clock& c = clocks_[static_cast<std::size_t>(into)];
    const Clock& f = clocks_[static_cast<std::size_t>(from)];
    for (std::size_t k = 0; k < c.size(); ++k) c[k] = std::max(c[k], f[k]);
  }

  void access(int t, Buffer b, bool write, const char* what) {
    join(t, kHost);  // the host issues it: what the host knows is done comes before it
    Info& i = info(b);
    if (i.refs <= 0) hazards.push_back(fmt::format("{} b{} after it was freed", what, b.id));
    auto conflict = [&](const Stamp& earlier) {
      if (!ordered(earlier, t)) {
        hazards.push_back(fmt::format("{} b{} on timeline {} unordered with {} on timeline {}",
                                      what, b.id, t, earlier.what, earlier.timeline));
      }
    };
    if (i.last_write) conflict(*i.last_write);
    if (write) {
      for (const Stamp& r : i.reads) conflict(r);
    }
    const Stamp stamp{t, ++clocks_[static_cast<std::size_t>(t)][static_cast<std::size_t>(t)], what};
    if (write) {
      i.last_write = stamp;
      i.reads.clear();
    } else {
      i.reads.push_back(stamp);
    }
  }

  // The last reference went: the owner may reuse the memory now (see Note [Checked backend]).
  void free(Buffer b) {
    const Info& i = info(b);
    auto covered = [&](const Stamp& a) {
      if (ordered(a, i.owner) || ordered(a, kHost) || i.recorded.count(a.timeline) > 0) {
        return true;
      }
      return std::any_of(i.recorded.begin(), i.recorded.end(),
                         [&](int t) { return ordered(a, t); });
    };
    std::vector<Stamp> accesses = i.reads;
    if (i.last_write) accesses.push_back(*i.last_write);
    for (const Stamp& a : accesses) {
      if (!covered(a)) {
        hazards.push_back(
            fmt::format("b{} freed for reuse by timeline {} while {} on timeline {} may run", b.id,
                        i.owner, a.what, a.timeline));
      }
    }
  }

  std::vector<Clock> clocks_;  // by timeline
  std::vector<Clock> events_;
  std::vector<bool> recorded_;
  std::vector<Info> buffers_;
};

static_assert(Backend<CheckedBackend>);

}  // namespace ferry::testing
