// The planner on random small models and random budgets: every plan it returns simulates, with
// the hazard checker and content tracking on, to completion with zero hazards, no content
// mismatch and a peak reserved within the budget (on a device with exactly the budget's
// memory); otherwise it says the budget is infeasible and names the floor. Planted fault: the
// plans that offload, replayed with the reload's wait dropped, are caught by the checker.

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "prop/planted.hpp"
#include "prop/rc_model_gens.hpp"

namespace ferry::sim {
namespace {

DeviceProfile device_profile() {
  auto p = load_device_profile(std::string(FERRY_SCENARIOS_DIR) + "/devices", "h100-sxm-pcie5");
  RC_ASSERT(p.ok());
  return p.value();
}

// A small transformer (GPT or Llama shape) or a random model whose every op is a layer.
Model gen_model(const DeviceProfile& device) {
  Model model;
  if (*rc::gen::arbitrary<bool>()) {
    TransformerShape shape;
    shape.kind =
        *rc::gen::arbitrary<bool>() ? TransformerShape::Kind::Llama : TransformerShape::Kind::Gpt;
    shape.layers = *rc::gen::inRange<std::int64_t>(1, 5);
    shape.heads = *rc::gen::element<std::int64_t>(2, 4);
    shape.kv_heads = shape.kind == TransformerShape::Kind::Llama ? 2 : shape.heads;
    shape.hidden = 64 * shape.heads;
    shape.ffn = 4 * shape.hidden;
    shape.vocab = 1000;
    shape.sequence = *rc::gen::element<std::int64_t>(128, 512, 1024);
    shape.flash_attention = *rc::gen::arbitrary<bool>();
    model = make_transformer(shape, "random-transformer");
  } else {
    const auto choices = *rc::gen::container<std::vector<testing::LayerChoice>>(
        *rc::gen::inRange<std::size_t>(1, 10), testing::gen_layer());
    model = testing::build_random_model(choices, testing::ModelOptions{});
  }
  RC_PRE(check_roofline(model, device).ok());
  assign_roofline_durations(model, device);
  return model;
}

// The checked replay of a plan on a device with `budget` of memory.
Result<TrainingRun> replay(const Plan& plan, const Model& model, const DeviceProfile& device,
                           Bytes budget, const TrainingFaults& faults = {}) {
  DeviceProfile capped = device;
  capped.memory = std::min(device.memory, budget);
  TrainingOptions base;
  base.steps = 2;
  auto options = plan_training_options(plan, model, base);
  if (!options) return options.error();
  return simulate_training(model, capped, options.value(), faults);
}

Bytes no_offload_peak(const Model& model, const DeviceProfile& device) {
  TrainingOptions o;
  o.offload.policy = Policy::None;
  o.sim.check_hazards = false;
  auto run = simulate_training(model, roomy(device), o);
  RC_ASSERT(run.ok());
  return run.value().sim.device_allocator(run.value().device).stats().reserved_peak;
}

// The floor the planner names for a budget of one byte.
Bytes planner_floor(const Model& model, const DeviceProfile& device) {
  auto outcome = make_plan(model, device, PlannerOptions{Bytes(1), std::nullopt, 2});
  RC_ASSERT(!outcome.ok());
  const std::string& message = outcome.error().message;
  const auto open = message.rfind('(');
  RC_ASSERT(open != std::string::npos);
  return Bytes(std::stoll(message.substr(open + 1)));
}

RC_GTEST_PROP(PlanProp, EveryPlanIsSafeAndWithinBudgetOrTheFloorIsNamed, ()) {
  const DeviceProfile device = device_profile();
  const Model model = gen_model(device);
  const Bytes peak = no_offload_peak(model, device);
  const Bytes floor = planner_floor(model, device);
  RC_ASSERT(floor <= peak);
  // From below the floor (permille < 0) to above the no-offload peak (permille > 1000).
  const std::int64_t permille = *rc::gen::resize(100, rc::gen::inRange<std::int64_t>(-200, 1100));
  const Bytes budget(
      std::max<std::int64_t>(1, floor.count() + (peak - floor).count() * permille / 1000));
  RC_TAG(permille < 0 ? "below the floor" : permille >= 1000 ? "above the peak" : "between");
  auto outcome = make_plan(model, device, PlannerOptions{budget, std::nullopt, 2});
  if (!outcome) {
    RC_TAG("infeasible");
    const std::string& message = outcome.error().message;
    RC_ASSERT(message.find("infeasible") != std::string::npos);
    if (message.find("failed their checked run") != std::string::npos) {
      // Plans reached the budget unchecked and every one failed its checked run: said so,
      // with no floor under the budget.
      RC_TAG("checked runs failed");
      RC_ASSERT(message.find("the floor") == std::string::npos);
      return;
    }
    RC_ASSERT(budget < floor);
    RC_ASSERT(message.find("the floor") != std::string::npos);
    return;
  }
  auto run = replay(outcome.value().plan, model, device, budget);
  RC_ASSERT(run.ok());
  const TrainingRun& r = run.value();
  RC_ASSERT(!r.failure);
  RC_ASSERT(r.sim.hazards().empty());
  RC_ASSERT(r.sim.content_mismatches().empty());
  RC_ASSERT(r.sim.device_allocator(r.device).stats().reserved_peak <= budget);
  RC_ASSERT(outcome.value().row.peak_reserved <= budget);
  RC_ASSERT(outcome.value().row.hazards == 0U);
}

// Note [Monotone in the budget]: budgets planned one after another by one Planner (random
// order): a budget at least as large as an earlier one gets a plan no slower than its.
RC_GTEST_PROP(PlanProp, ALargerBudgetNeverGivesASlowerPlan, ()) {
  const DeviceProfile device = device_profile();
  const Model model = gen_model(device);
  const Bytes peak = no_offload_peak(model, device);
  const Bytes floor = planner_floor(model, device);
  const auto permilles = *rc::gen::container<std::vector<std::int64_t>>(
      *rc::gen::inRange<std::size_t>(2, 5), rc::gen::inRange<std::int64_t>(0, 1100));
  Planner planner(check_model(model).value(), device, 2);
  std::vector<std::pair<Bytes, SimTime>> plans;  // budget, step time
  for (const std::int64_t permille : permilles) {
    const Bytes budget(floor.count() + (peak - floor).count() * permille / 1000);
    auto outcome = planner.plan(PlannerOptions{budget, std::nullopt, 2});
    if (!outcome) continue;  // a checked run the floor's plan failed at this budget
    RC_ASSERT(outcome.value().row.peak_reserved <= budget);
    plans.emplace_back(budget, outcome.value().row.step_time);
  }
  // Each budget at or above an earlier one has a plan no slower than that one's.
  for (std::size_t i = 0; i < plans.size(); ++i) {
    for (std::size_t j = i + 1; j < plans.size(); ++j) {
      if (plans[j].first >= plans[i].first) RC_ASSERT(plans[j].second <= plans[i].second);
    }
  }
}

TEST(PlanProp, PlantedMissingReloadWaitIsCaught) {
  const std::string found = ferry::testing::counterexample(
      [] {
        const DeviceProfile device = device_profile();
        const Model model = gen_model(device);
        const Bytes peak = no_offload_peak(model, device);
        const Bytes budget(peak.count() * *rc::gen::inRange<std::int64_t>(300, 950) / 1000);
        auto outcome = make_plan(model, device, PlannerOptions{budget, std::nullopt, 2});
        RC_PRE(outcome.ok() && outcome.value().row.d2h > Bytes(0));
        TrainingFaults faults;
        faults.offload.skip_reload_wait = true;
        auto run = replay(outcome.value().plan, model, device, budget, faults);
        RC_PRE(run.ok() && !run.value().failure);
        RC_ASSERT(run.value().sim.hazards().empty());
      },
      20261123, 200);
  EXPECT_FALSE(found.empty()) << "a plan replayed without its reload wait went unnoticed";
}

}  // namespace
}  // namespace ferry::sim
