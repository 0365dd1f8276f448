#pragma once
// What the rank cuts' tests share (tensor_parallel_cut_test.cpp, context_parallel_cut_test.cpp,
// expert_parallel_cut_test.cpp): presets, sums over a model, a device and two runs of a rank.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "plan_replay.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim::rank_cut_test {

inline Model preset(const std::string& name) {
  auto model = model_preset(name);
  EXPECT_TRUE(model.ok()) << name;
  return model.ok() ? model.value() : Model{};
}

inline TransformerShape shape_of(const std::string& name) {
  auto shape = model_preset_shape(name);
  EXPECT_TRUE(shape.ok()) << name;
  return shape.ok() ? shape.value() : TransformerShape{};
}

inline Bytes param_bytes(const Model& model) {
  Bytes sum(0);
  for (const ModelTensor& t : model.tensors) {
    if (t.role == TensorRole::Param && t.view_of < 0) sum += t.bytes;
  }
  return sum;
}

inline std::int64_t flops_of_layer(const Model& model, std::int32_t layer) {
  std::int64_t sum = 0;
  for (const ModelOp& op : model.ops) {
    if (op.layer == layer) sum += op.flops + op.backward_flops;
  }
  return sum;
}

/// The collective ops of each layer (-1: outside the layers) on `axis`, as "kind kind" counts.
inline std::map<std::int32_t, std::map<std::string, int>> collectives(
    const Model& model, MeshAxis axis = MeshAxis::Tensor) {
  std::map<std::int32_t, std::map<std::string, int>> out;
  for (const ModelOp& op : model.ops) {
    if (!op.collective.any() || op.collective.axis != axis) continue;
    ++out[op.layer][std::string(collective_kind_name(*op.collective.forward)) + "/" +
                    std::string(collective_kind_name(*op.collective.backward))];
  }
  return out;
}

// A device quick enough for the presets, with an intra-node link.
inline DeviceProfile rank_device() {
  DeviceProfile device = testing::simple_profile();
  device.flops_per_s = 100'000'000'000'000;
  device.memory = Bytes(std::int64_t{1} << 40);
  device.collectives.intra_node = {Bandwidth(100'000'000'000), SimTime(2000)};
  return device;
}

// `rank` trains two steps with offload, without and with checkpointing every layer: clean, its
// collectives on `stream`.
inline void trains_clean(Model rank, const std::string& stream) {
  const DeviceProfile device = rank_device();
  ASSERT_TRUE(check_roofline(rank, device).ok());
  assign_roofline_durations(rank, device);
  for (const bool checkpoint : {false, true}) {
    SCOPED_TRACE(checkpoint);
    TrainingOptions options;
    options.steps = 2;
    options.offload.policy = Policy::Ferry;
    options.offload.min_bytes = Bytes(0);
    if (checkpoint) options.checkpoint = checkpoint_every(rank, 1);
    auto run = simulate_training(rank, device, options);
    ASSERT_TRUE(run.ok()) << run.error().message;
    ASSERT_FALSE(run.value().failure) << run.value().failure->message;
    const Simulator& sim = run.value().sim;
    EXPECT_TRUE(sim.hazards().empty());
    EXPECT_TRUE(sim.content_mismatches().empty());
    const auto on_stream = std::ranges::count_if(sim.ops(), [&](const OpRecord& op) {
      return op.kind == OpKind::Kernel && op.collective && sim.stream_name(op.stream) == stream;
    });
    EXPECT_GT(on_stream, 0);
  }
}

// The time of `rank`'s second step on rank_device, without offload or checkpointing.
inline SimTime step_time(Model rank) {
  const DeviceProfile device = rank_device();
  assign_roofline_durations(rank, device);
  TrainingOptions options;
  options.steps = 2;  // the second: the caching allocator holds its segments
  options.offload.policy = Policy::None;
  auto run = simulate_training(rank, device, options);
  if (!run.ok() || run.value().failure || run.value().steps.empty()) {
    ADD_FAILURE() << "the step did not run";
    return SimTime(0);
  }
  const StepTimes& step = run.value().steps.back();
  return step.end - step.start;
}

// tokens.
// The sized Mixtral without the rows its trace gives each expert (balanced routing).
inline Model balanced_mixtral() {
  Model m = testing::sized_family("mixtral");
  for (ModelOp& op : m.ops) op.group_rows.clear();
  return m;
}

}  // namespace ferry::sim::rank_cut_test
