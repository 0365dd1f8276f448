// `ferry check [PROGRAM.json]`: simulates a stream program and reports its hazards, makespan and
// peak memory.

#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <string>

#include "command.hpp"
#include "ferry/sim/export/trace.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/report/check_report.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "io.hpp"

namespace ferry::cli {
namespace {

struct CheckArgs {
  std::string program;
  std::string trace;
  std::string memory_snapshot;
  std::string scenarios = default_scenarios();
  bool json = false;
  bool no_checker = false;
};

class CheckCommand final : public Command {
 public:
  explicit CheckCommand(CLI::App* cmd) : Command(cmd) {
    cmd->add_option("program", a_.program,
                    "Stream program JSON (default: the bundled offload_step example)");
    cmd->add_flag("--json", a_.json, "Print the summary as one JSON document");
    cmd->add_option("--trace", a_.trace, "Write a Chrome/Perfetto trace JSON to FILE");
    cmd->add_option("--memory-snapshot", a_.memory_snapshot,
                    "Write the device memory history to FILE as a PyTorch memory snapshot "
                    "pickle (pytorch.org/memory_viz)");
    cmd->add_option("--scenarios", a_.scenarios,
                    "Folder with devices/ and programs/ (bundled scenarios by default)");
    cmd->add_flag("--no-checker", a_.no_checker, "Time only; skip hazard checking");
  }

  [[nodiscard]] int run() const override;

 private:
  CheckArgs a_;
};

int CheckCommand::run() const {
  namespace fs = std::filesystem;
  const fs::path scenarios(a_.scenarios);
  const fs::path program_path =
      a_.program.empty() ? scenarios / "programs" / "offload_step.json" : fs::path(a_.program);
  auto program = sim::load_program(program_path, scenarios / "devices");
  if (!program) {
    fmt::print(stderr, "ferry check: error: {}\n", program.error().message);
    return kExitBadInput;
  }
  if (const std::string why = a_.memory_snapshot.empty() ? "" : unwritable(a_.memory_snapshot);
      !why.empty()) {
    fmt::print(stderr, "ferry check: error: --memory-snapshot: {}\n", why);
    return kExitBadInput;
  }
  sim::SimOptions options;
  options.check_hazards = !a_.no_checker;
  options.record_allocator = !a_.memory_snapshot.empty();
  sim::ChromeTrace trace;
  auto run = sim::run_program(program.value(), options, {}, a_.trace.empty() ? nullptr : &trace);
  if (!run) {
    fmt::print(stderr, "ferry check: error: {}: {}\n", program_path.string(), run.error().message);
    return kExitBadInput;
  }
  // Before the summary: a run the snapshot cannot describe is bad input, with no summary.
  if (!a_.memory_snapshot.empty()) {
    if (const int rc =
            write_memory_snapshot(run.value().sim, a_.memory_snapshot, "check", a_.json)) {
      return rc;
    }
  }
  const std::string source = program_path.string();
  print(a_.json ? sim::summary_json(run.value(), source) : sim::summary_text(run.value(), source));
  if (!a_.trace.empty()) {
    if (!write_output(a_.trace, trace.json(run.value().sim))) {
      fmt::print(stderr, "ferry check: error: cannot write trace to {}\n", a_.trace);
      return kExitBadInput;
    }
    if (!a_.json) fmt::print(stderr, "trace written to {}\n", a_.trace);
  }
  const bool clean = run.value().sim.hazards().empty() && !run.value().failure;
  return clean ? 0 : kExitFailed;
}

}  // namespace

std::unique_ptr<Command> add_check_command(CLI::App& app) {
  return std::make_unique<CheckCommand>(app.add_subcommand(
      "check", "Simulate a stream program; report hazards, makespan and peak memory"));
}

}  // namespace ferry::cli
