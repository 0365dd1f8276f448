// Collective ops of a rank's model (docs/model-format.md, Collective ops; Note [Mesh
// collectives]) on random models: all-reduces and all-to-alls after random ops, over random
// mesh axes, in the forward, the backward or both, with offload policies, checkpoint segments
// (reentrant or not), backward orders, device speeds, and FSDP2 beside them (its hooks and the
// collectives' chained). With the two waits around each collective there is no hazard, every
// unpacked tensor holds what was saved, memory after a step is what it is with kernels (the
// baseline, without FSDP) and the gradients are
// those of the same model with the collectives run as kernels on the current stream. Planted
// faults, each caught and shrunk: a collective's stream not waiting for the current stream
// before it reads the op's inputs, and the current stream not waiting for the collective before
// later ops read its outputs.

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "prop/collective_models.hpp"
#include "prop/planted.hpp"
#include "prop/training_prop.hpp"

namespace ferry::sim {
namespace {

using testing::LayerChoice;

struct Setup : testing::TrainingDraw {
  std::uint64_t after = 0;   // bit i: a collective op after op i
  std::uint64_t shapes = 0;  // two bits per op: what the collective after it runs (below)
  std::uint64_t axes = 0;    // two bits per op: its mesh axis (0 and 3 tp, 1 cp, 2 ep)
  bool fsdp = false;         // FSDP2 over 2 ranks beside the collectives
};

void showValue(const Setup& s, std::ostream& os) {
  os << "after " << s.after << ", shapes " << s.shapes << ", axes " << s.axes
     << (s.fsdp ? ", fsdp 2" : "") << ", ";
  testing::show_draw(s, os);
}

rc::Gen<Setup> gen_setup() {
  return rc::gen::apply(
      [](std::uint64_t after, std::uint64_t shapes, std::uint64_t axes, bool fsdp, Policy policy,
         std::int32_t segments, bool reentrant, std::uint64_t order, std::uint64_t device) {
        return Setup{{policy, segments, reentrant, order, device}, after, shapes, axes, fsdp};
      },
      rc::gen::inRange<std::uint64_t>(1, 1 << 12), rc::gen::arbitrary<std::uint64_t>(),
      rc::gen::arbitrary<std::uint64_t>(), rc::gen::arbitrary<bool>(),
      rc::gen::element(Policy::None, Policy::Ferry), rc::gen::inRange<std::int32_t>(0, 4),
      rc::gen::arbitrary<bool>(), rc::gen::inRange<std::uint64_t>(0, 3),
      rc::gen::inRange<std::uint64_t>(1, 1000));
}

/// `model` with each collective op an op like any other: a kernel on the current stream.
Model as_kernels(Model model) {
  for (ModelOp& op : model.ops) op.collective = {};
  return model;
}

void collectives_are_clean(const std::vector<LayerChoice>& layers, const Setup& setup,
                           const TrainingFaults& faults) {
  testing::ModelOptions mo;
  mo.param_per_layer = setup.fsdp;
  const Model model = testing::with_collectives(build_random_model(layers, mo), setup.after,
                                                setup.shapes, setup.axes);
  const bool any =
      std::ranges::any_of(model.ops, [](const ModelOp& op) { return op.collective.any(); });
  RC_PRE(any);
  if (auto valid = validate_model(model); !valid) RC_FAIL("invalid: " + valid.error().message);
  const DeviceProfile device = testing::random_linked_device(setup.device_seed);
  TrainingOptions options = testing::two_steps_of(model, setup);
  if (setup.fsdp) {
    auto parallelism = Mesh::make(Parallelism{.ranks = 2}, device);
    if (!parallelism.ok()) RC_FAIL("refused: " + parallelism.error().message);
    options.parallel.mesh = parallelism.value();
  }
  RC_TAG(setup.fsdp);
  auto plain = simulate_training(as_kernels(model), device, options);
  auto run = simulate_training(model, device, options, faults);
  testing::check_against(run, plain);
  const TrainingRun& r = run.value();
  const auto collectives = std::ranges::count_if(
      r.sim.ops(), [](const OpRecord& op) { return op.kind == OpKind::Kernel && op.collective; });
  // An inserted op whose output reaches no loss, with an identity forward, runs no collective.
  RC_CLASSIFY(collectives > 0, "collectives ran");
  // Memory after each step is what it is with kernels: back at the baseline without FSDP,
  // which keeps what it gathered and reduced between steps.
  for (std::size_t s = 0; s < r.steps.size(); ++s) {
    RC_ASSERT(r.allocated_after[s] == plain.value().allocated_after[s]);
    if (!setup.fsdp) RC_ASSERT(r.allocated_after[s] == r.baseline_allocated);
  }
}

RC_GTEST_PROP(MeshCollectivesProperty, CollectiveOpsWithTheirWaitsAreClean, ()) {
  collectives_are_clean(
      *rc::gen::nonEmpty(rc::gen::container<std::vector<LayerChoice>>(testing::gen_layer())),
      *gen_setup(), {});
}

void expect_caught(const TrainingFaults& faults, const char* name) {
  ferry::testing::expect_planted_fault_caught(
      [&] {
        collectives_are_clean(
            *rc::gen::nonEmpty(rc::gen::container<std::vector<LayerChoice>>(testing::gen_layer())),
            *gen_setup(), faults);
      },
      name, 20261127, 500);
}

TEST(MeshCollectivesProperty, PlantedMissingLaunchWaitIsCaught) {
  TrainingFaults faults;
  faults.collectives.skip_collective_launch_wait = true;
  expect_caught(faults, "a collective's stream does not wait for the current stream");
}

TEST(MeshCollectivesProperty, PlantedMissingOutputWaitIsCaught) {
  TrainingFaults faults;
  faults.collectives.skip_collective_output_wait = true;
  expect_caught(faults, "the current stream does not wait for a collective");
}

}  // namespace
}  // namespace ferry::sim
