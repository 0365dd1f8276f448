// ferry: the command line. One file per command:
//   ferry check [PROGRAM.json] [--json] [--trace FILE] [--memory-snapshot FILE] [--scenarios DIR]
//                                                                          (check_command.cpp)
//   ferry simulate [--model M] [--device D] [--policy P] [knobs] [--json] [--trace FILE]
//                  [--memory-snapshot FILE] [--plan FILE]              (simulate_command.cpp)
//   ferry compare [--model M] [--device D] [--json]                     (compare_command.cpp)
//   ferry plan --budget B [--model M] [--device D] [--host-budget B] [--json] [--out FILE]
//                                                                          (plan_command.cpp)
//   ferry probe [--device cpu|cuda[:N]] [--out FILE] [...]: runs ferry-probe (probe_command.cpp)
//   ferry --commands: the commands and their summaries, as JSON (ferry.commands/1), for tools
// Exit codes: command.hpp. What they read and write: io.hpp.

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "command.hpp"
#include "ferry/json_quote.hpp"

namespace {

/// `ferry --commands`: {"format": "ferry.commands/1", "commands": [{"name", "summary"}, ...]},
/// in the order of --help, so that tools need not read the help text.
void print_commands(const CLI::App& app) {
  const std::vector<const CLI::App*> subcommands = app.get_subcommands({});
  std::string out = "{\n  \"format\": \"ferry.commands/1\",\n  \"commands\": [";
  for (std::size_t i = 0; i < subcommands.size(); ++i) {
    out += fmt::format("{}\n    {{\"name\": {}, \"summary\": {}}}", i == 0 ? "" : ",",
                       ferry::json_quote(subcommands[i]->get_name()),
                       ferry::json_quote(subcommands[i]->get_description()));
  }
  out += "\n  ]\n}\n";
  fmt::print("{}", out);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ferry::cli;
  // Every argument after "probe" is the probe's own (see exec_probe).
  if (argc >= 2 && std::string_view(argv[1]) == "probe") return exec_probe(argc - 2, argv + 2);
  CLI::App app{
      "ferry: offload and checkpoint scheduling, with a simulated GPU that proves "
      "stream schedules safe"};
  app.set_version_flag("--version", std::string{"ferry "} + FERRY_VERSION);
  app.require_subcommand(1);
  std::vector<std::unique_ptr<Command>> commands;
  commands.push_back(add_check_command(app));
  commands.push_back(add_simulate_command(app));
  commands.push_back(add_compare_command(app));
  commands.push_back(add_plan_command(app));
  // Listed in --help only: main() hands `ferry probe ...` to exec_probe before parsing.
  app.add_subcommand("probe", "Measure this device and write a device profile (runs ferry-probe)");
  // Listed in --help; answered before parsing, which asks for a subcommand.
  bool list_commands = false;
  app.add_flag("--commands", list_commands,
               "Print the commands and their summaries as JSON and exit");
  if (argc == 2 && std::string_view(argv[1]) == "--commands") {
    print_commands(app);
    return 0;
  }
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
    for (const auto& command : commands) {
      if (command->parsed()) return command->run();
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "ferry: internal error: {}\n", e.what());
    return kExitInternal;
  }
  return kExitBadInput;
}
