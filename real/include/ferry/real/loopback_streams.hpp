#pragma once
/// The loopback device's streams: one interface, with an inline implementation (every copy at
/// once on the host, nothing to wait for) and an asynchronous one (copy streams on worker
/// threads, compute streams that finish some time after the host issued their work, real events
/// and waits, and buffers poisoned where a race went the wrong way). The device picks one when
/// it is made and never branches on which. Knows nothing of torch: a buffer is a key (its
/// storage), its bytes, and what to do when it is let go.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include "ferry/real/loopback_config.hpp"

namespace ferry::real {

// Note [The asynchronous loopback device]
// On a GPU an ordering bug (a copy that does not wait for the kernel that wrote its source, a
// kernel that reads a reload before it lands, a block freed or a pinned buffer rewritten while
// a copy still uses it) gives wrong bytes only when the race goes the wrong way. On the CPU
// nothing races unless something runs concurrently, so AsyncStreams makes the GPU's timing
// real and the wrong way visible:
//
// * Each copy stream is a worker thread running its copies, event records and waits in issue
//   order; each copy starts a seeded random delay (0 to max_delay) after the worker reaches it.
// * Compute runs on the host thread, at once, but the work a compute stream has been given
//   counts as finished only a seeded random delay after it was issued (the kernels a GPU is
//   still running): an event recorded on a compute stream completes then, and a tensor packed
//   from a compute stream is written then. A wait by the current compute stream blocks the
//   host; a wait by another compute stream is held until that stream becomes current again.
//   Whoever waits (the host, a worker, the poisoner) sleeps on a condition variable until the
//   deadline at which what it waits for completes, or until a worker signals.
// * Each buffer remembers its last writer and its readers (a copy, or compute on a stream).
//   A copy that starts while the last write of its source or destination, or a read of its
//   destination, by another stream has not finished, and compute that reads a buffer whose
//   last write by another stream has not finished, observed a race: the destination (the read
//   buffer) is poisoned with 0xFF bytes (NaN in every floating type), and a copy still to
//   write it writes poison too. Work on one stream is ordered by the stream and never races
//   with itself. These are the races `ferry check`'s HazardChecker reports from the recorded
//   program (read-after-write, write-after-read, write-after-write), met here on real bytes
//   in one interleaving instead of judged for all of them.
// * New buffers start poisoned. A buffer let go is poisoned (when nobody else holds its
//   storage) once the streams it was allocated on or recorded for reach the point of the
//   free, as the caching allocator hands the block out again (the checker's reuse rules); its
//   storage is released later, on the host, when no copy in flight uses it (so a race never
//   touches freed memory). Both callbacks of a Release run with the streams' mutex unlocked.
//
// So a missing wait or an early free or reuse gives NaN or wrong gradients with high
// probability over a step's many copies, while a correct schedule gives exactly the inline
// streams' results for every seed. Delays come from one generator seeded by
// LoopbackConfig::seed and drawn on the host in issue order; the interleaving of threads is
// the operating system's, so what varies between runs is only whether a race shows.

/// The streams of one loopback device, as the device drives them. Calls come from the host in
/// program order (one thread at a time). Stream ids are dense, from 0.
class LoopbackStreams {
 public:
  struct TokenState;
  /// A point in a stream's work: done once everything before it is (null: nothing to wait for).
  using Token = std::shared_ptr<TokenState>;

  /// A buffer: its storage (the key), its bytes, how many, and what keeps them alive while a
  /// copy that uses them is queued.
  struct Block {
    const void* key = nullptr;
    std::uint8_t* data = nullptr;
    std::size_t bytes = 0;
    std::shared_ptr<const void> owner;
  };

  /// What a let-go buffer still needs: whether nobody else holds its storage (then it may be
  /// poisoned), and the release of the device's reference. Run on a thread of the streams'
  /// choosing, never under their lock.
  struct Release {
    std::function<bool()> sole_holder;
    std::function<void()> let_go;
  };

  LoopbackStreams() = default;
  virtual ~LoopbackStreams() = default;
  LoopbackStreams(const LoopbackStreams&) = delete;
  LoopbackStreams& operator=(const LoopbackStreams&) = delete;

  /// Stream `id` (the next id) named `name`: a compute stream runs on the host; a copy stream
  /// has its own order.
  virtual void add_stream(std::uint32_t id, bool compute, std::string_view name) = 0;
  /// Compute stream `id` becomes current: the host waits for what it was told to wait for.
  virtual void set_current(std::uint32_t id) = 0;
  /// The point stream `id` has reached in what was issued to it (an event record).
  virtual Token record(std::uint32_t id) = 0;
  /// Stream `id` waits for `token` before its later work.
  virtual void wait(std::uint32_t id, const Token& token) = 0;
  /// The host waits until stream `id` has finished what was issued to it.
  virtual void synchronize(std::uint32_t id) = 0;
  /// Copies `bytes` from `src` + `src_offset` to `dst` + `dst_offset` on stream `id`.
  virtual void copy(std::uint32_t id, Block src, std::size_t src_offset, Block dst,
                    std::size_t dst_offset, std::size_t bytes) = 0;
  /// `block` was just allocated (its bytes are whatever the allocator left).
  virtual void allocated(Block block) = 0;
  /// Compute on the current stream wrote `block` (a tensor packed just now).
  virtual void produced(Block block) = 0;
  /// Compute on the current stream reads `block` from now on.
  virtual void consumed(Block block) = 0;
  /// `block` is let go on `streams` (its allocation stream and those recorded for it).
  virtual void release(Block block, const std::vector<std::uint32_t>& streams, Release release) = 0;
  /// Races observed so far (each poisoned a buffer).
  [[nodiscard]] virtual std::int64_t races() const = 0;
};

/// The streams `config` asks for: InlineStreams, or AsyncStreams when `config.async`.
[[nodiscard]] std::unique_ptr<LoopbackStreams> make_loopback_streams(const LoopbackConfig& config);

/// Every stream is the host: a copy runs at once, a free lets go at once, and there is never
/// anything to wait for (deterministic; sees no race).
class InlineStreams final : public LoopbackStreams {
 public:
  void add_stream(std::uint32_t /*id*/, bool /*compute*/, std::string_view /*name*/) override {}
  void set_current(std::uint32_t /*id*/) override {}
  Token record(std::uint32_t /*id*/) override { return nullptr; }
  void wait(std::uint32_t /*id*/, const Token& /*token*/) override {}
  void synchronize(std::uint32_t /*id*/) override {}
  void copy(std::uint32_t id, Block src, std::size_t src_offset, Block dst, std::size_t dst_offset,
            std::size_t bytes) override;
  void allocated(Block /*block*/) override {}
  void produced(Block /*block*/) override {}
  void consumed(Block /*block*/) override {}
  void release(Block block, const std::vector<std::uint32_t>& streams, Release release) override;
  [[nodiscard]] std::int64_t races() const override { return 0; }
};

/// The streams of one asynchronous loopback device (Note [The asynchronous loopback device]):
/// the workers and the poisoner run beside the host.
class AsyncStreams final : public LoopbackStreams {
 public:
  explicit AsyncStreams(const LoopbackConfig& config);
  ~AsyncStreams() override;

  void add_stream(std::uint32_t id, bool compute, std::string_view name) override;
  void set_current(std::uint32_t id) override;
  Token record(std::uint32_t id) override;
  void wait(std::uint32_t id, const Token& token) override;
  void synchronize(std::uint32_t id) override;
  void copy(std::uint32_t id, Block src, std::size_t src_offset, Block dst, std::size_t dst_offset,
            std::size_t bytes) override;
  /// Fills `block` with poison: what a reader that is too early sees.
  void allocated(Block block) override;
  void produced(Block block) override;
  void consumed(Block block) override;
  void release(Block block, const std::vector<std::uint32_t>& streams, Release release) override;
  [[nodiscard]] std::int64_t races() const override;

 private:
  struct Op;
  struct Worker;
  struct BlockState;
  struct Grave;
  using Clock = std::chrono::steady_clock;

  [[nodiscard]] bool done(const Token& token, Clock::time_point now) const;
  [[nodiscard]] static Clock::time_point deadline(const Token& token);
  void block_until(std::unique_lock<std::mutex>& lock, const Token& token);
  Token compute_point(std::uint32_t id);
  std::chrono::microseconds draw();
  [[nodiscard]] std::chrono::microseconds lag(std::uint32_t id) const;  // slow_by, or 0
  void run_worker(Worker& worker);
  void run_poisoner();
  void execute_copy(Op& op, std::unique_lock<std::mutex>& lock);
  void collect();
  BlockState& state_of(const void* key);
  static void poison(const Block& block);

  LoopbackConfig config_;
  std::mt19937_64 rng_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  std::vector<bool> compute_;                     // by stream id
  std::vector<bool> slow_;                        // by stream id: named slow_stream
  std::vector<std::unique_ptr<Worker>> workers_;  // by stream id; null for compute streams
  std::vector<std::vector<Token>> pending_;       // compute streams: waits not yet taken
  std::vector<Clock::time_point> finish_;         // compute streams: when their work so far ends
  std::uint32_t current_ = 0;
  std::map<const void*, BlockState> blocks_;
  std::list<Grave> graves_;  // a list: the poisoner keeps its place across an unlock
  std::int64_t races_ = 0;
  std::thread poisoner_;
};

}  // namespace ferry::real
