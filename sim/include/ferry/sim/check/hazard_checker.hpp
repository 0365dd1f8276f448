#pragma once
/// Happens-before race detection over byte ranges with vector clocks.
///
/// Threads are the host (thread 0) and every stream. Each operation that touches memory is
/// checked, at the moment the host issues it, against the earlier accesses to the same bytes.
/// The verdicts depend only on the happens-before graph (program order, launches, event
/// waits, synchronizations), never on simulated timing, so a program is judged for every
/// interleaving its synchronization allows. See Note [Access frontiers].

#include <cstdint>
#include <map>
#include <vector>

#include "ferry/ids.hpp"
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
};

enum class Conflict : std::uint8_t { None, ReadAfterWrite, WriteAfterRead, WriteAfterWrite };

/// One finding: the earlier and the later operation, and the bytes they share.
struct Hazard {
  HazardKind kind = HazardKind::Race;
  Conflict conflict = Conflict::None;
  OpId first;             ///< earlier access (or the free, for UseAfterFree/DoubleFree)
  OpId second;            ///< later access
  BufferId first_buffer;  ///< allocation the earlier op touched
  BufferId second_buffer;
  SpaceIndex space = 0;
  Bytes lo;  ///< first byte address of the shared range
  Bytes hi;  ///< one past the last byte
};

/// Test-only switches that break the checker on purpose (planted faults).
struct CheckerFaults {
  bool ignore_event_waits = false;  ///< forget every stream-waits-event edge
  bool skip_write_after_read = false;
};

class HazardChecker {
 public:
  explicit HazardChecker(CheckerFaults faults = {}) : faults_(faults) {}

  /// Adds a stream timeline; returns its thread index.
  ThreadIndex add_thread();
  [[nodiscard]] std::size_t thread_count() const { return clocks_.size(); }

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
    friend bool operator==(const Access&, const Access&) = default;
  };
  // An access set: at most one entry per thread, nearly always one or two. The first
  // kInline entries live in the segment itself, so splitting a segment allocates nothing.
  class AccessSet {
   public:
    [[nodiscard]] std::size_t size() const { return size_; }
    [[nodiscard]] const Access* begin() const { return data(); }
    [[nodiscard]] const Access* end() const { return data() + size_; }
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
  using Shadow = std::map<std::int64_t, Segment>;  // keyed by first byte

  static void join(Clock& into, const Clock& from);
  [[nodiscard]] bool ordered_before(const Access& a, const Clock& now) const;
  Shadow::iterator split(Shadow& shadow, std::int64_t at);
  void coalesce(Shadow& shadow, std::int64_t lo, std::int64_t hi);

  CheckerFaults faults_;
  std::vector<Clock> clocks_{Clock(1, 0)};
  std::vector<Clock> snapshots_;
  std::vector<Shadow> spaces_;
  std::vector<Hazard> hazards_;
};

}  // namespace ferry::sim
