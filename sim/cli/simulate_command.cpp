// `ferry simulate`: training steps of a model under one offload policy and checkpoint plan, on
// one device or a GPipe pipeline; or, with --plan, a plan written by `ferry plan`.

#include <fmt/format.h>

#include <memory>
#include <optional>
#include <string>

#include "command.hpp"
#include "ferry/sim/export/trace.hpp"
#include "io.hpp"
#include "run_options.hpp"

namespace ferry::cli {
namespace {

class SimulateCommand final : public Command {
 public:
  explicit SimulateCommand(CLI::App* cmd) : Command(cmd) { add_run_options(cmd, a_, true); }

  [[nodiscard]] int run() const override;

 private:
  // Writes the kept run's trace and memory snapshot where asked; 0 or the exit code.
  [[nodiscard]] int write_files(const std::optional<sim::TrainingRun>& run) const;

  RunArgs a_;
};

int SimulateCommand::run() const {
  const auto refuse = [](const std::string& why) {
    fmt::print(stderr, "ferry simulate: error: {}\n", why);
    return kExitBadInput;
  };
  auto knobs = run_knobs(a_);
  if (!knobs) return refuse(knobs.error().message);
  sim::SimulateRequest request = a_.simulate;
  request.target = a_.target.target();
  request.run = knobs.value();
  request.text = !a_.json;
  if (!a_.plan.empty()) request.plan = a_.plan;
  if (!a_.trainer.empty()) {
    // The trainer's settings say the policy and the checkpointing.
    for (const char* flag : {"--policy", "--checkpoint", "--plan"}) {
      if (app()->count(flag) > 0) {
        return refuse(
            fmt::format("--for {} runs the trainer's own settings: not with {}", a_.trainer, flag));
      }
    }
    auto trainer = sim::parse_trainer(a_.trainer);
    if (!trainer) return refuse(trainer.error().message);
    auto flags = sim::read_input(a_.trainer_config, "trainer config");
    if (!flags) return refuse(flags.error().message);
    request.trainer = trainer.value();
    request.trainer_flags = std::move(flags).value();
    request.trainer_source = a_.trainer_config;
  }
  request.trace = !a_.trace.empty();
  request.memory_snapshot = !a_.memory_snapshot.empty();
  if (request.memory_snapshot && a_.plan.empty() && request.run.mesh.pp == 1) {
    if (const std::string why = unwritable(a_.memory_snapshot); !why.empty()) {
      return refuse("--memory-snapshot: " + why);
    }
  }
  auto response = sim::respond(request);
  if (!response) return refuse(response.error().message);
  if (const int rc = write_files(response.value().run)) return rc;
  return print_response(response.value(), a_.json);
}

int SimulateCommand::write_files(const std::optional<sim::TrainingRun>& run) const {
  // A replayed plan keeps no run: it writes neither file.
  if (!a_.plan.empty()) return 0;
  if (!a_.trace.empty()) {
    if (!run) {
      fmt::print(stderr, "ferry simulate: no trace written to {}: the run did not complete\n",
                 a_.trace);
    } else if (!write_output(a_.trace, sim::chrome_trace(run->sim))) {
      fmt::print(stderr, "ferry simulate: error: cannot write trace to {}\n", a_.trace);
      return kExitBadInput;
    }
  }
  if (!a_.memory_snapshot.empty()) {
    if (!run) {
      fmt::print(stderr,
                 "ferry simulate: no memory snapshot written to {}: the run did not start\n",
                 a_.memory_snapshot);
    } else if (const int rc =
                   write_memory_snapshot(run->sim, a_.memory_snapshot, "simulate", a_.json)) {
      return rc;
    }
  }
  return 0;
}

}  // namespace

std::unique_ptr<Command> add_simulate_command(CLI::App& app) {
  return std::make_unique<SimulateCommand>(app.add_subcommand(
      "simulate", "Simulate training steps of a model under one offload policy"));
}

}  // namespace ferry::cli
