// Several compute streams on random models (SideStreamOptions): random layers on the side
// stream, recomputes there, all-reduces on the comm stream, with and without checkpointing,
// random backward orders and device speeds. With the edges in place there is no hazard, every
// unpacked tensor holds what was saved, memory returns to its baseline and the gradients are
// those of the run on one stream, with gradients kept between steps or freed
// (zero_grad(set_to_none=True)). Planted faults: dropping the wait before side or comm work, or
// the record_stream of a tensor used on another stream, or freeing a gradient as soon as its
// all-reduce is launched, is caught.

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <iostream>
#include <random>
#include <vector>

#include "prop/planted.hpp"
#include "prop/training_prop.hpp"

namespace ferry::sim {
namespace {

using testing::LayerChoice;

struct Setup : testing::TrainingDraw {
  std::uint64_t side_layers = 0;  // bit i: op i's layer on the side stream
  bool recompute = false;
  bool all_reduce = false;
  bool set_to_none = false;  // zero_grad(set_to_none=True) in both runs
};

void showValue(const Setup& s, std::ostream& os) {
  os << "side layers " << s.side_layers << (s.recompute ? ", recompute" : "")
     << (s.all_reduce ? ", all-reduce" : "") << ", ";
  testing::show_draw(s, os);
}

rc::Gen<Setup> gen_setup() {
  return rc::gen::apply(
      [](std::uint64_t layers, bool recompute, bool all_reduce, bool set_to_none,
         std::int32_t segments, bool reentrant, std::uint64_t order, std::uint64_t device) {
        return Setup{{Policy::None, segments, reentrant, order, device},
                     layers,
                     recompute,
                     all_reduce,
                     set_to_none};
      },
      rc::gen::inRange<std::uint64_t>(0, 1 << 12), rc::gen::arbitrary<bool>(),
      rc::gen::arbitrary<bool>(), rc::gen::arbitrary<bool>(), rc::gen::inRange<std::int32_t>(0, 4),
      rc::gen::arbitrary<bool>(), rc::gen::inRange<std::uint64_t>(0, 3),
      rc::gen::inRange<std::uint64_t>(1, 1000));
}

void side_streams_are_clean(const std::vector<LayerChoice>& layers, const Setup& setup,
                            const TrainingFaults& faults) {
  testing::ModelOptions mo;
  mo.side_branches = setup.policy != Policy::Trl;  // trl never hears of an unused branch's tensors
  const Model model = build_random_model(layers, mo);
  std::mt19937_64 rng(setup.device_seed);
  const DeviceProfile device = testing::random_profile(rng);
  TrainingOptions one = testing::two_steps_of(model, setup);
  one.grads_set_to_none = setup.set_to_none;
  TrainingOptions two = one;
  for (std::int32_t i = 0; i < 12; ++i) {
    if ((setup.side_layers >> i) & 1U) two.side.layers.push_back(i);
  }
  two.side.recompute = setup.recompute;
  two.side.all_reduce = setup.all_reduce;
  RC_TAG(two.side.any());
  auto plain = simulate_training(model, device, one);
  auto run = simulate_training(model, device, two, faults);
  testing::check_against(run, plain);
  const TrainingRun& r = run.value();
  // Memory after each step as on one stream: back at the baseline, except what the trl
  // policy itself holds over a checkpointed step (the reference never hears of a release).
  for (std::size_t s = 0; s < r.steps.size(); ++s) {
    RC_ASSERT(r.allocated_after[s] == plain.value().allocated_after[s]);
    if (setup.policy != Policy::Trl) RC_ASSERT(r.allocated_after[s] == r.baseline_allocated);
  }
}

RC_GTEST_PROP(SideStreamProperty, SideStreamWorkWithItsEdgesIsClean, ()) {
  side_streams_are_clean(testing::any_layers(), *gen_setup(), {});
}

// With the offloader, which asks compute_stream() at each pack and unpack and guards its frees
// on the streams current then, not at the release (Note [The compute stream is the current
// one]): otherwise an original produced on the side stream and retired by a later pack on the
// compute stream goes back to the side stream's pool, which the compute stream's wait for the
// copy does not order; and a reloaded tensor read by a node on the side stream and released
// after the switch back is guarded by an event on the compute stream only. Both are
// latent-reuse reports.
//
// Not covered yet, so not generated: side layers together with checkpoint segments. A layer
// on the side stream inside a checkpointed region allocates its output from the side stream's
// pool without any pack or unpack on that stream, and the next region packs it as an input on
// the compute stream: the core, which does not know a storage's allocation stream, guards the
// original's free on the compute streams it has seen, and the side stream is not among them
// (a latent-reuse report). Recomputations on the side stream are generated.
RC_GTEST_PROP(SideStreamProperty, SideStreamWorkWithTheOffloaderIsClean, ()) {
  const Policy policy = *rc::gen::element(Policy::Ferry, Policy::Trl);
  Setup setup = *gen_setup();
  setup.policy = policy;
  if (setup.segments >= 2) setup.side_layers = 0;
  side_streams_are_clean(testing::any_layers(), setup, {});
}

void expect_caught(const TrainingFaults& faults, const char* name) {
  ferry::testing::expect_planted_fault_caught(
      [&] { side_streams_are_clean(testing::any_layers(), *gen_setup(), faults); }, name, 20261123,
      500);
}

TEST(SideStreamProperty, PlantedMissingWaitIsCaught) {
  TrainingFaults faults;
  faults.skip_side_stream_wait = true;
  expect_caught(faults, "no wait before side or comm work");
}

TEST(SideStreamProperty, PlantedGradientFreedAtItsAllReduceIsCaught) {
  TrainingFaults faults;
  faults.free_grad_at_all_reduce = true;
  expect_caught(faults, "set_to_none frees a gradient its all-reduce may still read");
}

TEST(SideStreamProperty, PlantedMissingRecordStreamIsCaught) {
  TrainingFaults faults;
  faults.skip_cross_stream_record = true;
  expect_caught(faults, "no record_stream for a tensor used on another stream");
}

}  // namespace
}  // namespace ferry::sim
