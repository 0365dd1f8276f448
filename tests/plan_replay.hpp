#pragma once
// What the exhaustive plan tests share: a plan replayed as the planner measures it, and the
// traced Hugging Face models of tests/data/traced (written by tests/python/traced_families.py).

#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/lower.hpp"
#include "ferry/sim/runs/configurations.hpp"

namespace ferry::sim::testing {

/// A replayed plan: whether it ran without a failure, its last step's time and its peak
/// reserved.
struct Replay {
  bool ok = false;
  SimTime time;
  Bytes reserved;
};

/// The plan's unchecked run on the device with room for anything (as the planner measures). The
/// model is checked once by the caller, as the planner checks it, not again for each plan.
inline Replay replay(const Plan& plan, const CheckedModel& model, const DeviceProfile& device) {
  auto options = plan_training_options(plan, *model, timing_only(2));
  if (!options.ok()) return {};
  auto run = simulate_training(model, roomy(device), options.value());
  if (!run.ok() || run.value().failure || run.value().steps.empty()) return {};
  const TrainingRun& r = run.value();
  return Replay{true, r.steps.back().end - r.steps.back().start,
                r.sim.device_allocator(r.device).stats().reserved_peak};
}

/// The sized traced families (tests/data/traced/sized): five dense decoders, a mixture of
/// experts and an encoder-decoder.
inline constexpr std::array<const char*, 7> kSizedFamilies = {
    "gpt2", "llama", "mistral", "qwen2", "gemma2", "mixtral", "t5"};

/// The traced model file `name` of tests/data/traced as it gives it.
inline Model traced_file(const std::string& name) {
  const std::filesystem::path path =
      std::filesystem::path(FERRY_TESTS_DIR) / "data" / "traced" / name;
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto model = parse_model(text.str(), path.string());
  EXPECT_TRUE(model.ok()) << (model.ok() ? "" : model.error().message);
  return model.ok() ? std::move(model).value() : Model{};
}

/// The sized traced family `family` (one of kSizedFamilies: its published config cut to two
/// layers, tests/data/traced/sized) as its file gives it.
inline Model sized_family(const std::string& family) {
  return traced_file("sized/" + family + ".json");
}

/// A bundled device profile by name.
inline DeviceProfile device_named(const std::string& name) {
  auto d = load_device_profile(std::string(FERRY_SCENARIOS_DIR) + "/devices", name);
  EXPECT_TRUE(d.ok()) << name;
  return d.ok() ? d.value() : DeviceProfile{};
}

/// `check(family, model, device)` for each sized family on each bundled profile, the model's
/// durations assigned for the profile.
template <typename Check>
void for_each_sized_family(Check check) {
  for (const char* family : kSizedFamilies) {
    for (const char* profile : {"h100-sxm-pcie5", "a100-pcie4", "gh200"}) {
      const DeviceProfile device = device_named(profile);
      Model model = sized_family(family);
      ASSERT_FALSE(model.ops.empty()) << family;
      assign_roofline_durations(model, device);
      check(std::string(family), model, device);
    }
  }
}

}  // namespace ferry::sim::testing
