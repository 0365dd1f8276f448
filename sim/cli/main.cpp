// ferry: command-line entry point.
//   ferry check [PROGRAM.json] [--json] [--trace FILE] [--memory-snapshot FILE] [--scenarios DIR]
//   ferry simulate [--model M] [--device D] [--policy P] [knobs] [--json] [--trace FILE]
//                  [--memory-snapshot FILE]
//   ferry compare [--model M] [--device D] [--json]
//   ferry plan --budget B [--model M] [--device D] [--host-budget B] [--json] [--out FILE]
//   ferry probe [--device cpu|cuda[:N]] [--out FILE] [...]: runs ferry-probe (the real backend)
// Exit codes: 0 fine, 1 hazards found or the run failed (out of memory), 2 bad input or
// usage, 3 internal error; ferry probe: the probe's own, or 127 when there is no ferry-probe.

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include "ferry/sim/analysis/compare.hpp"
#include "ferry/sim/analysis/memory_snapshot.hpp"
#include "ferry/sim/analysis/report.hpp"
#include "ferry/sim/analysis/run_program.hpp"
#include "ferry/sim/analysis/trace.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "plan_command.hpp"
#include "snapshot_file.hpp"

namespace {

using ferry::cli::unwritable;
using ferry::cli::write_memory_snapshot;

constexpr int kExitHazards = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitInternal = 3;
constexpr int kExitNoProbe = 127;  // what a shell answers for a command it cannot find

// `ferry probe ARGS`: this process becomes ferry-probe (it links torch; this CLI does not), so
// the probe's output and exit code are its own. Looked for beside this executable (an
// install), then where the build put it, then on PATH.
int run_probe(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<std::string> candidates;
  std::error_code error;
  const fs::path self = fs::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back((self.parent_path() / "ferry-probe").string());
#ifdef FERRY_PROBE_PATH
  candidates.emplace_back(FERRY_PROBE_PATH);
#endif
  std::vector<char*> args = {const_cast<char*>("ferry-probe")};
  for (int i = 0; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  for (const std::string& path : candidates) {
    if (::access(path.c_str(), X_OK) == 0) {
      ::execv(path.c_str(), args.data());
      fmt::print(stderr, "ferry probe: error: cannot run {}: {}\n", path,
                 std::error_code(errno, std::generic_category()).message());
      return kExitNoProbe;
    }
  }
  ::execvp("ferry-probe", args.data());
  fmt::print(stderr,
             "ferry probe: error: ferry-probe was not found ({}, nor on PATH): the probe needs "
             "the LibTorch backend; build with -DFERRY_REAL=ON (target ferry-probe) or run "
             "python -m ferry probe\n",
             candidates.empty() ? std::string("no build path compiled in")
                                : fmt::format("looked for {}", fmt::join(candidates, ", ")));
  return kExitNoProbe;
}

struct CheckArgs {
  std::string program;
  std::string trace;
  std::string memory_snapshot;
  std::string scenarios = FERRY_DEFAULT_SCENARIOS_DIR;
  bool json = false;
  bool no_checker = false;
};

int run_check(const CheckArgs& args) {
  namespace fs = std::filesystem;
  const fs::path scenarios(args.scenarios);
  const fs::path program_path =
      args.program.empty() ? scenarios / "programs" / "offload_step.json" : fs::path(args.program);
  auto program = ferry::sim::load_program(program_path, scenarios / "devices");
  if (!program) {
    fmt::print(stderr, "ferry check: error: {}\n", program.error().message);
    return kExitBadInput;
  }
  if (const std::string why = args.memory_snapshot.empty() ? "" : unwritable(args.memory_snapshot);
      !why.empty()) {
    fmt::print(stderr, "ferry check: error: --memory-snapshot: {}\n", why);
    return kExitBadInput;
  }
  ferry::sim::SimOptions options;
  options.check_hazards = !args.no_checker;
  ferry::sim::ChromeTrace trace;
  auto run =
      ferry::sim::run_program(program.value(), options, {}, args.trace.empty() ? nullptr : &trace);
  if (!run) {
    fmt::print(stderr, "ferry check: error: {}: {}\n", program_path.string(), run.error().message);
    return kExitBadInput;
  }
  // Before the summary: a run the snapshot cannot describe is bad input, with no summary.
  if (!args.memory_snapshot.empty()) {
    if (const int rc =
            write_memory_snapshot(run.value().sim, args.memory_snapshot, "check", args.json)) {
      return rc;
    }
  }
  const std::string source = program_path.string();
  const std::string out = args.json ? ferry::sim::summary_json(run.value(), source)
                                    : ferry::sim::summary_text(run.value(), source);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  if (!args.trace.empty()) {
    std::ofstream file(args.trace, std::ios::binary);
    const std::string json = trace.json(run.value().sim);
    file.write(json.data(), static_cast<std::streamsize>(json.size()));
    if (!file) {
      fmt::print(stderr, "ferry check: error: cannot write trace to {}\n", args.trace);
      return kExitBadInput;
    }
    if (!args.json) fmt::print(stderr, "trace written to {}\n", args.trace);
  }
  const bool clean = run.value().sim.hazards().empty() && !run.value().failure;
  return clean ? 0 : kExitHazards;
}

struct PlanArgs {
  std::string model = "llama3-8b-s8192";
  std::string device = "h100-sxm-pcie5";
  std::string policy = "ferry";
  std::string scenarios = FERRY_DEFAULT_SCENARIOS_DIR;
  std::string trace;
  std::string memory_snapshot;
  std::string checkpoint = "none";
  std::string side_streams = "none";
  std::string plan;  // simulate --plan FILE
  std::int64_t min_bytes = 1024;
  std::int64_t window_mib = 512;
  std::int64_t prefetch_mib = 512;
  std::int64_t host_cap_gib = 1024;
  std::int32_t stash = 5;
  std::int32_t steps = 2;
  std::int32_t devices = 1;
  std::int32_t micro_batches = 4;
  std::string pipeline_checkpoint = "except_last";
  bool no_prefetch = false;
  bool no_dedup = false;
  std::string horizon = "auto";  // ferry: auto (derived), none, or a byte count
  bool no_early_stop = false;
  bool json = false;
  bool no_checker = false;
};

// A preset name, or a path to a model JSON file.
ferry::Result<ferry::sim::Model> load_model(const std::string& spec) {
  if (spec.ends_with(".json")) {
    std::ifstream in(spec, std::ios::binary);
    if (!in) return ferry::Error{fmt::format("cannot read model file {}", spec)};
    std::ostringstream text;
    text << in.rdbuf();
    return ferry::sim::parse_model(text.str(), spec);
  }
  return ferry::sim::model_preset(spec);
}

// A bundled profile name, or a path to a profile JSON file.
ferry::Result<ferry::sim::DeviceProfile> load_device(const std::string& spec,
                                                     const std::filesystem::path& scenarios) {
  if (spec.ends_with(".json")) {
    std::ifstream in(spec, std::ios::binary);
    if (!in) return ferry::Error{fmt::format("cannot read device file {}", spec)};
    std::ostringstream text;
    text << in.rdbuf();
    return ferry::sim::parse_device_profile(text.str(), spec);
  }
  return ferry::sim::load_device_profile(scenarios / "devices", spec);
}

ferry::sim::TrainingOptions training_options(const PlanArgs& args) {
  ferry::sim::TrainingOptions o;
  o.steps = args.steps;
  o.sim.check_hazards = !args.no_checker;
  o.sim.track_content = !args.no_checker;
  o.offload.min_bytes = ferry::Bytes(args.min_bytes);
  o.offload.window_bytes = args.window_mib * ferry::kMiB;
  o.offload.prefetch_bytes = args.prefetch_mib * ferry::kMiB;
  o.offload.host_cap = args.host_cap_gib * ferry::kGiB;
  o.offload.trl_stash_count = args.stash;
  o.offload.prefetch = !args.no_prefetch;
  o.offload.dedup = !args.no_dedup;
  return o;
}

int run_pipeline_cli(const PlanArgs& args, const ferry::sim::Model& model,
                     const ferry::sim::DeviceProfile& device,
                     const ferry::sim::TrainingOptions& base) {
  auto mode = ferry::sim::parse_checkpoint_mode(args.pipeline_checkpoint);
  if (!mode) {
    fmt::print(stderr, "ferry: error: --pipeline-checkpoint: {}\n", mode.error().message);
    return kExitBadInput;
  }
  ferry::sim::PipelineOptions o;
  o.devices = args.devices;
  o.micro_batches = args.micro_batches;
  o.checkpoint = mode.value();
  o.sim = base.sim;
  o.offload = base.offload;
  if (auto policy = ferry::parse_policy(args.policy)) {
    o.offload.policy = *policy;
  } else {
    fmt::print(stderr,
               "ferry simulate: error: unknown policy \"{}\" (none, trl, trl-seed, ferry)\n",
               args.policy);
    return kExitBadInput;
  }
  const auto row = ferry::sim::run_pipeline_row(model, device, ferry::sim::pipeline_row_name(o), o);
  if (row.failure && row.step_time.ns() == 0) {
    fmt::print(stderr, "ferry simulate: error: {}\n", row.failure->message);
    return kExitBadInput;
  }
  const std::string out = args.json ? "{\"format\": \"ferry.pipeline/1\", \"rows\": " +
                                          ferry::sim::pipeline_json({row}) + "}\n"
                                    : ferry::sim::pipeline_text({row});
  std::fwrite(out.data(), 1, out.size(), stdout);
  return row.hazards == 0 && !row.failure ? 0 : kExitHazards;
}

int run_plan(const PlanArgs& args, bool compare) {
  auto model = load_model(args.model);
  if (!model) {
    fmt::print(stderr, "ferry: error: {}\n", model.error().message);
    return kExitBadInput;
  }
  auto device = load_device(args.device, args.scenarios);
  if (!device) {
    fmt::print(stderr, "ferry: error: {}\n", device.error().message);
    return kExitBadInput;
  }
  if (auto fits = ferry::sim::check_roofline(model.value(), device.value()); !fits.ok()) {
    fmt::print(stderr, "ferry: error: {}: {}\n", args.model, fits.error().message);
    return kExitBadInput;
  }
  ferry::sim::assign_roofline_durations(model.value(), device.value());
  ferry::sim::TrainingOptions base = training_options(args);
  if (!compare) {
    auto plan = ferry::sim::parse_checkpoint_spec(args.checkpoint, model.value());
    if (!plan) {
      fmt::print(stderr, "ferry: error: --checkpoint: {}\n", plan.error().message);
      return kExitBadInput;
    }
    base.checkpoint = std::move(plan).value();
  }
  if (args.no_early_stop) base.checkpoint.global_early_stop = false;
  auto side = ferry::sim::parse_side_streams(args.side_streams);
  if (!side) {
    fmt::print(stderr, "ferry: error: --side-streams: {}\n", side.error().message);
    return kExitBadInput;
  }
  base.side = std::move(side).value();
  if (args.horizon == "none") {
    base.offload.horizon_bytes = ferry::Bytes(std::numeric_limits<std::int64_t>::max());
  } else if (args.horizon != "auto") {
    auto horizon = ferry::parse_bytes(args.horizon, "--horizon");
    if (!horizon) {
      fmt::print(stderr, "ferry: error: {} (or auto, none)\n", horizon.error().message);
      return kExitBadInput;
    }
    base.offload.horizon_bytes = horizon.value();
  }
  if (!args.plan.empty()) {
    return ferry::cli::replay_plan_file(args.plan, model.value(), device.value(), base, args.json);
  }
  if (args.devices > 1 && !compare) {
    if (base.side.any()) {
      fmt::print(stderr,
                 "ferry simulate: error: --side-streams applies to a single-device run; a "
                 "pipeline (--devices {}) runs one compute stream per device\n",
                 args.devices);
      return kExitBadInput;
    }
    if (!args.trace.empty()) {
      // The trace draws one single-device run; a pipeline's would be silently missing.
      fmt::print(stderr,
                 "ferry simulate: error: --trace draws a single-device run; a pipeline "
                 "(--devices {}) has no trace yet\n",
                 args.devices);
      return kExitBadInput;
    }
    if (!args.memory_snapshot.empty()) {
      fmt::print(stderr,
                 "ferry simulate: error: --memory-snapshot replays a single-device run; a "
                 "pipeline (--devices {}) has no memory snapshot yet\n",
                 args.devices);
      return kExitBadInput;
    }
    return run_pipeline_cli(args, model.value(), device.value(), base);
  }
  std::string out;
  bool clean = true;
  if (compare) {
    std::vector<ferry::sim::RowResult> rows;
    for (const auto& row : ferry::sim::default_rows(base, model.value(), device.value())) {
      if (!args.json) fmt::print(stderr, "simulating {} ...\n", row.name);
      rows.push_back(ferry::sim::run_row(model.value(), device.value(), row));
      clean = clean && rows.back().hazards == 0;
    }
    out = args.json ? ferry::sim::compare_json(rows, model.value(), device.value())
                    : ferry::sim::compare_text(rows, model.value(), device.value());
    if (args.devices > 1) {
      if (!args.json) fmt::print(stderr, "simulating pipelines ...\n");
      const auto prows = ferry::sim::pipeline_rows(model.value(), device.value(), args.devices,
                                                   args.micro_batches);
      for (const auto& p : prows) clean = clean && p.hazards == 0;
      if (args.json) {
        // One document: the compare object with a "pipeline" array before its closing brace.
        out.erase(out.find_last_of('}'));
        out += ",\n\"pipeline\": " + ferry::sim::pipeline_json(prows) + "\n}\n";
      } else {
        out += "\n" + ferry::sim::pipeline_text(prows);
      }
    }
  } else {
    ferry::sim::PolicyRow row{args.policy, base};
    if (auto policy = ferry::parse_policy(args.policy)) {
      row.options.offload.policy = *policy;
      if (!row.options.offload.horizon_bytes) {
        row.options.offload.horizon_bytes =
            ferry::sim::offload_horizon(model.value(), device.value(), row.options);
      }
    } else {
      fmt::print(stderr,
                 "ferry simulate: error: unknown policy \"{}\" (none, trl, trl-seed, ferry)\n",
                 args.policy);
      return kExitBadInput;
    }
    if (const std::string why =
            args.memory_snapshot.empty() ? "" : unwritable(args.memory_snapshot);
        !why.empty()) {
      fmt::print(stderr, "ferry simulate: error: --memory-snapshot: {}\n", why);
      return kExitBadInput;
    }
    std::optional<ferry::sim::TrainingRun> run;
    const bool keep = !args.trace.empty() || !args.memory_snapshot.empty();
    const auto result =
        ferry::sim::run_row(model.value(), device.value(), row, keep ? &run : nullptr);
    clean = result.hazards == 0 && !result.failure;
    out = args.json ? ferry::sim::simulate_json(result, model.value(), device.value())
                    : ferry::sim::simulate_text(result, model.value(), device.value());
    if (!args.trace.empty()) {
      if (run) {
        std::ofstream file(args.trace, std::ios::binary);
        file << ferry::sim::chrome_trace(run->sim);
        if (!file) {
          fmt::print(stderr, "ferry simulate: error: cannot write trace to {}\n", args.trace);
          return kExitBadInput;
        }
      } else {
        fmt::print(stderr, "ferry simulate: no trace written to {}: the run did not complete\n",
                   args.trace);
      }
    }
    if (!args.memory_snapshot.empty()) {
      if (!run) {
        fmt::print(stderr,
                   "ferry simulate: no memory snapshot written to {}: the run did not "
                   "start\n",
                   args.memory_snapshot);
      } else if (const int rc =
                     write_memory_snapshot(run->sim, args.memory_snapshot, "simulate", args.json)) {
        return rc;
      }
    }
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return clean ? 0 : kExitHazards;
}

void add_plan_options(CLI::App* cmd, PlanArgs& a, bool with_policy) {
  cmd->add_option("--model", a.model, "Model preset or model JSON file")->capture_default_str();
  cmd->add_option("--device", a.device, "Device profile name or JSON file")->capture_default_str();
  if (with_policy) {
    cmd->add_option("--policy", a.policy, "none, trl, trl-seed or ferry")->capture_default_str();
    cmd->add_option("--trace", a.trace, "Write a Chrome/Perfetto trace JSON to FILE");
    cmd->add_option("--memory-snapshot", a.memory_snapshot,
                    "Write the device memory history to FILE as a PyTorch memory snapshot "
                    "pickle (pytorch.org/memory_viz)");
    cmd->add_option("--plan", a.plan, "Replay a plan file (ferry.plan/1) written by ferry plan");
    cmd->add_option("--checkpoint", a.checkpoint,
                    "none, every:K, selective, segments:N or reentrant-segments:N")
        ->capture_default_str();
    cmd->add_option("--side-streams", a.side_streams,
                    "Work on a side compute stream: none, or layers L and ranges A-B, "
                    "recompute, all-reduce (comma-separated)")
        ->capture_default_str();
  }
  cmd->add_flag("--no-early-stop", a.no_early_stop, "Recompute whole checkpointed regions");
  cmd->add_option("--devices", a.devices, "Pipeline over N devices (GPipe); 1: no pipeline")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--micro-batches", a.micro_batches, "Pipeline micro-batches")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  if (with_policy) {
    cmd->add_option("--pipeline-checkpoint", a.pipeline_checkpoint,
                    "Pipeline checkpoint mode: always, except_last or never")
        ->capture_default_str();
  }
  cmd->add_option("--min-bytes", a.min_bytes, "Saved tensors smaller than this stay on the device")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 50));
  cmd->add_option("--window-mib", a.window_mib, "ferry: forward window of offloads in flight")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  cmd->add_option("--prefetch-mib", a.prefetch_mib, "ferry: reload budget ahead of demand")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  cmd->add_option("--host-cap-gib", a.host_cap_gib, "ferry: pinned host memory cap")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 20));
  cmd->add_option("--stash", a.stash, "trl: forward stash size in tensors")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--steps", a.steps, "Training steps to simulate (the last is reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--no-prefetch", a.no_prefetch, "ferry: reload on demand only");
  cmd->add_flag("--no-dedup", a.no_dedup, "ferry: copy views sharing a storage separately");
  cmd->add_option("--horizon", a.horizon,
                  "ferry: bytes a forward may copy out before the rest stays on the device: "
                  "auto (what the link can hide, derived), none, or a byte count")
      ->capture_default_str();
  cmd->add_flag("--json", a.json, "Print the results as one JSON document");
  cmd->add_flag("--no-checker", a.no_checker, "Time only; skip hazard and content checks");
  cmd->add_option("--scenarios", a.scenarios, "Folder with devices/ (bundled by default)");
}

}  // namespace

int main(int argc, char** argv) {
  // Every argument after "probe" is the probe's own (see run_probe).
  if (argc >= 2 && std::string_view(argv[1]) == "probe") return run_probe(argc - 2, argv + 2);
  CLI::App app{
      "ferry: offload and checkpoint scheduling, with a simulated GPU that proves "
      "stream schedules safe"};
  app.set_version_flag("--version", std::string{"ferry "} + FERRY_VERSION);
  app.require_subcommand(1);
  CheckArgs check;
  CLI::App* check_cmd = app.add_subcommand(
      "check", "Simulate a stream program; report hazards, makespan and peak memory");
  check_cmd->add_option("program", check.program,
                        "Stream program JSON (default: the bundled offload_step example)");
  check_cmd->add_flag("--json", check.json, "Print the summary as one JSON document");
  check_cmd->add_option("--trace", check.trace, "Write a Chrome/Perfetto trace JSON to FILE");
  check_cmd->add_option("--memory-snapshot", check.memory_snapshot,
                        "Write the device memory history to FILE as a PyTorch memory snapshot "
                        "pickle (pytorch.org/memory_viz)");
  check_cmd->add_option("--scenarios", check.scenarios,
                        "Folder with devices/ and programs/ (bundled scenarios by default)");
  check_cmd->add_flag("--no-checker", check.no_checker, "Time only; skip hazard checking");
  PlanArgs simulate;
  CLI::App* simulate_cmd =
      app.add_subcommand("simulate", "Simulate training steps of a model under one offload policy");
  add_plan_options(simulate_cmd, simulate, true);
  PlanArgs compare;
  CLI::App* compare_cmd = app.add_subcommand(
      "compare", "Compare offload policies on a model: time and memory as ratios to none");
  add_plan_options(compare_cmd, compare, false);
  ferry::cli::PlanCommandArgs plan;
  CLI::App* plan_cmd = ferry::cli::add_plan_command(app, plan, FERRY_DEFAULT_SCENARIOS_DIR);
  // Listed in --help only: main() hands `ferry probe ...` to run_probe before parsing.
  app.add_subcommand("probe", "Measure this device and write a device profile (runs ferry-probe)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitBadInput;
  }
  try {
    if (check_cmd->parsed()) return run_check(check);
    if (simulate_cmd->parsed()) return run_plan(simulate, false);
    if (compare_cmd->parsed()) return run_plan(compare, true);
    if (plan_cmd->parsed()) {
      return ferry::cli::run_plan_command(plan, {load_model, load_device});
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "ferry: internal error: {}\n", e.what());
    return kExitInternal;
  }
  return kExitBadInput;
}
