#include "run_options.hpp"

#include <fmt/format.h>

namespace ferry::cli {

std::string fsdp_line(const Parallelism& p, const sim::DeviceProfile& device) {
  if (!p.on()) return {};
  const std::int32_t nodes = p.node_count(device.collectives.gpus_per_node);
  return fmt::format(
      "FSDP2 over {} ranks on {} node{}{}, reshard after forward: {}; every figure is one "
      "rank's (its pinned memory: its part of the node's)\n",
      p.ranks, nodes, nodes == 1 ? "" : "s",
      p.replicas > 1 ? fmt::format(", {} HSDP replica groups", p.replicas) : "",
      to_string(p.reshard_after_forward));
}

CLI::Option* add_fsdp_options(CLI::App* cmd, sim::FsdpSpec& spec) {
  CLI::Option* fsdp = cmd->add_option(
      "--fsdp", spec.ranks,
      "FSDP2 over N ranks (1..1000000): each layer and the root fully_shard'ed; figures are one "
      "rank's (docs/fsdp.md)");
  cmd->add_option("--nodes", spec.nodes,
                  "With --fsdp: nodes the ranks span, 1..1000000 (default: as few as the device's "
                  "gpus_per_node allow)");
  cmd->add_option(
      "--hsdp", spec.replicas,
      "With --fsdp: HSDP replica groups, 1..1000000 (shard within a group, all-reduce across)");
  cmd->add_option("--reshard-after-forward", spec.reshard_after_forward,
                  "With --fsdp: true, false, or K (keep a 1/K shard after forward)")
      ->capture_default_str();
  return fsdp;
}

void add_allocator_option(CLI::App* cmd, std::optional<std::string>& name) {
  cmd->add_option("--allocator", name,
                  "The caching allocator's settings: default, or expandable "
                  "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; docs/allocators.md). "
                  "Default: the model file's \"allocator\", else default");
}

void add_run_options(CLI::App* cmd, RunArgs& args, bool simulate) {
  sim::RunSpec& a = args.run;
  cmd->add_option("--model", args.model, "Model preset or model JSON file")->capture_default_str();
  cmd->add_option("--device", args.device, "Device profile name or JSON file")
      ->capture_default_str();
  if (simulate) {
    cmd->add_option("--policy", a.policy, "none, trl, trl-seed or ferry")->capture_default_str();
    cmd->add_option("--trace", args.trace, "Write a Chrome/Perfetto trace JSON to FILE");
    cmd->add_option("--memory-snapshot", args.memory_snapshot,
                    "Write the device memory history to FILE as a PyTorch memory snapshot "
                    "pickle (pytorch.org/memory_viz)");
    cmd->add_option("--plan", args.plan, "Replay a plan file (ferry.plan/1) written by ferry plan");
    cmd->add_option(
           "--checkpoint", a.checkpoint,
           "none, every:K, selective, op-sac (torchtitan's op-level selective), segments:N "
           "or reentrant-segments:N")
        ->capture_default_str();
    cmd->add_option("--side-streams", a.side_streams,
                    "Work on a side compute stream: none, or layers L and ranges A-B, "
                    "recompute, all-reduce (comma-separated)")
        ->capture_default_str();
  }
  cmd->add_flag("--no-early-stop", a.no_early_stop, "Recompute whole checkpointed regions");
  CLI::Option* fsdp = add_fsdp_options(cmd, a.fsdp);
  add_allocator_option(cmd, a.allocator);
  cmd->add_option("--devices", args.devices, "Pipeline over N devices (GPipe); 1: no pipeline")
      ->capture_default_str()
      ->check(CLI::Range(1, 64))
      ->excludes(fsdp);
  cmd->add_option("--micro-batches", args.micro_batches, "Pipeline micro-batches")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  if (simulate) {
    cmd->add_option("--pipeline-checkpoint", args.pipeline_checkpoint,
                    "Pipeline checkpoint mode: always, except_last or never")
        ->capture_default_str();
  }
  cmd->add_option("--min-bytes", a.min_bytes,
                  "Saved tensors smaller than this stay on the device (0..2^50)")
      ->capture_default_str();
  cmd->add_option("--window-mib", a.window_mib,
                  "ferry: forward window of offloads in flight (0..2^30)")
      ->capture_default_str();
  cmd->add_option("--prefetch-mib", a.prefetch_mib,
                  "ferry: reload budget ahead of demand (0..2^30)")
      ->capture_default_str();
  cmd->add_option("--host-cap-gib", a.host_cap_gib, "ferry: pinned host memory cap (0..2^20)")
      ->capture_default_str();
  cmd->add_option("--stash", a.stash, "trl: forward stash size in tensors (1..2^20)")
      ->capture_default_str();
  cmd->add_option("--steps", a.steps, "Training steps to simulate, 1..1000 (the last is reported)")
      ->capture_default_str();
  cmd->add_flag("--no-prefetch", a.no_prefetch, "ferry: reload on demand only");
  cmd->add_flag("--no-dedup", a.no_dedup, "ferry: copy views sharing a storage separately");
  cmd->add_option("--horizon", a.horizon,
                  "ferry: bytes a forward may copy out before the rest stays on the device: "
                  "auto (what the link can hide, derived), none, or a byte count")
      ->capture_default_str();
  cmd->add_flag("--json", args.json, "Print the results as one JSON document");
  cmd->add_flag("--no-checker", a.no_checker, "Time only; skip hazard and content checks");
  cmd->add_option("--scenarios", args.scenarios, "Folder with devices/ (bundled by default)");
}

}  // namespace ferry::cli
