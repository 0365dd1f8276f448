// A pipeline on the mesh (Note [A pipeline on the mesh] in sim/src/autograd/executor_mesh.cpp)
// on random models with collective ops after random ops (collective_models.hpp), over two
// stages under every schedule, with and without FSDP over 2 ranks a stage: no hazard, every
// kernel reads what was computed, and the gradients are the single-device reference's. Each
// of the six waits, dropped, is caught and shrunk.

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "ferry/sim/autograd/pipeline.hpp"
#include "prop/collective_models.hpp"
#include "prop/planted.hpp"
#include "prop/rc_model_gens.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

using testing::LayerChoice;

struct Setup {
  std::uint64_t after = 0;   // bit i: a collective op after op i
  std::uint64_t shapes = 0;  // two bits an op: what it runs (collective_models.hpp)
  std::uint64_t axes = 0;    // two bits an op: its mesh axis
  bool fsdp = false;         // FSDP over 2 ranks a stage
  Schedule schedule = Schedule::OneFOneB;
  std::int32_t micro_batches = 2;
};

void showValue(const Setup& s, std::ostream& os) {
  os << "after " << s.after << ", shapes " << s.shapes << ", axes " << s.axes
     << (s.fsdp ? ", fsdp 2" : "") << ", " << schedule_name(s.schedule) << " over "
     << s.micro_batches << " micro-batches";
}

rc::Gen<Setup> gen_setup(bool fsdp_always) {
  return rc::gen::apply(
      [fsdp_always](std::uint64_t after, std::uint64_t shapes, std::uint64_t axes, bool fsdp,
                    Schedule schedule, std::int32_t micro_batches) {
        return Setup{after, shapes, axes, fsdp || fsdp_always, schedule, micro_batches};
      },
      rc::gen::inRange<std::uint64_t>(1, 1 << 12), rc::gen::arbitrary<std::uint64_t>(),
      rc::gen::arbitrary<std::uint64_t>(), rc::gen::arbitrary<bool>(),
      rc::gen::element(Schedule::GPipe, Schedule::OneFOneB, Schedule::InterleavedZeroBubble),
      rc::gen::inRange<std::int32_t>(2, 5));
}

void stages_are_clean(const std::vector<LayerChoice>& layers, const Setup& setup,
                      const PipelineFaults& faults) {
  testing::ModelOptions mo;
  mo.param_per_layer = true;
  mo.side_branches = false;
  const Model model = testing::with_collectives(testing::build_random_model(layers, mo),
                                                setup.after, setup.shapes, setup.axes);
  RC_PRE(std::ranges::any_of(model.ops, [](const ModelOp& op) { return op.collective.any(); }));
  RC_PRE(model.ops.size() >= 2);
  if (auto valid = validate_model(model); !valid) RC_FAIL("invalid: " + valid.error().message);
  const DeviceProfile device = testing::node_profile();
  PipelineOptions o;
  o.devices = 2;
  o.micro_batches = setup.micro_batches;
  o.schedule = setup.schedule;
  o.checkpoint = CheckpointMode::Never;
  if (setup.fsdp) o.mesh = Mesh::make(Parallelism{.ranks = 2}, device).value();
  RC_TAG(setup.fsdp, schedule_name(setup.schedule));
  auto run = simulate_pipeline(model, device, o, faults);
  auto reference = simulate_reference(model, device, o);
  if (!run.ok()) RC_FAIL("refused: " + run.error().message);
  RC_ASSERT(reference.ok());
  const PipelineRun& r = run.value();
  if (r.failure) RC_FAIL("the step failed: " + r.failure->message);
  if (!r.hazards().empty()) RC_FAIL("hazards:\n" + testing::hazard_lines(r.sim));
  RC_ASSERT(r.content_mismatches().empty());
  RC_ASSERT(r.param_grads == reference.value().param_grads);
}

std::vector<LayerChoice> some_layers() {
  return *rc::gen::resize(
      12, rc::gen::nonEmpty(rc::gen::container<std::vector<LayerChoice>>(testing::gen_layer())));
}

RC_GTEST_PROP(PipelineMeshProperty, StagesWithCollectivesAndFsdpAreClean, ()) {
  stages_are_clean(some_layers(), *gen_setup(false), {});
}

void expect_caught(bool PipelineFaults::*fault, const char* name, bool fsdp) {
  PipelineFaults faults;
  faults.*fault = true;
  ferry::testing::expect_planted_fault_caught(
      [&] { stages_are_clean(some_layers(), *gen_setup(fsdp), faults); }, name, 20261129, 500);
}

TEST(PipelineMeshProperty, PlantedMissingWaitsAreCaught) {
  expect_caught(&PipelineFaults::skip_collective_launch_wait,
                "a stage's collective does not wait for its compute stream", false);
  expect_caught(&PipelineFaults::skip_collective_output_wait,
                "a stage's compute stream does not wait for its collective", false);
  expect_caught(&PipelineFaults::skip_gather_launch_wait,
                "the all-gather does not wait for the parameters' initialization", true);
  expect_caught(&PipelineFaults::skip_gather_arrival_wait,
                "the first forward does not wait for the all-gather", true);
  expect_caught(&PipelineFaults::skip_reduce_launch_wait,
                "the reduce-scatter does not wait for the last backward", true);
  expect_caught(&PipelineFaults::skip_reduce_arrival_wait,
                "the optimizer does not wait for the reduce-scatter", true);
}

}  // namespace
}  // namespace ferry::sim
