#include "ferry/sim/analysis/metrics.hpp"

#include <algorithm>
#include <utility>
#include <vector>

namespace ferry::sim {

SimTime compute_stall(const Simulator& sim, StreamId compute, SimTime from, SimTime to) {
  std::int64_t stall = 0;
  std::int64_t last_end = 0;
  for (const OpRecord& r : sim.ops()) {
    if (r.stream != compute) continue;
    if (r.kind == OpKind::Kernel) {
      last_end = r.end.ns();
    } else if (r.kind == OpKind::Wait) {
      const std::int64_t ready = std::max(r.issued.ns(), last_end);
      if (r.end.ns() > ready && r.issued >= from && r.issued < to) stall += r.end.ns() - ready;
      last_end = std::max(last_end, r.end.ns());
    }
  }
  return SimTime(stall);
}

std::int64_t copy_overlap_permille(const Simulator& sim) {
  std::vector<std::pair<std::int64_t, std::int64_t>> kernels;
  std::vector<std::pair<std::int64_t, std::int64_t>> copies;
  for (const OpRecord& r : sim.ops()) {
    if (r.end <= r.start) continue;
    if (r.kind == OpKind::Kernel) kernels.emplace_back(r.start.ns(), r.end.ns());
    if (r.kind == OpKind::Copy) copies.emplace_back(r.start.ns(), r.end.ns());
  }
  std::sort(kernels.begin(), kernels.end());
  // Kernels of one device never overlap each other (one compute engine).
  std::int64_t total = 0;
  std::int64_t overlapped = 0;
  for (const auto& [lo, hi] : copies) {
    total += hi - lo;
    auto it = std::lower_bound(kernels.begin(), kernels.end(), std::make_pair(lo, std::int64_t{0}));
    if (it != kernels.begin()) --it;
    for (; it != kernels.end() && it->first < hi; ++it) {
      overlapped += std::max<std::int64_t>(0, std::min(hi, it->second) - std::max(lo, it->first));
    }
  }
  return total == 0 ? 0 : overlapped * 1000 / total;
}

}  // namespace ferry::sim
