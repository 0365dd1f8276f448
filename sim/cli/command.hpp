#pragma once
// The subcommands of `ferry`, one file each; main.cpp adds them to the app and runs the one the
// command line names.
//
// Exit codes, shared by every command: 0 fine; 1 hazards found, the run failed (out of memory)
// or no plan fits the budget; 2 bad input or usage; 3 internal error; `ferry probe`: the
// probe's own, or 127 when there is no ferry-probe.

#include <CLI/CLI.hpp>

#include <memory>

namespace ferry::cli {

inline constexpr int kExitFailed = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitInternal = 3;
inline constexpr int kExitNoProbe = 127;  // what a shell answers for a command it cannot find

/// A subcommand: its options are bound to its own arguments when it is added to the app.
class Command {
 public:
  explicit Command(CLI::App* app) : app_(app) {}
  Command(const Command&) = delete;
  Command& operator=(const Command&) = delete;
  virtual ~Command() = default;

  /// Whether the command line named this command.
  [[nodiscard]] bool parsed() const { return app_->parsed(); }
  /// Runs the command on the parsed arguments; the exit code.
  [[nodiscard]] virtual int run() const = 0;

 protected:
  /// The subcommand, as parsed.
  [[nodiscard]] const CLI::App* app() const { return app_; }

 private:
  CLI::App* app_;
};

// Each adds its subcommand to `app` (in the order of `ferry --help`).
std::unique_ptr<Command> add_check_command(CLI::App& app);
std::unique_ptr<Command> add_simulate_command(CLI::App& app);
std::unique_ptr<Command> add_compare_command(CLI::App& app);
std::unique_ptr<Command> add_plan_command(CLI::App& app);

/// `ferry probe ARGS`: this process becomes ferry-probe, the real backend's probe (it links
/// torch; this CLI does not), so the probe's output and exit code are its own. Returns only
/// when it cannot: with kExitNoProbe.
int exec_probe(int argc, char** argv);

}  // namespace ferry::cli
