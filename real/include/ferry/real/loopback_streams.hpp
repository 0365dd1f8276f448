#pragma once
/// The loopback device's streams when they run asynchronously: copy streams on worker threads,
/// compute streams that finish some time after the host issued their work, real events and
/// waits, and buffers poisoned where a race went the wrong way. Knows nothing of torch: a
/// buffer is a key (its storage), its bytes, and what to do when it is let go.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace ferry::real {

/// How the loopback device runs its streams.
struct LoopbackStreams {
  bool async = false;  ///< false: every copy runs at once on the host (deterministic)
  std::uint64_t seed = 0;
  /// Each copy starts up to this long after the stream reaches it, and each compute stream's
  /// work issued so far ends up to this long after it was issued (seeded, uniform).
  std::chrono::microseconds max_delay{1000};
  /// Each copy on the copy stream named `slow_stream` takes `slow_copy` longer (a congested
  /// link): a test's way to keep one stream far behind the others. C++ only.
  std::string slow_stream;
  std::chrono::microseconds slow_copy{0};

  friend bool operator==(const LoopbackStreams&, const LoopbackStreams&) = default;
};

/// "sync", "async", "async:SEED" or "async:SEED:MAX_DELAY_US" ("" is "sync"); a malformed text
/// throws std::invalid_argument naming `where` (the option or variable it came from).
[[nodiscard]] LoopbackStreams parse_loopback_streams(std::string_view text, std::string_view where);
/// The text parse_loopback_streams() reads back.
[[nodiscard]] std::string to_string(const LoopbackStreams& streams);

// Note [The asynchronous loopback device]
// On a GPU an ordering bug (a copy that does not wait for the kernel that wrote its source, a
// kernel that reads a reload before it lands, a block freed or a pinned buffer rewritten while
// a copy still uses it) gives wrong bytes only when the race goes the wrong way. On the CPU
// nothing races unless something runs concurrently, so this device makes the GPU's timing
// real and the wrong way visible:
//
// * Each copy stream is a worker thread running its copies, event records and waits in issue
//   order; each copy starts a seeded random delay (0 to max_delay) after the worker reaches it.
// * Compute runs on the host thread, at once, but the work a compute stream has been given
//   counts as finished only a seeded random delay after it was issued (the kernels a GPU is
//   still running): an event recorded on a compute stream completes then, and a tensor packed
//   from a compute stream is written then. A wait by the current compute stream blocks the
//   host; a wait by another compute stream is held until that stream becomes current again.
// * Each buffer remembers its last writer and its readers (a copy, or compute on a stream).
//   A copy that starts while the last write of its source or destination, or a read of its
//   destination, by another stream has not finished, and compute that reads a buffer whose
//   last write by another stream has not finished, observed a race: the destination (the read
//   buffer) is poisoned with 0xFF bytes (NaN in every floating type), and a copy still to
//   write it writes poison too. Work on one stream is ordered by the stream and never races
//   with itself.
// * New buffers start poisoned. A buffer let go is poisoned (when nobody else holds its
//   storage) once the streams it was allocated on or recorded for reach the point of the
//   free, as the caching allocator hands the block out again; its storage is released later,
//   on the host, when no copy in flight uses it (so a race never touches freed memory).
//
// So a missing wait or an early free or reuse gives NaN or wrong gradients with high
// probability over a step's many copies, while a correct schedule gives exactly the
// synchronous device's results for every seed. Delays come from one generator seeded by
// LoopbackStreams::seed and drawn on the host in issue order; the interleaving of threads is
// the operating system's, so what varies between runs is only whether a race shows.

/// The streams of one asynchronous loopback device. Calls come from the host in program order
/// (one thread at a time); the workers and the poisoner run beside it.
class AsyncStreams {
 public:
  struct TokenState;
  /// A point in a stream's work: done once everything before it is.
  using Token = std::shared_ptr<TokenState>;

  /// A buffer: its storage (the key), its bytes, how many, and what keeps them alive while a
  /// copy that uses them is queued.
  struct Block {
    const void* key = nullptr;
    std::uint8_t* data = nullptr;
    std::size_t bytes = 0;
    std::shared_ptr<const void> owner;
  };

  explicit AsyncStreams(const LoopbackStreams& config);
  ~AsyncStreams();
  AsyncStreams(const AsyncStreams&) = delete;
  AsyncStreams& operator=(const AsyncStreams&) = delete;

  /// Stream `id` (ids are dense, from 0) named `name`: a compute stream runs on the host; a
  /// copy stream gets a worker thread.
  void add_stream(std::uint32_t id, bool compute, std::string_view name = {});
  /// Compute stream `id` becomes current: the host waits for what it was told to wait for.
  void set_current(std::uint32_t id);

  /// The point stream `id` has reached in what was issued to it (an event record).
  Token record(std::uint32_t id);
  /// Stream `id` waits for `token` before its later work (null: nothing to wait for).
  void wait(std::uint32_t id, const Token& token);
  /// The host waits until stream `id` has finished what was issued to it.
  void synchronize(std::uint32_t id);

  /// Copies `bytes` from `src` + `src_offset` to `dst` + `dst_offset` on stream `id`.
  void copy(std::uint32_t id, Block src, std::size_t src_offset, Block dst, std::size_t dst_offset,
            std::size_t bytes);
  /// Compute on the current stream wrote `block` (a tensor packed just now).
  void produced(Block block);
  /// Compute on the current stream reads `block` from now on.
  void consumed(Block block);
  /// Fills `block` with poison (a new buffer).
  static void poison(Block block);

  /// What a let-go buffer still needs: whether nobody else holds its storage (then it is
  /// poisoned), and the release of the device's reference, run on the host.
  struct Release {
    std::function<bool()> sole_holder;
    std::function<void()> let_go;
  };
  /// `block` is let go on `streams` (its allocation stream and those recorded for it).
  void release(Block block, const std::vector<std::uint32_t>& streams, Release release);

  /// Races observed so far (each poisoned a buffer).
  [[nodiscard]] std::int64_t races() const;

 private:
  struct Op;
  struct Worker;
  struct BlockState;
  struct Grave;
  using Clock = std::chrono::steady_clock;

  [[nodiscard]] bool done(const Token& token, Clock::time_point now) const;
  void block_until(std::unique_lock<std::mutex>& lock, const Token& token);
  Token compute_point(std::uint32_t id);
  std::chrono::microseconds draw();
  void run_worker(Worker& worker);
  void run_poisoner();
  void execute_copy(Op& op, std::unique_lock<std::mutex>& lock);
  void collect(std::unique_lock<std::mutex>& lock);
  BlockState& state_of(const void* key);

  LoopbackStreams config_;
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
  std::deque<Grave> graves_;
  std::int64_t races_ = 0;
  std::thread poisoner_;
};

}  // namespace ferry::real
