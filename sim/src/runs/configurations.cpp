#include "ferry/sim/runs/configurations.hpp"

#include <array>
#include <string>
#include <utility>

#include "ferry/sim/autograd/checkpoint_plan.hpp"
#include "ferry/sim/runs/horizon.hpp"

namespace ferry::sim {

namespace {

constexpr std::array kKnobVariants{
    KnobVariant{"ferry no-prefetch", [](OffloadOptions& o) { o.prefetch = false; }},
    KnobVariant{"ferry window=128MiB", [](OffloadOptions& o) { o.window_bytes = 128 * kMiB; }},
    KnobVariant{"ferry prefetch=2GiB", [](OffloadOptions& o) { o.prefetch_bytes = 2 * kGiB; }},
    KnobVariant{"ferry min=16MiB", [](OffloadOptions& o) { o.min_bytes = 16 * kMiB; }},
};

}  // namespace

std::span<const KnobVariant> ferry_knob_variants() { return kKnobVariants; }

std::vector<PolicyRow> default_rows(const TrainingOptions& base, const Model& model,
                                    const DeviceProfile& device) {
  std::vector<PolicyRow> rows;
  auto add = [&](std::string_view name, Policy policy, auto tweak) {
    PolicyRow row{std::string(name), base};
    row.options.offload.policy = policy;
    tweak(row.options.offload);
    rows.push_back(std::move(row));
  };
  add("none", Policy::None, [](OffloadOptions&) {});
  add("trl", Policy::Trl, [](OffloadOptions& o) {
    o.min_bytes = Bytes(1024);
    o.trl_stash_count = 5;
  });
  add("ferry", Policy::Ferry, [](OffloadOptions&) {});
  for (const KnobVariant& variant : ferry_knob_variants()) {
    add(variant.name, Policy::Ferry, variant.apply);
  }
  auto with_checkpoint = [&](std::string name, Policy policy, CheckpointPlan plan) {
    PolicyRow row{std::move(name), base};
    row.options.offload.policy = policy;
    row.options.checkpoint = std::move(plan);
    rows.push_back(std::move(row));
  };
  with_checkpoint("checkpoint every layer", Policy::None, checkpoint_every(model, 1));
  with_checkpoint("checkpoint selective", Policy::None, checkpoint_attention_cores(model));
  with_checkpoint("ferry + checkpoint", Policy::Ferry, checkpoint_every(model, 1));
  for (PolicyRow& row : rows) {
    if (!row.options.offload.horizon_bytes) {
      row.options.offload.horizon_bytes = offload_horizon(model, device, row.options);
    }
  }
  return rows;
}

DeviceProfile roomy(const DeviceProfile& device) {
  DeviceProfile out = device;
  out.memory = Bytes(device.memory.count() * 8);
  return out;
}

TrainingOptions timing_only(std::int32_t steps) {
  TrainingOptions o;
  o.steps = steps;
  o.sim.check_hazards = false;
  o.sim.track_content = false;
  return o;
}

}  // namespace ferry::sim
