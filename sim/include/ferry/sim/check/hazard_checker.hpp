#pragma once
/// Happens-before race detection over byte ranges with vector clocks.
///
/// Threads are the host (thread 0, or one per process: set_host) and every stream. Each operation
/// that touches memory is checked, at the moment the host issues it, against the earlier accesses
/// to the same bytes. The verdicts depend only on the happens-before graph (program order,
/// launches, event waits, synchronizations), never on simulated timing, so a program is judged for
/// every interleaving its synchronization allows. See Note [Access frontiers].
///
/// Frees are judged the same way: at each free the checker decides whether every access to
/// the freed bytes is ordered before the point where the allocator may hand them out again,
/// whether or not the simulated run does reuse them. See Note [Latent reuse].

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <tuple>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/sim/support/node_pool.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// A timeline with its own vector-clock component: 0 is the host, 1 + n is stream n.
using ThreadIndex = std::uint32_t;
inline constexpr ThreadIndex kHostThread = 0;

/// A memory space: one per device, plus one for host memory.
using SpaceIndex = std::uint32_t;

/// What kind of operation made an access (used to classify reports).
enum class AccessOrigin : std::uint8_t { Kernel, Copy, Host };

enum class HazardKind : std::uint8_t {
  Race,            ///< two accesses to one allocation, at least one a write, not ordered
  Reuse,           ///< memory freed and handed to a new allocation, touched without ordering
  HostBeforeCopy,  ///< the host touched a buffer a copy was still using
  UseAfterFree,    ///< an operation named an allocation that was already freed
  DoubleFree,      ///< an allocation freed twice
  UseBeforeAlloc,  ///< an operation named a buffer slot with no memory
  LatentReuse,     ///< memory freed while an access to it may still run: a later owner races
};

enum class Conflict : std::uint8_t { None, ReadAfterWrite, WriteAfterRead, WriteAfterWrite };

/// One finding: the earlier and the later operation, and the bytes they share.
struct Hazard {
  HazardKind kind = HazardKind::Race;
  /// For LatentReuse: the earlier access against a write by the next owner (WriteAfterRead or
  /// WriteAfterWrite).
  Conflict conflict = Conflict::None;
  OpId first;             ///< earlier access (or the free, for UseAfterFree/DoubleFree)
  OpId second;            ///< later access (the free, for LatentReuse)
  BufferId first_buffer;  ///< allocation the earlier op touched
  BufferId second_buffer;
  SpaceIndex space = 0;
  Bytes lo;  ///< first byte address of the shared range
  Bytes hi;  ///< one past the last byte
  /// For LatentReuse: the first access by a later owner of these bytes that the earlier access
  /// was not ordered before (the simulated run did reuse them); invalid when none was seen.
  OpId reused_by{};
  BufferId reused_buffer{};  ///< the allocation reused_by touched
};

/// Test-only switches that break the checker on purpose (planted faults).
struct CheckerFaults {
  bool ignore_event_waits = false;  ///< forget every stream-waits-event edge
  bool skip_write_after_read = false;
  /// A free deferred by record_stream on one stream is taken to wait for every stream.
  bool deferral_covers_every_stream = false;
  /// The next owner of a deferred free's bytes is not ordered after its markers.
  bool ignore_floors = false;
};

class HazardChecker {
 public:
  explicit HazardChecker(CheckerFaults faults = {}) : faults_(faults) {}
  // Move-only, and not move-assignable: the shadow's nodes live in the pool it owns.
  HazardChecker(HazardChecker&&) noexcept = default;
  HazardChecker& operator=(HazardChecker&&) = delete;

  /// Adds a stream timeline; returns its thread index.
  ThreadIndex add_thread();
  [[nodiscard]] std::size_t thread_count() const { return clocks_.size(); }

  /// Makes `thread` the host thread issuing what follows: a process of its own, whose host is
  /// ordered with the others' only through the streams it waits for. Thread 0 until called.
  void set_host(ThreadIndex thread);
  [[nodiscard]] ThreadIndex host() const { return host_; }

  /// Starts an operation on `thread` issued by the host now: a stream inherits everything the
  /// host did before the launch. Must precede that operation's access() calls.
  void begin_op(ThreadIndex thread);
  /// Checks and records one access of the current operation of `thread`.
  void access(ThreadIndex thread, OpId op, AccessOrigin origin, BufferId buffer, SpaceIndex space,
              Bytes lo, Bytes hi, bool write);

  /// Snapshot of `thread`'s clock joined with the host's (an event record issued now).
  [[nodiscard]] std::uint32_t capture(ThreadIndex thread);
  /// `thread` waits for a captured snapshot (stream-waits-event).
  void wait(ThreadIndex thread, std::uint32_t snapshot);
  /// The host learns that a captured snapshot completed (event sync or successful query).
  void host_observes(std::uint32_t snapshot);
  /// The host learns that everything issued so far on `thread` completed (stream sync).
  void host_joins(ThreadIndex thread);

  /// The host frees `buffer`, which held [lo, hi) of `space`, in op `free_op`. The allocator
  /// may hand the bytes out once the host has reached this point and every thread in
  /// `alloc_threads` (whose later work is stream-ordered after the reuse: a device block's
  /// allocation stream) and in `deferred` (record_stream: the allocator waits for markers on
  /// them) has finished the work issued so far. Reports a LatentReuse hazard for each access
  /// to the buffer not ordered before that point. See Note [Latent reuse].
  void release(OpId free_op, BufferId buffer, SpaceIndex space, Bytes lo, Bytes hi,
               std::span<const ThreadIndex> alloc_threads, std::span<const ThreadIndex> deferred);
  /// `buffer` now holds [lo, hi) of `space`. Bytes a deferred free returned are handed out only
  /// after its markers completed, so the buffer's accesses are ordered after them.
  void allocated(BufferId buffer, SpaceIndex space, Bytes lo, Bytes hi);

  void report(Hazard hazard) { hazards_.push_back(hazard); }
  [[nodiscard]] const std::vector<Hazard>& hazards() const { return hazards_; }
  /// Byte-range segments and access entries currently tracked (memory use of the shadow).
  [[nodiscard]] std::size_t tracked_segments() const;
  [[nodiscard]] std::size_t tracked_entries() const;

 private:
  struct Access {
    ThreadIndex thread = 0;
    std::uint32_t epoch = 0;
    OpId op;
    BufferId buffer;
    AccessOrigin origin = AccessOrigin::Kernel;
    bool latent = false;  // reported as LatentReuse at its buffer's free (fits the padding)
    friend bool operator==(const Access&, const Access&) = default;
  };
  // An access set: at most one entry per thread, nearly always one or two. The first
  // kInline entries live in the segment itself, so splitting a segment allocates nothing.
  class AccessSet {
   public:
    [[nodiscard]] std::size_t size() const { return size_; }
    [[nodiscard]] const Access* begin() const { return data(); }
    [[nodiscard]] const Access* end() const { return data() + size_; }
    Access* begin() { return data(); }
    Access* end() { return data() + size_; }
    void push_back(const Access& a);
    template <class Pred>
    void erase_if(Pred pred) {
      Access* d = data();
      std::size_t kept = 0;
      for (std::size_t i = 0; i < size_; ++i) {
        if (!pred(d[i])) d[kept++] = d[i];
      }
      size_ = kept;
      if (!spill_.empty()) spill_.resize(size_);
    }
    friend bool operator==(const AccessSet& a, const AccessSet& b) {
      if (a.size_ != b.size_) return false;
      for (std::size_t i = 0; i < a.size_; ++i) {
        if (!(a.data()[i] == b.data()[i])) return false;
      }
      return true;
    }

   private:
    static constexpr std::size_t kInline = 3;
    [[nodiscard]] const Access* data() const { return spill_.empty() ? inline_ : spill_.data(); }
    Access* data() { return spill_.empty() ? inline_ : spill_.data(); }
    Access inline_[kInline]{};
    std::size_t size_ = 0;
    std::vector<Access> spill_;  // holds all entries once there are more than kInline
  };
  struct Segment {
    Bytes hi;
    AccessSet reads;
    AccessSet writes;
  };
  using Clock = std::vector<std::uint32_t>;
  // Keyed by first byte; nodes from pool_ (Note [Node pools] in node_pool.hpp).
  using Shadow = std::map<std::int64_t, Segment, std::less<>,
                          NodePoolAllocator<std::pair<const std::int64_t, Segment>>>;

  static void join(Clock& into, const Clock& from);
  [[nodiscard]] bool ordered_before(const Access& a, const Clock& now) const;
  Shadow::iterator split(Shadow& shadow, std::int64_t at);
  /// Merges equal neighbours from `it` through the segment that starts at `hi`.
  void coalesce(Shadow& shadow, Shadow::iterator it, std::int64_t hi);
  /// The clock `thread`'s access to `buffer` is ordered by: the thread's, joined with the
  /// buffer's floor when it holds bytes of a deferred free (Note [Latent reuse]).
  const Clock& access_clock(ThreadIndex thread, BufferId buffer);
  /// Records `self` as its thread's latest access to its buffer (last_access_).
  void note_last_access(const Access& self);
  /// Reports that `self`, over [lo, hi) of `space`, is not ordered after `earlier`: extends a
  /// report of this access made since hazards_[first_new], or joins a latent reuse reported
  /// at the free, or adds a hazard.
  void emit(const Access& earlier, const Access& self, SpaceIndex space, std::size_t first_new,
            Conflict conflict, std::int64_t lo, std::int64_t hi);

  // The bytes [lo, hi) of a deferred free, and what its markers captured.
  struct Floor {
    std::int64_t hi;
    std::uint32_t snapshot;
  };
  struct FloorMap {
    std::multimap<std::int64_t, Floor> ranges;  // by first byte; none inside a newer one
    std::int64_t longest = 0;                   // longest range, to bound an overlap search
  };
  static constexpr std::uint32_t kNoFloor = 0xffffffffU;

  CheckerFaults faults_;
  ThreadIndex host_ = kHostThread;  // the host thread issuing calls now
  std::vector<Clock> clocks_{Clock(1, 0)};
  std::vector<Clock> snapshots_;
  std::unique_ptr<NodePool> pool_ = std::make_unique<NodePool>();
  std::vector<Shadow> spaces_;
  std::vector<Hazard> hazards_;
  std::vector<FloorMap> floors_;             // per space
  std::vector<std::uint32_t> buffer_floor_;  // per buffer: snapshot, or kNoFloor
  Clock scratch_;                            // a thread's clock joined with a floor
  Clock reuse_;                              // a free's reuse point
  // Per buffer: the epoch of each thread's latest access to it. A free whose reuse point is
  // after every one needs no look at the shadow. A buffer is mostly touched by one or two
  // threads (the stream that made it, a copy engine), kept inline; a third and later ones go
  // to a row of every thread's epoch (0: none) in `spills_`, given back at the free.
  struct LastAccess {
    static constexpr ThreadIndex kNone = ~ThreadIndex{0};
    ThreadIndex thread[2] = {kNone, kNone};
    std::uint32_t epoch[2] = {0, 0};
    std::uint32_t spill = 0;  // 1 + the row in spills_, or 0
  };
  std::vector<LastAccess> last_access_;
  std::vector<std::vector<std::uint32_t>> spills_;
  std::vector<std::uint32_t> free_spills_;  // rows of spills_ given back, all zero
  // LatentReuse reports by (access op, its buffer, whether it wrote): an observed reuse of
  // the same access adds to that report rather than making a second one.
  std::map<std::tuple<std::uint32_t, std::uint32_t, bool>, std::size_t> latent_;
};

}  // namespace ferry::sim
