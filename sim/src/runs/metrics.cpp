#include "ferry/sim/runs/metrics.hpp"

#include <algorithm>
#include <limits>
#include <utility>

namespace ferry::sim {

namespace {

// A wait stalls the stream from when it could have run (issued, and the stream's previous work
// done) to when its event completed; fed the compute stream's kernels and waits in op order,
// which is stream order.
class StallSum {
 public:
  StallSum(SimTime from, SimTime to) : from_(from), to_(to) {}

  void add(OpKind kind, SimTime issued, SimTime end) {
    if (kind == OpKind::Kernel) {
      last_end_ = end.ns();
      return;
    }
    const std::int64_t ready = std::max(issued.ns(), last_end_);
    if (end.ns() > ready && issued >= from_ && issued < to_) stall_ += end.ns() - ready;
    last_end_ = std::max(last_end_, end.ns());
  }

  [[nodiscard]] SimTime total() const { return SimTime(stall_); }

 private:
  SimTime from_;
  SimTime to_;
  std::int64_t stall_ = 0;
  std::int64_t last_end_ = 0;
};

}  // namespace

void TimelineMetrics::op_finished(OpId op, const OpRecord& r) {
  if (r.collective) return;  // not compute: the link's time
  if (r.stream == compute_ && (r.kind == OpKind::Kernel || r.kind == OpKind::Wait)) {
    compute_ops_.push_back({.op = op, .kind = r.kind, .issued = r.issued, .end = r.end});
  }
  if (r.kind == OpKind::Copy) {
    copies_.push_back({.issued = r.issued, .direction = r.direction, .bytes = r.bytes});
  }
  if (r.end <= r.start) return;
  const Interval interval{.start = r.start, .end = r.end, .issued = r.issued};
  if (r.kind == OpKind::Kernel) kernels_.push_back(interval);
  if (r.kind == OpKind::Copy) copy_intervals_.push_back(interval);
}

SimTime TimelineMetrics::stall(SimTime from, SimTime to) const {
  std::vector<ComputeOp> ops = compute_ops_;
  std::sort(ops.begin(), ops.end(),
            [](const ComputeOp& a, const ComputeOp& b) { return a.op < b.op; });
  StallSum stall(from, to);
  for (const ComputeOp& r : ops) stall.add(r.kind, r.issued, r.end);
  return stall.total();
}

SimTime TimelineMetrics::kernels_done(SimTime from, SimTime to) const {
  SimTime done = from;
  for (const ComputeOp& r : compute_ops_) {
    if (r.kind == OpKind::Kernel && r.issued >= from && r.issued < to) done = std::max(done, r.end);
  }
  return done;
}

std::int64_t TimelineMetrics::copy_overlap_permille() const {
  return copy_overlap_permille(SimTime(0), SimTime(std::numeric_limits<std::int64_t>::max()));
}

std::int64_t TimelineMetrics::copy_overlap_permille(SimTime from, SimTime to) const {
  std::vector<std::pair<std::int64_t, std::int64_t>> kernels;
  kernels.reserve(kernels_.size());
  for (const Interval& k : kernels_) kernels.emplace_back(k.start.ns(), k.end.ns());
  std::sort(kernels.begin(), kernels.end());
  // Kernels of one device never overlap each other (one compute engine).
  std::int64_t total = 0;
  std::int64_t overlapped = 0;
  for (const Interval& c : copy_intervals_) {
    if (c.issued < from || c.issued > to) continue;
    const std::int64_t lo = c.start.ns();
    const std::int64_t hi = c.end.ns();
    total += hi - lo;
    auto it = std::lower_bound(kernels.begin(), kernels.end(), std::make_pair(lo, std::int64_t{0}));
    if (it != kernels.begin()) --it;
    for (; it != kernels.end() && it->first < hi; ++it) {
      overlapped += std::max<std::int64_t>(0, std::min(hi, it->second) - std::max(lo, it->first));
    }
  }
  return total == 0 ? 0 : overlapped * 1000 / total;
}

Bytes TimelineMetrics::copied(CopyDirection direction, SimTime from, SimTime to) const {
  Bytes sum;
  for (const Copy& c : copies_) {
    if (c.direction == direction && c.issued >= from && c.issued <= to) sum += c.bytes;
  }
  return sum;
}

SimTime compute_stall(const Simulator& sim, StreamId compute, SimTime from, SimTime to) {
  TimelineMetrics metrics(compute);
  sim.replay(metrics);
  return metrics.stall(from, to);
}

std::int64_t copy_overlap_permille(const Simulator& sim) {
  TimelineMetrics metrics{StreamId()};
  sim.replay(metrics);
  return metrics.copy_overlap_permille();
}

StepFigures step_figures(const Simulator& sim, StreamId compute, SimTime from, SimTime to) {
  // TimelineMetrics's stall and copied over the records in op order, the order it sorts by.
  StallSum stall(from, to);
  Bytes d2h;
  for (const OpRecord& r : sim.ops()) {
    if (r.collective) continue;
    if (r.kind == OpKind::Copy && r.direction == CopyDirection::DeviceToHost && r.issued >= from &&
        r.issued <= to) {
      d2h += r.bytes;
    }
    if (r.stream == compute && (r.kind == OpKind::Kernel || r.kind == OpKind::Wait)) {
      stall.add(r.kind, r.issued, r.end);
    }
  }
  return StepFigures{stall.total(), d2h};
}

}  // namespace ferry::sim
