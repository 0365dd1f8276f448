#include "run_options.hpp"

#include <fmt/format.h>

#include "command.hpp"
#include "ferry/sim/report/tables.hpp"

namespace ferry::cli {

sim::Target TargetFlags::target() const {
  return sim::Target{.model = {.name = model}, .device = device, .scenarios = scenarios};
}

CLI::Option* add_mesh_options(CLI::App* cmd, sim::MeshRequest& fsdp, TextFlags& text) {
  CLI::Option* ranks = cmd->add_option(
      "--fsdp", fsdp.ranks,
      "FSDP2 over N ranks (1..1000000): each layer and the root fully_shard'ed; figures are one "
      "rank's (docs/fsdp.md)");
  cmd->add_option("--nodes", fsdp.nodes,
                  "With --fsdp: nodes the ranks span, 1..1000000 (default: as few as the device's "
                  "gpus_per_node allow)");
  cmd->add_option(
      "--hsdp", fsdp.replicas,
      "With --fsdp: HSDP replica groups, 1..1000000 (shard within a group, all-reduce across)");
  cmd->add_option("--reshard-after-forward", text.reshard_after_forward,
                  "With --fsdp: true, false, or K (keep a 1/K shard after forward)")
      ->capture_default_str();
  cmd->add_option("--fsdp-impl", text.fsdp_impl,
                  "With --fsdp: fsdp2 (torch's fully_shard), or simple (torchtitan's SimpleFSDP: "
                  "the collectives' buffers from the compute stream's pool; docs/fsdp.md)")
      ->capture_default_str();
  cmd->add_option("--tp", fsdp.tp,
                  "Tensor parallelism over N GPUs a rank (1..1024, inside a node): each runs its "
                  "cut of the model, sequence parallel (docs/parallelism.md); 1: none")
      ->capture_default_str();
  cmd->add_option("--cp", fsdp.cp,
                  "With --fsdp: context parallelism over N GPUs a rank (1..1024): each holds 1/N "
                  "of the sequence, K and V all-gathered for attention, FSDP sharding over them "
                  "too (docs/parallelism.md); 1: none")
      ->capture_default_str();
  cmd->add_option("--ep", fsdp.ep,
                  "With --fsdp: expert parallelism over N GPUs of the shard group and their "
                  "tensor-parallel ones (1..1024, a multiple of --tp): each holds 1/N of a "
                  "mixture of experts' experts, the routed rows exchanged by all-to-alls "
                  "(docs/parallelism.md); 1: none")
      ->capture_default_str();
  cmd->add_option("--expert-capacity", fsdp.expert_capacity,
                  "With --ep: a static dispatcher's capacity factor F (1..1024), as CUDA-graphed "
                  "expert parallelism runs: each GPU's routed rows are allocated for F times a "
                  "balanced routing's, the experts computing the rows routed (docs/parallelism.md, "
                  "Static capacity and the paged stash); 0: none")
      ->capture_default_str();
  return ranks;
}

void add_allocator_option(CLI::App* cmd, TextFlags& text) {
  cmd->add_option("--allocator", text.allocator,
                  "The caching allocator's settings: default, or expandable "
                  "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; docs/allocators.md). "
                  "Default: the model file's \"allocator\", else default");
}

void add_target_options(CLI::App* cmd, TargetFlags& target) {
  cmd->add_option("--model", target.model, "Model preset or model JSON file")
      ->capture_default_str();
  cmd->add_option("--device", target.device, "Device profile name or JSON file")
      ->capture_default_str();
}

Status apply_text_flags(const TextFlags& text, sim::MeshRequest& fsdp,
                        std::optional<sim::AllocatorMode>& allocator) {
  auto reshard = sim::parse_reshard(text.reshard_after_forward);
  if (!reshard) return reshard.error();
  fsdp.reshard_after_forward = reshard.value();
  auto impl = sim::fsdp_impl(text.fsdp_impl);
  if (!impl) return impl.error();
  fsdp.impl = impl.value();
  if (text.allocator) {
    auto mode = sim::allocator_mode(*text.allocator);
    if (!mode) return mode.error();
    allocator = mode.value();
  }
  return Ok{};
}

Result<sim::RunKnobs> run_knobs(const RunArgs& args) {
  sim::RunKnobs k = args.run;
  k.prefetch = !args.no_prefetch;
  k.dedup = !args.no_dedup;
  k.early_stop = !args.no_early_stop;
  k.check = !args.no_checker;
  if (auto applied = apply_text_flags(args.text, k.mesh, k.allocator); !applied) {
    return applied.error();
  }
  return k;
}

void add_run_options(CLI::App* cmd, RunArgs& args, bool simulate) {
  sim::RunKnobs& a = args.run;
  sim::SimulateRequest& s = args.simulate;
  add_target_options(cmd, args.target);
  if (simulate) {
    cmd->add_option("--policy", s.policy, "none, trl, trl-seed or ferry")->capture_default_str();
    cmd->add_option("--trace", args.trace, "Write a Chrome/Perfetto trace JSON to FILE");
    cmd->add_option("--memory-snapshot", args.memory_snapshot,
                    "Write the device memory history to FILE as a PyTorch memory snapshot "
                    "pickle (pytorch.org/memory_viz)");
    cmd->add_option("--plan", args.plan, "Replay a plan file (ferry.plan/1) written by ferry plan");
    CLI::Option* trainer =
        cmd->add_option("--for", args.trainer,
                        "Run a trainer's own activation checkpointing: hf, torchtitan or megatron, "
                        "its settings from --trainer-config (docs/plan.md, \"A trainer's own "
                        "settings\"); nothing offloaded");
    cmd->add_option("--trainer-config", args.trainer_config,
                    "With --for: a file of the trainer's command-line flags, as ferry plan --for "
                    "writes them (--trainer-config there)")
        ->needs(trainer);
    trainer->needs("--trainer-config");
    cmd->add_option(
           "--checkpoint", s.checkpoint,
           "none, every:K, selective, op-sac (torchtitan's op-level selective), op-sac-all "
           "(the same, every matmul saved: torchtitan's graph trainer), segments:N or "
           "reentrant-segments:N")
        ->capture_default_str();
    cmd->add_option("--side-streams", s.side_streams,
                    "Work on a side compute stream: none, or layers L and ranges A-B, "
                    "recompute, all-reduce (comma-separated)")
        ->capture_default_str();
  }
  cmd->add_flag("--no-early-stop", args.no_early_stop, "Recompute whole checkpointed regions");
  cmd->add_flag("--set-to-none", a.set_to_none,
                "optimizer.zero_grad(set_to_none=True) between steps: each gradient allocated "
                "where backward first writes it and freed after the step (torch 2's default); "
                "without it gradients are kept from set-up on");
  cmd->add_flag("--paged-stash", a.paged_stash,
                "Megatron-Core's paged stash: saved tensors in static-capacity buffers "
                "(--expert-capacity) have their rows of data copied into pages of a device pool "
                "at the end of their layer's forward and back before its backward, the padded "
                "buffers freed between (docs/parallelism.md, Static capacity and the paged stash)");
  CLI::Option* fsdp = add_mesh_options(cmd, a.mesh, args.text);
  add_allocator_option(cmd, args.text);
  // Their bounds are the request's (Note [One check for both edges]).
  cmd->add_option("--devices", a.devices,
                  "Pipeline over N devices (--schedule), 1..64; 1: no pipeline")
      ->capture_default_str()
      ->excludes(fsdp);
  cmd->add_option("--micro-batches", a.micro_batches, "Pipeline micro-batches, 1..1024")
      ->capture_default_str();
  cmd->add_option("--schedule", a.schedule,
                  "Pipeline schedule: gpipe (torchgpipe), 1f1b, interleaved-1f1b or "
                  "interleaved-zero-bubble (torch's Schedule1F1B, ScheduleInterleaved1F1B, "
                  "ScheduleInterleavedZeroBubble)")
      ->capture_default_str();
  cmd->add_option("--virtual-stages", a.virtual_stages,
                  "Stages a device under interleaved-1f1b and interleaved-zero-bubble, 1..64")
      ->capture_default_str();
  if (simulate) {
    cmd->add_option("--pipeline-checkpoint", s.pipeline_checkpoint,
                    "Pipeline checkpoint mode: always, except_last or never (default except_last "
                    "under gpipe, never under torch's schedules)");
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
  cmd->add_flag("--no-prefetch", args.no_prefetch, "ferry: reload on demand only");
  cmd->add_flag("--no-dedup", args.no_dedup, "ferry: copy views sharing a storage separately");
  cmd->add_option("--horizon", s.horizon,
                  "ferry: bytes a forward may copy out before the rest stays on the device: "
                  "auto (what the link can hide, derived), none, or a byte count")
      ->capture_default_str();
  cmd->add_flag("--json", args.json, "Print the results as one JSON document");
  cmd->add_flag("--no-checker", args.no_checker, "Time only; skip hazard and content checks");
  cmd->add_option("--scenarios", args.target.scenarios,
                  "Folder with devices/ (bundled by default)");
}

int print_response(const sim::Response& response, bool json) {
  print(json ? sim::document_text(response.document) : response.text);
  return response.outcome == sim::Outcome::Ok ? 0 : kExitFailed;
}

}  // namespace ferry::cli
