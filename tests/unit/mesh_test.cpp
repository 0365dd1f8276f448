#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/io/parallelism_json.hpp"
#include "ferry/sim/mesh/axes.hpp"
#include "ferry/sim/mesh/mesh.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using testing::node_profile;

// The request's error for `fsdp`, or "" when it is accepted.
std::string request_error(const MeshRequest& fsdp) {
  auto p = parallelism_of(fsdp);
  return p ? std::string() : p.error().message;
}

// The file reader's error for the section `text`, or "".
std::string file_error(const std::string& text) {
  const auto json = nlohmann::json::parse(text);
  auto p = read_parallelism(JsonValue(json, "parallelism"));
  return p ? std::string() : p.error().message;
}

std::string mesh_error(const Parallelism& p, MeshNames names = kMeshFlags) {
  auto mesh = Mesh::make(p, node_profile(), names);
  return mesh ? std::string() : mesh.error().message;
}

TEST(MeshFields, EachRowIsItsFieldAndEveryNameIsUnique) {
  std::set<std::string_view> keys;
  std::set<std::string_view> flags;
  for (std::size_t i = 0; i < kMeshFields.size(); ++i) {
    const MeshFieldRule& row = kMeshFields[i];
    EXPECT_EQ(static_cast<std::size_t>(row.field), i) << row.key;
    EXPECT_TRUE(keys.insert(row.key).second) << row.key;
    EXPECT_TRUE(flags.insert(row.flag).second) << row.flag;
    EXPECT_EQ(row.flag.substr(0, 2), "--");
    EXPECT_LE(row.least, row.most);
  }
  EXPECT_EQ(fsdp_option_list(&MeshFieldRule::flag),
            "--nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype");
  EXPECT_EQ(fsdp_option_list(&MeshFieldRule::python),
            "nodes, hsdp, reshard_after_forward, fsdp_impl and reduce_dtype");
}

// Each axis's upper bound is the table's, at the request, in the file and in Mesh::make.
TEST(MeshFields, EveryEdgeRefusesADegreeAboveTheTablesBound) {
  for (const MeshField field : {MeshField::Tp, MeshField::Cp, MeshField::Ep}) {
    const MeshFieldRule& row = mesh_field(field);
    const auto above = static_cast<std::int32_t>(row.most + 1);
    MeshRequest fsdp{.ranks = 8};
    Parallelism p{.ranks = 8};
    (field == MeshField::Tp ? fsdp.tp : field == MeshField::Cp ? fsdp.cp : fsdp.ep) = above;
    (field == MeshField::Tp ? p.tp : field == MeshField::Cp ? p.cp : p.ep) = above;
    EXPECT_EQ(request_error(fsdp),
              fmt::format("{}: {} is not in 1..{}", row.flag, above, row.most));
    EXPECT_EQ(mesh_error(p), fmt::format("{}: {} ranks (use 1 to {})", row.flag, above, row.most));
    EXPECT_NE(file_error(fmt::format(R"({{"fsdp": 8, "{}": {}}})", row.key, above)), "") << row.key;
    EXPECT_EQ(file_error(fmt::format(R"({{"fsdp": 8, "{}": {}}})", row.key, row.most)), "")
        << row.key;
  }
  EXPECT_EQ(request_error(MeshRequest{.ranks = 1'000'001}), "--fsdp: 1000001 is not in 1..1000000");
  EXPECT_NE(file_error(R"({"fsdp": 1000001})"), "");
  EXPECT_EQ(mesh_error(Parallelism{.ranks = 1'000'001}, &MeshFieldRule::name),
            "ranks: 1000001 ranks (use 1 to 1000000)");
}

// The pipeline's stages are one more row: 1..64 at the request, in the file and in Mesh::make,
// needing no other field.
TEST(MeshFields, ThePipelinesStagesAreBoundedByTheirRowEverywhere) {
  const MeshFieldRule& row = mesh_field(MeshField::Pp);
  EXPECT_EQ(row.flag, "--pp");
  EXPECT_FALSE(row.has_need());
  EXPECT_EQ(request_error(MeshRequest{.pp = 0}), "--pp: 0 is not in 1..64");
  EXPECT_EQ(request_error(MeshRequest{.pp = 65}), "--pp: 65 is not in 1..64");
  EXPECT_EQ(request_error(MeshRequest{.pp = 64}), "");
  EXPECT_EQ(mesh_error(Parallelism{.pp = 65}), "--pp: 65 stages (use 1 to 64)");
  EXPECT_EQ(mesh_error(Parallelism{.pp = 0}, &MeshFieldRule::name), "pp: 0 stages (use 1 to 64)");
  EXPECT_NE(file_error(R"({"pp": 65})").find("pp"), std::string::npos);
  EXPECT_NE(file_error(R"({"pp": 0})"), "");
  // A pipeline alone needs no "fsdp"; with it, each stage is that mesh.
  EXPECT_EQ(file_error(R"({"pp": 64})"), "");
  const auto json = nlohmann::json::parse(R"({"fsdp": 4, "tp": 2, "pp": 3})");
  auto staged = read_parallelism(JsonValue(json, "parallelism"));
  ASSERT_TRUE(staged.ok()) << staged.error().message;
  EXPECT_EQ(staged.value(), (Parallelism{.ranks = 4, .tp = 2, .pp = 3}));
  EXPECT_EQ(parallelism_json(staged.value()).dump(), R"({"fsdp":4,"tp":2,"pp":3})");
  EXPECT_EQ(parallelism_json(Parallelism{.pp = 2}).dump(), R"({"pp":2})");
}

// Expert capacity 1..1024 needs ep 2 or more: the request, the file and the cut refuse it alike.
TEST(MeshFields, ExpertCapacityNeedsExpertParallelismEverywhere) {
  EXPECT_EQ(request_error(MeshRequest{.ranks = 8, .expert_capacity = 2}),
            "--expert-capacity needs --ep 2 or more: a static dispatcher pads the rows expert "
            "parallelism exchanges");
  EXPECT_EQ(request_error(MeshRequest{.ranks = 8, .ep = 2, .expert_capacity = 1025}),
            "--expert-capacity 1025: use a factor from 1 to 1024");
  EXPECT_EQ(request_error(MeshRequest{.ranks = 8, .ep = 2, .expert_capacity = 1024}), "");
  EXPECT_NE(file_error(R"({"fsdp": 8, "expert_capacity": 2})").find("needs \"ep\" 2 or more"),
            std::string::npos);
  EXPECT_NE(file_error(R"({"fsdp": 8, "ep": 2, "expert_capacity": 0.5})")
                .find("expected a capacity factor from 1 to 1024"),
            std::string::npos);
  const Model m = testing::chain_model(2, 1 << 10);
  auto cut = expert_parallel_model(m, 1, 1, 2);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.error().message.rfind("--expert-capacity 2 needs --ep 2 or more", 0), 0U);
}

// --nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype need --fsdp, at the
// request; --cp and --ep need it at Mesh::make, each with its reason.
TEST(MeshFields, WhatNeedsFsdpIsRefusedWithoutIt) {
  const std::string plain =
      "--nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype need --fsdp N";
  EXPECT_EQ(request_error(MeshRequest{.nodes = 2}), plain);
  EXPECT_EQ(request_error(MeshRequest{.replicas = 2}), plain);
  EXPECT_EQ(request_error(MeshRequest{.reshard_after_forward = Reshard::False()}), plain);
  EXPECT_EQ(request_error(MeshRequest{.impl = FsdpImpl::Simple}), plain);
  EXPECT_EQ(request_error(MeshRequest{.reduce = ReduceDtype::Float32}), plain);
  EXPECT_EQ(mesh_error(Parallelism{.cp = 2}).rfind("--cp 2 needs --fsdp N: FSDP2 shards", 0), 0U);
  EXPECT_EQ(mesh_error(Parallelism{.ep = 2}).rfind("--ep 2 needs --fsdp N: expert parallelism", 0),
            0U);
  EXPECT_EQ(mesh_error(Parallelism{.ep = 2}, &MeshFieldRule::name).rfind("ep 2 needs ranks N", 0),
            0U);
  EXPECT_EQ(mesh_error(Parallelism{.ranks = 8, .cp = 2, .ep = 2}), "");
}

TEST(Mesh, TheDefaultIsOneGpuOnAnyDevice) {
  const Mesh one;
  EXPECT_FALSE(one.on());
  EXPECT_FALSE(one.cuts());
  for (const Mesh::Axis axis :
       {Mesh::Axis::Shard, Mesh::Axis::Replicate, Mesh::Axis::Tensor, Mesh::Axis::Context,
        Mesh::Axis::Expert, Mesh::Axis::ExpertShard, Mesh::Axis::Pipeline}) {
    EXPECT_EQ(one.group(axis).size, 1);
    EXPECT_EQ(one.group(axis).nodes, 1);
  }
  auto made = Mesh::make(Parallelism{}, testing::simple_profile());
  ASSERT_TRUE(made.ok());
  EXPECT_EQ(made.value(), one);
}

// 32 GPUs on four nodes of eight: ranks 8 (two replica groups of four) x cp 2 x tp 2, ep 4.
TEST(Mesh, GroupsLieWhereTheLayoutPutsThem) {
  auto made =
      Mesh::make(Parallelism{.ranks = 8, .replicas = 2, .tp = 2, .cp = 2, .ep = 4}, node_profile());
  ASSERT_TRUE(made.ok()) << made.error().message;
  const Mesh& mesh = made.value();
  EXPECT_EQ(mesh.per_node(), 8);
  EXPECT_EQ(mesh.group(Mesh::Axis::Tensor), (MeshGroup{.size = 2, .nodes = 1, .stride = 1}));
  // cp x tp = 4 consecutive GPUs: inside a node.
  EXPECT_EQ(mesh.group(Mesh::Axis::Context), (MeshGroup{.size = 2, .nodes = 1, .stride = 2}));
  EXPECT_EQ(mesh.group(Mesh::Axis::Expert), (MeshGroup{.size = 4, .nodes = 1, .stride = 1}));
  // The shard group: 8 / 2 data-parallel ranks times cp 2, every 2nd GPU of 15: two nodes,
  // whose links it shares with the other tensor-parallel rank's shard group.
  EXPECT_EQ(mesh.group(Mesh::Axis::Shard),
            (MeshGroup{.size = 8, .nodes = 2, .stride = 2, .sharing = 2}));
  // A replica group: one GPU of each shard group's 16, so on two nodes; each of a node's eight
  // GPUs is in one.
  EXPECT_EQ(mesh.group(Mesh::Axis::Replicate),
            (MeshGroup{.size = 2, .nodes = 2, .stride = 16, .sharing = 8}));
  // An expert's shard group: 8 x 2 / 4 GPUs, every 4th.
  EXPECT_EQ(mesh.group(Mesh::Axis::ExpertShard),
            (MeshGroup{.size = 4, .nodes = 2, .stride = 4, .sharing = 4}));
}

// Four stages of ranks 2 x tp 2: stage s holds GPUs 4s..4s+3, so rank 0's pipeline group is
// every 4th GPU, on two nodes of eight. A stage's world, and the nodes it spans, are its own.
TEST(Mesh, ThePipelineGroupIsOneGpuOfEachStage) {
  auto made = Mesh::make(Parallelism{.ranks = 2, .tp = 2, .pp = 4}, node_profile());
  ASSERT_TRUE(made.ok()) << made.error().message;
  const Mesh& mesh = made.value();
  EXPECT_EQ(mesh.parallelism().world(), 4);
  EXPECT_EQ(mesh.group(Mesh::Axis::Pipeline), (MeshGroup{.size = 4, .nodes = 2, .stride = 4}));
  EXPECT_EQ(mesh.group(Mesh::Axis::Shard), (MeshGroup{.size = 2, .nodes = 1, .stride = 2}));
  auto alone = Mesh::make(Parallelism{.pp = 3}, node_profile());
  ASSERT_TRUE(alone.ok()) << alone.error().message;
  EXPECT_EQ(alone.value().group(Mesh::Axis::Pipeline),
            (MeshGroup{.size = 3, .nodes = 1, .stride = 1}));
}

// Stages fill nodes one after another: four stages of 4 GPUs two to a node of eight, stages of
// 8 GPUs a node each, one-GPU stages eight to a node.
TEST(Mesh, StagesFillNodesOneAfterAnother) {
  const auto nodes_of = [](const Parallelism& p, std::int32_t stages) {
    const Mesh mesh = Mesh::make(p, node_profile()).value();
    std::vector<std::int32_t> nodes;
    for (std::int32_t s = 0; s < stages; ++s) nodes.push_back(mesh.node_of_stage(s));
    return nodes;
  };
  EXPECT_EQ(nodes_of(Parallelism{.ranks = 2, .tp = 2, .pp = 4}, 4),
            (std::vector<std::int32_t>{0, 0, 1, 1}));
  EXPECT_EQ(nodes_of(Parallelism{.ranks = 8, .pp = 3}, 3), (std::vector<std::int32_t>{0, 1, 2}));
  EXPECT_EQ(nodes_of(Parallelism{.ranks = 16, .pp = 2}, 2), (std::vector<std::int32_t>{0, 2}));
  EXPECT_EQ(nodes_of(Parallelism{.pp = 10}, 10),
            (std::vector<std::int32_t>{0, 0, 0, 0, 0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(nodes_of(Parallelism{.ranks = 8}, 1), (std::vector<std::int32_t>{0}));
}

TEST(Mesh, AContextGroupSpanningNodesCountsThem) {
  auto made = Mesh::make(Parallelism{.ranks = 1, .tp = 2, .cp = 8}, node_profile());
  ASSERT_TRUE(made.ok()) << made.error().message;
  EXPECT_EQ(made.value().group(Mesh::Axis::Context).nodes, 2);
  // Both tensor-parallel ranks of a node run a context group across the nodes at once.
  EXPECT_EQ(made.value().group(Mesh::Axis::Context).sharing, 2);
  EXPECT_EQ(made.value().kept_shard(Mesh::Axis::Shard).size, 1);
}

TEST(Mesh, RefusalsNameTheFieldAsTheEdgeSpellsIt) {
  const Parallelism uneven{.ranks = 4, .replicas = 3};
  EXPECT_EQ(mesh_error(uneven, &MeshFieldRule::name),
            "replicas: 3 replica groups do not divide 4 ranks");
  EXPECT_EQ(mesh_error(uneven), "--hsdp: 3 replica groups do not divide 4 ranks");
  EXPECT_EQ(mesh_error(uneven, &MeshFieldRule::key),
            "hsdp: 3 replica groups do not divide 4 ranks");
  EXPECT_EQ(mesh_error(Parallelism{.ranks = 4, .tp = 2, .ep = 3}).rfind("--ep 3 with --tp 2", 0),
            0U);
  EXPECT_EQ(mesh_error(Parallelism{.ranks = 4, .reshard_after_forward = Reshard::K(3)})
                .rfind("--reshard-after-forward: 3 must be", 0),
            0U);
  EXPECT_EQ(mesh_error(Parallelism{.nodes = 2, .tp = 2}),
            "--nodes: 2 GPUs of tensor parallelism lie inside one node, not 2");
}

// A rank's pinned host memory is its even part of the node's.
TEST(Mesh, ARankHoldsItsPartOfTheNodesPinnedMemory) {
  DeviceProfile device = node_profile();
  device.pinned_host_capacity = Bytes(8000);
  auto made = Mesh::make(Parallelism{.ranks = 4}, device);
  ASSERT_TRUE(made.ok());
  EXPECT_EQ(made.value().rank_profile(device).pinned_host_capacity, Bytes(2000));
  EXPECT_EQ(Mesh().rank_profile(device).pinned_host_capacity, Bytes(8000));
}

}  // namespace
}  // namespace ferry::sim
