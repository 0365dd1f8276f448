// A pipeline on the mesh (Note [A pipeline on the mesh] in sim/src/autograd/executor_mesh.cpp):
// each stage a rank of FSDP x TP, its collective ops on the device's mesh stream and its
// parameters gathered and gradients reduced once a step. Every schedule runs hazard-free with
// the reference's gradients, and each of the six waits, dropped, is a race the checker reports.

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/sim/autograd/pipeline.hpp"
#include "ferry/sim/workload/model.hpp"
#include "ferry/sim/workload/rank_workload.hpp"
#include "plan_replay.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

// tiny-llama as one GPU of FSDP over 2 ranks times tensor parallelism over 2 runs it.
struct StageRank {
  Mesh mesh;
  Workload rank;
};

StageRank fsdp_tp_rank() {
  const DeviceProfile device = testing::node_profile();
  const Mesh mesh = Mesh::make(Parallelism{.ranks = 2, .tp = 2}, device).value();
  const Workload whole{check_model(model_preset("tiny-llama").value()).value(), device};
  return StageRank{mesh, rank_workload(whole, mesh).value()};
}

PipelineOptions options(Schedule schedule, std::int32_t virtual_stages, const Mesh& mesh) {
  PipelineOptions o;
  o.schedule = schedule;
  o.devices = 2;
  o.micro_batches = 4;
  o.virtual_stages = virtual_stages;
  o.checkpoint = CheckpointMode::Never;
  o.mesh = mesh;
  return o;
}

std::size_t count_labels(const PipelineRun& run, const std::string& label) {
  std::size_t n = 0;
  for (const OpRecord& r : run.sim.ops()) n += run.sim.label(r.label) == label ? 1 : 0;
  return n;
}

const std::vector<std::tuple<Schedule, std::int32_t>> kSchedules = {
    {Schedule::GPipe, 1},
    {Schedule::OneFOneB, 1},
    {Schedule::Interleaved1F1B, 2},
    {Schedule::InterleavedZeroBubble, 1},
    {Schedule::ZeroBubbleV, 2}};

TEST(PipelineMesh, FsdpTimesTpStagesAreCleanUnderEverySchedule) {
  const StageRank s = fsdp_tp_rank();
  const Model& model = *s.rank.model;
  ASSERT_TRUE(
      std::ranges::any_of(model.ops, [](const ModelOp& op) { return op.collective.any(); }));
  for (const auto& [schedule, v] : kSchedules) {
    SCOPED_TRACE(schedule_name(schedule));
    const PipelineOptions o = options(schedule, v, s.mesh);
    const PipelineRun run = simulate_pipeline(s.rank.model, s.rank.device, o).value();
    const PipelineRun reference = simulate_reference(model, s.rank.device, o).value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    EXPECT_TRUE(run.hazards().empty()) << testing::hazard_lines(run.sim);
    EXPECT_TRUE(run.content_mismatches().empty());
    EXPECT_EQ(run.param_grads, reference.param_grads);
    // One all-gather of each device's parameters and one reduce-scatter of its gradients.
    EXPECT_EQ(count_labels(run, "all-gather parameters"), 2U);
    EXPECT_EQ(count_labels(run, "reduce-scatter gradients"), 2U);
    // Each stage holds its parameters gathered, and their shard beside them.
    PipelineOptions alone = o;
    alone.mesh = Mesh{};
    const PipelineRun unsharded = simulate_pipeline(s.rank.model, s.rank.device, alone).value();
    for (std::size_t d = 0; d < 2; ++d) {
      EXPECT_GT(run.peak_allocated[d], unsharded.peak_allocated[d]) << d;
    }
  }
}

// The traced Mixtral at FSDP x EP over two stages: its all-to-alls on the mesh stream, its
// experts' weights gathered over the expert shard group apart from the rest.
TEST(PipelineMesh, ExpertParallelStagesOfTheTracedMixtralAreClean) {
  DeviceProfile device = testing::node_profile();
  device.memory = Bytes(std::int64_t{64} << 30);
  const Mesh mesh = Mesh::make(Parallelism{.ranks = 2, .ep = 2}, device).value();
  const Workload whole{check_model(testing::sized_family("mixtral")).value(), device};
  const Workload rank = rank_workload(whole, mesh).value();
  for (const auto& [schedule, v] : kSchedules) {
    SCOPED_TRACE(schedule_name(schedule));
    PipelineOptions o = options(schedule, v, mesh);
    // Balanced by forward time every stage holds experts (by layers zbv's device 0 holds the
    // embedding's stage and the head's, none).
    o.split.rule = PipelineSplit::Rule::Balanced;
    const PipelineRun run = simulate_pipeline(rank.model, rank.device, o).value();
    ASSERT_FALSE(run.failure) << run.failure->message;
    EXPECT_TRUE(run.hazards().empty()) << testing::hazard_lines(run.sim);
    EXPECT_TRUE(run.content_mismatches().empty());
    EXPECT_EQ(run.param_grads, simulate_reference(*rank.model, rank.device, o).value().param_grads);
    // Each device gathers its experts' weights and the rest apart, and reduces both.
    EXPECT_EQ(count_labels(run, "all-gather parameters"), 4U);
    EXPECT_EQ(count_labels(run, "reduce-scatter gradients"), 4U);
  }
}

// Note [Sends between nodes]: two stages of FSDP over 8 GPUs fill a node each, and their sends
// run at a NIC's share of the node's inter-node link (10 GB/s over 8 GPUs) and its latency; two
// stages of 2 GPUs share a node and send over the peer link (2 GB/s).
TEST(PipelineMesh, SendsBetweenNodesRunAtOneNicsRate) {
  const DeviceProfile device = testing::node_profile();
  const Workload whole{check_model(model_preset("tiny-llama").value()).value(), device};
  const auto sends = [&](std::int32_t ranks) {
    const Mesh mesh = Mesh::make(Parallelism{.ranks = ranks, .pp = 2}, device).value();
    const Workload rank = rank_workload(whole, mesh).value();
    const PipelineRun run =
        simulate_pipeline(rank.model, rank.device, options(Schedule::OneFOneB, 1, mesh)).value();
    EXPECT_FALSE(run.failure);
    EXPECT_TRUE(run.hazards().empty()) << testing::hazard_lines(run.sim);
    std::vector<OpRecord> out;
    for (const OpRecord& r : run.sim.ops()) {
      if (r.kind == OpKind::Copy && r.direction == CopyDirection::Peer) out.push_back(r);
    }
    return out;
  };
  const Bandwidth nic(device.collectives.inter_node.bandwidth.bytes_per_s() / 8);
  const std::vector<OpRecord> across = sends(8);
  ASSERT_FALSE(across.empty());
  for (const OpRecord& r : across) {
    EXPECT_EQ(r.end - r.start, device.collectives.inter_node.latency + transfer_time(r.bytes, nic));
  }
  const std::vector<OpRecord> within = sends(2);
  ASSERT_EQ(within.size(), across.size());
  for (const OpRecord& r : within) {
    EXPECT_EQ(r.end - r.start, device.peer.latency + transfer_time(r.bytes, device.peer.bandwidth));
  }
}

// Each wait, dropped (PipelineFaults), is a race: a collective op's two, the all-gather's two
// and the reduce-scatter's two.
TEST(PipelineMesh, EachDroppedWaitIsARace) {
  const StageRank s = fsdp_tp_rank();
  const std::vector<std::pair<const char*, bool PipelineFaults::*>> faults = {
      {"collective launch", &PipelineFaults::skip_collective_launch_wait},
      {"collective output", &PipelineFaults::skip_collective_output_wait},
      {"gather launch", &PipelineFaults::skip_gather_launch_wait},
      {"gather arrival", &PipelineFaults::skip_gather_arrival_wait},
      {"reduce launch", &PipelineFaults::skip_reduce_launch_wait},
      {"reduce arrival", &PipelineFaults::skip_reduce_arrival_wait}};
  for (const auto& [schedule, v] : kSchedules) {
    const PipelineOptions o = options(schedule, v, s.mesh);
    for (const auto& [name, fault] : faults) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + ": " + name);
      PipelineFaults planted;
      planted.*fault = true;
      const PipelineRun run = simulate_pipeline(s.rank.model, s.rank.device, o, planted).value();
      EXPECT_FALSE(run.hazards().empty());
    }
  }
}

}  // namespace
}  // namespace ferry::sim
