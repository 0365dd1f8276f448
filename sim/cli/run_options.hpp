#pragma once
// The options `ferry simulate` and `ferry compare` share: the model, the device and the knobs of
// the scheduler core, the checkpoint plan and the simulator.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "ferry/result.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "io.hpp"

namespace ferry::cli {

struct RunArgs {
  std::string model = "llama3-8b-s8192";
  std::string device = "h100-sxm-pcie5";
  std::string policy = "ferry";
  std::string scenarios = default_scenarios();
  std::string trace;
  std::string memory_snapshot;
  std::string checkpoint = "none";
  std::string side_streams = "none";
  std::string plan;  // simulate --plan FILE
  std::int64_t min_bytes = 1024;
  std::int64_t window_mib = 512;
  std::int64_t prefetch_mib = 512;
  std::int64_t host_cap_gib = 1024;
  std::int32_t stash = 5;
  std::int32_t steps = 2;
  std::int32_t devices = 1;
  std::int32_t micro_batches = 4;
  std::string pipeline_checkpoint = "except_last";
  bool no_prefetch = false;
  bool no_dedup = false;
  std::string horizon = "auto";  // ferry: auto (derived), none, or a byte count
  bool no_early_stop = false;
  bool json = false;
  bool no_checker = false;
};

/// Adds the shared options to `cmd`; `simulate` adds those of one run (policy, checkpoint plan,
/// side streams, trace and snapshot files, a plan to replay).
void add_run_options(CLI::App* cmd, RunArgs& args, bool simulate);

/// The training options `args` ask for on `model`; the checkpoint plan of --checkpoint only
/// when `with_checkpoint` (compare runs its own). Errors name the option.
Result<sim::TrainingOptions> run_options(const RunArgs& args, const sim::Model& model,
                                         bool with_checkpoint);

}  // namespace ferry::cli
