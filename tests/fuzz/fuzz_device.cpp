// libFuzzer harness for device profiles (scenarios/devices/*.json): parse as
// `ferry simulate --device FILE` does, then use the profile the ways the CLI can: the bundled
// MLP model under every compare row and pipeline, and bundled programs (one device and two
// over a link) with the profile in place of theirs.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/report/check_report.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "fuzz_common.hpp"

namespace {

namespace fuzz = ferry::sim::fuzz;

const ferry::sim::Model& model() {
  static const ferry::sim::Model parsed = [] {
    auto m = ferry::sim::parse_model(fuzz::read_scenario("models/mlp.json"), "mlp.json");
    if (!m) fuzz::fail(m.error().message);
    return m.value();
  }();
  return parsed;
}

const std::vector<ferry::sim::Program>& programs() {
  static const std::vector<ferry::sim::Program> parsed = [] {
    std::vector<ferry::sim::Program> out;
    for (const char* name : {"programs/offload_step.json", "programs/two_gpu_pipeline.json"}) {
      auto p = ferry::sim::parse_program(fuzz::read_scenario(name), name,
                                         fuzz::scenarios_dir() / "devices");
      if (!p) fuzz::fail(p.error().message);
      out.push_back(std::move(p).value());
    }
    return out;
  }();
  return parsed;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto profile = ferry::sim::parse_device_profile(text, fuzz::kSource);
  if (!profile) {
    fuzz::expect_error_names_source(profile.error());
    return 0;
  }
  fuzz::simulate_model(model(), profile.value());
  for (ferry::sim::Program program : programs()) {
    for (auto& device : program.devices) {
      device.profile = profile.value();
      device.profile_name.clear();
    }
    ferry::sim::SimOptions options;
    options.check_hazards = true;
    auto run = ferry::sim::run_program(program, options);
    if (!run) fuzz::fail(run.error().message);
    (void)ferry::sim::summary_text(run.value(), "program");
    (void)ferry::sim::summary_json(run.value(), "program");
  }
  return 0;
}
