#pragma once
// `ferry plan` and `ferry simulate --plan`: the command-line side of the planner.

#include <CLI/CLI.hpp>

#include <filesystem>
#include <functional>
#include <string>

#include "ferry/sim/analysis/compare.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/planner/sweep.hpp"

namespace ferry::cli {

/// How main() reads a model (preset or file) and a device profile (name or file).
struct Loaders {
  std::function<Result<sim::Model>(const std::string&)> model;
  std::function<Result<sim::DeviceProfile>(const std::string&, const std::filesystem::path&)>
      device;
};

struct PlanCommandArgs {
  std::string model = "llama3-8b-s8192";
  std::string device = "h100-sxm-pcie5";
  std::string budget;
  std::string host_budget;
  std::string out;
  std::string plot;             ///< --sweep: the SVG plot's file
  std::string memory_snapshot;  ///< the plan's run as a PyTorch memory snapshot
  std::string scenarios;
  std::int32_t steps = 2;
  std::int32_t sweep = 0;  ///< budgets of a sweep; 0: one plan at --budget
  bool json = false;
};

/// Adds the `plan` subcommand to `app`, filling `args`.
CLI::App* add_plan_command(CLI::App& app, PlanCommandArgs& args, std::string default_scenarios);

/// Runs `ferry plan`. Exit codes: 0 a plan, 1 the budget is infeasible, 2 bad input.
int run_plan_command(const PlanCommandArgs& args, const Loaders& loaders);

/// `ferry simulate --plan FILE`: replays the plan in FILE on `model` and `device` (durations
/// assigned) with `base`'s simulator options. Exit codes as simulate's.
int replay_plan_file(const std::string& path, const sim::Model& model,
                     const sim::DeviceProfile& device, const sim::TrainingOptions& base, bool json);

}  // namespace ferry::cli
