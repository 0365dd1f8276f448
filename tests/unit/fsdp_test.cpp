// FSDP2 in the simulated autograd (ParallelOptions, Note [FSDP2, one rank]): one rank's memory is
// its shards plus what is gathered, the collectives run on their own streams beside compute,
// with the waits FSDP2 makes the run is hazard-free and its gradients are those of the run
// without FSDP, and each planted fault is reported. Also the parallelism as the edges are given
// it (MeshRequest) and as JSON writes it (parallelism_json).

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/autograd/checkpoint_plan.hpp"
#include "ferry/sim/io/parallelism_json.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "plan_replay.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using testing::node_profile;

// `p` checked against node_profile, where it must hold.
Mesh on_fsdp_profile(const Parallelism& p) {
  auto checked = Mesh::make(p, node_profile());
  EXPECT_TRUE(checked.ok()) << checked.error().message;
  return checked.ok() ? checked.value() : Mesh{};
}

TrainingOptions fsdp_options(std::int32_t ranks, Policy policy = Policy::None,
                             Reshard reshard = Reshard::True()) {
  TrainingOptions o = testing::two_steps(policy);
  o.parallel.mesh = on_fsdp_profile(Parallelism{.ranks = ranks, .reshard_after_forward = reshard});
  return o;
}

TrainingRun train(const Model& m, const TrainingOptions& o, const TrainingFaults& faults = {},
                  const DeviceProfile& device = node_profile()) {
  auto run = simulate_training(m, device, o, faults);
  EXPECT_TRUE(run.ok()) << run.error().message;
  return std::move(run.value());
}

void expect_clean(const TrainingRun& run) {
  ASSERT_FALSE(run.failure) << run.failure->message;
  EXPECT_TRUE(run.sim.hazards().empty()) << run.sim.hazards().size() << " hazards\n"
                                         << testing::hazard_lines(run.sim);
  EXPECT_TRUE(run.sim.content_mismatches().empty());
}

std::int64_t ops_on(const TrainingRun& run, const std::string& stream, bool collective) {
  std::int64_t n = 0;
  for (const OpRecord& op : run.sim.ops()) {
    if (op.kind == OpKind::Kernel && op.collective == collective && op.stream.valid() &&
        run.sim.stream_name(op.stream) == stream) {
      ++n;
    }
  }
  return n;
}

TEST(Fsdp, EachLayerIsGatheredTwiceAndReducedOnceAStep) {
  const Model m = testing::chain_model(4, 1 << 20);
  const TrainingRun run = train(m, fsdp_options(4));
  expect_clean(run);
  // Four layer units, each all-gathered for forward and again for backward (resharded after
  // forward), and reduce-scattered once; the root (the loss: no parameters) never. Two steps.
  EXPECT_EQ(ops_on(run, "all_gather", true), 2 * 4 * 2);
  EXPECT_EQ(ops_on(run, "reduce_scatter", true), 2 * 4);
  EXPECT_EQ(ops_on(run, "compute", true), 0);
}

TEST(Fsdp, GradientsAreThoseOfTheRunWithoutFsdp) {
  const Model m = testing::chain_model(5, 1 << 20);
  TrainingOptions plain = testing::two_steps(Policy::Ferry);
  const TrainingRun reference = train(m, plain);
  for (const Reshard reshard : {Reshard::True(), Reshard::False(), Reshard::K(2)}) {
    const TrainingOptions o = fsdp_options(4, Policy::Ferry, reshard);
    const TrainingRun run = train(m, o);
    expect_clean(run);
    EXPECT_EQ(run.gradient_values, reference.gradient_values) << "reshard " << to_string(reshard);
  }
}

TEST(Fsdp, CheckpointedLayersRecomputeOnGatheredParameters) {
  const Model m = testing::chain_model(6, 1 << 20);
  for (const bool reentrant : {false, true}) {
    TrainingOptions o = fsdp_options(8, Policy::Ferry);
    o.checkpoint = checkpoint_segments(m, 3, reentrant);
    const TrainingRun run = train(m, o);
    expect_clean(run);
    EXPECT_GT(run.recomputations, 0);
  }
}

TEST(Fsdp, MoreRanksHoldLessOfTheModel) {
  // Large parameters, small activations: the shards dominate.
  Model m = testing::chain_model(4, 1 << 10);
  for (ModelTensor& t : m.tensors) {
    if (t.role == TensorRole::Param) t.bytes = Bytes(16LL << 20);
  }
  Bytes last(std::numeric_limits<std::int64_t>::max());
  for (const std::int32_t ranks : {1, 2, 8}) {
    const TrainingRun run = train(m, fsdp_options(ranks));
    expect_clean(run);
    const Bytes peak = run.sim.device_allocator(run.device).stats().allocated_peak;
    EXPECT_LT(peak, last) << ranks << " ranks";
    last = peak;
  }
}

// FSDP keeps the optimizer's state of its shards itself: a tensor whose role is an optimizer's
// state is FSDP's, whatever its name, and a buffer is the model's, whatever its name. Without
// FSDP the model holds its optimizer's state for the step, as it holds a buffer.
TEST(Fsdp, TheOptimizersStateIsKnownByItsRoleNotItsName) {
  const Bytes state_bytes(64LL << 20);
  const auto peak = [&](const std::string& name, std::optional<TensorRole> role, bool fsdp) {
    Model m = testing::chain_model(4, 1 << 20);
    if (role) {
      ModelTensor state;
      state.name = name;
      state.bytes = state_bytes;
      state.dtype = DType::F32;
      state.role = *role;
      m.tensors.push_back(state);
    }
    const TrainingRun run = train(m, fsdp ? fsdp_options(4) : testing::two_steps(Policy::None));
    expect_clean(run);
    return run.sim.device_allocator(run.device).stats().allocated_peak;
  };
  const Bytes sharded = peak("", std::nullopt, true);
  EXPECT_EQ(peak("moments", TensorRole::OptimizerState, true), sharded);
  EXPECT_EQ(peak("optimizer.moments", TensorRole::Buffer, true), sharded + state_bytes);
  const Bytes whole = peak("", std::nullopt, false);
  EXPECT_EQ(peak("moments", TensorRole::OptimizerState, false), whole + state_bytes);
  EXPECT_EQ(peak("optimizer.moments", TensorRole::Buffer, false), whole + state_bytes);
}

TEST(Fsdp, CollectivesOverlapCompute) {
  const Model m = testing::chain_model(6, 1 << 20);
  const TrainingRun run = train(m, fsdp_options(8));
  expect_clean(run);
  bool overlapped = false;
  std::vector<const OpRecord*> kernels;
  for (const OpRecord& op : run.sim.ops()) {
    if (op.kind == OpKind::Kernel && !op.collective && op.end > op.start) kernels.push_back(&op);
  }
  for (const OpRecord& c : run.sim.ops()) {
    if (!c.collective) continue;
    for (const OpRecord* k : kernels) overlapped |= k->start < c.end && c.start < k->end;
  }
  EXPECT_TRUE(overlapped);
}

TEST(Fsdp, BadOptionsAreRefusedWithTheFieldNamed) {
  // A parallelism is checked once, against the device, before any run can take it.
  auto run = Mesh::make(Parallelism{.ranks = 4, .replicas = 3}, node_profile());
  ASSERT_FALSE(run.ok());
  EXPECT_EQ(run.error().message, "replicas: 3 replica groups do not divide 4 ranks");
  auto bare = Mesh::make(Parallelism{.ranks = 4}, testing::simple_profile());
  ASSERT_FALSE(bare.ok());
  EXPECT_NE(bare.error().message.find("collectives"), std::string::npos);
  auto crowded = Mesh::make(Parallelism{.ranks = 16, .nodes = 1}, node_profile());
  ASSERT_FALSE(crowded.ok());
  EXPECT_EQ(crowded.error().message.rfind("nodes: 16 ranks over 1 nodes", 0), 0U);
  auto uneven =
      Mesh::make(Parallelism{.ranks = 4, .reshard_after_forward = Reshard::K(3)}, node_profile());
  ASSERT_FALSE(uneven.ok());
  EXPECT_EQ(uneven.error().message.rfind("reshard_after_forward: 3 must be", 0), 0U);
  // The default is one GPU, on any device.
  EXPECT_FALSE(Mesh{}.on());
  EXPECT_TRUE(Mesh::make(Parallelism{}, testing::simple_profile()).ok());
}

bool reported_on(const TrainingRun& run, const std::string& stream) {
  for (const Hazard& h : run.sim.hazards()) {
    for (const OpId op : {h.first, h.second}) {
      const StreamId on = run.sim.ops()[op.value()].stream;
      if (on.valid() && run.sim.stream_name(on) == stream) return true;
    }
  }
  return false;
}

TEST(Fsdp, PlantedFaultsAreReported) {
  const Model m = testing::chain_model(4, 1 << 20);
  TrainingFaults f;
  f.fsdp.skip_all_gather_wait = true;
  EXPECT_TRUE(reported_on(train(m, fsdp_options(4), f), "all_gather"));
  f = {};
  f.fsdp.skip_reduce_scatter_wait = true;
  EXPECT_TRUE(reported_on(train(m, fsdp_options(4), f), "reduce_scatter"));
  f = {};
  f.fsdp.skip_backward_unshard = true;
  EXPECT_FALSE(train(m, fsdp_options(4), f).sim.hazards().empty());
  f = {};
  f.fsdp.skip_copy_in_wait = true;
  EXPECT_TRUE(reported_on(train(m, fsdp_options(4), f), "all_gather"));
}

// SimpleFSDP as torchtitan's graph trainer runs it: gradients reduced in float32.
TrainingOptions simple_fsdp_options(std::int32_t ranks, Policy policy = Policy::None,
                                    Reshard reshard = Reshard::True()) {
  TrainingOptions o = testing::two_steps(policy);
  o.parallel.mesh = on_fsdp_profile(Parallelism{.ranks = ranks,
                                                .reshard_after_forward = reshard,
                                                .impl = FsdpImpl::Simple,
                                                .reduce = ReduceDtype::Float32});
  return o;
}

// Bytes reserved at the step's end by the pools of the streams named `stream`.
Bytes reserved_by(const TrainingRun& run, const std::string& stream) {
  Bytes held(0);
  for (const SegmentInfo& segment : run.sim.device_allocator(run.device).segments()) {
    if (run.sim.stream_name(segment.stream) == stream) held += segment.size;
  }
  return held;
}

TEST(SimpleFsdp, RunsFsdp2sScheduleWithEveryBufferFromTheComputeStreamsPool) {
  const Model m = testing::chain_model(5, 1 << 20);
  const TrainingRun reference = train(m, testing::two_steps(Policy::Ferry));
  for (const Reshard reshard : {Reshard::True(), Reshard::False(), Reshard::K(2)}) {
    const TrainingRun fsdp2 = train(m, fsdp_options(4, Policy::Ferry, reshard));
    const TrainingRun simple = train(m, simple_fsdp_options(4, Policy::Ferry, reshard));
    expect_clean(simple);
    EXPECT_EQ(simple.gradient_values, reference.gradient_values) << to_string(reshard);
    // The same collectives on the same streams; the copy-ins on the compute stream.
    EXPECT_EQ(ops_on(simple, "all_gather", true), ops_on(fsdp2, "all_gather", true));
    EXPECT_EQ(ops_on(simple, "reduce_scatter", true), ops_on(fsdp2, "reduce_scatter", true));
    EXPECT_GT(ops_on(fsdp2, "all_gather_copy_in", false), 0);
    EXPECT_EQ(ops_on(simple, "all_gather_copy_in", false), 0);
    // FSDP2's copy-in and reduce-scatter streams keep pools of their own; SimpleFSDP's do not.
    EXPECT_GT(reserved_by(fsdp2, "all_gather_copy_in"), Bytes(0));
    EXPECT_GT(reserved_by(fsdp2, "reduce_scatter"), Bytes(0));
    EXPECT_EQ(reserved_by(simple, "all_gather_copy_in"), Bytes(0));
    EXPECT_EQ(reserved_by(simple, "reduce_scatter"), Bytes(0));
  }
}

TEST(SimpleFsdp, ASecondBackwardAccumulatesTheGradientShardsCleanly) {
  const Model m = testing::chain_model(4, 1 << 20);
  for (const FsdpImpl impl : {FsdpImpl::Fsdp2, FsdpImpl::Simple}) {
    TrainingOptions o = impl == FsdpImpl::Simple ? simple_fsdp_options(4) : fsdp_options(4);
    o.retain_graph = true;
    SCOPED_TRACE(to_string(impl));
    expect_clean(train(m, o));
  }
  // SimpleFSDP accumulates on the compute stream: without its wait for the reduce-scatter, the
  // accumulate reads the new shard while the collective may still write it.
  TrainingOptions o = simple_fsdp_options(4);
  o.retain_graph = true;
  TrainingFaults f;
  f.fsdp.skip_accumulate_wait = true;
  EXPECT_TRUE(reported_on(train(m, o, f), "reduce_scatter"));
}

TEST(SimpleFsdp, PlantedFaultsAreReported) {
  // A free into the compute stream's pool before the compute stream waits for the collective
  // that used the buffer: the pool hands the block out again while the collective may run.
  const Model m = testing::chain_model(4, 1 << 20);
  TrainingFaults f;
  f.fsdp.skip_all_gather_wait = true;
  EXPECT_TRUE(reported_on(train(m, simple_fsdp_options(4), f), "all_gather"));
  f = {};
  f.fsdp.skip_copy_in_wait = true;
  EXPECT_TRUE(reported_on(train(m, simple_fsdp_options(4), f), "all_gather"));
  f = {};
  f.fsdp.skip_reduce_scatter_wait = true;
  EXPECT_TRUE(reported_on(train(m, simple_fsdp_options(4), f), "reduce_scatter"));
  f = {};
  f.fsdp.skip_reduce_input_free_wait = true;
  EXPECT_TRUE(reported_on(train(m, simple_fsdp_options(4), f), "reduce_scatter"));
  // FSDP2's waits for its side streams' pools are not SimpleFSDP's: without them its run is
  // still clean, since those buffers come from the compute stream's pool.
  f = {};
  f.fsdp.skip_gather_free_wait = true;
  expect_clean(train(m, simple_fsdp_options(4), f));
  f = {};
  f.fsdp.skip_grad_shard_free_wait = true;
  expect_clean(train(m, simple_fsdp_options(4), f));
}

TEST(Fsdp2Torch24, CopiesGradientsInOnTheReduceScatterStreamAndKeepsItsInputInThatPool) {
  // Note [torch 2.4's copy-in]: the same collectives and gradients as torch 2.11's FSDP2, the
  // copy-in kernels on the reduce-scatter stream, whose pool then holds the inputs' blocks too
  // (parameters of 8 MiB: reduce-scatter inputs of the large pool).
  Model m = testing::chain_model(5, 1 << 20);
  for (ModelTensor& t : m.tensors) {
    if (t.role == TensorRole::Param) t.bytes = Bytes(8 << 20);
  }
  // Gradients reduced in float32, as torchtitan's runs of that torch did.
  TrainingOptions o = fsdp_options(4, Policy::Ferry);
  o.parallel.mesh = on_fsdp_profile(Parallelism{.ranks = 4, .reduce = ReduceDtype::Float32});
  const TrainingRun fsdp2 = train(m, o);
  o.parallel.mesh = on_fsdp_profile(
      Parallelism{.ranks = 4, .impl = FsdpImpl::Fsdp2Torch24, .reduce = ReduceDtype::Float32});
  const TrainingRun old = train(m, o);
  expect_clean(old);
  EXPECT_EQ(old.gradient_values, fsdp2.gradient_values);
  EXPECT_EQ(ops_on(old, "reduce_scatter", true), ops_on(fsdp2, "reduce_scatter", true));
  EXPECT_GT(ops_on(old, "reduce_scatter", false), ops_on(fsdp2, "reduce_scatter", false));
  EXPECT_GT(reserved_by(old, "reduce_scatter"), reserved_by(fsdp2, "reduce_scatter"));
  // Freeing the gradients before the current stream waits for their copy-in hands their blocks
  // to the next backward op while the reduce-scatter stream may still read them.
  TrainingFaults f;
  f.fsdp.skip_copy_in_free_wait = true;
  EXPECT_FALSE(train(m, o, f).sim.hazards().empty());
  EXPECT_EQ(parse_fsdp_impl("fsdp2-torch2.4"), FsdpImpl::Fsdp2Torch24);
  EXPECT_EQ(to_string(FsdpImpl::Fsdp2Torch24), "fsdp2-torch2.4");
}

// The summed durations of the collectives on `stream`.
SimTime collective_time_on(const TrainingRun& run, const std::string& stream) {
  SimTime total;
  for (const OpRecord& op : run.sim.ops()) {
    if (op.kind == OpKind::Kernel && op.collective && run.sim.stream_name(op.stream) == stream) {
      total += op.end - op.start;
    }
  }
  return total;
}

// Note [The reduce dtype]: by default (torch's) a bf16 model's gradients are reduce-scattered,
// and with HSDP all-reduced, in bf16 and cast to their float32 shards after; --reduce-dtype
// float32 moves twice the bytes. The gradients and the shards' bytes are the same either way.
TEST(Fsdp, GradientsReduceInTheirOwnDtypeUnlessFloat32IsAsked) {
  Model m = testing::chain_model(4, 1 << 20);
  for (ModelTensor& t : m.tensors) {
    if (t.role == TensorRole::Param) t.bytes = Bytes(8 << 20);
  }
  const TrainingRun reference = train(m, testing::two_steps(Policy::None));
  for (const std::int32_t replicas : {1, 2}) {
    for (const FsdpImpl impl : {FsdpImpl::Fsdp2, FsdpImpl::Simple}) {
      SCOPED_TRACE(fmt::format("{} replicas, {}", replicas, to_string(impl)));
      const auto run = [&](ReduceDtype reduce) {
        TrainingOptions o = testing::two_steps(Policy::None);
        o.parallel.mesh = on_fsdp_profile(
            Parallelism{.ranks = 8, .replicas = replicas, .impl = impl, .reduce = reduce});
        return train(m, o);
      };
      const TrainingRun param = run(ReduceDtype::Param);
      const TrainingRun float32 = run(ReduceDtype::Float32);
      expect_clean(param);
      expect_clean(float32);
      EXPECT_EQ(param.gradient_values, reference.gradient_values);
      EXPECT_EQ(float32.gradient_values, reference.gradient_values);
      EXPECT_EQ(param.allocated_after.back(), float32.allocated_after.back());
      EXPECT_LT(collective_time_on(param, "reduce_scatter"),
                collective_time_on(float32, "reduce_scatter"));
      if (replicas > 1) {
        EXPECT_LT(collective_time_on(param, "all_reduce"),
                  collective_time_on(float32, "all_reduce"));
      }
      // Four layers, two steps: a cast each reduce-scatter in bf16, none in float32.
      const auto casts = [](const TrainingRun& r) {
        return std::ranges::count_if(r.sim.ops(), [&](const OpRecord& op) {
          return r.sim.label(op.label).ends_with("reduce-scatter cast");
        });
      };
      EXPECT_EQ(casts(param), 2 * 4);
      EXPECT_EQ(casts(float32), 0);
    }
  }
  // A float32 model has nothing to cast: both reduce in float32.
  Model f32 = m;
  for (ModelTensor& t : f32.tensors) t.dtype = DType::F32;
  TrainingOptions o = testing::two_steps(Policy::None);
  o.parallel.mesh = on_fsdp_profile(Parallelism{.ranks = 8});
  const TrainingRun plain = train(f32, o);
  o.parallel.mesh = on_fsdp_profile(Parallelism{.ranks = 8, .reduce = ReduceDtype::Float32});
  EXPECT_EQ(collective_time_on(plain, "reduce_scatter"),
            collective_time_on(train(f32, o), "reduce_scatter"));
  EXPECT_EQ(parse_reduce_dtype("float32"), ReduceDtype::Float32);
  EXPECT_EQ(parse_reduce_dtype("param"), ReduceDtype::Param);
  EXPECT_EQ(parse_reduce_dtype("bf16"), std::nullopt);
  EXPECT_EQ(reduce_dtype("fp32").error().message,
            "--reduce-dtype: \"fp32\" is not param (the gradients' dtype, torch's default) or "
            "float32");
}

TEST(Fsdp, EachGroupsCollectivesTakeTheLinkItsRanksLieOn) {
  const Model m = testing::chain_model(4, 1 << 20);
  DeviceProfile slow_network = node_profile();
  slow_network.collectives.inter_node.bandwidth = Bandwidth(1'000'000'000);
  const auto hsdp = [&](std::int32_t ranks, std::int32_t nodes, std::int32_t replicas,
                        const DeviceProfile& device) {
    TrainingOptions o = testing::two_steps(Policy::None);
    auto checked =
        Mesh::make(Parallelism{.ranks = ranks, .nodes = nodes, .replicas = replicas}, device);
    EXPECT_TRUE(checked.ok()) << checked.error().message;
    if (checked.ok()) o.parallel.mesh = checked.value();
    return train(m, o, {}, device);
  };
  // 16 ranks on two nodes, two replica groups: each shard group fills a node (its
  // reduce-scatters over NVLink), so each replica group spans both (its all-reduces over the
  // network, which a slower network slows).
  {
    const TrainingRun fast = hsdp(16, 2, 2, node_profile());
    const TrainingRun slow = hsdp(16, 2, 2, slow_network);
    expect_clean(fast);
    EXPECT_EQ(collective_time_on(fast, "reduce_scatter"),
              collective_time_on(slow, "reduce_scatter"));
    EXPECT_GT(collective_time_on(fast, "all_reduce"), SimTime(0));
    EXPECT_GT(collective_time_on(slow, "all_reduce"), collective_time_on(fast, "all_reduce"));
  }
  // Four replica groups of shard groups of four: ranks 0, 4, 8 and 12 span both nodes too.
  EXPECT_GT(collective_time_on(hsdp(16, 2, 4, slow_network), "all_reduce"),
            collective_time_on(hsdp(16, 2, 4, node_profile()), "all_reduce"));
  // Eight ranks in one node, two replica groups: nothing leaves the node.
  EXPECT_EQ(collective_time_on(hsdp(8, 1, 2, slow_network), "all_reduce"),
            collective_time_on(hsdp(8, 1, 2, node_profile()), "all_reduce"));
}

// Tensor parallelism is innermost (docs/parallelism.md): an FSDP2 shard group's members are tp
// GPUs apart, so eight ranks of two tensor-parallel GPUs span two nodes of eight.
TEST(Fsdp, AShardGroupOfTensorParallelRanksSpansTheirGpus) {
  const Model m = testing::chain_model(4, 1 << 20);
  DeviceProfile slow_network = node_profile();
  slow_network.collectives.inter_node.bandwidth = Bandwidth(1'000'000'000);
  const auto reduce = [&](std::int32_t ranks, std::int32_t tp, const DeviceProfile& device) {
    TrainingOptions o = testing::two_steps(Policy::None);
    auto checked = Mesh::make(Parallelism{.ranks = ranks, .tp = tp}, device);
    EXPECT_TRUE(checked.ok()) << checked.error().message;
    if (checked.ok()) o.parallel.mesh = checked.value();
    const TrainingRun run = train(m, o, {}, device);
    expect_clean(run);
    return collective_time_on(run, "reduce_scatter");
  };
  EXPECT_GT(reduce(8, 2, slow_network), reduce(8, 2, node_profile()));
  EXPECT_EQ(reduce(4, 2, slow_network), reduce(4, 2, node_profile()));
  EXPECT_EQ(reduce(8, 1, slow_network), reduce(8, 1, node_profile()));
}

TEST(Fsdp, ATensorParallelGroupMustFitANode) {
  const auto refused = [](const Parallelism& p, const DeviceProfile& device) {
    auto checked = Mesh::make(p, device, kMeshFlags);
    EXPECT_FALSE(checked.ok());
    return checked.ok() ? std::string() : checked.error().message;
  };
  EXPECT_EQ(refused(Parallelism{.tp = 16}, node_profile())
                .rfind("--tp: 16 ranks do not fit a node of 8 GPUs", 0),
            0U);
  EXPECT_EQ(refused(Parallelism{.tp = 3}, node_profile())
                .rfind("--tp: 3 ranks do not fit a node of 8 GPUs", 0),
            0U);
  EXPECT_EQ(refused(Parallelism{.tp = 0}, node_profile()), "--tp: 0 ranks (use 1 to 1024)");
  EXPECT_NE(refused(Parallelism{.tp = 2}, testing::simple_profile()).find("collectives"),
            std::string::npos);
  EXPECT_EQ(refused(Parallelism{.ranks = 6, .nodes = 1, .tp = 2}, node_profile())
                .rfind("--nodes: 12 ranks over 1 nodes", 0),
            0U);
  EXPECT_TRUE(Mesh::make(Parallelism{.tp = 8}, node_profile()).ok());
  EXPECT_TRUE(Mesh::make(Parallelism{.ranks = 4, .tp = 2}, node_profile()).ok());
}

// Context parallelism: FSDP shards over the data-parallel and context-parallel ranks together
// (torchtitan's dp_shard_cp), so FSDP2 x CP4 runs FSDP as FSDP8 does on the same GPUs.
TEST(Fsdp, AShardGroupSpansItsContextParallelRanks) {
  const Model m = testing::chain_model(4, 1 << 20);
  const auto run = [&](const Parallelism& p) {
    TrainingOptions o = testing::two_steps(Policy::None);
    auto checked = Mesh::make(p, node_profile());
    EXPECT_TRUE(checked.ok()) << checked.error().message;
    if (checked.ok()) o.parallel.mesh = checked.value();
    return train(m, o, {}, node_profile());
  };
  const TrainingRun fsdp8 = run(Parallelism{.ranks = 8});
  const TrainingRun cp4 = run(Parallelism{.ranks = 2, .cp = 4});
  expect_clean(cp4);
  EXPECT_EQ(Parallelism({.ranks = 2, .cp = 4}).shard_group(), 8);
  EXPECT_EQ(cp4.allocated_after, fsdp8.allocated_after);
  EXPECT_EQ(cp4.baseline_allocated, fsdp8.baseline_allocated);
  EXPECT_EQ(collective_time_on(cp4, "reduce_scatter"), collective_time_on(fsdp8, "reduce_scatter"));
  EXPECT_EQ(collective_time_on(cp4, "all_gather"), collective_time_on(fsdp8, "all_gather"));
  // FSDP2 x CP2 x TP2 lays the shard group every other GPU, over 4 of them.
  const TrainingRun tp2 = run(Parallelism{.ranks = 2, .tp = 2, .cp = 2});
  expect_clean(tp2);
  EXPECT_EQ(collective_time_on(tp2, "reduce_scatter"),
            collective_time_on(run(Parallelism{.ranks = 4, .tp = 2}), "reduce_scatter"));
}

// Expert parallelism: each layer's experts are a unit of their own (torchtitan's fully_shard of
// the experts over the expert shard group): on Mixtral's two layers cut for EP2 under FSDP8, a
// GPU holds the same shards as FSDP8 of the whole model (its 1/2 of the experts over 4 GPUs),
// gathers 1/2 of the experts, and trains clean.
TEST(Fsdp, ALayersExpertsAreAUnitShardedOverTheExpertShardGroup) {
  const Model whole = testing::sized_family("mixtral");
  auto cut = expert_parallel_model(whole, 2);
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  DeviceProfile device = node_profile();
  device.flops_per_s = 1'000'000'000'000'000;
  device.memory = Bytes(std::int64_t{1} << 40);
  const auto timed = [&](Model m) {
    assign_roofline_durations(m, device);
    return m;
  };
  const auto run = [&](const Model& m, const Parallelism& p) {
    TrainingOptions o = testing::two_steps(Policy::None);
    auto checked = Mesh::make(p, device);
    EXPECT_TRUE(checked.ok()) << checked.error().message;
    if (checked.ok()) o.parallel.mesh = checked.value();
    return train(m, o, {}, device);
  };
  const TrainingRun ep2 = run(timed(cut.value()), Parallelism{.ranks = 8, .ep = 2});
  const TrainingRun fsdp8 = run(timed(whole), Parallelism{.ranks = 8});
  expect_clean(ep2);
  // The bytes of the buffers named "unit ...`suffix`", summed, and the largest one's.
  const auto bytes_of = [](const TrainingRun& r, const std::string& suffix) {
    std::int64_t sum = 0;
    std::int64_t largest = 0;
    for (const BufferInfo& b : r.sim.buffers()) {
      const std::string_view name = r.sim.label(b.label);
      if (!name.starts_with("unit ") || !name.ends_with(suffix)) continue;
      sum += b.bytes.count();
      largest = std::max(largest, b.bytes.count());
    }
    return std::pair{sum, largest};
  };
  // The shards: the same bytes in all (each unit's rounded up to a byte).
  EXPECT_NEAR(static_cast<double>(bytes_of(ep2, " shard").first),
              static_cast<double>(bytes_of(fsdp8, " shard").first), 8.0);
  // The largest gathered unit: under FSDP8 a layer (its experts, Mixtral's 3 x 8 matrices of
  // 4096 x 14336 in bf16, and its attention); under EP2 a layer's experts, halved.
  const std::int64_t experts = std::int64_t{3} * 8 * 4096 * 14336 * 2;
  EXPECT_GT(bytes_of(fsdp8, " params").second, experts);  // the layer, experts and attention
  EXPECT_EQ(bytes_of(ep2, " params").second, experts / 2);
}

TEST(Fsdp, AContextParallelGroupNeedsFsdpAndWholeNodes) {
  const auto refused = [](const Parallelism& p) {
    auto checked = Mesh::make(p, node_profile(), kMeshFlags);
    EXPECT_FALSE(checked.ok());
    return checked.ok() ? std::string() : checked.error().message;
  };
  EXPECT_EQ(refused(Parallelism{.cp = 2}).rfind("--cp 2 needs --fsdp N", 0), 0U);
  EXPECT_EQ(refused(Parallelism{.ranks = 2, .cp = 0}), "--cp: 0 ranks (use 1 to 1024)");
  // 12 GPUs on two nodes of 6: a group of 2 x 2 GPUs would straddle them.
  EXPECT_EQ(refused(Parallelism{.ranks = 3, .tp = 2, .cp = 2})
                .rfind("--cp: 2 ranks (times 2 of tensor parallelism) neither fit", 0),
            0U);
  EXPECT_TRUE(Mesh::make(Parallelism{.ranks = 1, .cp = 16}, node_profile()).ok());
  // Expert parallelism: GPUs of the shard group and their tensor-parallel ones, a multiple of
  // the tensor-parallel group.
  EXPECT_EQ(refused(Parallelism{.ep = 2}).rfind("--ep 2 needs --fsdp N", 0), 0U);
  EXPECT_EQ(refused(Parallelism{.ranks = 6, .ep = 4})
                .rfind("--ep: 4 ranks do not divide the shard group's 6 GPUs", 0),
            0U);
  EXPECT_EQ(
      refused(Parallelism{.ranks = 4, .tp = 4, .ep = 2})
          .rfind("--ep 2 with --tp 4: expert parallelism takes in the tensor-parallel GPUs", 0),
      0U);
  EXPECT_EQ(refused(Parallelism{.ranks = 3, .tp = 2, .ep = 4})
                .rfind("--ep: 4 ranks do not divide the shard group's 6 GPUs (data-parallel "
                       "times context-parallel times tensor-parallel)",
                       0),
            0U);
  const Parallelism fsdp4_tp2_ep2{.ranks = 4, .tp = 2, .ep = 2};
  EXPECT_TRUE(Mesh::make(fsdp4_tp2_ep2, node_profile()).ok());
  EXPECT_EQ(fsdp4_tp2_ep2.expert_shard_group(), 4);  // torchtitan's efsdp: 4 x 2 / 2
  EXPECT_EQ(refused(Parallelism{.ranks = 8, .reshard_after_forward = Reshard::K(8), .ep = 2})
                .rfind("--reshard-after-forward: 8 must be true, false or a number of ranks that "
                       "divides the shard group (8, and the experts' 4)",
                       0),
            0U);
  EXPECT_TRUE(Mesh::make(Parallelism{.ranks = 2, .cp = 4, .ep = 8}, node_profile()).ok());
  EXPECT_TRUE(Mesh::make(Parallelism{.ranks = 2, .tp = 2, .cp = 2}, node_profile()).ok());
}

TEST(Fsdp, OneRankGathersAndReduceScattersNothing) {
  const Model m = testing::chain_model(4, 1 << 20);
  const TrainingRun one = train(m, fsdp_options(1, Policy::Ferry));
  expect_clean(one);
  EXPECT_EQ(ops_on(one, "all_gather", true), 0);
  EXPECT_EQ(ops_on(one, "reduce_scatter", true), 0);
  EXPECT_GT(ops_on(one, "reduce_scatter", false), 0);  // the input copied to the shard
  EXPECT_EQ(one.gradient_values, train(m, testing::two_steps(Policy::Ferry)).gradient_values);
  // Two ranks do gather.
  EXPECT_GT(ops_on(train(m, fsdp_options(2, Policy::Ferry)), "all_gather", true), 0);
}

TEST(Fsdp, RanksOfANodeRunSideBySideTheSameWayEveryTime) {
  const Model m = testing::chain_model(4, 1 << 20);
  TrainingOptions o = fsdp_options(8, Policy::Ferry);
  o.offload.min_bytes = Bytes(0);
  auto once = simulate_node(m, node_profile(), o, 3);
  auto again = simulate_node(m, node_profile(), o, 3);
  ASSERT_TRUE(once.ok()) << once.error().message;
  ASSERT_TRUE(again.ok());
  const Simulator& sim = once.value().sim;
  EXPECT_EQ(sim.device_count(), 3U);
  EXPECT_TRUE(sim.hazards().empty()) << testing::hazard_lines(sim);
  EXPECT_TRUE(sim.content_mismatches().empty());
  for (std::uint32_t r = 0; r < 3; ++r) {
    EXPECT_FALSE(once.value().failures[r]);
    EXPECT_GT(sim.pinned_allocator(DeviceId(r)).stats().allocated_peak.count(), 0) << r;
  }
  EXPECT_EQ(once.value().gradient_values, again.value().gradient_values);
  ASSERT_EQ(sim.ops().size(), again.value().sim.ops().size());
  for (std::size_t i = 0; i < sim.ops().size(); ++i) {
    EXPECT_EQ(sim.ops()[i].end, again.value().sim.ops()[i].end) << i;
  }
}

TEST(Fsdp, NodeRunsAreRefusedWithTheReason) {
  const Model m = testing::chain_model(2, 1 << 10);
  auto no_fsdp = simulate_node(m, node_profile(), testing::two_steps(Policy::Ferry), 2);
  ASSERT_FALSE(no_fsdp.ok());
  EXPECT_NE(no_fsdp.error().message.find("fsdp"), std::string::npos);
  auto crowded = simulate_node(m, node_profile(), fsdp_options(4), 5);
  ASSERT_FALSE(crowded.ok());
  EXPECT_NE(crowded.error().message.find("2 to 4 ranks"), std::string::npos);
}

TEST(MeshRequest, ReshardTextIsTrueFalseOrARankCountOfTwoOrMore) {
  EXPECT_EQ(parse_reshard("true").value(), Reshard::True());
  EXPECT_EQ(parse_reshard("false").value(), Reshard::False());
  EXPECT_EQ(parse_reshard("4").value(), Reshard::K(4));
  for (const std::string bad : {"1", "0", "-2", "True", "4x", ""}) {
    auto refused = parse_reshard(bad);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_EQ(refused.error().message,
              "--reshard-after-forward: \"" + bad +
                  "\" is not true, false or a number of ranks (2 or more)");
  }
  for (const Reshard r : {Reshard::True(), Reshard::False(), Reshard::K(8)}) {
    EXPECT_EQ(parse_reshard(to_string(r)).value(), r) << to_string(r);
  }
  // A number of ranks from Python is refused as its text is.
  EXPECT_EQ(reshard_ranks(4).value(), Reshard::K(4));
  for (const std::int64_t bad :
       {std::int64_t{1}, std::int64_t{0}, std::int64_t{-3}, std::int64_t{1} << 40}) {
    EXPECT_EQ(reshard_ranks(bad).error().message,
              parse_reshard(std::to_string(bad)).error().message)
        << bad;
  }
}

TEST(MeshRequest, TheFlagsGiveOneParallelismAndTheFileFillsWhatTheyLeaveOut) {
  EXPECT_EQ(parallelism_of(MeshRequest{}).value(), Parallelism{});
  EXPECT_EQ(parallelism_of(
                MeshRequest{.ranks = 16, .replicas = 2, .reshard_after_forward = Reshard::K(4)})
                .value(),
            (Parallelism{.ranks = 16, .replicas = 2, .reshard_after_forward = Reshard::K(4)}));
  EXPECT_EQ(parallelism_of(MeshRequest{.ranks = 0}).error().message,
            "--fsdp: 0 is not in 1..1000000");
  EXPECT_EQ(
      parallelism_of(MeshRequest{.nodes = 2}).error().message,
      "--nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype need --fsdp N");
  EXPECT_EQ(
      parallelism_of(MeshRequest{.impl = FsdpImpl::Simple}).error().message,
      "--nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype need --fsdp N");
  EXPECT_EQ(fsdp_impl("simple").value(), FsdpImpl::Simple);
  EXPECT_EQ(fsdp_impl("fsdp2").value(), FsdpImpl::Fsdp2);
  EXPECT_EQ(fsdp_impl("FSDP2").error().message,
            "--fsdp-impl: \"FSDP2\" is not fsdp2, simple or fsdp2-torch2.4");
  // The file's section where the flags kept the defaults; the flags' own values win.
  const Parallelism file{.ranks = 8,
                         .nodes = 1,
                         .replicas = 2,
                         .reshard_after_forward = Reshard::False(),
                         .impl = FsdpImpl::Simple};
  MeshRequest bare;
  adopt_parallelism(bare, file);
  EXPECT_EQ(parallelism_of(bare).value(), file);
  MeshRequest given{.ranks = 16, .reshard_after_forward = Reshard::K(4)};
  adopt_parallelism(given, file);
  EXPECT_EQ(parallelism_of(given).value(), (Parallelism{.ranks = 16,
                                                        .nodes = 1,
                                                        .replicas = 2,
                                                        .reshard_after_forward = Reshard::K(4),
                                                        .impl = FsdpImpl::Simple}));
  // A pipeline asked for runs its stages on the mesh asked: nothing of the file's.
  MeshRequest pipelined{.pp = 2};
  adopt_parallelism(pipelined, file);
  EXPECT_EQ(parallelism_of(pipelined).value(), Parallelism{.pp = 2});
  // A file's pipeline where the flags ask none, with the file's mesh for each stage.
  Parallelism staged = file;
  staged.pp = 4;
  MeshRequest unpiped;
  adopt_parallelism(unpiped, staged);
  EXPECT_EQ(parallelism_of(unpiped).value(), staged);
  // The pipeline's bounds are its row's, and a file's stages do not hide a count out of them.
  MeshRequest zero{.pp = 0};
  adopt_parallelism(zero, staged);
  EXPECT_EQ(parallelism_of(zero).error().message, "--pp: 0 is not in 1..64");
  EXPECT_EQ(parallelism_of(MeshRequest{.pp = 65}).error().message, "--pp: 65 is not in 1..64");
}

TEST(MeshRequest, EdgesNameTheFlagsWhereTheSimulatorNamesTheFields) {
  const Parallelism uneven{.ranks = 4, .replicas = 3};
  EXPECT_EQ(Mesh::make(uneven, node_profile()).error().message,
            "replicas: 3 replica groups do not divide 4 ranks");
  EXPECT_EQ(Mesh::make(uneven, node_profile(), kMeshFlags).error().message,
            "--hsdp: 3 replica groups do not divide 4 ranks");
  const Parallelism bare{.ranks = 4};
  EXPECT_NE(Mesh::make(bare, testing::simple_profile(), kMeshFlags)
                .error()
                .message.find("links: --fsdp 4 needs"),
            std::string::npos);
}

TEST(ParallelismJson, TheFileSectionAndTheReportMemberAreWrittenFromOneValue) {
  const Parallelism p{.ranks = 16, .replicas = 2, .reshard_after_forward = Reshard::K(4)};
  EXPECT_EQ(parallelism_json(p).dump(), R"({"fsdp":16,"hsdp":2,"reshard_after_forward":4})");
  EXPECT_EQ(parallelism_json(Parallelism{.ranks = 8}).dump(), R"({"fsdp":8})");
  EXPECT_EQ(parallelism_report_json(p, 8).dump(),
            R"({"ranks":16,"nodes":2,"hsdp":2,"reshard_after_forward":4,"per_rank":true})");
  EXPECT_EQ(parallelism_report_json(Parallelism{.ranks = 4}, 8).dump(),
            R"({"ranks":4,"nodes":1,"hsdp":1,"reshard_after_forward":true,"per_rank":true})");
  // SimpleFSDP is written where it is asked for; FSDP2, the default, is left out.
  const Parallelism simple{.ranks = 8, .impl = FsdpImpl::Simple};
  EXPECT_EQ(parallelism_json(simple).dump(), R"({"fsdp":8,"fsdp_impl":"simple"})");
  EXPECT_EQ(parallelism_report_json(simple, 8).dump(),
            R"({"ranks":8,"nodes":1,"hsdp":1,"reshard_after_forward":true,"fsdp_impl":"simple",)"
            R"("per_rank":true})");
  // So is a float32 reduce; the gradients' own dtype, the default, is left out. Read back, the
  // section is the value written.
  const Parallelism float32{.ranks = 8, .reduce = ReduceDtype::Float32};
  EXPECT_EQ(parallelism_json(float32).dump(), R"({"fsdp":8,"reduce_dtype":"float32"})");
  const auto written = nlohmann::json::parse(parallelism_json(float32).dump());
  auto read = read_parallelism(JsonValue(written, "parallelism"));
  ASSERT_TRUE(read.ok()) << read.error().message;
  EXPECT_EQ(read.value(), float32);
  const auto bad = nlohmann::json::parse(R"({"fsdp": 8, "reduce_dtype": "bf16"})");
  EXPECT_NE(read_parallelism(JsonValue(bad, "parallelism"))
                .error()
                .message.find(R"(expected "param" or "float32", got "bf16")"),
            std::string::npos);
}

}  // namespace
}  // namespace ferry::sim
