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

#include "ferry/ids.hpp"
#include "ferry/sim/check/hazard_checker.hpp"

namespace ferry::sim {

/// A point in a stream: the first `count` ops submitted to `stream` (what an event captures).
struct StreamPosition {
  StreamId stream;
  std::uint64_t count = 0;
};

/// An op that left its stream's queue: handed to an engine, or a wait that has been satisfied
/// (and so has completed, taking no time).
struct StreamStart {
  OpId op;
  bool wait_done = false;
};

/// The streams of the machine and their queues.
class StreamScheduler {
 public:
  /// With `ignore_waits` (a planted fault), waits never hold their stream.
  explicit StreamScheduler(bool ignore_waits) : ignore_waits_(ignore_waits) {}

  /// A new empty stream of `device`; `thread` is its thread in the hazard checker.
  StreamId add(std::string name, DeviceId device, ThreadIndex thread);

  /// FERRY_CHECKs that `stream` exists.
  void check(StreamId stream) const;
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

  /// Submits `op` to `stream`; a wait (`until` set) holds the stream until `until` is reached.
  /// Ops that start now are appended to `started`, in the order they start.
  void submit(StreamId stream, OpId op, std::optional<StreamPosition> until,
              std::vector<StreamStart>& started);
  /// The op `stream` handed to an engine completed; appends what starts next to `started`.
  void complete(StreamId stream, std::vector<StreamStart>& started);

 private:
  struct Queued {
    OpId op;
    std::optional<StreamPosition> until;  // set for waits
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

  void advance(StreamId stream, std::vector<StreamStart>& started);
  void notify_waiters(StreamId stream, std::vector<StreamStart>& started);

  std::vector<Stream> streams_;
  bool ignore_waits_;
};

}  // namespace ferry::sim
