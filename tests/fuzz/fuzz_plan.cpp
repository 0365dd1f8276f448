// libFuzzer harness for plan files (`ferry.plan/1`): parse as `ferry simulate --plan FILE`
// does; a plan that reads back must write the same plan, and applied to the tiny-gpt preset
// (whose op names the seed corpus uses) it must either be refused with a message naming the
// op list or run with zero hazards and every reloaded or recomputed tensor as forward saved it.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/lower.hpp"
#include "fuzz_common.hpp"

namespace {

namespace fuzz = ferry::sim::fuzz;

const ferry::sim::DeviceProfile& device() {
  static const ferry::sim::DeviceProfile parsed = [] {
    auto d = ferry::sim::load_device_profile(fuzz::scenarios_dir() / "devices", "h100-sxm-pcie5");
    if (!d) fuzz::fail(d.error().message);
    return d.value();
  }();
  return parsed;
}

const ferry::sim::Model& model() {
  static const ferry::sim::Model built = [] {
    auto m = ferry::sim::model_preset("tiny-gpt");
    if (!m) fuzz::fail(m.error().message);
    ferry::sim::assign_roofline_durations(m.value(), device());
    return m.value();
  }();
  return built;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto plan = ferry::sim::parse_plan(text, fuzz::kSource);
  if (!plan) {
    fuzz::expect_error_names_source(plan.error());
    return 0;
  }
  auto again = ferry::sim::parse_plan(ferry::sim::plan_to_json(plan.value()), fuzz::kSource);
  if (!again || !(again.value() == plan.value())) fuzz::fail("a plan does not read back equal");
  auto options =
      ferry::sim::plan_training_options(plan.value(), model(), fuzz::cli_training_options());
  if (!options) {
    if (!options.error().message.starts_with("ops")) {
      fuzz::fail("a plan for another model is refused without naming the ops");
    }
    return 0;
  }
  auto run = ferry::sim::simulate_training(model(), device(), options.value());
  if (!run) return 0;  // refused by the trainer's own checks, with a message
  if (!run.value().sim.hazards().empty()) fuzz::fail("a valid plan ran with a hazard");
  if (!run.value().sim.content_mismatches().empty()) {
    fuzz::fail("a valid plan reloaded or recomputed a tensor that differs from forward's");
  }
  return 0;
}
