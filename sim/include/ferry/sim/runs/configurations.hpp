#pragma once
/// The fixed configurations, each defined once: the rows of `ferry compare` (which the planner
/// measures and starts its search from), the ferry policy's knob variants among them (which the
/// planner also tries on the plan it found), the roomy device, and the options of a run measured
/// for its time and peaks only.

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "ferry/sim/runs/measure.hpp"

namespace ferry::sim {

/// A ferry row of `ferry compare` that changes one knob of the offload options it is given.
struct KnobVariant {
  std::string_view name;           ///< the row's name, e.g. "ferry window=128MiB"
  void (*apply)(OffloadOptions&);  ///< changes the knob
};

/// The knob variants, in the order of their rows: no prefetch, a 128 MiB window, 2 GiB of
/// prefetch, and 16 MiB as the smallest offloaded tensor.
[[nodiscard]] std::span<const KnobVariant> ferry_knob_variants();

/// The rows of `ferry compare`: none, trl, ferry, the ferry knob variants, checkpointing every
/// layer, selective checkpointing, and offload of checkpoint inputs with recompute inside, each
/// on top of `base`. The ferry rows offload up to the horizon offload_horizon derives for them
/// on `device` (unless `base` sets one).
[[nodiscard]] std::vector<PolicyRow> default_rows(const TrainingOptions& base, const Model& model,
                                                  const DeviceProfile& device);

/// `device` with eight times its memory: where a run that does not fit is measured again, so
/// that it still says its peaks, and where the planner measures its candidates.
[[nodiscard]] DeviceProfile roomy(const DeviceProfile& device);

/// Options for a run measured for its time and peaks only: `steps` training steps, the hazard
/// checker and content tracking off.
[[nodiscard]] TrainingOptions timing_only(std::int32_t steps);

}  // namespace ferry::sim
