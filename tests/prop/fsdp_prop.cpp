// FSDP2 with offload and checkpointing on random models (ParallelOptions, Note [FSDP2, one rank]):
// random rank counts, nodes, HSDP replicas, reshard-after-forward settings, FSDP2, SimpleFSDP
// (Note [SimpleFSDP's pool]) or torch 2.4's FSDP2 (Note [torch 2.4's copy-in]), one backward or two
// (retain_graph), gradients reduced in the compute dtype or in float32 (Note [The reduce dtype]),
// offload policies, checkpoint segments (reentrant or not), backward orders and
// device speeds, and models with a mixture of experts' grouped matmuls split by expert parallelism
// (each layer's experts an FSDP unit of their own over the expert shard group, the routed rows
// exchanged by all-to-alls; the tag counts the cases by expert-parallel degree). With FSDP2's waits
// there is no hazard, every unpacked tensor holds what was saved and the gradients are those of the
// run without FSDP. Planted faults, each caught and shrunk: a unit's forward not waiting for its
// all-gather (and a layer's experts alone not waiting for theirs), backward reading parameters
// resharded after forward, the reduce-scatter reading gradients before backward wrote them, an
// all-gather not waiting for its copy-in, SimpleFSDP's second backward accumulating before the
// reduce-scatter is waited for, and each free FSDP2 orders behind a wait made without it (an
// all-gather output, a reduce-scatter input, the gradient shards at zero_grad, HSDP's all-reduced
// gradients in the compute dtype). Two ranks of a node
// side by side (simulate_node) share nothing, so no hazard; planted fault: their pinned pools at
// the same addresses, one host buffer written by both ranks' offloads.

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <iostream>
#include <string>

#include "ferry/sim/workload/rank_model.hpp"
#include "prop/planted.hpp"
#include "prop/training_prop.hpp"

namespace ferry::sim {
namespace {

using testing::LayerChoice;

struct Setup : testing::TrainingDraw {
  std::int32_t ranks = 2;
  std::int32_t nodes_per_group = 1;  // nodes = ceil(ranks / 8) * this, when it divides
  std::int32_t replicas = 1;
  Reshard reshard{};
  FsdpImpl impl = FsdpImpl::Fsdp2;
  ReduceDtype reduce = ReduceDtype::Param;
  bool retain_graph = false;
  bool experts = false;  // every second op a grouped expert matmul
  std::int32_t ep = 1;   // expert parallelism over the shard group's GPUs
};

void showValue(const Setup& s, std::ostream& os) {
  os << s.ranks << " ranks, " << s.replicas << " replicas, reshard " << to_string(s.reshard) << ", "
     << to_string(s.impl) << ", reduce " << to_string(s.reduce)
     << (s.retain_graph ? ", two backwards" : "") << ", ";
  testing::show_draw(s, os);
  os << (s.experts ? fmt::format(", experts, ep {}", s.ep) : "");
}

rc::Gen<Setup> gen_setup() {
  return rc::gen::apply(
      [](std::int32_t ranks_log2, bool hsdp, std::int32_t reshard, FsdpImpl impl, bool retain_graph,
         Policy policy, std::int32_t segments, bool reentrant, std::uint64_t order,
         std::uint64_t device, std::int32_t ep_log2, ReduceDtype reduce) {
        Setup s;
        s.reduce = reduce;
        s.ranks = 1 << ranks_log2;
        s.replicas = hsdp && s.ranks >= 4 ? 2 : 1;
        s.impl = impl;
        s.retain_graph = retain_graph;
        s.policy = policy;
        s.segments = segments;
        s.reentrant = reentrant;
        s.order_seed = order;
        s.device_seed = device;
        // ep_log2 -1: a dense model; else experts, split among as many GPUs as divide the
        // shard group (and the experts).
        s.experts = ep_log2 >= 0;
        s.ep = 1;
        while (s.experts && s.ep < (1 << ep_log2) && (s.ranks / s.replicas) % (2 * s.ep) == 0 &&
               2 * s.ep <= testing::kExperts) {
          s.ep *= 2;
        }
        // -1 true, 0 false, 1 an int (2), where the shard group, and the experts', have 2 ranks
        // to keep it over.
        s.reshard = reshard < 0                        ? Reshard::True()
                    : reshard == 0                     ? Reshard::False()
                    : s.ranks / s.replicas / s.ep >= 2 ? Reshard::K(2)
                                                       : Reshard::True();
        return s;
      },
      rc::gen::inRange<std::int32_t>(0, 7), rc::gen::arbitrary<bool>(),
      rc::gen::inRange<std::int32_t>(-1, 2),
      rc::gen::element(FsdpImpl::Fsdp2, FsdpImpl::Simple, FsdpImpl::Fsdp2Torch24),
      rc::gen::arbitrary<bool>(), rc::gen::element(Policy::None, Policy::Ferry),
      rc::gen::inRange<std::int32_t>(0, 4), rc::gen::arbitrary<bool>(),
      rc::gen::inRange<std::uint64_t>(0, 3), rc::gen::inRange<std::uint64_t>(1, 1000),
      rc::gen::inRange<std::int32_t>(-1, 4),
      rc::gen::element(ReduceDtype::Param, ReduceDtype::Float32));
}

void fsdp_is_clean(const std::vector<LayerChoice>& layers, const Setup& setup,
                   const TrainingFaults& faults) {
  testing::ModelOptions mo;
  mo.side_branches = setup.policy != Policy::Trl;
  mo.param_per_layer = true;
  mo.experts = setup.experts;
  const DeviceProfile device = testing::random_linked_device(setup.device_seed);
  // Expert parallelism runs one GPU's cut of the model, with and without FSDP alike.
  // A model of one op has no grouped matmul (every second op is one): nothing to split.
  const std::int32_t ep = layers.size() >= 2 ? setup.ep : 1;
  RC_TAG(ep);
  const std::int32_t per_node = std::max(1, device.collectives.gpus_per_node);
  auto cut =
      expert_parallel_model(build_random_model(layers, mo), ep, (ep + per_node - 1) / per_node);
  if (!cut.ok()) RC_FAIL("refused: " + cut.error().message);
  const Model& model = cut.value();
  TrainingOptions plain = testing::two_steps_of(model, setup);
  plain.retain_graph = setup.retain_graph;
  TrainingOptions sharded = plain;
  auto parallelism = Mesh::make(Parallelism{.ranks = setup.ranks,
                                            .replicas = setup.replicas,
                                            .reshard_after_forward = setup.reshard,
                                            .impl = setup.impl,
                                            .reduce = setup.reduce,
                                            .ep = ep},
                                device);
  if (!parallelism.ok()) RC_FAIL("refused: " + parallelism.error().message);
  sharded.parallel.mesh = parallelism.value();
  auto reference = simulate_training(model, device, plain);
  auto run = simulate_training(model, device, sharded, faults);
  testing::check_against(run, reference);
  const TrainingRun& r = run.value();
  // After the first step the memory is the shards and the optimizer's state: the same after
  // every later step.
  for (std::size_t s = 2; s < r.allocated_after.size(); ++s) {
    RC_ASSERT(r.allocated_after[s] == r.allocated_after[1]);
  }
}

RC_GTEST_PROP(FsdpProperty, FsdpWithOffloadAndCheckpointIsClean, ()) {
  fsdp_is_clean(testing::any_layers(), *gen_setup(), {});
}

void expect_caught(const TrainingFaults& faults, const char* name) {
  ferry::testing::expect_planted_fault_caught(
      [&] { fsdp_is_clean(testing::any_layers(), *gen_setup(), faults); }, name, 20261124, 500);
}

// Each of FSDP2's waits, dropped by a planted fault: the name of the test, and the defect.
struct PlantedWait {
  const char* test;
  bool FsdpFaults::*fault;
  const char* defect;
};

constexpr PlantedWait kPlantedWaits[] = {
    {"ForwardWithoutAllGatherWait", &FsdpFaults::skip_all_gather_wait,
     "a unit's forward does not wait for its all-gather"},
    {"ExpertsWithoutAllGatherWait", &FsdpFaults::skip_expert_all_gather_wait,
     "a layer's experts, a unit of their own under expert parallelism, run before their "
     "all-gather"},
    {"BackwardOnReshardedParameters", &FsdpFaults::skip_backward_unshard,
     "unsharded parameters freed before the backward that reads them"},
    {"ReduceScatterBeforeGradients", &FsdpFaults::skip_reduce_scatter_wait,
     "the reduce-scatter reads gradients before backward wrote them"},
    {"AllGatherBeforeItsCopyIn", &FsdpFaults::skip_copy_in_wait,
     "an all-gather reads its input before the copy-in wrote it"},
    {"AccumulateBeforeTheReduceScatter", &FsdpFaults::skip_accumulate_wait,
     "SimpleFSDP's second backward accumulates a gradient shard the reduce-scatter still writes"},
    {"GatherOutputFreedBeforeItsCopyOut", &FsdpFaults::skip_gather_free_wait,
     "an all-gather output freed before the copy-out that reads it"},
    {"ReduceInputFreedBeforeItsReduceScatter", &FsdpFaults::skip_reduce_input_free_wait,
     "a reduce-scatter input freed before the collective that reads it"},
    {"GradientShardsFreedBeforeTheOptimizer", &FsdpFaults::skip_grad_shard_free_wait,
     "zero_grad frees gradient shards the optimizer step still reads"},
    {"GradientsFreedBeforeTheirCopyIn", &FsdpFaults::skip_copy_in_free_wait,
     "torch 2.4's FSDP2 frees gradients its reduce-scatter stream still copies in"},
    {"AllReducedGradientsFreedBeforeTheirCast", &FsdpFaults::skip_reduced_free_wait,
     "HSDP's all-reduced gradients freed into the reduce-scatter stream's pool while the "
     "all-reduce stream may still cast them"},
};

class PlantedFsdpFault : public ::testing::TestWithParam<PlantedWait> {};

TEST_P(PlantedFsdpFault, IsCaught) {
  TrainingFaults faults;
  faults.fsdp.*(GetParam().fault) = true;
  expect_caught(faults, GetParam().defect);
}

INSTANTIATE_TEST_SUITE_P(FsdpProperty, PlantedFsdpFault, ::testing::ValuesIn(kPlantedWaits),
                         [](const ::testing::TestParamInfo<PlantedWait>& param) {
                           return std::string(param.param.test);
                         });

// Two or three ranks of a node, each offloading into its share of the node's pinned memory.
void node_is_clean(const std::vector<LayerChoice>& layers, const Setup& setup,
                   std::int32_t node_ranks, const TrainingFaults& faults) {
  const Model model = build_random_model(
      layers, testing::ModelOptions{.side_branches = true, .param_per_layer = true});
  const DeviceProfile device = testing::random_linked_device(setup.device_seed);
  testing::TrainingDraw draw = setup;
  draw.policy = Policy::Ferry;
  TrainingOptions options = testing::two_steps_of(model, draw);
  auto parallelism = Mesh::make(Parallelism{.ranks = std::max(setup.ranks, 8),
                                            .replicas = setup.replicas,
                                            .reshard_after_forward = setup.reshard},
                                device);
  if (!parallelism.ok()) RC_FAIL("refused: " + parallelism.error().message);
  options.parallel.mesh = parallelism.value();
  auto one = simulate_training(model, device, options);
  auto node = simulate_node(model, device, options, node_ranks, faults);
  RC_ASSERT(one.ok());
  if (!node.ok()) RC_FAIL("refused: " + node.error().message);
  const NodeRun& n = node.value();
  for (const auto& failure : n.failures) {
    if (failure) RC_FAIL("a rank failed: " + failure->message);
  }
  if (!n.sim.hazards().empty()) RC_FAIL("hazards:\n" + testing::hazard_lines(n.sim));
  RC_ASSERT(n.sim.content_mismatches().empty());
  // Rank 0 loads the batch the one-rank run loads: its neighbours change nothing it computes.
  RC_ASSERT(n.gradient_values[0] == one.value().gradient_values);
  // Rank 1 loads a batch of its own.
  if (!n.gradient_values[0].empty()) RC_ASSERT(n.gradient_values[1] != n.gradient_values[0]);
}

RC_GTEST_PROP(FsdpProperty, RanksOfANodeShareNoBytes, ()) {
  node_is_clean(testing::any_layers(), *gen_setup(), *rc::gen::inRange<std::int32_t>(2, 4), {});
}

TEST(FsdpProperty, PlantedPinnedBufferSharedByTwoRanksIsCaught) {
  TrainingFaults faults;
  faults.shared_pinned_pool = true;
  ferry::testing::expect_planted_fault_caught(
      [&] {
        node_is_clean(testing::any_layers(), *gen_setup(), *rc::gen::inRange<std::int32_t>(2, 4),
                      faults);
      },
      "a pinned host buffer shared by two ranks' offloads", 20261124, 500);
}

}  // namespace
}  // namespace ferry::sim
