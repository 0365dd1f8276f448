// Loads a stream program with ferry::sim, runs it on the simulated GPU and expects no hazard.
// Usage: ferry_consumer PROGRAM.json PROFILE_DIR
#include <cstdio>
#include <filesystem>

#include "ferry/result.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "ferry/units.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ferry_consumer PROGRAM.json PROFILE_DIR\n");
    return 2;
  }
  const ferry::Result<ferry::sim::Program> program =
      ferry::sim::load_program(std::filesystem::path(argv[1]), std::filesystem::path(argv[2]));
  if (!program) {
    std::fprintf(stderr, "consumer: %s\n", program.error().message.c_str());
    return 1;
  }
  ferry::Result<ferry::sim::ProgramRun> run = ferry::sim::run_program(program.value());
  if (!run) {
    std::fprintf(stderr, "consumer: %s\n", run.error().message.c_str());
    return 1;
  }
  const ferry::sim::Simulator& sim = run.value().sim;
  const ferry::SimTime makespan = sim.makespan();
  std::printf("consumer: %zu ops, makespan %lld ns, %zu hazards\n", run.value().issued,
              static_cast<long long>(makespan.ns()), sim.hazards().size());
  return sim.hazards().empty() && !run.value().failure ? 0 : 1;
}
