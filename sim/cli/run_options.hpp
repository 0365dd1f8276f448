#pragma once
// The flags `ferry simulate`, `compare` and `plan` share, and how their text becomes a request's
// values (sim/api/requests.hpp): the model, the device, FSDP2, the allocator, and the knobs of
// the scheduler core, the checkpoint plan and the simulator.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <string>

#include "ferry/sim/api/requests.hpp"
#include "io.hpp"

namespace ferry::cli {

/// The flags as the command line gives them, where a request's value has a text form:
/// `--reshard-after-forward true|false|K`, `--fsdp-impl fsdp2|simple`, `--reduce-dtype
/// param|float32` and
/// `--allocator default|expandable`.
struct TextFlags {
  std::string reshard_after_forward = "true";
  std::string fsdp_impl = "fsdp2";
  std::string reduce_dtype = "param";
  std::optional<std::string> allocator;
};

/// The model, the device and the scenarios folder as `--model`, `--device` and `--scenarios`
/// give them.
struct TargetFlags {
  std::string model = "llama3-8b-s8192";
  std::string device{sim::kDefaultDevice};
  std::string scenarios = default_scenarios();
  /// The request's target.
  [[nodiscard]] sim::Target target() const;
};

struct RunArgs {
  TargetFlags target;
  std::string trace;
  std::string memory_snapshot;
  std::string plan;            // simulate --plan FILE
  std::string trainer;         // simulate --for T
  std::string trainer_config;  // simulate --trainer-config FILE (the trainer's flags)
  bool json = false;
  bool no_prefetch = false;
  bool no_dedup = false;
  bool no_early_stop = false;
  bool no_checker = false;
  bool set_to_none = false;  // zero_grad(set_to_none=True) asked for
  bool keep_grads = false;   // zero_grad(set_to_none=False)
  TextFlags text;
  sim::RunKnobs run;              // the numbers, bound to their flags as they are
  sim::SimulateRequest simulate;  // simulate's own options (policy, checkpoint plan, ...)
};

/// Adds `--fsdp`, `--nodes`, `--hsdp`, `--reshard-after-forward` and `--fsdp-impl` to `cmd`;
/// returns `--fsdp`.
CLI::Option* add_mesh_options(CLI::App* cmd, sim::MeshRequest& fsdp, TextFlags& text);
/// `--pp` (kMeshFields' row), its help `help` with "{bounds}" the row's.
void add_stages_option(CLI::App* cmd, sim::MeshRequest& mesh, std::string help);

/// Adds `--allocator default|expandable` to `cmd`.
void add_allocator_option(CLI::App* cmd, TextFlags& text);

/// Adds `--model`, `--device` and `--scenarios` to `cmd`.
void add_target_options(CLI::App* cmd, TargetFlags& target);

/// `fsdp` and `allocator` with the values of `text`, or the error that names the flag.
Status apply_text_flags(const TextFlags& text, sim::MeshRequest& fsdp,
                        std::optional<sim::AllocatorMode>& allocator);

/// The knobs the flags give (the switches and text flags applied to `args.run`).
Result<sim::RunKnobs> run_knobs(const RunArgs& args);

/// Adds the shared options to `cmd`; `simulate` adds those of one run (policy, checkpoint plan,
/// side streams, trace and snapshot files, a plan to replay).
void add_run_options(CLI::App* cmd, RunArgs& args, bool simulate);

/// Prints `response` as `--json` asks (its document) or its text; its exit code.
int print_response(const sim::Response& response, bool json);

}  // namespace ferry::cli
