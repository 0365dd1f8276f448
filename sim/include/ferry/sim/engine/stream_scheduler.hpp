#pragma once
/// What happens on streams: each stream runs its ops in submission order, one at a time; a wait
/// holds its stream until another stream has completed a given number of ops. How long an op
/// takes is not decided here: a started op is handed to its engine (compute or copy), which
/// reports its completion back.

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/ids.hpp"
#include "ferry/sim/check/hazard_checker.hpp"

namespace ferry::sim {

/// A point in a stream: the first `count` ops submitted to `stream` (what an event captures).
struct StreamPosition {
  StreamId stream;
  std::uint64_t count = 0;
};

/// The streams of the machine and their queues. An op that leaves its stream's queue is
/// handed to `start(op, wait_done)`: to an engine, or, with `wait_done`, a wait that has been
/// satisfied (and so has completed, taking no time). `start` must not call back into the
/// scheduler; the calls come in the order the ops start.
class StreamScheduler {
 public:
  /// With `ignore_waits` (a planted fault), waits never hold their stream.
  explicit StreamScheduler(bool ignore_waits) : ignore_waits_(ignore_waits) {}

  /// A new empty stream of `device`; `thread` is its thread in the hazard checker.
  StreamId add(std::string name, DeviceId device, ThreadIndex thread);

  /// FERRY_CHECKs that `stream` exists.
  void check(StreamId stream) const {
    FERRY_CHECK(stream.valid() && stream.value() < streams_.size(), "unknown stream");
  }
  [[nodiscard]] std::size_t size() const { return streams_.size(); }
  [[nodiscard]] const std::string& name(StreamId s) const { return streams_[s.value()].name; }
  [[nodiscard]] DeviceId device(StreamId s) const { return streams_[s.value()].device; }
  [[nodiscard]] ThreadIndex thread(StreamId s) const { return streams_[s.value()].thread; }

  /// Everything submitted to `stream` so far.
  [[nodiscard]] StreamPosition submitted(StreamId stream) const {
    return StreamPosition{stream, streams_[stream.value()].submitted};
  }
  /// True once the ops up to `position` have completed.
  [[nodiscard]] bool reached(StreamPosition position) const {
    return streams_[position.stream.value()].completed >= position.count;
  }
  /// The ops completed so far on every stream: reached() answers as before while it stays.
  [[nodiscard]] std::uint64_t completions() const { return completions_; }

  /// Submits `op` to `stream`; a wait (`until` set) holds the stream until `until` is reached.
  template <class Start>
  void submit(StreamId stream, OpId op, std::optional<StreamPosition> until, Start&& start) {
    Stream& s = streams_[stream.value()];
    s.queue.push_back(until ? Queued{op, until->stream, until->count} : Queued{op, {}, 0});
    ++s.submitted;
    if (!s.busy && s.queue.size() == 1) advance(stream, start);
  }

  /// The op `stream` handed to an engine completed; starts what comes next.
  template <class Start>
  void complete(StreamId stream, Start&& start) {
    Stream& s = streams_[stream.value()];
    s.busy = false;
    ++s.completed;
    ++completions_;
    if (!s.waiters.empty()) notify_waiters(stream, start);
    advance(stream, start);
  }

 private:
  struct Queued {
    OpId op;
    StreamId until;  // a wait, for the first `count` ops of `until`, when valid
    std::uint64_t count = 0;
  };
  struct Stream {
    std::string name;
    DeviceId device;
    ThreadIndex thread = 0;
    std::deque<Queued> queue;  // submitted, not yet started; the head may be a held wait
    std::uint64_t submitted = 0;
    std::uint64_t completed = 0;
    bool busy = false;                                        // the head op is on an engine
    std::vector<std::pair<std::uint64_t, StreamId>> waiters;  // (count, stream held by a wait)
  };

  template <class Start>
  void advance(StreamId stream, Start& start) {
    Stream& s = streams_[stream.value()];
    while (!s.busy && !s.queue.empty()) {
      const Queued head = s.queue.front();
      if (head.until.valid()) {
        Stream& target = streams_[head.until.value()];
        if (!ignore_waits_ && target.completed < head.count) {
          target.waiters.emplace_back(head.count, stream);
          return;
        }
        s.queue.pop_front();
        ++s.completed;
        ++completions_;
        start(head.op, true);
        if (!s.waiters.empty()) notify_waiters(stream, start);
        continue;
      }
      s.queue.pop_front();
      s.busy = true;
      start(head.op, false);
    }
  }

  template <class Start>
  void notify_waiters(StreamId stream, Start& start) {
    Stream& s = streams_[stream.value()];
    std::vector<StreamId> woken;
    std::erase_if(s.waiters, [&](const std::pair<std::uint64_t, StreamId>& w) {
      if (w.first > s.completed) return false;
      woken.push_back(w.second);
      return true;
    });
    for (const StreamId w : woken) advance(w, start);
  }

  std::vector<Stream> streams_;
  bool ignore_waits_;
  std::uint64_t completions_ = 0;  // completed ops, every stream's
};

}  // namespace ferry::sim
