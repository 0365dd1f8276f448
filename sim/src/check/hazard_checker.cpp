#include "ferry/sim/check/hazard_checker.hpp"

#include <algorithm>

#include "ferry/check.hpp"
#include "ferry/sim/support/by_id.hpp"

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

// Note [Latent reuse]
// A free is judged when it is issued, for every timing, not by whether the simulated
// allocator happens to hand the bytes out again while an access may still run. Let F free
// buffer B and let R be the join of the host's clock at F with the clocks, at F, of the threads
// that guard the reuse: a device block's allocation stream s0 (the caching allocator hands the
// block only to later allocations on s0, whose work is stream-ordered after s0's past), and each
// stream record_stream named (the allocator records a marker there at F and hands the bytes
// out only once the markers completed). Pinned blocks have no allocation stream: the pool hands
// them to the host. Claim: no later owner of B's bytes can race an access A of B, in any
// timing, iff A happens before R.
//  (if) A later owner's access Y is issued after the bytes were handed out. Device, not
//  deferred: the hand-out is an allocation on s0 issued after F, and its owner uses the block
//  on s0 (or orders its other streams after s0, as the allocator requires), so Y's clock
//  includes the host's and s0's at F. Deferred, or pinned: the hand-out follows F on the host
//  and, when deferred, the host seeing every marker complete, so Y includes R too. Then
//  A -> R -> Y.
//  (only if) If A is not ordered before R, let every access not ordered before R run as slowly
//  as it likes: the host, s0 and the recorded streams reach R without waiting for A, the next
//  allocation of that size on s0 (or the next pinned request) gets B's bytes, and a write to
//  them by the new owner overlaps A. Training's next step makes that allocation.
// So at F every access to B in the shadow is compared with R: any not ordered before it is a
// LatentReuse. The frontiers lose no verdict: if A was evicted by A' of the same kind with
// A -> A', and A is not ordered before R, neither is A' (A' -> R would give A -> R), so A is
// reported through A' as in Note [Access frontiers]. Nothing but B touches the bytes between
// its allocation and F, so no other buffer's access evicted one of B's.
//
// Marker queries. The allocator learns that a deferred free's markers completed by polling
// (cudaEventQuery) at its next malloc; whether a poll says "done" depends on timing. So a poll
// does not order the host after the marker: a free issued later would otherwise look ordered
// after stream work only because a poll happened to succeed. What the poll does order is the
// hand-out: only a buffer that gets bytes of a deferred free holds them after the markers, in
// every timing in which it gets them. The checker keeps, per space, the byte ranges of
// deferred frees with a snapshot of their markers (a floor); allocated() gives a new buffer
// the join of the floors its bytes overlap, and its accesses are checked with the floor joined
// to their thread's clock. A floor also joins the freed buffer's own floor, so a newer floor
// over the same bytes subsumes an older one, which is dropped. Blocking waits for markers
// (empty_cache, an out-of-memory retry) are synchronizations and order the host as before.
//
// Observed reuse. When the simulated run does reuse the bytes, the new owner's access meets
// the old access in the shadow; if that access was already reported as latent at its free,
// it is the same defect: the access becomes the report's reused_by instead of a second
// report.

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
  if (thread != host_) join(clock, clocks_[host_]);
  if (clock.size() <= thread) clock.resize(thread + 1, 0);
  ++clock[thread];
}

std::uint32_t HazardChecker::capture(ThreadIndex thread) {
  Clock snapshot = clocks_[thread];
  join(snapshot, clocks_[host_]);
  snapshots_.push_back(std::move(snapshot));
  return static_cast<std::uint32_t>(snapshots_.size() - 1);
}

void HazardChecker::wait(ThreadIndex thread, std::uint32_t snapshot) {
  if (faults_.ignore_event_waits) return;
  join(clocks_[thread], snapshots_.at(snapshot));
}

void HazardChecker::host_observes(std::uint32_t snapshot) {
  join(clocks_[host_], snapshots_.at(snapshot));
}

void HazardChecker::host_joins(ThreadIndex thread) { join(clocks_[host_], clocks_[thread]); }

void HazardChecker::set_host(ThreadIndex thread) {
  FERRY_CHECK(thread < clocks_.size(), "unknown thread {}", thread);
  host_ = thread;
}

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

void HazardChecker::coalesce(Shadow& shadow, Shadow::iterator it, std::int64_t hi) {
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

// access_clock and note_last_access run on every access: inline, as when they were part of it.
inline const HazardChecker::Clock& HazardChecker::access_clock(ThreadIndex thread,
                                                               BufferId buffer) {
  // A buffer holding bytes of a deferred free is ordered after its markers (a floor).
  const bool floored =
      buffer.value() < buffer_floor_.size() && buffer_floor_[buffer.value()] != kNoFloor;
  if (!floored) return clocks_.at(thread);
  scratch_ = clocks_.at(thread);
  join(scratch_, snapshots_[buffer_floor_[buffer.value()]]);
  return scratch_;
}

inline void HazardChecker::note_last_access(const Access& self) {
  cover(last_access_, self.buffer.value());
  LastAccess& last = last_access_[self.buffer.value()];
  // The inline slots fill in order and empty together: the first that is this thread's or
  // empty is the one.
  for (std::size_t s = 0; s < 2; ++s) {
    if (last.thread[s] == self.thread || last.thread[s] == LastAccess::kNone) {
      last.thread[s] = self.thread;
      last.epoch[s] = self.epoch;
      return;
    }
  }
  if (last.spill == 0) {
    if (free_spills_.empty()) {
      spills_.emplace_back();
      free_spills_.push_back(static_cast<std::uint32_t>(spills_.size() - 1));
    }
    last.spill = free_spills_.back() + 1;
    free_spills_.pop_back();
  }
  std::vector<std::uint32_t>& row = spills_[last.spill - 1];
  if (row.size() <= self.thread) row.resize(self.thread + 1, 0);
  row[self.thread] = self.epoch;
}

void HazardChecker::emit(const Access& earlier, const Access& self, SpaceIndex space,
                         std::size_t first_new, Conflict conflict, std::int64_t lo,
                         std::int64_t hi) {
  // Ranges arrive in address order: extend the previous report of this pair when contiguous.
  for (std::size_t i = first_new; i < hazards_.size(); ++i) {
    Hazard& h = hazards_[i];
    if (h.first == earlier.op && h.conflict == conflict && h.hi.count() == lo) {
      h.hi = Bytes(hi);
      return;
    }
  }
  HazardKind kind = HazardKind::Race;
  if (earlier.buffer != self.buffer) {
    kind = HazardKind::Reuse;
    // See Note [Latent reuse]: the defect was reported at the free.
    const auto latent = earlier.latent ? latent_.find({earlier.op.value(), earlier.buffer.value(),
                                                       conflict != Conflict::WriteAfterRead})
                                       : latent_.end();
    if (latent != latent_.end()) {
      Hazard& h = hazards_[latent->second];
      if (!h.reused_by.valid()) {
        h.reused_by = self.op;
        h.reused_buffer = self.buffer;
      }
      return;
    }
  } else if (self.origin == AccessOrigin::Host && earlier.origin == AccessOrigin::Copy) {
    kind = HazardKind::HostBeforeCopy;
  }
  hazards_.push_back(Hazard{kind, conflict, earlier.op, self.op, earlier.buffer, self.buffer, space,
                            Bytes(lo), Bytes(hi)});
}

void HazardChecker::access(ThreadIndex thread, OpId op, AccessOrigin origin, BufferId buffer,
                           SpaceIndex space, Bytes lo_bytes, Bytes hi_bytes, bool write) {
  const std::int64_t lo = lo_bytes.count();
  const std::int64_t hi = hi_bytes.count();
  if (lo >= hi) return;
  while (spaces_.size() <= space) spaces_.emplace_back(Shadow::allocator_type(pool_.get()));
  Shadow& shadow = spaces_[space];
  const Clock& now = access_clock(thread, buffer);
  const Access self{thread, clocks_[thread][thread], op, buffer, origin};
  note_last_access(self);
  const std::size_t first_new = hazards_.size();
  const auto report = [&](const Access& earlier, Conflict conflict, std::int64_t seg_lo,
                          std::int64_t seg_hi) {
    emit(earlier, self, space, first_new, conflict, seg_lo, seg_hi);
  };

  // One look-up: the segment holding `lo` (split there), then a walk to `hi` that fills gaps
  // and splits the last segment at `hi` before it is touched.
  auto it = split(shadow, lo);
  auto at_lo = shadow.end();
  std::int64_t pos = lo;
  while (pos < hi) {
    if (it == shadow.end() || it->first > pos) {
      const std::int64_t gap_hi = it == shadow.end() ? hi : std::min(it->first, hi);
      it = shadow.emplace_hint(it, pos, Segment{Bytes(gap_hi), {}, {}});
    } else if (it->second.hi.count() > hi) {
      Segment tail = it->second;
      it->second.hi = Bytes(hi);
      shadow.emplace_hint(std::next(it), hi, std::move(tail));
    }
    if (pos == lo) at_lo = it;
    Segment& seg = it->second;
    const std::int64_t seg_hi = seg.hi.count();
    for (const Access& w : seg.writes) {
      if (!ordered_before(w, now)) {
        report(w, write ? Conflict::WriteAfterWrite : Conflict::ReadAfterWrite, pos, seg_hi);
      }
    }
    if (write && !faults_.skip_write_after_read) {
      for (const Access& r : seg.reads) {
        if (!ordered_before(r, now)) report(r, Conflict::WriteAfterRead, pos, seg_hi);
      }
    }
    AccessSet& frontier = write ? seg.writes : seg.reads;
    frontier.erase_if([&](const Access& a) { return ordered_before(a, now); });
    frontier.push_back(self);
    pos = seg_hi;
    ++it;
  }
  // Merging starts at the neighbour before the segment at `lo`.
  coalesce(shadow, at_lo == shadow.begin() ? at_lo : std::prev(at_lo), hi);
}

void HazardChecker::release(OpId free_op, BufferId buffer, SpaceIndex space, Bytes lo_bytes,
                            Bytes hi_bytes, std::span<const ThreadIndex> alloc_threads,
                            std::span<const ThreadIndex> deferred) {
  // See Note [Latent reuse].
  const std::int64_t lo = lo_bytes.count();
  const std::int64_t hi = hi_bytes.count();
  Clock& reuse = reuse_;
  reuse = clocks_[host_];
  for (const ThreadIndex t : alloc_threads) join(reuse, clocks_.at(t));
  for (const ThreadIndex t : deferred) join(reuse, clocks_.at(t));
  if (faults_.deferral_covers_every_stream && !deferred.empty()) {
    for (const Clock& c : clocks_) join(reuse, c);
  }
  if (!deferred.empty() && lo < hi) {
    Clock floor = clocks_[host_];
    for (const ThreadIndex t : deferred) join(floor, clocks_.at(t));
    if (buffer.value() < buffer_floor_.size() && buffer_floor_[buffer.value()] != kNoFloor) {
      join(floor, snapshots_[buffer_floor_[buffer.value()]]);
    }
    snapshots_.push_back(std::move(floor));
    if (floors_.size() <= space) floors_.resize(space + 1);
    FloorMap& floors = floors_[space];
    for (auto it = floors.ranges.lower_bound(lo); it != floors.ranges.end() && it->first < hi;) {
      it = it->second.hi <= hi ? floors.ranges.erase(it) : std::next(it);
    }
    floors.ranges.emplace(lo, Floor{hi, static_cast<std::uint32_t>(snapshots_.size() - 1)});
    floors.longest = std::max(floors.longest, hi - lo);
  }
  if (lo >= hi || space >= spaces_.size() || buffer.value() >= last_access_.size()) return;
  // Each thread's latest access to the buffer follows its earlier ones: when all of those are
  // ordered before the reuse point, so is every access.
  LastAccess& last = last_access_[buffer.value()];
  const auto after_reuse = [&](ThreadIndex t, std::uint32_t epoch) {
    return epoch != 0 && (t >= reuse.size() || epoch > reuse[t]);
  };
  bool unordered = false;
  for (std::size_t s = 0; s < 2 && last.thread[s] != LastAccess::kNone; ++s) {
    unordered = unordered || after_reuse(last.thread[s], last.epoch[s]);
  }
  if (last.spill != 0) {
    std::vector<std::uint32_t>& row = spills_[last.spill - 1];
    for (ThreadIndex t = 0; t < row.size(); ++t) unordered = unordered || after_reuse(t, row[t]);
    std::fill(row.begin(), row.end(), 0);
    free_spills_.push_back(last.spill - 1);
  }
  last = LastAccess{};
  if (!unordered) return;
  Shadow& shadow = spaces_[space];
  const std::size_t first_new = hazards_.size();
  auto emit = [&](Access& a, bool write, std::int64_t seg_lo, std::int64_t seg_hi) {
    a.latent = true;
    const Conflict conflict = write ? Conflict::WriteAfterWrite : Conflict::WriteAfterRead;
    for (std::size_t i = first_new; i < hazards_.size(); ++i) {
      Hazard& h = hazards_[i];
      if (h.first == a.op && h.conflict == conflict && h.hi.count() == seg_lo) {
        h.hi = Bytes(seg_hi);
        return;
      }
    }
    latent_.emplace(std::make_tuple(a.op.value(), buffer.value(), write), hazards_.size());
    hazards_.push_back(Hazard{HazardKind::LatentReuse, conflict, a.op, free_op, buffer, buffer,
                              space, Bytes(seg_lo), Bytes(seg_hi)});
  };
  auto it = shadow.upper_bound(lo);
  if (it != shadow.begin()) --it;
  for (; it != shadow.end() && it->first < hi; ++it) {
    const std::int64_t seg_lo = std::max(it->first, lo);
    const std::int64_t seg_hi = std::min(it->second.hi.count(), hi);
    if (seg_lo >= seg_hi) continue;
    for (Access& w : it->second.writes) {
      if (w.buffer == buffer && !ordered_before(w, reuse)) emit(w, true, seg_lo, seg_hi);
    }
    for (Access& r : it->second.reads) {
      if (r.buffer == buffer && !ordered_before(r, reuse)) emit(r, false, seg_lo, seg_hi);
    }
  }
}

void HazardChecker::allocated(BufferId buffer, SpaceIndex space, Bytes lo_bytes, Bytes hi_bytes) {
  // See Note [Latent reuse]: the buffer is ordered after every deferred free it overlaps.
  const std::int64_t lo = lo_bytes.count();
  const std::int64_t hi = hi_bytes.count();
  if (lo >= hi || space >= floors_.size() || floors_[space].ranges.empty()) return;
  if (faults_.ignore_floors) return;
  const FloorMap& floors = floors_[space];
  Clock floor;
  bool any = false;
  for (auto it = floors.ranges.lower_bound(lo - floors.longest);
       it != floors.ranges.end() && it->first < hi; ++it) {
    if (it->second.hi <= lo) continue;
    join(floor, snapshots_[it->second.snapshot]);
    any = true;
  }
  if (!any) return;
  snapshots_.push_back(std::move(floor));
  if (buffer_floor_.size() <= buffer.value()) buffer_floor_.resize(buffer.value() + 1, kNoFloor);
  buffer_floor_[buffer.value()] = static_cast<std::uint32_t>(snapshots_.size() - 1);
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
