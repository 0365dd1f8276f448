#pragma once
/// What the libFuzzer harnesses share: the CLI's default options, the bundled scenarios, and
/// the checks every input must pass (an error names its source; a valid document round-trips).

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "ferry/result.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/configurations.hpp"

namespace ferry::sim::fuzz {

/// The name the harnesses give every document; each parse error must begin with it.
inline constexpr std::string_view kSource = "fuzz.json";

/// Stops the run with a report: the fuzzer keeps the input as a crash.
[[noreturn]] inline void fail(std::string_view what) {
  fmt::print(stderr, "fuzz: {}\n", what);
  std::fflush(stderr);
  std::abort();
}

/// A parse error must name the document and the place ("fuzz.json: ops[3]...: ...").
inline void expect_error_names_source(const Error& error) {
  const std::string& message = error.message;
  if (!message.starts_with(kSource) || message.size() <= kSource.size() + 2) {
    fail(fmt::format("error does not name the source: {}", message));
  }
}

inline std::filesystem::path scenarios_dir() { return FERRY_SCENARIOS_DIR; }

inline std::string read_scenario(const std::filesystem::path& relative) {
  std::ifstream in(scenarios_dir() / relative, std::ios::binary);
  if (!in) fail(fmt::format("cannot read scenario {}", relative.string()));
  std::ostringstream text;
  text << in.rdbuf();
  return std::move(text).str();
}

/// The options `ferry simulate` and `ferry compare` run with by default.
inline TrainingOptions cli_training_options() {
  TrainingOptions o;
  o.steps = 2;
  o.sim.check_hazards = true;
  o.sim.track_content = true;
  o.offload.min_bytes = Bytes(1024);
  o.offload.window_bytes = 512 * kMiB;
  o.offload.prefetch_bytes = 512 * kMiB;
  o.offload.host_cap = 1024 * kGiB;
  o.offload.trl_stash_count = 5;
  return o;
}

/// What `ferry compare` and `ferry simulate --checkpoint ... --pp 2` do with a model that
/// loaded and whose ops' roofline times on the device are within the format's bounds: every row of
/// compare, the checkpoint specs compare leaves out, the pipeline rows, and every report. Durations
/// come from the device's roofline, as in the CLI.
inline void simulate_model(Model model, const DeviceProfile& device) {
  if (const Status fits = check_roofline(model, device); !fits.ok()) {
    if (!fits.error().message.starts_with("ops[")) fail("roofline error names no op");
    return;
  }
  assign_roofline_durations(model, device);
  const TrainingOptions base = cli_training_options();
  std::vector<PolicyRow> rows = default_rows(base, model, device);
  rows.push_back(PolicyRow{"trl-seed", base});
  rows.back().options.offload.policy = Policy::TrlSeed;
  for (const char* spec : {"segments:2", "reentrant-segments:2", "every:2"}) {
    auto plan = parse_checkpoint_spec(spec, model);
    if (!plan) continue;
    rows.push_back(PolicyRow{spec, base});
    rows.back().options.checkpoint = std::move(plan).value();
  }
  if (has_static_capacity(model)) {
    for (const Policy policy : {Policy::None, Policy::Ferry}) {
      rows.push_back(PolicyRow{std::string(policy_name(policy)) + " + paged stash", base});
      rows.back().options.offload.policy = policy;
      rows.back().options.paged_stash.on = true;
    }
  }
  std::vector<RowResult> results;
  for (const PolicyRow& row : rows) results.push_back(run_row(model, device, row));
  (void)simulate_text(results.front(), model, device);
  (void)simulate_json(results.front(), model, device);
  (void)compare_text(results, model, device);
  (void)compare_json(results, model, device);
  const auto pipeline = pipeline_rows(check_model(model).value(), device, 2, 2);
  (void)pipeline_text(pipeline);
  (void)pipeline_json(pipeline);
}

}  // namespace ferry::sim::fuzz
