// A pipeline stage's optimizer state (Note [A stage's optimizer state] in
// sim/src/autograd/pipeline_plan.cpp): each stage holds the AdamW moments of the parameters it
// updates from set-up, the stages together hold what one device holds, and the step ends with an
// optimizer step that reads gradients, parameters and state and writes the last two at the
// device's memory bandwidth. On the mesh a stage holds the moments of its parameters' shard.

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "ferry/sim/autograd/pipeline.hpp"
#include "ferry/sim/workload/model.hpp"
#include "ferry/sim/workload/rank_workload.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using testing::simple_profile;

// `model` with AdamW's two moments of each parameter, named as the tracer names them; each of
// a size the allocator hands out unrounded (a multiple of 512 B).
Model with_adamw_state(Model model) {
  const std::size_t tensors = model.tensors.size();
  for (std::uint32_t t = 0; t < tensors; ++t) {
    const ModelTensor param = model.tensors[t];
    if (param.role != TensorRole::Param || param.view_of >= 0) continue;
    for (const char* key : {"exp_avg", "exp_avg_sq"}) {
      ModelTensor state;
      state.name = "optimizer." + param.name + "." + key;
      state.bytes = Bytes((param.bytes.count() + 511) / 512 * 512);
      state.dtype = param.dtype;
      state.role = TensorRole::OptimizerState;
      model.tensors.push_back(state);
    }
  }
  return model;
}

PipelineOptions options(std::int32_t devices) {
  PipelineOptions o;
  o.devices = devices;
  o.micro_batches = 4;
  o.checkpoint = CheckpointMode::Never;
  return o;
}

// Per device: the parameter bytes its stage's ops read (its layers' parameters, a tied one on
// each stage that reads it), and the bytes of their state in `with`.
struct Owned {
  std::vector<Bytes> params, state;
  Bytes tied_state;  ///< the state of parameters more than one stage reads, once
};

Owned owned(const Model& with, const PipelineRun& run) {
  std::map<std::string, std::set<std::uint32_t>> devices_of_param;
  for (std::uint32_t j = 0; j + 1 < run.partition_starts.size(); ++j) {
    for (std::uint32_t k = run.partition_starts[j]; k < run.partition_starts[j + 1]; ++k) {
      for (std::uint32_t t : with.ops[k].inputs) {
        while (with.tensors[t].view_of >= 0)
          t = static_cast<std::uint32_t>(with.tensors[t].view_of);
        if (with.tensors[t].role == TensorRole::Param)
          devices_of_param[with.tensors[t].name].insert(j);
      }
    }
  }
  const std::size_t devices = run.partition_starts.size() - 1;
  Owned o{std::vector<Bytes>(devices, Bytes(0)), std::vector<Bytes>(devices, Bytes(0)), Bytes(0)};
  for (const ModelTensor& t : with.tensors) {
    if (t.role == TensorRole::Param && t.view_of < 0) {
      for (const std::uint32_t d : devices_of_param.at(t.name)) o.params[d] += t.bytes;
    }
    if (t.role != TensorRole::OptimizerState) continue;
    const std::string param = t.name.substr(10, t.name.rfind('.') - 10);  // "optimizer."
    const std::set<std::uint32_t>& on = devices_of_param.at(param);
    for (const std::uint32_t d : on) o.state[d] += t.bytes;
    if (on.size() > 1) o.tied_state += t.bytes;
  }
  return o;
}

std::vector<const OpRecord*> optimizer_steps(const PipelineRun& run) {
  std::vector<const OpRecord*> steps;
  for (const OpRecord& r : run.sim.ops()) {
    if (run.sim.label(r.label) == "optimizer step") steps.push_back(&r);
  }
  return steps;
}

TEST(PipelineOptimizer, EachStageHoldsItsParametersStateAndTheStagesHoldOneDevices) {
  const DeviceProfile device = simple_profile();
  const Model without = testing::tiny_gpt(device);
  const Model with = with_adamw_state(without);
  Bytes one_device(0);
  for (const std::int32_t devices : {1, 2, 3}) {
    SCOPED_TRACE(fmt::format("{} devices", devices));
    const PipelineRun base = simulate_pipeline(without, device, options(devices)).value();
    const PipelineRun run = simulate_pipeline(with, device, options(devices)).value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    EXPECT_TRUE(run.hazards().empty());
    EXPECT_TRUE(run.content_mismatches().empty());
    EXPECT_EQ(run.param_grads, base.param_grads);
    EXPECT_EQ(run.buffers_left, 0);
    const Owned o = owned(with, run);
    Bytes total(0);
    for (std::size_t d = 0; d < o.state.size(); ++d) {
      EXPECT_GT(o.state[d].count(), 0) << "gpu" << d;
      EXPECT_EQ(run.peak_allocated[d] - base.peak_allocated[d], o.state[d]) << "gpu" << d;
      total += o.state[d];
    }
    // One device's state, and one more of each parameter two stages read (tiny-gpt's tied
    // embedding: each stage updates its copy, as Megatron-LM's first and last stages do).
    if (devices == 1) {
      EXPECT_EQ(o.tied_state, Bytes(0));
      one_device = total;
    } else {
      EXPECT_GT(o.tied_state.count(), 0);
    }
    EXPECT_EQ(total, one_device + o.tied_state);
  }
}

TEST(PipelineOptimizer, TheStepEndsWithAnOptimizerStepAtTheMemoryBandwidth) {
  const DeviceProfile device = simple_profile();
  const Model without = testing::tiny_gpt(device);
  const Model with = with_adamw_state(without);
  const PipelineRun base = simulate_pipeline(without, device, options(2)).value();
  const PipelineRun run = simulate_pipeline(with, device, options(2)).value();
  ASSERT_FALSE(run.failure) << run.failure->message;
  const Owned o = owned(with, run);
  const Bandwidth rate(device.memory_bandwidth.bytes_per_s() * memory_permille(device) / 1000);
  const std::vector<const OpRecord*> steps = optimizer_steps(run);
  ASSERT_EQ(steps.size(), 2U);
  for (const OpRecord* step : steps) {
    const std::uint32_t d = run.sim.stream_device(step->stream).value();
    // Reads gradients, parameters and state; writes parameters and state.
    const Bytes moved = 3 * o.params[d] + 2 * o.state[d];
    EXPECT_EQ(step->end - step->start, transfer_time(moved, rate)) << "gpu" << d;
    EXPECT_GT(step->end - step->start, SimTime(1));
  }
  for (const OpRecord* step : optimizer_steps(base)) EXPECT_EQ(step->end - step->start, SimTime(1));
  EXPECT_GT(run.step_time, base.step_time);
}

// With a traced step (Note [The optimizer step] in model.cpp) each stage steps its parameters'
// share of it: the bytes moved, and each of the step's temporaries, allocated for the step.
TEST(PipelineOptimizer, EachStageStepsItsParametersShareOfATracedStep) {
  const DeviceProfile device = simple_profile();
  Model with = with_adamw_state(testing::tiny_gpt(device));
  const Bytes whole = trainable_param_bytes(with);
  std::vector<Bytes> foreach_sqrt;  // torch's foreach AdamW: a tensor a parameter
  for (const ModelTensor& t : with.tensors) {
    if (t.role == TensorRole::Param && t.view_of < 0) foreach_sqrt.push_back(t.bytes);
  }
  with.optimizer_step = OptimizerStep{.bytes = 20 * whole, .temporaries = foreach_sqrt};
  const PipelineRun run = simulate_pipeline(with, device, options(2)).value();
  ASSERT_FALSE(run.failure) << run.failure->message;
  EXPECT_TRUE(run.hazards().empty());
  EXPECT_TRUE(run.content_mismatches().empty());
  const Owned o = owned(with, run);
  std::map<std::uint32_t, Bytes> temporaries;
  for (const BufferInfo& b : run.sim.buffers()) {
    if (run.sim.label(b.label) == "optimizer step temporaries") {
      temporaries[b.device.value()] += b.bytes;
    }
  }
  const std::vector<const OpRecord*> steps = optimizer_steps(run);
  ASSERT_EQ(steps.size(), 2U);
  for (const OpRecord* step : steps) {
    const std::uint32_t d = run.sim.stream_device(step->stream).value();
    Bytes expected(0);
    for (const Bytes t : foreach_sqrt) expected += share_of(t, o.params[d], whole);
    EXPECT_EQ(temporaries[d], expected) << "gpu" << d;
    EXPECT_EQ(step->end - step->start,
              streaming_time(device, share_of(20 * whole, o.params[d], whole)))
        << "gpu" << d;
  }
}

// On the mesh a stage holds AdamW's moments of its parameters' shard, twice the shard, as FSDP
// on one rank holds them (Fsdp2::optimizer_step), and not the rank model's own state.
TEST(PipelineOptimizer, AStageOnTheMeshHoldsTheMomentsOfItsShard) {
  const DeviceProfile device = testing::node_profile();
  const Mesh mesh = Mesh::make(Parallelism{.ranks = 4}, device).value();
  const Workload whole{check_model(with_adamw_state(model_preset("tiny-llama").value())).value(),
                       device};
  const Workload rank = rank_workload(whole, mesh).value();
  PipelineOptions o = options(2);
  o.mesh = mesh;
  const PipelineRun run = simulate_pipeline(rank.model, rank.device, o).value();
  ASSERT_FALSE(run.failure) << run.failure->message;
  EXPECT_TRUE(run.hazards().empty());
  std::map<std::uint32_t, Bytes> shard, moments;
  for (const BufferInfo& b : run.sim.buffers()) {
    const std::string_view label = run.sim.label(b.label);
    if (label == "parameters (FSDP shard)") shard[b.device.value()] += b.bytes;
    if (label == "AdamW moments (FSDP shard)") moments[b.device.value()] += b.bytes;
    EXPECT_FALSE(label.starts_with("optimizer.")) << label;
  }
  ASSERT_EQ(moments.size(), 2U);
  for (const auto& [d, bytes] : shard) EXPECT_EQ(moments.at(d), 2 * bytes) << "gpu" << d;
  for (const OpRecord* step : optimizer_steps(run)) EXPECT_GT(step->end - step->start, SimTime(1));
}

}  // namespace
}  // namespace ferry::sim
