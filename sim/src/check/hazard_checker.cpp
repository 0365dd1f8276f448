#include "ferry/sim/check/hazard_checker.hpp"

#include <algorithm>

#include "ferry/check.hpp"

namespace ferry::sim {

// Note [Access frontiers]
// For every byte range the checker keeps two small sets: the writes and the reads that no
// later access of the same kind is known to follow. A new access is compared with each entry:
// an entry not ordered before it (its epoch is ahead of the new access's clock for the entry's
// thread) is a hazard. The new access then evicts the entries of its own kind that are
// ordered before it, and joins the set. Eviction loses no verdict: if A happens before A' (both
// writes, or both reads, of these bytes) and A races a later access B, then A' races B too,
// since A' -> B would give A -> B. So every racing pair (A, B) is reported through some A'
// with A = A' or A -> A', of the same kind, over the same bytes. Reads are not dropped when a
// write follows them, so a write-after-read is never reported only as a write-after-write.
// Each set is an antichain, at most one entry per thread: memory is bounded by the number of
// streams, whatever the program's length.

ThreadIndex HazardChecker::add_thread() {
  clocks_.emplace_back(clocks_.size() + 1, 0);
  return static_cast<ThreadIndex>(clocks_.size() - 1);
}

void HazardChecker::join(Clock& into, const Clock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (std::size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

bool HazardChecker::ordered_before(const Access& a, const Clock& now) const {
  return a.thread < now.size() && a.epoch <= now[a.thread];
}

void HazardChecker::begin_op(ThreadIndex thread) {
  FERRY_CHECK(thread < clocks_.size(), "unknown thread {}", thread);
  Clock& clock = clocks_[thread];
  if (thread != kHostThread) join(clock, clocks_[kHostThread]);
  if (clock.size() <= thread) clock.resize(thread + 1, 0);
  ++clock[thread];
}

std::uint32_t HazardChecker::capture(ThreadIndex thread) {
  Clock snapshot = clocks_[thread];
  join(snapshot, clocks_[kHostThread]);
  snapshots_.push_back(std::move(snapshot));
  return static_cast<std::uint32_t>(snapshots_.size() - 1);
}

void HazardChecker::wait(ThreadIndex thread, std::uint32_t snapshot) {
  if (faults_.ignore_event_waits) return;
  join(clocks_[thread], snapshots_.at(snapshot));
}

void HazardChecker::host_observes(std::uint32_t snapshot) {
  join(clocks_[kHostThread], snapshots_.at(snapshot));
}

void HazardChecker::host_joins(ThreadIndex thread) { join(clocks_[kHostThread], clocks_[thread]); }

HazardChecker::Shadow::iterator HazardChecker::split(Shadow& shadow, std::int64_t at) {
  auto it = shadow.upper_bound(at);
  if (it == shadow.begin()) return it;
  auto prev = std::prev(it);
  if (prev->first == at) return prev;
  if (prev->second.hi.count() <= at) return it;
  Segment tail = prev->second;
  prev->second.hi = Bytes(at);
  return shadow.emplace_hint(it, at, std::move(tail));
}

void HazardChecker::coalesce(Shadow& shadow, std::int64_t lo, std::int64_t hi) {
  auto it = shadow.lower_bound(lo);
  if (it != shadow.begin()) --it;
  while (it != shadow.end() && it->first <= hi) {
    auto next = std::next(it);
    if (next == shadow.end()) break;
    Segment& a = it->second;
    const Segment& b = next->second;
    if (a.hi.count() == next->first && a.reads == b.reads && a.writes == b.writes) {
      a.hi = b.hi;
      shadow.erase(next);
    } else {
      it = next;
    }
  }
}

void HazardChecker::access(ThreadIndex thread, OpId op, AccessOrigin origin, BufferId buffer,
                           SpaceIndex space, Bytes lo_bytes, Bytes hi_bytes, bool write) {
  const std::int64_t lo = lo_bytes.count();
  const std::int64_t hi = hi_bytes.count();
  if (lo >= hi) return;
  if (spaces_.size() <= space) spaces_.resize(space + 1);
  Shadow& shadow = spaces_[space];
  const Clock& now = clocks_.at(thread);
  const Access self{thread, now[thread], op, buffer, origin};
  const std::size_t first_new = hazards_.size();

  auto emit = [&](const Access& earlier, Conflict conflict, std::int64_t seg_lo,
                  std::int64_t seg_hi) {
    // Ranges arrive in address order: extend the previous report of this pair when contiguous.
    for (std::size_t i = first_new; i < hazards_.size(); ++i) {
      Hazard& h = hazards_[i];
      if (h.first == earlier.op && h.conflict == conflict && h.hi.count() == seg_lo) {
        h.hi = Bytes(seg_hi);
        return;
      }
    }
    HazardKind kind = HazardKind::Race;
    if (earlier.buffer != buffer) {
      kind = HazardKind::Reuse;
    } else if (origin == AccessOrigin::Host && earlier.origin == AccessOrigin::Copy) {
      kind = HazardKind::HostBeforeCopy;
    }
    hazards_.push_back(Hazard{kind, conflict, earlier.op, op, earlier.buffer, buffer, space,
                              Bytes(seg_lo), Bytes(seg_hi)});
  };

  split(shadow, lo);
  split(shadow, hi);
  std::int64_t pos = lo;
  auto it = shadow.lower_bound(lo);
  while (pos < hi) {
    if (it == shadow.end() || it->first > pos) {
      const std::int64_t gap_hi = it == shadow.end() ? hi : std::min(it->first, hi);
      it = shadow.emplace_hint(it, pos, Segment{Bytes(gap_hi), {}, {}});
    }
    Segment& seg = it->second;
    const std::int64_t seg_hi = seg.hi.count();
    for (const Access& w : seg.writes) {
      if (!ordered_before(w, now)) {
        emit(w, write ? Conflict::WriteAfterWrite : Conflict::ReadAfterWrite, pos, seg_hi);
      }
    }
    if (write && !faults_.skip_write_after_read) {
      for (const Access& r : seg.reads) {
        if (!ordered_before(r, now)) emit(r, Conflict::WriteAfterRead, pos, seg_hi);
      }
    }
    AccessSet& frontier = write ? seg.writes : seg.reads;
    frontier.erase_if([&](const Access& a) { return ordered_before(a, now); });
    frontier.push_back(self);
    pos = seg_hi;
    ++it;
  }
  coalesce(shadow, lo, hi);
}

std::size_t HazardChecker::tracked_segments() const {
  std::size_t n = 0;
  for (const Shadow& shadow : spaces_) n += shadow.size();
  return n;
}

std::size_t HazardChecker::tracked_entries() const {
  std::size_t n = 0;
  for (const Shadow& shadow : spaces_) {
    for (const auto& [lo, seg] : shadow) n += seg.reads.size() + seg.writes.size();
  }
  return n;
}

void HazardChecker::AccessSet::push_back(const Access& a) {
  if (spill_.empty() && size_ < kInline) {
    inline_[size_++] = a;
    return;
  }
  if (spill_.empty()) spill_.assign(inline_, inline_ + size_);
  spill_.push_back(a);
  ++size_;
}

}  // namespace ferry::sim
