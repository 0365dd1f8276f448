// `ferry compare`: the fixed configurations (no offload, checkpointing, each policy) of a model
// side by side, and with --pp N the pipeline configurations too.

#include <fmt/format.h>

#include <memory>
#include <string>

#include "command.hpp"
#include "io.hpp"
#include "run_options.hpp"

namespace ferry::cli {
namespace {

class CompareCommand final : public Command {
 public:
  explicit CompareCommand(CLI::App* cmd) : Command(cmd) { add_run_options(cmd, a_, false); }

  [[nodiscard]] int run() const override;

 private:
  RunArgs a_;
};

int CompareCommand::run() const {
  const auto refuse = [](const Error& error) {
    fmt::print(stderr, "ferry compare: error: {}\n", error.message);
    return kExitBadInput;
  };
  auto knobs = run_knobs(a_);
  if (!knobs) return refuse(knobs.error());
  sim::CompareRequest request{.target = a_.target.target(), .run = knobs.value()};
  request.text = !a_.json;
  if (!a_.json) {
    request.progress = [](const std::string& name) {
      fmt::print(stderr, "simulating {} ...\n", name);
    };
  }
  auto response = sim::respond(request);
  if (!response) return refuse(response.error());
  return print_response(response.value(), a_.json);
}

}  // namespace

std::unique_ptr<Command> add_compare_command(CLI::App& app) {
  return std::make_unique<CompareCommand>(app.add_subcommand(
      "compare", "Compare offload policies on a model: time and memory as ratios to none"));
}

}  // namespace ferry::cli
