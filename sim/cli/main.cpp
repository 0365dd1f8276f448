// ferry: command-line entry point.
//   ferry check [PROGRAM.json] [--json] [--trace FILE] [--devices-dir DIR]
// Exit codes: 0 no hazards, 1 hazards found or the program failed (out of memory),
// 2 bad input or usage, 3 internal error.

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>

#include "ferry/sim/program_json.hpp"
#include "ferry/sim/report.hpp"
#include "ferry/sim/run_program.hpp"

namespace {

constexpr int kExitHazards = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitInternal = 3;

struct CheckArgs {
  std::string program;
  std::string trace;
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
  ferry::sim::SimOptions options;
  options.check_hazards = !args.no_checker;
  auto run = ferry::sim::run_program(program.value(), options);
  if (!run) {
    fmt::print(stderr, "ferry check: error: {}: {}\n", program_path.string(), run.error().message);
    return kExitBadInput;
  }
  const std::string source = program_path.string();
  const std::string out = args.json ? ferry::sim::summary_json(run.value(), source)
                                    : ferry::sim::summary_text(run.value(), source);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  if (!args.trace.empty()) {
    std::ofstream file(args.trace, std::ios::binary);
    const std::string trace = ferry::sim::chrome_trace(run.value().sim);
    file.write(trace.data(), static_cast<std::streamsize>(trace.size()));
    if (!file) {
      fmt::print(stderr, "ferry check: error: cannot write trace to {}\n", args.trace);
      return kExitBadInput;
    }
    if (!args.json) fmt::print(stderr, "trace written to {}\n", args.trace);
  }
  const bool clean = run.value().sim.hazards().empty() && !run.value().failure;
  return clean ? 0 : kExitHazards;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry: offload and checkpoint scheduling, with a simulated GPU that proves "
               "stream schedules safe"};
  app.require_subcommand(1);
  CheckArgs check;
  CLI::App* check_cmd = app.add_subcommand(
      "check", "Simulate a stream program; report hazards, makespan and peak memory");
  check_cmd->add_option("program", check.program,
                        "Stream program JSON (default: the bundled offload_step example)");
  check_cmd->add_flag("--json", check.json, "Print the summary as one JSON document");
  check_cmd->add_option("--trace", check.trace, "Write a Chrome/Perfetto trace JSON to FILE");
  check_cmd->add_option("--scenarios", check.scenarios,
                        "Folder with devices/ and programs/ (bundled scenarios by default)");
  check_cmd->add_flag("--no-checker", check.no_checker, "Time only; skip hazard checking");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitBadInput;
  }
  try {
    if (check_cmd->parsed()) return run_check(check);
  } catch (const std::exception& e) {
    fmt::print(stderr, "ferry: internal error: {}\n", e.what());
    return kExitInternal;
  }
  return kExitBadInput;
}
