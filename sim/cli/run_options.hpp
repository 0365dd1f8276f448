#pragma once
// The options `ferry simulate` and `ferry compare` share: the model, the device and the knobs of
// the scheduler core, the checkpoint plan and the simulator.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <string>

#include "ferry/sim/api/run_spec.hpp"
#include "io.hpp"

namespace ferry::cli {

struct RunArgs {
  std::string model = "llama3-8b-s8192";
  std::string device{sim::kDefaultDevice};
  std::string scenarios = default_scenarios();
  std::string trace;
  std::string memory_snapshot;
  std::string plan;  // simulate --plan FILE
  std::int32_t devices = 1;
  std::int32_t micro_batches = 4;
  std::string pipeline_checkpoint = "except_last";
  bool json = false;
  sim::RunSpec run;  // the run's own options, as `ferry.simulate` takes them too
};

/// Adds `--fsdp`, `--nodes`, `--hsdp` and `--reshard-after-forward` to `cmd`; returns `--fsdp`.
CLI::Option* add_fsdp_options(CLI::App* cmd, sim::FsdpSpec& spec);

/// Adds `--allocator default|expandable` to `cmd`, into `name` (checked by run_spec's
/// allocator_mode, as Python's `allocator=` is).
void add_allocator_option(CLI::App* cmd, std::optional<std::string>& name);

/// The line text reports end with under FSDP: the parallelism `p`, and that figures are one
/// rank's. Empty without FSDP.
[[nodiscard]] std::string fsdp_line(const Parallelism& p, const sim::DeviceProfile& device);

/// Adds the shared options to `cmd`; `simulate` adds those of one run (policy, checkpoint plan,
/// side streams, trace and snapshot files, a plan to replay).
void add_run_options(CLI::App* cmd, RunArgs& args, bool simulate);

}  // namespace ferry::cli
