#include "plan_command.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "ferry/sim/io/plan_json.hpp"
#include "snapshot_file.hpp"

namespace ferry::cli {

namespace {

constexpr int kExitFailed = 1;
constexpr int kExitBadInput = 2;

// Refuses an empty byte count: "--budget ''" is a mistake, not "no budget" (which is leaving the
// option out).
const CLI::Validator kByteCount(
    [](const std::string& text) {
      return text.find_first_not_of(" \t") == std::string::npos
                 ? std::string("empty; give a byte count such as 40GiB, or leave the option out")
                 : std::string();
    },
    "BYTES");

void print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

CLI::App* add_plan_command(CLI::App& app, PlanCommandArgs& a, std::string default_scenarios) {
  a.scenarios = std::move(default_scenarios);
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "The fastest keep / offload / recompute plan whose peak reserved memory fits a budget");
  cmd->add_option("--model", a.model, "Model preset or model JSON file")->capture_default_str();
  cmd->add_option("--device", a.device, "Device profile name or JSON file")->capture_default_str();
  cmd->add_option("--budget", a.budget,
                  "Device budget, peak reserved: 40GiB, \"40 GiB\", 40GB, 4e10 (bytes); default: "
                  "the device's memory")
      ->check(kByteCount);
  cmd->add_option("--sweep", a.sweep,
                  "Plan at N budgets from the floor to the no-offload peak (no --budget)")
      ->check(CLI::Range(2, 100));
  cmd->add_option("--plot", a.plot, "With --sweep: write the curve as an SVG plot to FILE");
  cmd->add_option("--host-budget", a.host_budget, "Pinned host memory budget, as --budget")
      ->check(kByteCount);
  cmd->add_option("--out", a.out, "Write the plan (ferry.plan/1 JSON) to FILE");
  cmd->add_option("--memory-snapshot", a.memory_snapshot,
                  "Write the plan's simulated run as a PyTorch memory snapshot (pickle) to FILE");
  cmd->add_option("--steps", a.steps, "Training steps per simulation (the last is measured)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  cmd->add_flag("--json", a.json, "Print the report as one JSON document");
  cmd->add_option("--scenarios", a.scenarios, "Folder with devices/ (bundled by default)");
  return cmd;
}

int run_plan_command(const PlanCommandArgs& args, const Loaders& loaders) {
  if (args.sweep > 0 && (!args.budget.empty() || !args.out.empty())) {
    fmt::print(stderr,
               "ferry plan: error: --sweep plans its own budgets; it takes no --budget "
               "or --out\n");
    return kExitBadInput;
  }
  if (args.sweep > 0 && !args.memory_snapshot.empty()) {
    fmt::print(stderr, "ferry plan: error: --memory-snapshot is of one plan: not with --sweep\n");
    return kExitBadInput;
  }
  if (const std::string why = args.memory_snapshot.empty() ? "" : unwritable(args.memory_snapshot);
      !why.empty()) {
    fmt::print(stderr, "ferry plan: error: --memory-snapshot: {}\n", why);
    return kExitBadInput;
  }
  if (args.sweep == 0 && !args.plot.empty()) {
    fmt::print(stderr, "ferry plan: error: --plot draws a sweep: give --sweep N\n");
    return kExitBadInput;
  }
  sim::PlannerOptions options;
  if (args.sweep == 0 && !args.budget.empty()) {
    auto budget = parse_bytes(args.budget, "--budget");
    if (!budget) {
      fmt::print(stderr, "ferry plan: error: {}\n", budget.error().message);
      return kExitBadInput;
    }
    options.budget = budget.value();
  }
  options.steps = args.steps;
  if (!args.host_budget.empty()) {
    auto host = parse_bytes(args.host_budget, "--host-budget");
    if (!host) {
      fmt::print(stderr, "ferry plan: error: {}\n", host.error().message);
      return kExitBadInput;
    }
    options.host_budget = host.value();
  }
  auto model = loaders.model(args.model);
  if (!model) {
    fmt::print(stderr, "ferry plan: error: {}\n", model.error().message);
    return kExitBadInput;
  }
  auto device = loaders.device(args.device, args.scenarios);
  if (!device) {
    fmt::print(stderr, "ferry plan: error: {}\n", device.error().message);
    return kExitBadInput;
  }
  if (auto fits = sim::check_roofline(model.value(), device.value()); !fits.ok()) {
    fmt::print(stderr, "ferry plan: error: {}: {}\n", args.model, fits.error().message);
    return kExitBadInput;
  }
  // No budget: the device's whole memory, the question "what is fastest that fits at all?".
  if (args.sweep == 0 && args.budget.empty()) options.budget = device.value().memory;
  sim::assign_roofline_durations(model.value(), device.value());
  if (args.sweep > 0) {
    const auto points = sim::plan_sweep(model.value(), device.value(), options, args.sweep,
                                        [](std::size_t i, std::size_t n, Bytes budget) {
                                          fmt::print(stderr, "planning {}/{}: budget {} ...\n",
                                                     i + 1, n, format_bytes(budget));
                                        });
    print(args.json ? sim::sweep_json(points, model.value(), device.value())
                    : sim::sweep_text(points, model.value(), device.value()));
    if (!args.plot.empty()) {
      std::ofstream file(args.plot, std::ios::binary);
      file << sim::sweep_svg(points, model.value(), device.value());
      if (!file) {
        fmt::print(stderr, "ferry plan: error: cannot write the plot to {}\n", args.plot);
        return kExitBadInput;
      }
      fmt::print(stderr, "plot written to {}\n", args.plot);
    }
    return 0;
  }
  auto outcome = sim::make_plan(model.value(), device.value(), options);
  if (!outcome) {
    fmt::print(stderr, "ferry plan: {}\n", outcome.error().message);
    return kExitFailed;
  }
  if (!args.out.empty()) {
    std::ofstream file(args.out, std::ios::binary);
    file << sim::plan_to_json(outcome.value().plan);
    if (!file) {
      fmt::print(stderr, "ferry plan: error: cannot write the plan to {}\n", args.out);
      return kExitBadInput;
    }
  }
  if (!args.memory_snapshot.empty()) {
    // The plan's checked run again, on the device as the planner checked it: its memory is the
    // budget.
    sim::DeviceProfile capped = device.value();
    capped.memory = std::min(capped.memory, options.budget);
    sim::TrainingOptions base;
    base.steps = args.steps;
    auto training = sim::plan_training_options(outcome.value().plan, model.value(), base);
    std::optional<sim::TrainingRun> run;
    if (training) {
      (void)sim::run_row(model.value(), capped, sim::PolicyRow{"plan", std::move(training).value()},
                         &run);
    }
    if (!run) {
      fmt::print(stderr, "ferry plan: error: --memory-snapshot: the plan's run did not start\n");
      return kExitFailed;
    }
    if (const int rc = write_memory_snapshot(run->sim, args.memory_snapshot, "plan", args.json)) {
      return rc;
    }
  }
  print(args.json ? sim::plan_report_json(outcome.value(), model.value(), device.value())
                  : sim::plan_text(outcome.value(), model.value(), device.value()));
  if (!args.out.empty() && !args.json) fmt::print(stderr, "plan written to {}\n", args.out);
  return 0;
}

int replay_plan_file(const std::string& path, const sim::Model& model,
                     const sim::DeviceProfile& device, const sim::TrainingOptions& base,
                     bool json) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    fmt::print(stderr, "ferry simulate: error: cannot read plan file {}\n", path);
    return kExitBadInput;
  }
  std::ostringstream text;
  text << in.rdbuf();
  auto plan = sim::parse_plan(text.str(), path);
  if (!plan) {
    fmt::print(stderr, "ferry simulate: error: {}\n", plan.error().message);
    return kExitBadInput;
  }
  auto row = sim::replay_plan(plan.value(), model, device, base);
  if (!row) {
    fmt::print(stderr, "ferry simulate: error: {}: {}\n", path, row.error().message);
    return kExitBadInput;
  }
  row.value().name = "plan " + path;
  print(json ? sim::simulate_json(row.value(), model, device)
             : sim::simulate_text(row.value(), model, device));
  return row.value().hazards == 0 && !row.value().failure ? 0 : kExitFailed;
}

}  // namespace ferry::cli
