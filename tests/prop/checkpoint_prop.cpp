// Checkpointing on random models with random (nested) regions, early-stop settings,
// retain_graph, backward orders and offload policies: every gradient equals the run without
// checkpointing (also with a backward run inside a region during its forward); no hazard; every
// unpacked tensor holds what forward saved; memory returns to its baseline; the peak stays within
// the schedule's bound; with early stop each replay ends exactly at the op that saved its frame's
// last tensor. Planted fault: skipping the RNG restore is caught. The reference offloader (trl) is
// left out here: it never hears of saved tensors freed without an unpack (a frame's inputs when the
// frame saved nothing), and rejects packs during backward (the reentrant recompute), as the seed
// version does; its composition with checkpointing is covered by unit tests
// (tests/unit/checkpoint_test.cpp).

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <iostream>
#include <random>

#include "ferry/sim/autograd/autograd.hpp"
#include "prop/planted.hpp"
#include "prop/random_program.hpp"
#include "prop/rc_model_gens.hpp"

namespace ferry::sim {
namespace {

using testing::gen_layer;
using testing::LayerChoice;

struct RegionChoice {
  std::uint32_t start = 0;
  std::uint32_t length = 1;
  std::uint32_t inner = 0;  // 0: none; else an inner region's offset (and length 1..)
  std::uint32_t early = 0;  // 0 default, 1 on, 2 off
  bool reentrant = false;
};

void showValue(const RegionChoice& r, std::ostream& os) {
  os << "{start " << r.start << ", length " << r.length << ", inner " << r.inner << ", early "
     << r.early << (r.reentrant ? ", reentrant" : "") << "}";
}

rc::Gen<RegionChoice> gen_region() {
  return rc::gen::apply(
      [](std::uint32_t s, std::uint32_t l, std::uint32_t i, std::uint32_t e, bool r) {
        return RegionChoice{s, l, i, e, r};
      },
      rc::gen::inRange<std::uint32_t>(0, 16), rc::gen::inRange<std::uint32_t>(1, 6),
      rc::gen::inRange<std::uint32_t>(0, 4), rc::gen::inRange<std::uint32_t>(0, 3),
      rc::gen::arbitrary<bool>());
}

struct RunSetup {
  Policy offload = Policy::None;
  std::uint64_t order_seed = 0;
  std::uint32_t global_early = 0;  // 0 unset, 1 on, 2 off
  bool retain_graph = false;
  std::uint64_t device_seed = 1;
  std::int32_t inside = -1;  // an op after whose forward a backward runs (-1: none)
  // Which ops the regions save: 0 none (plain checkpointing), 1 some, drawn by `save_seed`
  // (eager selective checkpointing), 2 those of 1 that a compiled graph keeps
  // (drop_unread_saves).
  std::uint32_t saving = 0;
  std::uint64_t save_seed = 0;
};

void showValue(const RunSetup& s, std::ostream& os) {
  os << policy_name(s.offload) << " order " << s.order_seed << " global_early " << s.global_early
     << " retain " << s.retain_graph << " device " << s.device_seed << " inside " << s.inside
     << " saving " << s.saving << " save_seed " << s.save_seed;
}

rc::Gen<RunSetup> gen_setup() {
  return rc::gen::apply(
      [](int p, std::uint64_t order, std::uint32_t early, bool retain, std::uint64_t dev,
         std::int32_t inside, std::uint32_t saving, std::uint64_t save_seed) {
        RunSetup s;
        s.offload = p == 0 ? Policy::None : Policy::Ferry;
        s.order_seed = order;
        s.global_early = early;
        s.retain_graph = retain && s.offload != Policy::Trl;
        s.device_seed = dev;
        s.inside = inside;
        s.saving = saving;
        s.save_seed = save_seed;
        return s;
      },
      rc::gen::inRange(0, 2), rc::gen::inRange<std::uint64_t>(0, 3),
      rc::gen::inRange<std::uint32_t>(0, 3), rc::gen::arbitrary<bool>(),
      rc::gen::inRange<std::uint64_t>(1, 1000), rc::gen::inRange<std::int32_t>(-3, 12),
      rc::gen::inRange<std::uint32_t>(0, 3), rc::gen::inRange<std::uint64_t>(0, 1000));
}

std::optional<bool> early(std::uint32_t code) {
  if (code == 1) return true;
  if (code == 2) return false;
  return std::nullopt;
}

// Non-overlapping top-level regions in choice order; each may hold one nested region.
CheckpointPlan plan_for(const Model& m, const std::vector<RegionChoice>& choices) {
  CheckpointPlan plan;
  const auto ops = static_cast<std::uint32_t>(m.ops.size());
  std::vector<bool> used(ops, false);
  for (const RegionChoice& c : choices) {
    const std::uint32_t first = c.start % ops;
    const std::uint32_t end = std::min(ops, first + c.length);
    bool free = true;
    for (std::uint32_t i = first; i < end; ++i) free = free && !used[i];
    if (!free || first >= end) continue;
    for (std::uint32_t i = first; i < end; ++i) used[i] = true;
    const bool nest = c.inner > 0 && end - first >= 2;
    plan.regions.push_back(CheckpointRegion{first, end, c.reentrant && !nest, early(c.early)});
    if (nest) {
      const std::uint32_t in_first = first + (c.inner % (end - first));
      const std::uint32_t in_end = std::min(end, in_first + 1 + c.inner / 2);
      plan.regions.push_back(CheckpointRegion{in_first, in_end, false, early(c.early)});
    }
  }
  // Outer regions must come before the regions they contain.
  std::stable_sort(plan.regions.begin(), plan.regions.end(), [](const auto& a, const auto& b) {
    return a.first_op != b.first_op ? a.first_op < b.first_op : a.end_op > b.end_op;
  });
  return plan;
}

// What checkpointing may add to the peak: a region's outputs re-materialized, and its inputs,
// saved in place of its internals (kept alive, or reloaded as copies while the originals may
// still be alive).
Bytes region_bytes(const Model& m, const CheckpointPlan& plan) {
  Bytes sum;
  {
    for (const auto& r : plan.regions) {
      std::vector<std::uint32_t> produced;
      std::vector<std::uint32_t> counted;
      for (std::uint32_t i = r.first_op; i < r.end_op; ++i) {
        for (const auto t : m.ops[i].inputs) {
          const auto& tensor = m.tensors[t];
          const std::uint32_t b =
              tensor.view_of >= 0 ? static_cast<std::uint32_t>(tensor.view_of) : t;
          if (m.tensors[b].role == TensorRole::Param) continue;
          if (std::find(produced.begin(), produced.end(), b) != produced.end()) continue;
          if (std::find(counted.begin(), counted.end(), b) != counted.end()) continue;
          counted.push_back(b);
          sum += m.tensors[b].bytes;
        }
        for (const auto t : m.ops[i].outputs) produced.push_back(t);
      }
    }
  }
  std::vector<bool> inside(m.ops.size(), false);
  for (const auto& r : plan.regions) {
    for (std::uint32_t i = r.first_op; i < r.end_op; ++i) inside[i] = true;
  }
  for (std::size_t i = 0; i < m.ops.size(); ++i) {
    if (!inside[i]) continue;
    for (const auto t : m.ops[i].outputs) {
      if (m.tensors[t].view_of < 0) sum += m.tensors[t].bytes;
    }
  }
  return sum;
}

// The saved ops `setup` draws (RunSetup::saving); with `drop_every_save` (a planted fault) every
// one of them is dropped, whether a backward reads it or not.
// Saves are drawn where no region nests in another: a saved op inside a region that a replay
// of an outer one begins again is served from the outer frame, which did not cache it (a
// limitation of nested selective checkpointing, docs/checkpoint.md).
void choose_saves(CheckpointPlan& plan, const Model& model, const RunSetup& setup,
                  bool drop_every_save) {
  if (setup.saving == 0) return;
  for (std::size_t r = 1; r < plan.regions.size(); ++r) {
    if (plan.regions[r].first_op < plan.regions[r - 1].end_op) return;
  }
  // An op that draws random numbers is recomputed: served from the cache instead, it would not
  // advance the generator, and the ops after it would draw other numbers (as in torch's
  // selective checkpointing, whose save lists name no random op).
  std::mt19937_64 draw(setup.save_seed);
  plan.op_policy.assign(model.ops.size(), OpPolicy::PreferRecompute);
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const bool random = model.ops[i].draws_rng || model.ops[i].draws_cpu_rng;
    if (draw() % 2 == 0 && !random) plan.op_policy[i] = OpPolicy::MustSave;
  }
  if (setup.saving == 2) drop_unread_saves(plan, model);
  if (drop_every_save) std::ranges::replace(plan.op_policy, OpPolicy::MustSave, OpPolicy::Dropped);
}

void checkpoint_is_faithful(const std::vector<LayerChoice>& layers,
                            const std::vector<RegionChoice>& regions, const RunSetup& setup,
                            bool skip_rng_restore, bool drop_every_save = false) {
  testing::ModelOptions mo;
  mo.side_branches = setup.offload != Policy::Trl;
  const Model model = build_random_model(layers, mo);
  std::mt19937_64 rng(setup.device_seed);
  const DeviceProfile device = testing::random_profile(rng);
  TrainingOptions base;
  base.steps = 2;
  base.offload.policy = setup.offload;
  base.offload.min_bytes = Bytes(0);
  base.order_seed = setup.order_seed;
  base.retain_graph = setup.retain_graph;
  if (setup.inside >= 0) {
    base.backward_inside_op = setup.inside % static_cast<std::int32_t>(model.ops.size());
  }
  TrainingOptions ck = base;
  ck.checkpoint = plan_for(model, regions);
  ck.checkpoint.global_early_stop = early(setup.global_early);
  choose_saves(ck.checkpoint, model, setup, drop_every_save);
  RC_TAG(setup.saving);
  TrainingFaults faults;
  faults.skip_rng_restore = skip_rng_restore;
  RC_TAG(ck.checkpoint.regions.size());
  auto plain = simulate_training(model, device, base);
  auto run = simulate_training(model, device, ck, faults);
  RC_ASSERT(plain.ok() && run.ok());
  const TrainingRun& r = run.value();
  if (r.failure && r.failure->message.find("not found in storage") != std::string::npos) {
    // torch raises this too: a backward inside a region's forward replays the region, early
    // stop off, past the op forward has reached, to one selective checkpointing serves from
    // forward.
    RC_ASSERT(base.backward_inside_op >= 0 && setup.saving > 0 && !plain.value().failure);
    RC_SUCCEED("a backward inside a region replays an op forward has not run");
  }
  if (r.failure) RC_FAIL("run failed: " + r.failure->message);
  RC_ASSERT(!plain.value().failure);
  RC_ASSERT(r.sim.hazards().empty());
  RC_ASSERT(r.sim.content_mismatches().empty());
  RC_ASSERT(r.gradient_values == plain.value().gradient_values);
  for (std::size_t s = 0; s < r.steps.size(); ++s)
    RC_ASSERT(r.allocated_after[s] == r.baseline_allocated);
  const Bytes peak = r.sim.device_allocator(DeviceId(0)).stats().requested_peak;
  const Bytes base_peak = plain.value().sim.device_allocator(DeviceId(0)).stats().requested_peak;
  // A backward run inside a region's forward recomputes that region while its forward's
  // tensors are still alive: the region's bytes may stand twice.
  bool backward_in_region = false;
  for (const auto& reg : ck.checkpoint.regions) {
    const auto at = base.backward_inside_op;
    backward_in_region =
        backward_in_region || (at >= 0 && static_cast<std::uint32_t>(at) >= reg.first_op &&
                               static_cast<std::uint32_t>(at) < reg.end_op);
  }
  const Bytes added = region_bytes(model, ck.checkpoint);
  RC_ASSERT(peak <= base_peak + (backward_in_region ? added + added : added));
  bool all_early = setup.global_early != 2;
  for (const auto& reg : ck.checkpoint.regions) {
    if (setup.global_early == 0) all_early = all_early && reg.early_stop.value_or(true);
  }
  for (const auto& [ran, last] : r.replay_stops) {
    if (all_early) {
      RC_ASSERT(ran == last);
    } else {
      RC_ASSERT(ran >= last);
    }
  }
}

RC_GTEST_PROP(CheckpointProperty, RecomputeIsFaithfulOnRandomModelsAndRegions, ()) {
  checkpoint_is_faithful(*rc::gen::container<std::vector<LayerChoice>>(gen_layer()),
                         *rc::gen::container<std::vector<RegionChoice>>(gen_region()), *gen_setup(),
                         false);
}

// A backward inside op 0's forward, in a region whose replay does not stop early, replays the
// ops forward has not reached yet; selective checkpointing serves one of them from forward,
// which stored nothing for it: torch's error, not an internal one (found by this property).
TEST(CheckpointProperty, ABackwardInsideARegionReplayingPastForwardIsTorchsError) {
  std::vector<LayerChoice> layers(6);
  layers[0].save = 1;  // op 0 saves its input: the inner backward unpacks it
  RunSetup setup;
  setup.global_early = 2;
  setup.inside = 0;
  setup.saving = 1;
  const Model model = build_random_model(layers, testing::ModelOptions{});
  TrainingOptions options;
  options.steps = 1;
  options.offload.policy = Policy::None;
  options.backward_inside_op = 0;
  options.checkpoint = plan_for(model, {RegionChoice{0, 4, 0, 0, false}});
  options.checkpoint.global_early_stop = false;
  choose_saves(options.checkpoint, model, setup, false);
  ASSERT_EQ(options.checkpoint.op_policy.size(), model.ops.size());
  std::mt19937_64 rng(1);
  auto run = simulate_training(model, testing::random_profile(rng), options);
  ASSERT_TRUE(run.ok()) << run.error().message;
  ASSERT_TRUE(run.value().failure.has_value());
  EXPECT_EQ(run.value().failure->kind, FailureKind::Misuse);
  EXPECT_NE(run.value().failure->message.find("encountered during backward, but not found in "
                                              "storage"),
            std::string::npos)
      << run.value().failure->message;
  // With early stop the replay ends at the op the inner backward needs, and the step runs.
  options.checkpoint.global_early_stop = true;
  auto early = simulate_training(model, testing::random_profile(rng), options);
  ASSERT_TRUE(early.ok());
  EXPECT_FALSE(early.value().failure.has_value()) << early.value().failure->message;
}

TEST(CheckpointProperty, PlantedFaultDroppingTheRngRestoreIsCaught) {
  const std::string found = ferry::testing::counterexample([] {
    checkpoint_is_faithful(*rc::gen::container<std::vector<LayerChoice>>(gen_layer()),
                           *rc::gen::container<std::vector<RegionChoice>>(gen_region()),
                           *gen_setup(), true);
  });
  ASSERT_FALSE(found.empty()) << "recompute without the RNG restore went unnoticed";
  std::cout << "planted fault \"RNG restore dropped\", shrunk counterexample:\n" << found << "\n";
}

// A compiled graph drops only the saves no backward reads: dropping every one a region makes
// loses a tensor a replay or a backward reads, and is caught.
TEST(CheckpointProperty, PlantedFaultDroppingSavesABackwardReadsIsCaught) {
  const std::string found = ferry::testing::counterexample([] {
    const auto saving = rc::gen::map(gen_setup(), [](RunSetup s) {
      s.saving = 1;
      return s;
    });
    checkpoint_is_faithful(*rc::gen::container<std::vector<LayerChoice>>(gen_layer()),
                           *rc::gen::container<std::vector<RegionChoice>>(gen_region()), *saving,
                           false, true);
  });
  ASSERT_FALSE(found.empty()) << "dropping saves that a backward reads went unnoticed";
  std::cout << "planted fault \"every save dropped\", shrunk counterexample:\n" << found << "\n";
}

}  // namespace
}  // namespace ferry::sim
