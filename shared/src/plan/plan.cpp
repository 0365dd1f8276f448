#include "ferry/plan/plan.hpp"

#include <fmt/format.h>

#include <utility>

namespace ferry {

const char* saved_decision_name(SavedDecision decision) {
  switch (decision) {
    case SavedDecision::Keep:
      return "keep";
    case SavedDecision::Offload:
      return "offload";
    case SavedDecision::Recompute:
      return "recompute";
  }
  return "?";
}

std::optional<SavedDecision> parse_saved_decision(std::string_view name) {
  for (const SavedDecision d :
       {SavedDecision::Keep, SavedDecision::Offload, SavedDecision::Recompute}) {
    if (name == saved_decision_name(d)) return d;
  }
  return std::nullopt;
}

Status validate_plan(const Plan& plan) {
  const auto n = static_cast<std::uint32_t>(plan.ops.size());
  std::vector<bool> inside(n, false);
  for (std::size_t r = 0; r < plan.regions.size(); ++r) {
    const PlanRegion& region = plan.regions[r];
    if (region.first_op >= n) {
      return Error{fmt::format("regions[{}].first_op: {} is not an op index (the plan has {} ops)",
                               r, region.first_op, n)};
    }
    if (region.end_op <= region.first_op || region.end_op > n) {
      return Error{fmt::format(
          "regions[{}].end_op: {} must be above first_op {} and at most the op count {}", r,
          region.end_op, region.first_op, n)};
    }
    if (r > 0 && region.first_op < plan.regions[r - 1].end_op) {
      return Error{fmt::format(
          "regions[{}].first_op: {} overlaps or precedes regions[{}] (ends at {}); regions are "
          "sorted and disjoint",
          r, region.first_op, r - 1, plan.regions[r - 1].end_op)};
    }
    if (region.inputs == SavedDecision::Recompute) {
      return Error{fmt::format("regions[{}].inputs: a region's inputs are kept or offloaded", r)};
    }
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) inside[i] = true;
  }
  for (std::uint32_t i = 0; i < n; ++i) {
    if (plan.ops[i].name.empty()) return Error{fmt::format("ops[{}].name: empty", i)};
    if (plan.ops[i].saved == SavedDecision::Recompute && !inside[i]) {
      return Error{
          fmt::format("ops[{}].saved: op \"{}\" is recomputed but lies in no checkpoint region", i,
                      plan.ops[i].name)};
    }
  }
  if (plan.knobs.min_bytes < Bytes(0) || plan.knobs.window_bytes < Bytes(0) ||
      plan.knobs.prefetch_bytes < Bytes(0)) {
    return Error{"knobs: byte counts must be non-negative"};
  }
  return Ok{};
}

bool plan_offloads(const Plan& plan) {
  for (const PlanOp& op : plan.ops) {
    if (op.saved == SavedDecision::Offload) return true;
  }
  for (const PlanRegion& r : plan.regions) {
    if (r.inputs == SavedDecision::Offload) return true;
  }
  return false;
}

}  // namespace ferry
