#include "ferry/real/loopback_streams.hpp"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "ferry/check.hpp"

namespace ferry::real {

std::unique_ptr<LoopbackStreams> make_loopback_streams(const LoopbackConfig& config) {
  if (config.async) return std::make_unique<AsyncStreams>(config);
  return std::make_unique<InlineStreams>();
}

void InlineStreams::copy(std::uint32_t /*id*/, Block src, std::size_t src_offset, Block dst,
                         std::size_t dst_offset, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst.data + dst_offset, src.data + src_offset, bytes);
}

void InlineStreams::release(Block /*block*/, const std::vector<std::uint32_t>& /*streams*/,
                            Release release) {
  release.let_go();
}

// Done once signalled, not before `ready`, and once each of `after` is done.
struct LoopbackStreams::TokenState {
  std::uint32_t stream = 0;
  bool signalled = false;  ///< a worker reached it (always true on a compute stream)
  std::chrono::steady_clock::time_point ready{};
  std::vector<Token> after;  ///< a compute stream's pending waits when the point was taken
};

struct AsyncStreams::Op {
  enum class Kind : std::uint8_t { Copy, Signal, Wait };
  Kind kind = Kind::Copy;
  Token token;  ///< Copy: its end; Signal: the point reached; Wait: what to wait for
  Block src, dst;
  std::size_t src_offset = 0, dst_offset = 0, bytes = 0;
  std::chrono::microseconds delay{0};
  std::vector<Token> before;  ///< the accesses to its buffers it must come after
  bool poison = false;        ///< a reader saw it unfinished: it writes poison
};

struct AsyncStreams::Worker {
  std::uint32_t id = 0;
  std::deque<std::shared_ptr<Op>> queue;
  std::thread thread;
};

struct AsyncStreams::BlockState {
  Token last_write;
  std::shared_ptr<Op> writer;  ///< the copy that writes it last, until it ran
  std::vector<Token> readers;  ///< reads since the last write
  int in_flight = 0;           ///< queued copies that use it
};

struct AsyncStreams::Grave {
  Block block;
  std::vector<Token> points;  ///< the streams' points of the free
  Release release;
  /// The points were reached (and the block poisoned if nobody else holds it).
  bool poisoned = false;
};

AsyncStreams::AsyncStreams(const LoopbackConfig& config)
    : config_(config), rng_(config.seed), poisoner_([this] { run_poisoner(); }) {}

AsyncStreams::~AsyncStreams() {
  {
    std::unique_lock lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }
  for (auto& worker : workers_) {
    if (worker && worker->thread.joinable()) worker->thread.join();
  }
  if (poisoner_.joinable()) poisoner_.join();
  // Nothing runs beside the host any more: the lock is not needed, and must not be held.
  for (Grave& grave : graves_) grave.release.let_go();
}

void AsyncStreams::add_stream(std::uint32_t id, bool compute, std::string_view name) {
  std::unique_lock lock(mutex_);
  FERRY_CHECK(id == compute_.size(), "loopback streams are added in order (got {}, expected {})",
              id, compute_.size());
  compute_.push_back(compute);
  slow_.push_back(!config_.slow_stream.empty() && name == config_.slow_stream);
  pending_.emplace_back();
  finish_.push_back(Clock::now());
  workers_.push_back(nullptr);
  if (!compute) {
    workers_.back() = std::make_unique<Worker>();
    Worker& worker = *workers_.back();
    worker.id = id;
    worker.thread = std::thread([this, &worker] { run_worker(worker); });
  }
}

std::chrono::microseconds AsyncStreams::draw() {
  if (config_.max_delay.count() <= 0) return std::chrono::microseconds(0);
  std::uniform_int_distribution<std::int64_t> delay(0, config_.max_delay.count());
  return std::chrono::microseconds(delay(rng_));
}

std::chrono::microseconds AsyncStreams::lag(std::uint32_t id) const {
  return slow_[id] ? config_.slow_by : std::chrono::microseconds(0);
}

bool AsyncStreams::done(const Token& token, Clock::time_point now) const {
  if (!token) return true;
  if (!token->signalled || now < token->ready) return false;
  for (const Token& t : token->after) {
    if (!done(t, now)) return false;
  }
  token->after.clear();  // done for good
  return true;
}

AsyncStreams::Clock::time_point AsyncStreams::deadline(const Token& token) {
  if (!token) return {};
  Clock::time_point at = token->ready;
  for (const Token& t : token->after) at = std::max(at, deadline(t));
  return at;
}

void AsyncStreams::block_until(std::unique_lock<std::mutex>& lock, const Token& token) {
  for (;;) {
    const Clock::time_point now = Clock::now();
    if (done(token, now)) return;
    // Done at its deadline, unless a copy stream has still to reach a point in it: its worker
    // signals that.
    const Clock::time_point at = deadline(token);
    if (at > now) {
      changed_.wait_until(lock, at);
    } else {
      changed_.wait(lock);
    }
  }
}

AsyncStreams::Token AsyncStreams::compute_point(std::uint32_t id) {
  finish_[id] = std::max(finish_[id], Clock::now() + draw() + lag(id));
  auto token = std::make_shared<TokenState>();
  token->stream = id;
  token->signalled = true;
  token->ready = finish_[id];
  token->after = pending_[id];
  return token;
}

void AsyncStreams::set_current(std::uint32_t id) {
  collect();
  std::unique_lock lock(mutex_);
  for (const Token& t : pending_[id]) block_until(lock, t);
  pending_[id].clear();
  current_ = id;
}

AsyncStreams::Token AsyncStreams::record(std::uint32_t id) {
  collect();
  std::unique_lock lock(mutex_);
  if (compute_[id]) return compute_point(id);
  auto op = std::make_shared<Op>();
  op->kind = Op::Kind::Signal;
  op->token = std::make_shared<TokenState>();
  op->token->stream = id;
  workers_[id]->queue.push_back(op);
  changed_.notify_all();
  return op->token;
}

void AsyncStreams::wait(std::uint32_t id, const Token& token) {
  if (!token) return;
  std::unique_lock lock(mutex_);
  if (compute_[id]) {
    if (id == current_) {
      block_until(lock, token);
    } else {
      pending_[id].push_back(token);
    }
    return;
  }
  auto op = std::make_shared<Op>();
  op->kind = Op::Kind::Wait;
  op->token = token;
  workers_[id]->queue.push_back(op);
  changed_.notify_all();
}

void AsyncStreams::synchronize(std::uint32_t id) {
  const Token point = record(id);
  std::unique_lock lock(mutex_);
  block_until(lock, point);
}

AsyncStreams::BlockState& AsyncStreams::state_of(const void* key) { return blocks_[key]; }

void AsyncStreams::copy(std::uint32_t id, Block src, std::size_t src_offset, Block dst,
                        std::size_t dst_offset, std::size_t bytes) {
  collect();
  std::unique_lock lock(mutex_);
  auto op = std::make_shared<Op>();
  op->token = std::make_shared<TokenState>();
  op->token->stream = id;
  op->src = src;
  op->dst = dst;
  op->src_offset = src_offset;
  op->dst_offset = dst_offset;
  op->bytes = bytes;
  BlockState& s = state_of(src.key);
  BlockState& d = state_of(dst.key);
  // What the copy must come after: the last write of each buffer and the reads of the one it
  // writes. Only those of other streams can race: a stream runs its own work in order.
  for (const Token* t : {&s.last_write, &d.last_write}) {
    if (*t && (*t)->stream != id) op->before.push_back(*t);
  }
  for (const Token& t : d.readers) {
    if (t->stream != id) op->before.push_back(t);
  }
  const Clock::time_point now = Clock::now();
  std::erase_if(s.readers, [&](const Token& t) { return done(t, now); });
  d.readers.clear();
  if (compute_[id]) {
    // The host is the compute stream: the copy runs now, after what the stream waits for.
    for (const Token& t : pending_[id]) block_until(lock, t);
    pending_[id].clear();
    ++s.in_flight;
    ++d.in_flight;
    execute_copy(*op, lock);
    Token end = compute_point(id);
    s.readers.push_back(end);
    d.last_write = end;
    d.writer = nullptr;
    return;
  }
  op->delay = draw() + lag(id);
  ++s.in_flight;
  ++d.in_flight;
  s.readers.push_back(op->token);
  d.last_write = op->token;
  d.writer = op;
  workers_[id]->queue.push_back(op);
  changed_.notify_all();
}

void AsyncStreams::execute_copy(Op& op, std::unique_lock<std::mutex>& lock) {
  const Clock::time_point now = Clock::now();
  const bool race = std::any_of(op.before.begin(), op.before.end(),
                                [&](const Token& t) { return !done(t, now); });
  if (race) ++races_;
  const Block& src = op.src;
  const Block& dst = op.dst;
  const bool poisoned = race || op.poison;
  lock.unlock();
  if (poisoned) {
    std::memset(dst.data + op.dst_offset, 0xFF, op.bytes);
  } else if (op.bytes > 0) {
    std::memcpy(dst.data + op.dst_offset, src.data + op.src_offset, op.bytes);
  }
  lock.lock();
  // A reader that saw this copy unfinished while it ran: what it wrote is poison too.
  if (op.poison && !poisoned) std::memset(dst.data + op.dst_offset, 0xFF, op.bytes);
  op.token->signalled = true;
  op.before.clear();
  op.src.owner = nullptr;
  op.dst.owner = nullptr;
  --blocks_[src.key].in_flight;
  --blocks_[dst.key].in_flight;
  BlockState& d = blocks_[dst.key];
  if (d.writer.get() == &op) d.writer = nullptr;
  changed_.notify_all();
}

void AsyncStreams::run_worker(Worker& worker) {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !worker.queue.empty(); });
    if (worker.queue.empty()) return;  // stopping, and nothing left to run
    const std::shared_ptr<Op> op = worker.queue.front();
    switch (op->kind) {
      case Op::Kind::Signal:
        op->token->signalled = true;
        changed_.notify_all();
        break;
      case Op::Kind::Wait:
        block_until(lock, op->token);
        break;
      case Op::Kind::Copy:
        if (op->delay.count() > 0) {
          lock.unlock();
          std::this_thread::sleep_for(op->delay);
          lock.lock();
        }
        execute_copy(*op, lock);
        break;
    }
    worker.queue.pop_front();
  }
}

void AsyncStreams::allocated(Block block) { poison(block); }

void AsyncStreams::produced(Block block) {
  collect();
  std::unique_lock lock(mutex_);
  BlockState& s = state_of(block.key);
  s.last_write = compute_point(current_);
  s.writer = nullptr;
  s.readers.clear();
}

void AsyncStreams::consumed(Block block) {
  std::unique_lock lock(mutex_);
  BlockState& s = state_of(block.key);
  if (s.last_write && s.last_write->stream != current_ && !done(s.last_write, Clock::now())) {
    // Compute reads bytes still being written: what it sees, and what the writer leaves, is
    // poison.
    ++races_;
    poison(block);
    if (s.writer) s.writer->poison = true;
  }
  const Clock::time_point now = Clock::now();
  std::erase_if(s.readers, [&](const Token& t) { return done(t, now); });
  s.readers.push_back(compute_point(current_));
}

void AsyncStreams::poison(const Block& block) {
  if (block.bytes > 0) std::memset(block.data, 0xFF, block.bytes);
}

void AsyncStreams::release(Block block, const std::vector<std::uint32_t>& streams,
                           Release release) {
  std::vector<Token> points;
  points.reserve(streams.size());
  for (const std::uint32_t s : streams) points.push_back(record(s));
  std::unique_lock lock(mutex_);
  graves_.push_back(Grave{block, std::move(points), std::move(release), false});
  changed_.notify_all();
}

void AsyncStreams::run_poisoner() {
  std::unique_lock lock(mutex_);
  for (;;) {
    const Clock::time_point now = Clock::now();
    std::vector<Grave*> due;  // a list's elements stay put while the lock is dropped
    bool waiting = false;
    std::optional<Clock::time_point> wake;
    for (Grave& grave : graves_) {
      if (grave.poisoned) continue;
      if (std::all_of(grave.points.begin(), grave.points.end(),
                      [&](const Token& t) { return done(t, now); })) {
        due.push_back(&grave);
        continue;
      }
      waiting = true;
      Clock::time_point at{};
      for (const Token& t : grave.points) at = std::max(at, deadline(t));
      if (at > now && (!wake || at < *wake)) wake = at;
    }
    if (!due.empty()) {
      // The blocks go back to their pool: what the allocator's next user writes is poison.
      // Unpoisoned graves stay where they are (collect() takes poisoned ones only).
      lock.unlock();
      for (Grave* grave : due) {
        if (grave->release.sole_holder()) poison(grave->block);
      }
      lock.lock();
      for (Grave* grave : due) {
        grave->poisoned = true;
        grave->points.clear();
      }
      continue;
    }
    if (stopping_ && !waiting) return;
    // A grave's points are reached by its deadline, or when a worker signals one.
    if (wake) {
      changed_.wait_until(lock, *wake);
    } else {
      changed_.wait(lock);
    }
  }
}

void AsyncStreams::collect() {
  std::vector<Release> due;
  {
    std::unique_lock lock(mutex_);
    for (auto it = graves_.begin(); it != graves_.end();) {
      if (!it->poisoned) {
        ++it;
        continue;
      }
      const auto state = blocks_.find(it->block.key);
      if (state != blocks_.end()) {
        if (state->second.in_flight > 0) {
          ++it;
          continue;
        }
        blocks_.erase(state);
      }
      due.push_back(std::move(it->release));
      it = graves_.erase(it);
    }
  }
  for (Release& release : due) release.let_go();
}

std::int64_t AsyncStreams::races() const {
  std::unique_lock lock(mutex_);
  return races_;
}

}  // namespace ferry::real
