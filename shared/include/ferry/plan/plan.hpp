#pragma once
/// A plan: what happens to every op's saved tensors in a training step (keep on the device,
/// offload to pinned host memory, or recompute inside a checkpoint region), with the offload
/// knobs. Decisions only, backend-independent; `ferry.plan/1` is its file form
/// (docs/plan-format.md). Each backend turns it into its own run configuration.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/units.hpp"

namespace ferry {

/// What a plan does with the tensors an op saves for backward.
enum class SavedDecision : std::uint8_t {
  Keep,       ///< stay on the device
  Offload,    ///< copied to pinned host memory in forward, reloaded for backward
  Recompute,  ///< dropped in forward, the op re-run in backward (inside a region only)
};

/// "keep", "offload", "recompute".
[[nodiscard]] const char* saved_decision_name(SavedDecision decision);
/// The decision named `name` (as saved_decision_name() spells it), or nullopt.
[[nodiscard]] std::optional<SavedDecision> parse_saved_decision(std::string_view name);

/// One op of the plan, matched to the model's op of the same index and name.
struct PlanOp {
  std::string name;
  SavedDecision saved = SavedDecision::Keep;

  friend bool operator==(const PlanOp&, const PlanOp&) = default;
};

/// A checkpoint region over ops [first_op, end_op) (non-reentrant, early stop). Its ops'
/// decisions are per-op policies: Recompute (re-run), Keep (must-save), Offload.
struct PlanRegion {
  std::uint32_t first_op = 0;
  std::uint32_t end_op = 0;
  /// The region's inputs (saved by the parent): Keep or Offload.
  SavedDecision inputs = SavedDecision::Keep;

  friend bool operator==(const PlanRegion&, const PlanRegion&) = default;
};

/// The offload scheduler's knobs a plan fixes (the ferry policy's).
struct PlanKnobs {
  Bytes min_bytes{1024};              ///< smaller saved tensors stay on the device
  Bytes window_bytes{512LL << 20};    ///< device bytes of offloads in flight in forward
  Bytes prefetch_bytes{512LL << 20};  ///< bytes of reloads issued ahead of demand
  bool prefetch = true;               ///< reload ahead of demand
  /// Bytes a forward may copy to the host before the rest stays (Note [Offload horizon]);
  /// unset: no limit beyond the per-op decisions.
  std::optional<Bytes> horizon_bytes = std::nullopt;

  friend bool operator==(const PlanKnobs&, const PlanKnobs&) = default;
};

/// What the plan was predicted to cost when it was made (informative; replays measure anew).
struct PlanPrediction {
  SimTime step_time;
  SimTime lower_bound;  ///< no schedule under the budget is faster (see docs/plan.md)
  SimTime recompute_time;
  SimTime stall;  ///< compute stream waiting on copies, forward and backward
  Bytes peak_reserved;
  Bytes peak_allocated;
  Bytes pinned_peak;
  Bytes d2h;
  Bytes h2d;

  friend bool operator==(const PlanPrediction&, const PlanPrediction&) = default;
};

/// A whole plan for one model on one device.
struct Plan {
  std::string model;                 ///< the model's name
  std::string device;                ///< the device profile's name
  Bytes budget;                      ///< device budget: peak reserved bytes
  std::optional<Bytes> host_budget;  ///< pinned host budget, when one was given
  PlanKnobs knobs;
  /// The parallelism the plan was made for (fsdp 0: one GPU); every figure is one rank's.
  Parallelism parallelism{};
  /// The step runs the paged stash of saved tensors in static-capacity buffers (the simulator's
  /// PagedStashOptions; docs/parallelism.md, Static capacity and the paged stash).
  bool paged_stash = false;
  std::vector<PlanOp> ops;          ///< one per model op, in forward order
  std::vector<PlanRegion> regions;  ///< sorted, disjoint
  PlanPrediction predicted;

  friend bool operator==(const Plan&, const Plan&) = default;
};

/// Checks the plan on its own: regions sorted, disjoint and non-empty inside the op list,
/// region inputs Keep or Offload, Recompute only inside a region. The error names the place
/// as its JSON path ("regions[1].first_op", "ops[7].saved").
Status validate_plan(const Plan& plan);

/// Whether any op's saved tensors are offloaded or any region's inputs are.
[[nodiscard]] bool plan_offloads(const Plan& plan);

}  // namespace ferry
