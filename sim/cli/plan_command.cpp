// `ferry plan`: the fastest keep / offload / recompute plan that fits a budget, or with --sweep
// the curve of plans over budgets.

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "command.hpp"
#include "ferry/sim/api/load.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/planner/lower.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/planner/sweep.hpp"
#include "ferry/sim/runs/measure.hpp"
#include "ferry/units.hpp"
#include "io.hpp"
#include "run_options.hpp"

namespace ferry::cli {
namespace {

struct PlanArgs {
  std::string model = "llama3-8b-s8192";
  std::string device{sim::kDefaultDevice};
  std::string budget;
  std::string host_budget;
  std::string out;
  std::string plot;             // --sweep: the SVG plot's file
  std::string memory_snapshot;  // the plan's run as a PyTorch memory snapshot
  std::string scenarios = default_scenarios();
  std::int32_t steps = 2;
  std::int32_t sweep = 0;  // budgets of a sweep; 0: one plan at --budget
  bool json = false;
  sim::FsdpSpec fsdp;
  std::optional<std::string> allocator;
  std::optional<std::string> margin;  // none: sim::kDefaultPlanMarginPermille
};

class PlanCommand final : public Command {
 public:
  explicit PlanCommand(CLI::App* cmd);

  [[nodiscard]] int run() const override;

 private:
  // Options that do not go together, or a file that cannot be written: why, or empty.
  [[nodiscard]] std::string misuse() const;
  // The budgets and steps of the command line (the device budget is left to the caller), with
  // the parallelism `fsdp` and the allocator `allocator`, checked as `ferry.plan` checks them.
  [[nodiscard]] Result<sim::PlannerOptions> planner_options(
      const sim::FsdpSpec& fsdp, const std::optional<std::string>& allocator) const;
  [[nodiscard]] int sweep(const sim::Workload& w, const sim::PlannerOptions& options) const;
  [[nodiscard]] int plan(const sim::Workload& w, const sim::PlannerOptions& options) const;
  // The plan's checked run again, written as a memory snapshot; 0 or the exit code.
  [[nodiscard]] int write_snapshot(const sim::Workload& w, const sim::PlannerOptions& options,
                                   const Plan& plan) const;

  PlanArgs a_;
};

PlanCommand::PlanCommand(CLI::App* cmd) : Command(cmd) {
  cmd->add_option("--model", a_.model, "Model preset or model JSON file")->capture_default_str();
  cmd->add_option("--device", a_.device, "Device profile name or JSON file")->capture_default_str();
  cmd->add_option("--budget", a_.budget,
                  "Device budget, peak reserved: 40GiB, \"40 GiB\", 40GB, 4e10 (bytes); default: "
                  "the device's memory");
  cmd->add_option("--sweep", a_.sweep,
                  "Plan at N budgets from the floor to the no-offload peak (no --budget)")
      ->check(CLI::Range(2, 100));
  cmd->add_option("--plot", a_.plot, "With --sweep: write the curve as an SVG plot to FILE");
  cmd->add_option("--host-budget", a_.host_budget, "Pinned host memory budget, as --budget");
  cmd->add_option("--margin", a_.margin,
                  fmt::format("Plan to the budget less this percent of it, 0..50 (docs/plan.md, "
                              "\"What fits promises\"); default: {}",
                              sim::margin_text(sim::kDefaultPlanMarginPermille)));
  cmd->add_option("--out", a_.out, "Write the plan (ferry.plan/1 JSON) to FILE");
  cmd->add_option("--memory-snapshot", a_.memory_snapshot,
                  "Write the plan's simulated run as a PyTorch memory snapshot (pickle) to FILE");
  cmd->add_option("--steps", a_.steps,
                  "Training steps per simulation, 1..100 (the last is measured)")
      ->capture_default_str();
  cmd->add_flag("--json", a_.json, "Print the report as one JSON document");
  cmd->add_option("--scenarios", a_.scenarios, "Folder with devices/ (bundled by default)");
  add_fsdp_options(cmd, a_.fsdp);
  add_allocator_option(cmd, a_.allocator);
}

std::string PlanCommand::misuse() const {
  if (a_.sweep > 0 && (!a_.budget.empty() || !a_.out.empty() || a_.margin)) {
    return "--sweep plans its own budgets; it takes no --budget, --margin or --out";
  }
  if (a_.sweep > 0 && !a_.memory_snapshot.empty()) {
    return "--memory-snapshot is of one plan: not with --sweep";
  }
  if (const std::string why = a_.memory_snapshot.empty() ? "" : unwritable(a_.memory_snapshot);
      !why.empty()) {
    return "--memory-snapshot: " + why;
  }
  if (a_.sweep == 0 && !a_.plot.empty()) return "--plot draws a sweep: give --sweep N";
  return {};
}

Result<sim::PlannerOptions> PlanCommand::planner_options(
    const sim::FsdpSpec& fsdp, const std::optional<std::string>& allocator) const {
  // A given option has a value: CLI11 refuses `--budget=`.
  const auto given = [](const std::string& text) {
    return text.empty() ? std::nullopt : std::optional<std::string>(text);
  };
  return sim::planner_options(
      sim::PlanSpec{.budget = a_.sweep == 0 ? given(a_.budget) : std::nullopt,
                    .host_budget = given(a_.host_budget),
                    .steps = a_.steps,
                    .fsdp = fsdp,
                    .allocator = allocator,
                    .margin = a_.margin});
}

int PlanCommand::run() const {
  if (const std::string why = misuse(); !why.empty()) {
    fmt::print(stderr, "ferry plan: error: {}\n", why);
    return kExitBadInput;
  }
  // The flags, checked before any file is read.
  auto options = planner_options(a_.fsdp, a_.allocator);
  if (!options) {
    fmt::print(stderr, "ferry plan: error: {}\n", options.error().message);
    return kExitBadInput;
  }
  auto workload = sim::load_workload(a_.model, a_.device, a_.scenarios);
  if (!workload) {
    fmt::print(stderr, "ferry plan: error: {}\n", workload.error().message);
    return kExitBadInput;
  }
  sim::FsdpSpec fsdp = a_.fsdp;
  sim::adopt_model_parallelism(fsdp, workload.value().model);
  std::optional<std::string> allocator = a_.allocator;
  sim::adopt_model_allocator(allocator, workload.value().model);
  options = planner_options(fsdp, allocator);
  if (!options) {
    fmt::print(stderr, "ferry plan: error: {}: parallelism: {}\n", a_.model,
               options.error().message);
    return kExitBadInput;
  }
  if (auto valid = sim::validate_parallelism(options.value().fsdp.parallelism,
                                             workload.value().device, sim::kFsdpFlags);
      !valid) {
    fmt::print(stderr, "ferry plan: error: {}\n", valid.error().message);
    return kExitBadInput;
  }
  if (a_.sweep > 0) {
    // A sweep's budgets are the simulator's peaks, from the floor up: no margin below them.
    options.value().margin_permille = 0;
    return sweep(workload.value(), options.value());
  }
  // No budget: the device's whole memory, the question "what is fastest that fits at all?".
  if (a_.budget.empty()) options.value().budget = workload.value().device.memory;
  return plan(workload.value(), options.value());
}

int PlanCommand::sweep(const sim::Workload& w, const sim::PlannerOptions& options) const {
  const Parallelism& parallelism = options.fsdp.parallelism;
  const auto points = sim::plan_sweep(
      w.model, w.device, options, a_.sweep, [](std::size_t i, std::size_t n, Bytes budget) {
        fmt::print(stderr, "planning {}/{}: budget {} ...\n", i + 1, n, format_bytes(budget));
      });
  print(a_.json
            ? sim::with_fsdp_json(sim::sweep_json(points, w.model, w.device), parallelism, w.device)
            : sim::sweep_text(points, w.model, w.device) + fsdp_line(parallelism, w.device));
  if (!a_.plot.empty()) {
    if (!write_output(a_.plot, sim::sweep_svg(points, w.model, w.device))) {
      fmt::print(stderr, "ferry plan: error: cannot write the plot to {}\n", a_.plot);
      return kExitBadInput;
    }
    fmt::print(stderr, "plot written to {}\n", a_.plot);
  }
  return 0;
}

int PlanCommand::plan(const sim::Workload& w, const sim::PlannerOptions& options) const {
  const Parallelism& parallelism = options.fsdp.parallelism;
  auto outcome = sim::make_plan(w.model, w.device, options);
  if (!outcome) {
    fmt::print(stderr, "ferry plan: {}\n", outcome.error().message);
    return kExitFailed;
  }
  if (!a_.out.empty() && !write_output(a_.out, sim::plan_to_json(outcome.value().plan))) {
    fmt::print(stderr, "ferry plan: error: cannot write the plan to {}\n", a_.out);
    return kExitBadInput;
  }
  if (!a_.memory_snapshot.empty()) {
    if (const int rc = write_snapshot(w, options, outcome.value().plan)) return rc;
  }
  print(a_.json ? sim::with_fsdp_json(sim::plan_report_json(outcome.value(), w.model, w.device),
                                      parallelism, w.device)
                : sim::plan_text(outcome.value(), w.model, w.device) +
                      fsdp_line(parallelism, w.device));
  if (!a_.out.empty() && !a_.json) fmt::print(stderr, "plan written to {}\n", a_.out);
  return 0;
}

int PlanCommand::write_snapshot(const sim::Workload& w, const sim::PlannerOptions& options,
                                const Plan& plan) const {
  // On the device as the planner checked the plan: its memory is the budget less the margin.
  sim::DeviceProfile capped = w.device;
  capped.memory =
      std::min(capped.memory, sim::budget_less_margin(options.budget, options.margin_permille));
  sim::TrainingOptions base;
  base.steps = a_.steps;
  base.fsdp = options.fsdp;
  base.sim.record_allocator = true;
  base.sim.allocator = options.allocator;
  auto training = sim::plan_training_options(plan, w.model, base);
  std::optional<sim::TrainingRun> run;
  if (training) {
    (void)sim::run_row(w.model, capped, sim::PolicyRow{"plan", std::move(training).value()}, &run);
  }
  if (!run) {
    fmt::print(stderr, "ferry plan: error: --memory-snapshot: the plan's run did not start\n");
    return kExitFailed;
  }
  return write_memory_snapshot(run->sim, a_.memory_snapshot, "plan", a_.json);
}

}  // namespace

std::unique_ptr<Command> add_plan_command(CLI::App& app) {
  return std::make_unique<PlanCommand>(app.add_subcommand(
      "plan",
      "The fastest keep / offload / recompute plan whose peak reserved memory fits a budget"));
}

}  // namespace ferry::cli
