// The step's lower bound and the ferry policy's offload horizon: what the link can carry in
// forward, and the tensors kept because it cannot carry them in time.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "ferry/plan/lower.hpp"
#include "ferry/plan/plan.hpp"
#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/export/memory_snapshot.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/bound.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/planner/seeds.hpp"
#include "ferry/sim/planner/space.hpp"
#include "ferry/sim/planner/sweep.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/runs/horizon.hpp"
#include "plan_test_support.hpp"
#include "sim_fixtures.hpp"
#include "sim_models.hpp"

namespace ferry::sim {
namespace {

using plan_test::fixed_row;
using plan_test::preset;
using plan_test::profile;

using testing::ModelBuilder;

// An op of layer `layer`, 10 ms forward and 20 ms backward, that reads `in`, produces `out` and
// saves `in`.
ModelOp& timed_op(ModelBuilder& b, std::string name, std::int32_t layer, std::uint32_t in,
                  std::uint32_t out) {
  ModelOp& op = b.op(std::move(name), {in}, {out}, {in}, SimTime(10'000'000), SimTime(20'000'000));
  op.layer = layer;
  return op;
}

// Note [What the link can carry in forward]: a storage saved as forward ends cannot leave the
// device before backward, whatever the link's bandwidth times the forward's length.
TEST(LowerBound, TheLinkCarriesOnlyWhatForwardHasSavedSoFar) {
  DeviceProfile device = profile("a100-pcie4");
  ModelBuilder b;
  b.m.name = "late";
  const std::uint32_t x = b.tensor("x", 1 << 10, TensorRole::Input);
  const std::uint32_t h0 = b.tensor("h0", 1 << 10, TensorRole::Activation);
  const std::uint32_t h1 = b.tensor("h1", std::int64_t{1} << 32, TensorRole::Activation);
  const std::uint32_t loss = b.tensor("loss", 4, TensorRole::Activation);
  timed_op(b, "l0", -1, x, h0).saved.clear();
  timed_op(b, "l1", -1, h0, h1).saved.clear();
  timed_op(b, "loss", -1, h1, loss);  // h1 (4 GiB) is saved by the last op, as forward ends
  b.m.loss = loss;
  ASSERT_TRUE(validate_model(b.m).ok());
  RowResult none;
  none.step_time = SimTime(90'000'000);
  none.forward_time = SimTime(30'000'000);
  none.peak_allocated = Bytes(std::int64_t{5} << 30);
  none.peak_reserved = none.peak_allocated;
  // 512 MiB to free (Note [The bytes a plan must free]): 30 ms of a 25.5 GB/s link would carry
  // 765 MB, but nothing is saved before the last op ends, so the link must have a longer
  // forward: 512 MiB at its bandwidth.
  const Bytes budget = none.peak_allocated - Bytes(512LL << 20);
  const SimTime bound = step_lower_bound(b.m, device, none, budget);
  const std::int64_t link = (512LL << 20) * 1'000'000'000 / device.d2h.bandwidth.bytes_per_s();
  EXPECT_NEAR(static_cast<double>((bound - none.step_time).ns()), static_cast<double>(link), 1e3);
}

// --- the ferry policy's offload horizon (Note [Deriving the offload horizon]) ---------------

TEST(OffloadHorizon, KeepsATensorSavedAtTheEndOfForwardThatTheLinkCannotCarryInTime) {
  // x -> l0 -> l1 -> loss: the last layer saves a storage whose copy would take far longer
  // than the backward work left after it; the first layer's copy is hidden.
  DeviceProfile device = profile("a100-pcie4");
  ModelBuilder b;
  Model& m = b.m;
  m.name = "tail";
  const std::uint32_t x = b.tensor("x", 1 << 20, TensorRole::Input);
  const std::uint32_t h0 = b.tensor("h0", 1 << 20, TensorRole::Activation);
  const std::uint32_t h1 = b.tensor("h1", std::int64_t{1} << 32, TensorRole::Activation);
  const std::uint32_t loss = b.tensor("loss", 4, TensorRole::Activation);
  timed_op(b, "l0", 0, x, h0);
  timed_op(b, "l1", 1, h0, h1);
  timed_op(b, "loss", -1, h1, loss);
  m.loss = loss;
  ASSERT_TRUE(validate_model(m).ok());
  TrainingOptions o;
  o.offload.policy = Policy::Ferry;
  // x and h0 (1 MiB each) are hidden; h1 (4 GiB, 170 ms at 25.5 GB/s) is needed 20 ms after
  // forward ends.
  EXPECT_EQ(offload_horizon(m, device, o), Bytes(2 << 20));
  o.offload.policy = Policy::Trl;
  EXPECT_FALSE(offload_horizon(m, device, o).has_value());
  // Recomputed inside a region, h1 is not saved: every copy is hidden, there is no limit.
  o.offload.policy = Policy::Ferry;
  o.checkpoint = checkpoint_every(m, 1);
  o.offload_selection.ops.assign(m.ops.size(), true);
  o.offload_selection.ops[2] = false;  // the loss keeps
  EXPECT_FALSE(offload_horizon(m, device, o).has_value());
}

TEST(OffloadHorizon, FerryRowsOfATracedLlamaAreNoSlowerThanTrlAndCheckpointing) {
  // On Llama-3.2-3B as a trace lists it, on a100-pcie4: ferry keeps what its link cannot hide
  // (the loss's log-softmax, the last layers), so it beats trl, and ferry + checkpoint costs
  // what checkpointing costs (2%).
  const DeviceProfile device = profile("a100-pcie4");
  const Model model = preset("llama3.2-3b-traced-s4096-b2", device);
  TrainingOptions base;
  base.steps = 2;
  std::map<std::string, RowResult> rows;
  for (const PolicyRow& row : default_rows(base, model, device)) {
    if (row.name == "trl" || row.name == "ferry" || row.name == "checkpoint every layer" ||
        row.name == "ferry + checkpoint") {
      rows[row.name] = fixed_row(model, device, row);
    }
  }
  ASSERT_EQ(rows.size(), 4U);
  const RowResult& ferry = rows["ferry"];
  ASSERT_TRUE(ferry.horizon.has_value());
  EXPECT_GT(ferry.telemetry.past_horizon, 0);
  EXPECT_LE(ferry.step_time, rows["trl"].step_time);
  EXPECT_LE(rows["ferry + checkpoint"].step_time.ns() * 100,
            rows["checkpoint every layer"].step_time.ns() * 102);
  EXPECT_EQ(rows["ferry + checkpoint"].backward_stall, SimTime(0));
}

}  // namespace
}  // namespace ferry::sim
