// `ferry plan`: the fastest keep / offload / recompute plan that fits a budget, or with --sweep
// the curve of plans over budgets.

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "command.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/units.hpp"
#include "io.hpp"
#include "run_options.hpp"

namespace ferry::cli {
namespace {

// The planner's progress as one line on a terminal, redrawn at most every tenth of a second
// and cleared when the command is done: the budget of a sweep, the search's stage, the plans
// it asked about (of how many, where the stage knows), and the fastest plan that fits so far.
class ProgressLine {
 public:
  ProgressLine() = default;
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;
  ~ProgressLine() { clear(); }

  void budget(std::size_t i, std::size_t n, Bytes budget) {
    budget_ = fmt::format("budget {}/{} ({}): ", i + 1, n, format_bytes(budget));
    shown_at_ = {};
  }

  void step(const sim::PlanProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (now - shown_at_ < std::chrono::milliseconds(100)) return;
    shown_at_ = now;
    std::string line = fmt::format("ferry plan: {}{}", budget_, p.stage);
    if (p.done > 0 || p.total > 0) {
      line += p.total > 0 ? fmt::format(" {}/{}", p.done, p.total) : fmt::format(" {}", p.done);
    }
    if (p.best) line += fmt::format(", best {}", format_time(*p.best));
    fmt::print(stderr, "\r\033[K{}", line);
    std::fflush(stderr);
    shown_ = true;
  }

  void clear() {
    if (!shown_) return;
    fmt::print(stderr, "\r\033[K");
    std::fflush(stderr);
    shown_ = false;
  }

 private:
  std::string budget_;
  std::chrono::steady_clock::time_point shown_at_{};
  bool shown_ = false;
};

struct PlanArgs {
  TargetFlags target;
  std::string budget;
  std::string host_budget;
  std::string out;
  std::string plot;                   // --sweep: the SVG plot's file
  std::string memory_snapshot;        // the plan's run as a PyTorch memory snapshot
  std::string trainer;                // --for T
  std::string trainer_config;         // --for: write the trainer's best flags to FILE
  std::optional<std::string> margin;  // none: sim::kDefaultPlanMarginPermille
  bool json = false;
  bool quiet = false;  // no progress on stderr
  TextFlags text;
  sim::PlanRequest request;  // the numbers, bound to their flags as they are
};

class PlanCommand final : public Command {
 public:
  explicit PlanCommand(CLI::App* cmd);

  [[nodiscard]] int run() const override;

 private:
  // Options that do not go together, or a file that cannot be written: why, or empty.
  [[nodiscard]] std::string misuse() const;
  // The request the flags give, their text read as `ferry.plan` reads its arguments.
  [[nodiscard]] Result<sim::PlanRequest> request() const;

  PlanArgs a_;
};

PlanCommand::PlanCommand(CLI::App* cmd) : Command(cmd) {
  sim::PlanRequest& r = a_.request;
  add_target_options(cmd, a_.target);
  cmd->add_option("--budget", a_.budget,
                  "Device budget, peak reserved: 40GiB, \"40 GiB\", 40GB, 4e10 (bytes); default: "
                  "the device's memory");
  cmd->add_option("--sweep", r.sweep,
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
  cmd->add_option("--steps", r.steps,
                  "Training steps per simulation, 1..100 (the last is measured)")
      ->capture_default_str();
  CLI::Option* trainer = cmd->add_option(
      "--for", a_.trainer,
      "Also the fastest setting of a trainer's own activation checkpointing that fits: hf, "
      "torchtitan or megatron, printed as its configuration (docs/plan.md, \"A trainer's own "
      "settings\")");
  cmd->add_option("--trainer-config", a_.trainer_config,
                  "With --for: write the trainer's best setting as its command-line flags to "
                  "FILE (what ferry simulate --for reads)")
      ->needs(trainer);
  cmd->add_flag("--json", a_.json, "Print the report as one JSON document");
  cmd->add_option("--jobs,-j", r.jobs,
                  "Simulations run at once, 1..1024; default (0): one per hardware thread (the "
                  "plan is the same for any count)");
  cmd->add_flag("--quiet,-q", a_.quiet, "No progress on stderr");
  cmd->add_option("--scenarios", a_.target.scenarios, "Folder with devices/ (bundled by default)");
  add_mesh_options(cmd, r.mesh, a_.text);
  add_allocator_option(cmd, a_.text);
  add_stages_option(cmd, r.mesh,
                    "Plan a pipeline of N stages, {bounds}, every stage within the budget "
                    "(docs/plan.md, \"A pipeline\"); 1: no pipeline");
  // Their bounds are the request's (Note [One check for both edges]).
  cmd->add_option("--micro-batches", r.micro_batches, "Pipeline micro-batches, 1..1024")
      ->capture_default_str();
  cmd->add_option("--schedule", r.schedule,
                  "Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble, zbv "
                  "(torchtitan's ZBVZeroBubble), or auto (each, the fastest that fits); default: "
                  "1f1b (torchtitan's)");
  cmd->add_option("--virtual-stages", r.virtual_stages,
                  "Stages a device under interleaved-1f1b and interleaved-zero-bubble, 1..64; "
                  "2 under zbv")
      ->capture_default_str();
  cmd->add_option("--split", r.split,
                  "How the model is cut into stages: layers (its transformer layers evenly, the "
                  "input and output one layer each: torchtitan's default), balanced (by forward "
                  "time), or the layer each stage after the first starts at, e.g. 8,16,24")
      ->capture_default_str();
}

std::string PlanCommand::misuse() const {
  if (a_.request.jobs < 0 || a_.request.jobs > 1024) {
    return fmt::format("--jobs: {} is not in 0..1024 (0: one per hardware thread)",
                       a_.request.jobs);
  }
  if (a_.request.sweep > 0 && (!a_.budget.empty() || !a_.out.empty() || a_.margin)) {
    return "--sweep plans its own budgets; it takes no --budget, --margin or --out";
  }
  if (a_.request.sweep > 0 && !a_.memory_snapshot.empty()) {
    return "--memory-snapshot is of one plan: not with --sweep";
  }
  if (const std::string why = a_.memory_snapshot.empty() ? "" : unwritable(a_.memory_snapshot);
      !why.empty()) {
    return "--memory-snapshot: " + why;
  }
  if (a_.request.sweep == 0 && !a_.plot.empty()) return "--plot draws a sweep: give --sweep N";
  if (a_.request.mesh.pp > 1 && !a_.out.empty()) {
    return "--out writes a ferry.plan/1 plan of one device or rank; a pipeline's plan is its "
           "configuration, in the report (--json)";
  }
  if (const std::string why = a_.trainer_config.empty() ? "" : unwritable(a_.trainer_config);
      !why.empty()) {
    return "--trainer-config: " + why;
  }
  return {};
}

Result<sim::PlanRequest> PlanCommand::request() const {
  sim::PlanRequest r = a_.request;
  r.target = a_.target.target();
  // A given option has a value: CLI11 refuses `--budget=`.
  if (!a_.budget.empty()) {
    auto budget = sim::byte_count(a_.budget, "--budget");
    if (!budget) return budget.error();
    r.budget = budget.value();
  }
  if (!a_.host_budget.empty()) {
    auto host = sim::byte_count(a_.host_budget, "--host-budget");
    if (!host) return host.error();
    r.host_budget = host.value();
  }
  if (auto applied = apply_text_flags(a_.text, r.mesh, r.allocator); !applied) {
    return applied.error();
  }
  if (a_.margin) {
    auto margin = sim::margin_permille(*a_.margin);
    if (!margin) return margin.error();
    r.margin_permille = margin.value();
  }
  if (!a_.trainer.empty()) {
    auto trainer = sim::parse_trainer(a_.trainer);
    if (!trainer) return trainer.error();
    r.trainer = trainer.value();
  }
  r.memory_snapshot = !a_.memory_snapshot.empty();
  r.plot = !a_.plot.empty();
  r.text = !a_.json;
  return r;
}

int PlanCommand::run() const {
  if (const std::string why = misuse(); !why.empty()) {
    fmt::print(stderr, "ferry plan: error: {}\n", why);
    return kExitBadInput;
  }
  auto asked = request();
  // Progress on stderr: on a terminal one line the planner redraws; elsewhere a sweep's line
  // per budget.
  ProgressLine line;
  if (asked && !a_.quiet) {
    sim::PlanRequest& r = asked.value();
    if (isatty(fileno(stderr)) != 0) {
      r.search_progress = [&line](const sim::PlanProgress& p) { line.step(p); };
      if (r.sweep > 0) {
        r.progress = [&line](std::size_t i, std::size_t n, Bytes budget) {
          line.budget(i, n, budget);
        };
      }
    } else if (r.sweep > 0) {
      r.progress = [](std::size_t i, std::size_t n, Bytes budget) {
        fmt::print(stderr, "planning {}/{}: budget {} ...\n", i + 1, n, format_bytes(budget));
      };
    }
  }
  auto response = asked ? sim::respond(asked.value()) : Result<sim::Response>(asked.error());
  line.clear();
  if (!response) {
    fmt::print(stderr, "ferry plan: error: {}\n", response.error().message);
    return kExitBadInput;
  }
  const sim::Response& r = response.value();
  if (r.outcome == sim::Outcome::Refused) {
    fmt::print(stderr, "ferry plan: {}\n", r.refusal);
    if (a_.json) print(sim::document_text(r.document));
    return kExitFailed;
  }
  if (a_.request.sweep > 0) {
    print(a_.json ? sim::document_text(r.document) : r.text);
    if (a_.plot.empty()) return 0;
    if (!write_output(a_.plot, r.plot)) {
      fmt::print(stderr, "ferry plan: error: cannot write the plot to {}\n", a_.plot);
      return kExitBadInput;
    }
    fmt::print(stderr, "plot written to {}\n", a_.plot);
    return 0;
  }
  // The report's "plan" member is the plan's document, made once (plan_report_json).
  if (!a_.out.empty() && !write_output(a_.out, sim::plan_document_text(r.document.at("plan")))) {
    fmt::print(stderr, "ferry plan: error: cannot write the plan to {}\n", a_.out);
    return kExitBadInput;
  }
  if (!a_.memory_snapshot.empty()) {
    // The planner's own checked run of the plan, kept (PlannerOptions::keep_run).
    if (!r.plan->run) {
      fmt::print(stderr, "ferry plan: error: --memory-snapshot: the plan's run did not start\n");
      return kExitFailed;
    }
    if (const int rc =
            write_memory_snapshot(r.plan->run->sim, a_.memory_snapshot, "plan", a_.json)) {
      return rc;
    }
  }
  if (!a_.trainer_config.empty() && !write_output(a_.trainer_config, r.trainer_flags + "\n")) {
    fmt::print(stderr, "ferry plan: error: cannot write the trainer's flags to {}\n",
               a_.trainer_config);
    return kExitBadInput;
  }
  print(a_.json ? sim::document_text(r.document) : r.text);
  if (!a_.out.empty() && !a_.json) fmt::print(stderr, "plan written to {}\n", a_.out);
  return 0;
}

}  // namespace

std::unique_ptr<Command> add_plan_command(CLI::App& app) {
  return std::make_unique<PlanCommand>(app.add_subcommand(
      "plan",
      "The fastest keep / offload / recompute plan whose peak reserved memory fits a budget"));
}

}  // namespace ferry::cli
