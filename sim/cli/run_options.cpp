#include "run_options.hpp"

#include <fmt/format.h>

#include <limits>
#include <utility>

#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/units.hpp"

namespace ferry::cli {

void add_run_options(CLI::App* cmd, RunArgs& a, bool simulate) {
  cmd->add_option("--model", a.model, "Model preset or model JSON file")->capture_default_str();
  cmd->add_option("--device", a.device, "Device profile name or JSON file")->capture_default_str();
  if (simulate) {
    cmd->add_option("--policy", a.policy, "none, trl, trl-seed or ferry")->capture_default_str();
    cmd->add_option("--trace", a.trace, "Write a Chrome/Perfetto trace JSON to FILE");
    cmd->add_option("--memory-snapshot", a.memory_snapshot,
                    "Write the device memory history to FILE as a PyTorch memory snapshot "
                    "pickle (pytorch.org/memory_viz)");
    cmd->add_option("--plan", a.plan, "Replay a plan file (ferry.plan/1) written by ferry plan");
    cmd->add_option("--checkpoint", a.checkpoint,
                    "none, every:K, selective, segments:N or reentrant-segments:N")
        ->capture_default_str();
    cmd->add_option("--side-streams", a.side_streams,
                    "Work on a side compute stream: none, or layers L and ranges A-B, "
                    "recompute, all-reduce (comma-separated)")
        ->capture_default_str();
  }
  cmd->add_flag("--no-early-stop", a.no_early_stop, "Recompute whole checkpointed regions");
  cmd->add_option("--devices", a.devices, "Pipeline over N devices (GPipe); 1: no pipeline")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--micro-batches", a.micro_batches, "Pipeline micro-batches")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  if (simulate) {
    cmd->add_option("--pipeline-checkpoint", a.pipeline_checkpoint,
                    "Pipeline checkpoint mode: always, except_last or never")
        ->capture_default_str();
  }
  cmd->add_option("--min-bytes", a.min_bytes, "Saved tensors smaller than this stay on the device")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 50));
  cmd->add_option("--window-mib", a.window_mib, "ferry: forward window of offloads in flight")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  cmd->add_option("--prefetch-mib", a.prefetch_mib, "ferry: reload budget ahead of demand")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  cmd->add_option("--host-cap-gib", a.host_cap_gib, "ferry: pinned host memory cap")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 20));
  cmd->add_option("--stash", a.stash, "trl: forward stash size in tensors")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--steps", a.steps, "Training steps to simulate (the last is reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--no-prefetch", a.no_prefetch, "ferry: reload on demand only");
  cmd->add_flag("--no-dedup", a.no_dedup, "ferry: copy views sharing a storage separately");
  cmd->add_option("--horizon", a.horizon,
                  "ferry: bytes a forward may copy out before the rest stays on the device: "
                  "auto (what the link can hide, derived), none, or a byte count")
      ->capture_default_str();
  cmd->add_flag("--json", a.json, "Print the results as one JSON document");
  cmd->add_flag("--no-checker", a.no_checker, "Time only; skip hazard and content checks");
  cmd->add_option("--scenarios", a.scenarios, "Folder with devices/ (bundled by default)");
}

Result<sim::TrainingOptions> run_options(const RunArgs& args, const sim::Model& model,
                                         bool with_checkpoint) {
  sim::TrainingOptions o;
  o.steps = args.steps;
  o.sim.check_hazards = !args.no_checker;
  o.sim.track_content = !args.no_checker;
  o.offload.min_bytes = Bytes(args.min_bytes);
  o.offload.window_bytes = args.window_mib * kMiB;
  o.offload.prefetch_bytes = args.prefetch_mib * kMiB;
  o.offload.host_cap = args.host_cap_gib * kGiB;
  o.offload.trl_stash_count = args.stash;
  o.offload.prefetch = !args.no_prefetch;
  o.offload.dedup = !args.no_dedup;
  if (with_checkpoint) {
    auto plan = sim::parse_checkpoint_spec(args.checkpoint, model);
    if (!plan) return Error{fmt::format("--checkpoint: {}", plan.error().message)};
    o.checkpoint = std::move(plan).value();
  }
  if (args.no_early_stop) o.checkpoint.global_early_stop = false;
  auto side = sim::parse_side_streams(args.side_streams);
  if (!side) return Error{fmt::format("--side-streams: {}", side.error().message)};
  o.side = std::move(side).value();
  if (args.horizon == "none") {
    o.offload.horizon_bytes = Bytes(std::numeric_limits<std::int64_t>::max());
  } else if (args.horizon != "auto") {
    auto horizon = parse_bytes(args.horizon, "--horizon");
    if (!horizon) return Error{fmt::format("{} (or auto, none)", horizon.error().message)};
    o.offload.horizon_bytes = horizon.value();
  }
  return o;
}

}  // namespace ferry::cli
