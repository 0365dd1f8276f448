// The optimizer's step (Note [The optimizer step] in sim/src/workload/model.cpp): after backward
// a kernel bound by the memory bandwidth moves what the trace measured the step to move, and the
// step's temporaries (torch's foreach AdamW: one parameter set) are allocated for it and freed
// after it; a rank that steps part of the parameters (an FSDP shard, a tensor-parallel cut) pays
// their share; a model with optimizer state but no measured step steps as fused AdamW does.

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

constexpr Bytes kParam(4LL << 20);  // each of the chain's four weights

// A chain of four 4 MiB weights and 1 KiB activations, with AdamW's two moments of each weight
// and the given measured step.
Model stepped(std::optional<OptimizerStep> step) {
  Model m = testing::chain_model(4, 1 << 10);
  const std::size_t tensors = m.tensors.size();
  for (std::uint32_t t = 0; t < tensors; ++t) {
    if (m.tensors[t].role != TensorRole::Param) continue;
    m.tensors[t].bytes = kParam;
    for (const char* key : {"exp_avg", "exp_avg_sq"}) {
      ModelTensor state;
      state.name = "optimizer." + m.tensors[t].name + "." + key;
      state.bytes = kParam;
      state.dtype = DType::F32;
      state.role = TensorRole::OptimizerState;
      m.tensors.push_back(state);
    }
  }
  m.optimizer_step = step;
  return m;
}

// What torch's foreach AdamW holds at its peak: `exp_avg_sq_sqrt`, a tensor a weight.
std::vector<Bytes> foreach_sqrt() { return std::vector<Bytes>(4, kParam); }

TrainingRun train(const Model& m, TrainingOptions o = testing::two_steps(Policy::None)) {
  auto run = simulate_training(m, testing::node_profile(), o);
  EXPECT_TRUE(run.ok()) << run.error().message;
  const TrainingRun& r = run.value();
  EXPECT_FALSE(r.failure) << r.failure->message;
  EXPECT_TRUE(r.sim.hazards().empty()) << testing::hazard_lines(r.sim);
  EXPECT_TRUE(r.sim.content_mismatches().empty());
  return std::move(run.value());
}

TrainingOptions fsdp(std::int32_t ranks) {
  TrainingOptions o = testing::two_steps(Policy::None);
  o.parallel.mesh = Mesh::make(Parallelism{.ranks = ranks}, testing::node_profile()).value();
  return o;
}

// The durations of the run's kernels labelled `label`, in order.
std::vector<SimTime> durations(const TrainingRun& run, std::string_view label) {
  std::vector<SimTime> out;
  for (const OpRecord& r : run.sim.ops()) {
    if (run.sim.label(r.label) == label) out.push_back(r.end - r.start);
  }
  return out;
}

// The buffers labelled "optimizer step temporaries": how many, and their bytes.
struct Temporaries {
  std::int64_t count = 0;
  Bytes bytes;
  friend bool operator==(const Temporaries&, const Temporaries&) = default;
};

Temporaries temporaries(const TrainingRun& run) {
  Temporaries out;
  for (const BufferInfo& b : run.sim.buffers()) {
    if (run.sim.label(b.label) != "optimizer step temporaries") continue;
    ++out.count;
    out.bytes += b.bytes;
  }
  return out;
}

Bytes peak(const TrainingRun& run) {
  return run.sim.device_allocator(run.device).stats().requested_peak;
}

TEST(OptimizerStep, ForeachTemporariesRaiseTheStepsPeakByTheParameters) {
  const Bytes params = 4 * kParam;
  const TrainingRun fused = train(stepped(OptimizerStep{.bytes = 8 * params, .temporaries = {}}));
  const TrainingRun foreach =
      train(stepped(OptimizerStep{.bytes = 20 * params, .temporaries = foreach_sqrt()}));
  // Wide weights, narrow activations: the foreach step holds the weights, their gradients,
  // both moments and one parameter set more, above any other moment of the fused run.
  EXPECT_GE(peak(foreach), 5 * params);
  EXPECT_LT(peak(fused), 5 * params);
  EXPECT_EQ(temporaries(fused), Temporaries{});
  // A tensor a weight, a step's worth each step.
  EXPECT_EQ(temporaries(foreach), (Temporaries{.count = 8, .bytes = 2 * params}));
  const DeviceProfile device = testing::node_profile();
  EXPECT_EQ(durations(fused, "optimizer step"),
            std::vector<SimTime>(2, streaming_time(device, 8 * params)));
  EXPECT_EQ(durations(foreach, "optimizer step"),
            std::vector<SimTime>(2, streaming_time(device, 20 * params)));
  EXPECT_GT(foreach.steps.back().end - foreach.steps.back().start,
            fused.steps.back().end - fused.steps.back().start);
}

// Without a measured step, the state steps as fused AdamW: reads parameters, gradients and both
// moments, writes parameters and moments; a model with neither names no optimizer.
TEST(OptimizerStep, WithoutAMeasuredStepTheStateStepsAsFusedAdamW) {
  const Bytes params = 4 * kParam;
  const TrainingRun run = train(stepped(std::nullopt));
  EXPECT_EQ(durations(run, "optimizer step"),
            std::vector<SimTime>(2, streaming_time(testing::node_profile(), 7 * params)));
  EXPECT_EQ(temporaries(run), Temporaries{});
  const TrainingRun bare = train(testing::chain_model(4, 1 << 10));
  EXPECT_TRUE(durations(bare, "optimizer step").empty());
}

// Under FSDP a rank steps its shards, FSDP2's float32 masters of the chain's 16-bit weights: on
// four ranks a quarter of the parameters at twice their bytes, and that share of the step.
TEST(OptimizerStep, AnFsdpRankStepsItsShardsShare) {
  const Bytes params = 4 * kParam;
  const TrainingRun run =
      train(stepped(OptimizerStep{.bytes = 20 * params, .temporaries = foreach_sqrt()}), fsdp(4));
  EXPECT_EQ(temporaries(run), (Temporaries{.count = 8, .bytes = 4 * kParam}));
  EXPECT_EQ(durations(run, "optimizer step (AdamW)"),
            std::vector<SimTime>(2, streaming_time(testing::node_profile(), 10 * params)));
  const TrainingRun fused =
      train(stepped(OptimizerStep{.bytes = 8 * params, .temporaries = {}}), fsdp(4));
  EXPECT_EQ(temporaries(fused), Temporaries{});
}

// A tensor-parallel rank's model carries its parameters' share of the measured step, of each
// temporary too.
TEST(OptimizerStep, ATensorParallelCutCarriesItsParametersShare) {
  Model whole = model_preset("tiny-llama").value();
  const Bytes params = trainable_param_bytes(whole);
  whole.optimizer_step = OptimizerStep{.bytes = 20 * params, .temporaries = {params, Bytes(3)}};
  const Model cut = tensor_parallel_model(whole, 2).value();
  const Bytes part = trainable_param_bytes(cut);
  ASSERT_LT(part, params);
  ASSERT_TRUE(cut.optimizer_step);
  const auto share = [&](Bytes b) {
    return Bytes((b.count() * part.count() + params.count() - 1) / params.count());
  };
  EXPECT_EQ(cut.optimizer_step->bytes, share(20 * params));
  EXPECT_EQ(cut.optimizer_step->temporaries, (std::vector<Bytes>{share(params), share(Bytes(3))}));
  EXPECT_EQ(optimizer_step_cost(cut, part, part, Bytes(0)).temporaries,
            cut.optimizer_step->temporaries);
}

}  // namespace
}  // namespace ferry::sim
