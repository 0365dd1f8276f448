// libFuzzer harness for the stream program format (ferry.program/1): parse as `ferry check`
// does (device profiles by name from the bundled scenarios, or inline), run it on the simulator
// with the hazard checker, and write every report.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ferry/sim/export/trace.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/report/check_report.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace fuzz = ferry::sim::fuzz;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto program = ferry::sim::parse_program(text, fuzz::kSource, fuzz::scenarios_dir() / "devices");
  if (!program) {
    fuzz::expect_error_names_source(program.error());
    return 0;
  }
  ferry::sim::SimOptions options;
  options.check_hazards = true;
  auto run = ferry::sim::run_program(program.value(), options);
  if (!run) return 0;  // misuse the simulator names (`ferry check` exits 2)
  (void)ferry::sim::summary_text(run.value(), fuzz::kSource);
  (void)ferry::sim::summary_json(run.value(), fuzz::kSource);
  (void)ferry::sim::chrome_trace(run.value().sim);
  return 0;
}
