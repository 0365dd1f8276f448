#include "ferry/sim/engine/stream_scheduler.hpp"

#include "ferry/check.hpp"

namespace ferry::sim {

StreamId StreamScheduler::add(std::string name, DeviceId device, ThreadIndex thread) {
  Stream s;
  s.name = std::move(name);
  s.device = device;
  s.thread = thread;
  streams_.push_back(std::move(s));
  return StreamId(static_cast<std::uint32_t>(streams_.size() - 1));
}

void StreamScheduler::check(StreamId stream) const {
  FERRY_CHECK(stream.valid() && stream.value() < streams_.size(), "unknown stream");
}

void StreamScheduler::submit(StreamId stream, OpId op, std::optional<StreamPosition> until,
                             std::vector<StreamStart>& started) {
  Stream& s = streams_[stream.value()];
  s.queue.push_back(Queued{op, until});
  ++s.submitted;
  if (!s.busy && s.queue.size() == 1) advance(stream, started);
}

void StreamScheduler::complete(StreamId stream, std::vector<StreamStart>& started) {
  Stream& s = streams_[stream.value()];
  s.busy = false;
  ++s.completed;
  notify_waiters(stream, started);
  advance(stream, started);
}

void StreamScheduler::advance(StreamId stream, std::vector<StreamStart>& started) {
  Stream& s = streams_[stream.value()];
  while (!s.busy && !s.queue.empty()) {
    const Queued head = s.queue.front();
    if (head.until) {
      Stream& target = streams_[head.until->stream.value()];
      if (!ignore_waits_ && target.completed < head.until->count) {
        target.waiters.emplace_back(head.until->count, stream);
        return;
      }
      s.queue.pop_front();
      ++s.completed;
      started.push_back(StreamStart{head.op, true});
      notify_waiters(stream, started);
      continue;
    }
    s.queue.pop_front();
    s.busy = true;
    started.push_back(StreamStart{head.op, false});
  }
}

void StreamScheduler::notify_waiters(StreamId stream, std::vector<StreamStart>& started) {
  Stream& s = streams_[stream.value()];
  if (s.waiters.empty()) return;
  std::vector<StreamId> woken;
  std::erase_if(s.waiters, [&](const std::pair<std::uint64_t, StreamId>& w) {
    if (w.first > s.completed) return false;
    woken.push_back(w.second);
    return true;
  });
  for (const StreamId w : woken) advance(w, started);
}

}  // namespace ferry::sim
