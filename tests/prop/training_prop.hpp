#pragma once
// What the properties of simulated training steps on random models share (fsdp_prop.cpp,
// side_stream_prop.cpp, mesh_collectives_prop.cpp): the draws every setup makes, the options of
// two steps under them, a device with random links, and the checks of a run against the run it
// must equal.

#include <rapidcheck.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/autograd/checkpoint_plan.hpp"
#include "prop/random_program.hpp"
#include "prop/rc_model_gens.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim::testing {

/// What every setup draws: the offload policy, checkpoint segments (fewer than 2: none),
/// reentrant or not, the backward order's seed and the device's seed.
struct TrainingDraw {
  Policy policy = Policy::None;
  std::int32_t segments = 0;
  bool reentrant = false;
  std::uint64_t order_seed = 0;
  std::uint64_t device_seed = 1;
};

/// Prints `d` as a counterexample shows it: "policy, segments N[ reentrant], order X, device Y".
inline void show_draw(const TrainingDraw& d, std::ostream& os) {
  os << policy_name(d.policy) << ", segments " << d.segments << (d.reentrant ? " reentrant" : "")
     << ", order " << d.order_seed << ", device " << d.device_seed;
}

/// A random model's layers, none or more.
inline std::vector<LayerChoice> any_layers() {
  return *rc::gen::container<std::vector<LayerChoice>>(gen_layer());
}

/// Two training steps of `model` as `d` draws them: its policy over every size of tensor, its
/// backward order and its checkpoint segments.
inline TrainingOptions two_steps_of(const Model& model, const TrainingDraw& d) {
  TrainingOptions o;
  o.offload.policy = d.policy;
  o.offload.min_bytes = Bytes(0);
  o.steps = 2;
  o.order_seed = d.order_seed;
  if (d.segments >= 2) o.checkpoint = checkpoint_segments(model, d.segments, d.reentrant);
  return o;
}

/// A random device with random collective links, from `seed`.
inline DeviceProfile random_linked_device(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  return with_random_links(random_profile(rng), rng);
}

/// Fails the property unless `run` ran to its end with no hazard, every unpacked tensor held
/// what was saved, and its gradients are those of `reference` (which ran to its end too).
inline void check_against(const Result<TrainingRun>& run, const Result<TrainingRun>& reference) {
  RC_ASSERT(reference.ok());
  if (!run.ok()) RC_FAIL("refused: " + run.error().message);
  const TrainingRun& r = run.value();
  if (r.failure) RC_FAIL("run failed: " + r.failure->message);
  RC_ASSERT(!reference.value().failure);
  if (!r.sim.hazards().empty()) RC_FAIL("hazards:\n" + hazard_lines(r.sim));
  RC_ASSERT(r.sim.content_mismatches().empty());
  RC_ASSERT(r.gradient_values == reference.value().gradient_values);
}

}  // namespace ferry::sim::testing
