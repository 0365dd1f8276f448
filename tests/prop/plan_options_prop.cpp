// The exact stage's stated space by brute force (docs/plan.md, "The stated space of the exact
// stage"): every plan of per-layer options, replayed, against the plan at the same budget, on
// a 4-layer preset and on the traced Hugging Face families (tests/data/traced, two layers
// each). Heavier than a unit test (about 10^5 simulations: 1-2.5 min on two cores), so run
// with the exhaustive label.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "ferry/sim/planner/bound.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/space.hpp"
#include "plan_replay.hpp"

namespace ferry::sim {
namespace {

using testing::device_named;
using testing::Replay;

// Every plan of per-layer options of `space` (the options the stage measures: a level or a
// tail, never both; with `offload`, each kept or offloaded).
std::vector<std::vector<planning::LayerConfig>> every_plan_of_options(
    const planning::PlanSpace& space, bool offload) {
  std::vector<std::vector<planning::LayerConfig>> all{{}};
  for (const planning::Layer& layer : space.layers()) {
    std::vector<std::vector<planning::LayerConfig>> next;
    for (const auto& prefix : all) {
      for (std::size_t k = 0; k < layer.levels.size(); ++k) {
        for (std::size_t t = 0; t < layer.tails.size(); ++t) {
          if (k > 0 && t > 0) continue;  // the options the stage measures (options_of)
          for (const bool off : {false, true}) {
            if (off && !offload) continue;
            next.push_back(prefix);
            next.back().push_back(planning::LayerConfig{k, off, t});
          }
        }
      }
    }
    all = std::move(next);
  }
  return all;
}

// At each budget (`percents` of the peak of checkpointing every layer, and three between that
// peak and the largest plan of options'), the plan is at most 0.5 % slower than the fastest
// plan of options that fits, and both bounds lie below that plan: the plan / bound the report
// prints is then at least plan / fastest, a certified gap.
struct SpaceCheck {
  double worst = 0;          ///< the largest plan / fastest plan of options that fits
  double checkpointing = 0;  ///< checkpointing every layer / that fastest, at its own peak
};

SpaceCheck check_space(const std::string& name, const Model& model, const DeviceProfile& device,
                       bool offload, std::initializer_list<int> percents) {
  const planning::PlanSpace space(model, device);
  const auto all = every_plan_of_options(space, offload);
  const CheckedModel checked = check_model(model).value();
  std::vector<Replay> replays;
  replays.reserve(all.size());
  for (const auto& configs : all) {
    replays.push_back(
        testing::replay(space.plan_of(configs, PlanKnobs{}, std::nullopt), checked, device));
  }
  Planner planner(checked, device);
  Bytes checkpointed;
  SimTime checkpointing;
  for (const RowResult& row : planner.fixed()) {
    if (row.name == "checkpoint every layer") {
      checkpointed = row.peak_reserved;
      checkpointing = row.step_time;
    }
  }
  EXPECT_GT(checkpointed, Bytes(0)) << name;
  // Where memory binds: a quarter, half and three quarters of the way from checkpointing's
  // peak to the largest peak of a plan of options (everything kept).
  Bytes kept;
  for (const Replay& r : replays) {
    if (r.ok) kept = std::max(kept, r.reserved);
  }
  std::vector<Bytes> budgets;
  for (const int percent : percents) budgets.emplace_back(checkpointed.count() * percent / 100);
  if (kept > checkpointed) {
    for (const int quarter : {1, 2, 3}) {
      budgets.emplace_back(checkpointed.count() + (kept - checkpointed).count() * quarter / 4);
    }
  }
  SpaceCheck check;
  for (const Bytes budget : budgets) {
    const double at =
        static_cast<double>(budget.count()) / static_cast<double>(checkpointed.count());
    const auto outcome = planner.plan(PlannerOptions{budget, std::nullopt, 2});
    if (!outcome.ok()) {
      ADD_FAILURE() << name << " on " << device.name << " at " << at
                    << "x: " << outcome.error().message;
      continue;
    }
    const PlanOutcome& o = outcome.value();
    std::optional<SimTime> best;
    for (const Replay& r : replays) {
      if (r.ok && r.reserved <= budget && (!best || r.time < *best)) best = r.time;
    }
    if (!best) {
      ADD_FAILURE() << name << " on " << device.name << ": no plan of options fits at " << at
                    << "x";
      continue;
    }
    const double ratio =
        static_cast<double>(o.row.step_time.ns()) / static_cast<double>(best->ns());
    check.worst = std::max(check.worst, ratio);
    if (budget == checkpointed) {
      check.checkpointing =
          static_cast<double>(checkpointing.ns()) / static_cast<double>(best->ns());
    }
    std::printf(
        "%s on %s, %zu plans of options, at %.2fx: plan %.4f ms, best %.4f ms: %.4f; "
        "plan / bound %.4f, plan / options bound %.4f\n",
        name.c_str(), device.name.c_str(), all.size(), at,
        static_cast<double>(o.row.step_time.ns()) / 1e6, static_cast<double>(best->ns()) / 1e6,
        ratio, static_cast<double>(o.row.step_time.ns()) / static_cast<double>(o.lower_bound.ns()),
        static_cast<double>(o.row.step_time.ns()) / static_cast<double>(o.options_bound.ns()));
    EXPECT_LE(ratio, 1.005) << name << " on " << device.name << " at " << at << "x";
    EXPECT_LE(o.lower_bound, *best) << name << " on " << device.name << " at " << at << "x";
    EXPECT_LE(o.options_bound, *best) << name << " on " << device.name << " at " << at << "x";
    // The plan itself, which may keep single ops outside the space, is bounded by the first.
    EXPECT_LE(o.lower_bound.ns(), o.row.step_time.ns())
        << name << " on " << device.name << " at " << at << "x";
    if (o.in_option_space) {
      EXPECT_LE(o.options_bound.ns(), o.row.step_time.ns())
          << name << " on " << device.name << " at " << at << "x";
    }
  }
  return check;
}

TEST(PlanOptions, ThePlanIsWithinHalfAPercentOfEveryPlanOfOptionsWithoutOffload) {
  // Offload left out (it multiplies the 65,536 plans by 16); at 1.1x everything kept fits.
  TransformerShape shape = model_preset_shape("tiny-llama").value();
  shape.layers = 4;
  const DeviceProfile device = device_named("h100-sxm-pcie5");
  Model model = make_transformer(shape, "tiny-llama-4");
  assign_roofline_durations(model, device);
  ASSERT_EQ(planning::PlanSpace(model, device).layers().size(), 4U);
  const SpaceCheck check = check_space("tiny-llama-4", model, device, false, {100, 103, 106});
  RecordProperty("worst_plan_over_options", std::to_string(check.worst));
}

TEST(PlanOptions, ThePlanIsWithinHalfAPercentOfEveryPlanOfOptionsOnTracedFamilies) {
  // The sized traced families (tests/data/traced/sized, two layers each), offload included,
  // at 1.0x, 1.1x and 1.3x the peak of checkpointing every layer on the three bundled profiles.
  double worst = 0;
  double checkpointing = 0;
  testing::for_each_sized_family(
      [&](const std::string& family, const Model& model, const DeviceProfile& device) {
        ASSERT_EQ(planning::PlanSpace(model, device).layers().size(), 2U) << family;
        const SpaceCheck check = check_space(family, model, device, true, {100, 110, 130});
        worst = std::max(worst, check.worst);
        checkpointing = std::max(checkpointing, check.checkpointing);
      });
  std::printf("worst plan / fastest plan of options: %.4f\n", worst);
  RecordProperty("worst_plan_over_options", std::to_string(worst));
  // The comparison can fail: a plan that checkpoints every layer, at its own peak, is more
  // than 0.5 % slower than the fastest plan of options there.
  std::printf("checkpointing every layer / fastest plan of options at its peak: %.4f\n",
              checkpointing);
  EXPECT_GT(checkpointing, 1.005);
}

TEST(PlanOptions, ThePlanIsWithinHalfAPercentOfEveryPlanOfOptionsOnPresetsCutToTwoLayers) {
  // The bundled presets' shapes with two layers, offload included, as the traced families.
  double worst = 0;
  for (const char* preset : {"gpt2-small-s1024", "llama3-8b-s8192", "titan-llama3-8b-s8192",
                             "llama-70b-s4096", "llama3.2-3b-traced-s4096-b2"}) {
    for (const char* profile : {"h100-sxm-pcie5", "a100-pcie4", "gh200"}) {
      const DeviceProfile device = device_named(profile);
      TransformerShape shape = model_preset_shape(preset).value();
      shape.layers = 2;
      Model model = make_transformer(shape, std::string(preset) + "-2");
      assign_roofline_durations(model, device);
      ASSERT_EQ(planning::PlanSpace(model, device).layers().size(), 2U) << preset;
      worst = std::max(worst, check_space(model.name, model, device, true, {100, 110, 130}).worst);
    }
  }
  std::printf("worst plan / fastest plan of options: %.4f\n", worst);
  RecordProperty("worst_plan_over_options", std::to_string(worst));
}

}  // namespace
}  // namespace ferry::sim
