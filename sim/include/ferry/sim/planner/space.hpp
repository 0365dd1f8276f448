#pragma once
/// The planner's search space (Note [Planner search] in search.cpp): a model's transformer
/// layers, each with its recompute levels, and the plans built from one configuration per layer.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ferry/plan/plan.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::planning {

/// One run of consecutive ops of a transformer layer, ranked for recompute.
struct Layer {
  std::int32_t layer = -1;
  std::uint32_t first = 0;             ///< its first op
  std::uint32_t end = 0;               ///< one past its last op
  std::vector<std::uint32_t> ranking;  ///< op indices, most bytes freed per ns of recompute first
  std::vector<std::size_t> levels;     ///< ops of the ranking recomputed at each level (0: none)
  /// Where a region that keeps the layer's head and recomputes its tail may start its tail:
  /// tails[0] is `end` (no tail), the others op indices of the layer, latest first (Note
  /// [Layer options] in exact.cpp).
  std::vector<std::uint32_t> tails;
  /// One past the last op its region's replay runs (replay_end): the ops from there to `end`
  /// recompute for free; those that save something rank first (Note [What a replay never
  /// reaches ranks first] in space.cpp).
  std::uint32_t replayed_end = 0;
};

/// What a plan does with one layer: a recompute level (0: no region), whether the layer's
/// saved tensors and its region's inputs are offloaded, and a tail of ops recomputed besides
/// the level's (0: none). A layer with a level or a tail above 0 is a checkpoint region.
struct LayerConfig {
  std::size_t level = 0;  ///< index into Layer::levels
  bool offload = false;
  std::size_t tail = 0;  ///< index into Layer::tails: its ops from there to the end recompute
  friend bool operator==(const LayerConfig&, const LayerConfig&) = default;
};

/// The layers of `model` that a plan may change (ops in a layer, outside no-offload regions),
/// each with its ranking and levels.
[[nodiscard]] std::vector<Layer> find_layers(const Model& model);

/// The first op of a region over [first, end) that its replay does not run: early stop ends
/// the replay at the pack of the region's last saved tensor, before that tensor's op where the
/// op saves its inputs alone (Note [A replay ends before the op it no longer needs] in
/// sim/src/autograd/trainer_backward.cpp).
[[nodiscard]] std::uint32_t replay_end(const Model& model, std::uint32_t first, std::uint32_t end);

/// Bytes of op `p`'s outputs that ops of [first, end) save (its share of the layer's saved
/// activations).
[[nodiscard]] Bytes freed_by(const Model& model, std::uint32_t p, std::uint32_t first,
                             std::uint32_t end);

/// The plan's decisions as a string: two plans with the same key simulate alike.
[[nodiscard]] std::string key_of(const Plan& plan);

/// What the simulation of `plan` depends on, as a string (Note [Runs of plans that offload
/// nothing] in space.cpp): key_of, without the knobs and the pinned budget when the plan
/// offloads nothing. Plans with the same run key simulate alike.
[[nodiscard]] std::string run_key_of(const Plan& plan);

/// A model's layers and the plans of per-layer configurations. `model` must outlive it.
class PlanSpace {
 public:
  PlanSpace(const Model& model, const DeviceProfile& device);

  [[nodiscard]] const Model& model() const { return *model_; }
  [[nodiscard]] const std::vector<Layer>& layers() const { return layers_; }
  /// The plan with every op kept and no region (keep_everything_plan).
  [[nodiscard]] const Plan& kept() const { return kept_; }
  /// The device's device-to-host bandwidth, bytes per second (at least 1).
  [[nodiscard]] std::int64_t d2h_bandwidth() const { return d2h_bandwidth_; }

  /// The plan that gives layer l configuration `configs[l]`, with `knobs` and `host_budget`;
  /// `offload_outside`: the ops outside the layers offload too (as the fixed ferry
  /// configurations do), else they keep. Random ops are recomputed as a replay needs
  /// (recompute_random_prefix).
  [[nodiscard]] Plan plan_of(const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
                             std::optional<Bytes> host_budget, bool offload_outside = false) const;
  /// Sets layer `l`'s ops in `plan` as plan_of does for `config`, and appends its region when
  /// it has one (true then); random ops are left to recompute_random_prefix.
  bool configure_layer(Plan& plan, std::size_t l, const LayerConfig& config) const;

 private:
  const Model* model_;
  Plan kept_;  // every op kept, no region
  std::int64_t d2h_bandwidth_;
  std::vector<Layer> layers_;
};

}  // namespace ferry::sim::planning
