// The paged stash (Note [Paged stash] in paged_stash.cpp) on a traced mixture of experts: a
// four-layer Mixtral (tests/data/traced/mixtral-4layer.json: hidden 64, 4 experts, top 2,
// batch 2 x 64 tokens, bf16, written by tests/python/traced_families.py's trace_family("mixtral",
// batch=2, seq=64, overrides={"num_hidden_layers": 4})) cut for a rank of random expert
// parallelism and static capacity, with random page sizes, headroom, offload policies,
// checkpointing, backward orders, steps and device speeds. With the stash's waits there is no
// hazard, every restored tensor holds what was saved, the gradients are those of the same run
// without the stash, and memory after each step is that run's plus the pool. Planted faults,
// each caught and shrunk: a stash copied before its stream waits for the producer, padded
// buffers freed before the compute stream waits for their stash, a restore read before the
// compute stream waits for it, a restored tensor handed back to the stash stream's pool before
// that stream waits for backward's reads, and a pool sized by rows rather than pages (which
// overflows: the step stops).

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "prop/planted.hpp"
#include "prop/random_program.hpp"
#include "sim_fixtures.hpp"

namespace ferry {

namespace sim {
namespace {

struct Setup {
  std::int32_t ep = 2;
  double capacity = 1;
  std::int64_t page_rows = 64;
  double headroom = 1.1;
  Policy policy = Policy::None;
  bool checkpoint = false;  // every other layer
  std::int32_t steps = 2;
  std::uint64_t order_seed = 0;
  std::uint64_t device_seed = 1;
};

void showValue(const Setup& s, std::ostream& os) {
  os << "ep " << s.ep << ", capacity " << s.capacity << ", " << s.page_rows
     << " rows a page, headroom " << s.headroom << ", " << policy_name(s.policy)
     << (s.checkpoint ? ", checkpoint every:2" : "") << ", " << s.steps << " steps, order "
     << s.order_seed << ", device " << s.device_seed;
}

rc::Gen<Setup> gen_setup() {
  return rc::gen::apply(
      [](std::int32_t ep, double capacity, std::int64_t page_rows, double headroom, Policy policy,
         bool checkpoint, std::int32_t steps, std::uint64_t order, std::uint64_t device) {
        return Setup{ep, capacity, page_rows, headroom, policy, checkpoint, steps, order, device};
      },
      rc::gen::element(2, 4), rc::gen::element(1.0, 1.25, 2.0, 4.0),
      rc::gen::element<std::int64_t>(64, 1, 16, 100, 512), rc::gen::element(1.1, 1.0, 1.5),
      rc::gen::element(Policy::None, Policy::Ferry), rc::gen::arbitrary<bool>(),
      rc::gen::inRange<std::int32_t>(1, 4), rc::gen::inRange<std::uint64_t>(0, 3),
      rc::gen::inRange<std::uint64_t>(1, 1000));
}

const Model& traced_moe() {
  static const Model model = [] {
    const std::filesystem::path path =
        std::filesystem::path(FERRY_TESTS_DIR) / "data" / "traced" / "mixtral-4layer.json";
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    auto parsed = parse_model(text.str(), path.string());
    if (!parsed.ok()) throw std::runtime_error(parsed.error().message);
    return std::move(parsed).value();
  }();
  return model;
}

void stash_is_clean(const Setup& setup, const TrainingFaults& faults) {
  std::mt19937_64 rng(setup.device_seed);
  const DeviceProfile device = testing::with_random_links(testing::random_profile(rng), rng);
  auto cut = expert_parallel_model(traced_moe(), setup.ep, 1, setup.capacity);
  if (!cut.ok()) RC_FAIL("cut refused: " + cut.error().message);
  auto checked = check_model(std::move(cut).value());
  if (!checked.ok()) RC_FAIL("invalid: " + checked.error().message);
  auto timed = with_roofline_durations(std::move(checked).value(), device);
  if (!timed.ok()) RC_FAIL("untimed: " + timed.error().message);
  const Model& model = *timed.value();
  TrainingOptions options;
  options.offload.policy = setup.policy;
  options.offload.min_bytes = Bytes(0);
  options.steps = setup.steps;
  options.order_seed = setup.order_seed;
  if (setup.checkpoint) {
    auto plan = parse_checkpoint_spec("every:2", model);
    if (!plan.ok()) RC_FAIL("checkpoint: " + plan.error().message);
    options.checkpoint = std::move(plan).value();
  }
  auto plain = simulate_training(timed.value(), device, options);
  options.paged_stash =
      PagedStashOptions{.on = true, .page_rows = setup.page_rows, .headroom = setup.headroom};
  auto run = simulate_training(timed.value(), device, options, faults);
  RC_ASSERT(plain.ok() && run.ok());
  RC_ASSERT(!plain.value().failure);
  const TrainingRun& r = run.value();
  if (r.failure) RC_FAIL("run failed: " + r.failure->message);
  RC_CLASSIFY(r.paged_stash.stashed > 0, "stashed");
  if (!r.sim.hazards().empty()) RC_FAIL("hazards:\n" + testing::hazard_lines(r.sim));
  RC_ASSERT(r.sim.content_mismatches().empty());
  RC_ASSERT(r.gradient_values == plain.value().gradient_values);
  for (std::size_t s = 0; s < r.steps.size(); ++s) {
    RC_ASSERT(r.allocated_after[s] == plain.value().allocated_after[s] + r.paged_stash.pool);
  }
}

RC_GTEST_PROP(PagedStashProperty, TheStashWithItsWaitsIsCleanAndChangesNoGradient, ()) {
  stash_is_clean(*gen_setup(), {});
}

void expect_caught(const TrainingFaults& faults, const char* name) {
  ferry::testing::expect_planted_fault_caught([&] { stash_is_clean(*gen_setup(), faults); }, name,
                                              20261128, 300);
}

TEST(PagedStashProperty, PlantedStashBeforeItsProducerIsCaught) {
  TrainingFaults faults;
  faults.paged_stash.skip_stash_launch_wait = true;
  expect_caught(faults, "a stash copies before its stream waits for the compute stream");
}

TEST(PagedStashProperty, PlantedFreeBeforeTheStashIsDoneIsCaught) {
  TrainingFaults faults;
  faults.paged_stash.skip_stash_done_wait = true;
  expect_caught(faults, "padded buffers freed before the compute stream waits for their stash");
}

TEST(PagedStashProperty, PlantedRestoreNotAwaitedIsCaught) {
  TrainingFaults faults;
  faults.paged_stash.skip_restore_wait = true;
  expect_caught(faults, "backward reads a restore the compute stream did not wait for");
}

TEST(PagedStashProperty, PlantedRestoredFreeWithoutWaitIsCaught) {
  TrainingFaults faults;
  faults.paged_stash.skip_restored_free_wait = true;
  expect_caught(faults, "a restored tensor handed back before the stash stream waits for backward");
}

TEST(PagedStashProperty, PlantedPoolSizedByRowsOverflows) {
  TrainingFaults faults;
  faults.paged_stash.pool_by_rows = true;
  expect_caught(faults, "a pool sized by rows rather than pages");
}

// A file's static-capacity buffer whose pages would not fit any device: the step stops naming
// the pool, before its first op, rather than overflowing a product of sizes.
TEST(PagedStash, APoolAboveTheLargestBufferIsRefused) {
  Model m;
  m.name = "huge rows";
  const auto tensor = [&](std::string name, std::int64_t bytes, TensorRole role) {
    ModelTensor& t = m.tensors.emplace_back();
    t.name = std::move(name);
    t.bytes = Bytes(bytes);
    t.role = role;
    return static_cast<std::uint32_t>(m.tensors.size() - 1);
  };
  const std::uint32_t x = tensor("x", 1024, TensorRole::Input);
  const std::uint32_t a = tensor("a", std::int64_t{1} << 40, TensorRole::Activation);
  const std::uint32_t b = tensor("b", std::int64_t{1} << 40, TensorRole::Activation);
  const std::uint32_t y = tensor("y", 4, TensorRole::Activation);
  for (const std::uint32_t t : {a, b}) {
    m.tensors[t].capacity = Bytes(std::int64_t{1} << 41);
    m.tensors[t].rows = 1;  // one row of 2^40 bytes: pages of 2^20 rows hold 2^60
  }
  const auto op = [&](std::string name, std::int32_t layer, std::uint32_t in, std::uint32_t out,
                      bool saves) {
    ModelOp& o = m.ops.emplace_back();
    o.name = std::move(name);
    o.layer = layer;
    o.inputs = {in};
    o.outputs = {out};
    if (saves) o.saved = {out};
  };
  op("first", 0, x, a, true);
  op("second", 1, a, b, true);
  op("loss", -1, b, y, false);
  m.loss = y;
  ASSERT_TRUE(validate_model(m).ok()) << validate_model(m).error().message;
  TrainingOptions options;
  options.paged_stash = PagedStashOptions{.on = true, .page_rows = std::int64_t{1} << 20};
  auto run = simulate_training(m, testing::simple_profile(), options);
  ASSERT_TRUE(run.ok()) << run.error().message;
  ASSERT_TRUE(run.value().failure);
  EXPECT_EQ(run.value().failure->kind, FailureKind::Infeasible);
  EXPECT_NE(run.value().failure->message.find("the paged stash's pool of 2 pages of "),
            std::string::npos)
      << run.value().failure->message;
  EXPECT_TRUE(run.value().steps.empty());
}

}  // namespace
}  // namespace sim
}  // namespace ferry
