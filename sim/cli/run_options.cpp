#include "run_options.hpp"

#include <fmt/format.h>

#include <string>
#include <string_view>
#include <utility>

#include "command.hpp"
#include "ferry/offload/options.hpp"
#include "ferry/sim/report/tables.hpp"

namespace ferry::cli {

sim::Target TargetFlags::target() const {
  return sim::Target{.model = {.name = model}, .device = device, .scenarios = scenarios};
}

namespace {

// `field`'s flag (kMeshFields).
std::string mesh_flag(sim::MeshField field) { return std::string(sim::mesh_field(field).flag); }

// The help of `field`'s flag: `text`, its "{bounds}" the field's (kMeshFields), after "With
// --X: " where the field needs another.
std::string mesh_help(sim::MeshField field, std::string text) {
  const sim::MeshFieldRule& row = sim::mesh_field(field);
  if (const auto at = text.find("{bounds}"); at != std::string::npos) {
    text.replace(at, std::string_view("{bounds}").size(),
                 fmt::format("{}..{}", row.least, row.most));
  }
  if (!row.has_need()) return text;
  return fmt::format("With {}: {}", sim::mesh_field(row.needs).flag, text);
}

// The axes' degrees and the expert capacity (kMeshFields' bounds).
void add_axis_options(CLI::App* cmd, sim::MeshRequest& fsdp) {
  using sim::MeshField;
  cmd->add_option(mesh_flag(MeshField::Tp), fsdp.tp,
                  mesh_help(MeshField::Tp,
                            "Tensor parallelism over N GPUs a rank ({bounds}, inside a node): each "
                            "runs its cut of the model, sequence parallel (docs/parallelism.md); "
                            "1: none"))
      ->capture_default_str();
  cmd->add_option(mesh_flag(MeshField::Cp), fsdp.cp,
                  mesh_help(MeshField::Cp,
                            "context parallelism over N GPUs a rank ({bounds}): each holds 1/N of "
                            "the sequence, K and V all-gathered for attention, FSDP sharding over "
                            "them too (docs/parallelism.md); 1: none"))
      ->capture_default_str();
  cmd->add_option(mesh_flag(MeshField::Ep), fsdp.ep,
                  mesh_help(MeshField::Ep,
                            "expert parallelism over N GPUs of the shard group and their "
                            "tensor-parallel ones ({bounds}, a multiple of --tp): each holds 1/N "
                            "of a mixture of experts' experts, the routed rows exchanged by "
                            "all-to-alls (docs/parallelism.md); 1: none"))
      ->capture_default_str();
  cmd->add_option(mesh_flag(MeshField::ExpertCapacity), fsdp.expert_capacity,
                  mesh_help(MeshField::ExpertCapacity,
                            "a static dispatcher's capacity factor F ({bounds}), as CUDA-graphed "
                            "expert parallelism runs: each GPU's routed rows are allocated for F "
                            "times a balanced routing's, the experts computing the rows routed "
                            "(docs/parallelism.md, Static capacity and the paged stash); 0: none"))
      ->capture_default_str();
}

}  // namespace

void add_stages_option(CLI::App* cmd, sim::MeshRequest& mesh, std::string help) {
  cmd->add_option(mesh_flag(sim::MeshField::Pp), mesh.pp,
                  mesh_help(sim::MeshField::Pp, std::move(help)))
      ->capture_default_str();
}

CLI::Option* add_mesh_options(CLI::App* cmd, sim::MeshRequest& fsdp, TextFlags& text) {
  using sim::MeshField;
  CLI::Option* ranks = cmd->add_option(
      mesh_flag(MeshField::Fsdp), fsdp.ranks,
      mesh_help(MeshField::Fsdp,
                "FSDP2 over N ranks ({bounds}): each layer and the root fully_shard'ed; figures "
                "are one rank's (docs/fsdp.md)"));
  cmd->add_option(mesh_flag(MeshField::Nodes), fsdp.nodes,
                  mesh_help(MeshField::Nodes,
                            "nodes the ranks span, {bounds} (default: as few as the device's "
                            "gpus_per_node allow)"));
  cmd->add_option(
      mesh_flag(MeshField::Hsdp), fsdp.replicas,
      mesh_help(MeshField::Hsdp,
                "HSDP replica groups, {bounds} (shard within a group, all-reduce across)"));
  cmd->add_option(mesh_flag(MeshField::ReshardAfterForward), text.reshard_after_forward,
                  mesh_help(MeshField::ReshardAfterForward,
                            "true, false, or K (keep a 1/K shard after forward)"))
      ->capture_default_str();
  cmd->add_option(mesh_flag(MeshField::FsdpImpl), text.fsdp_impl,
                  mesh_help(MeshField::FsdpImpl,
                            "fsdp2 (torch's fully_shard), simple (torchtitan's SimpleFSDP: the "
                            "collectives' buffers from the compute stream's pool), or "
                            "fsdp2-torch2.4 (fully_shard of torch 2.4 and before: the "
                            "reduce-scatter's input from its stream's pool; docs/fsdp.md)"))
      ->capture_default_str();
  cmd->add_option(mesh_flag(MeshField::ReduceDtype), text.reduce_dtype,
                  mesh_help(MeshField::ReduceDtype,
                            "the gradients' reduce dtype: param (torch's default) or float32 "
                            "(torchtitan's)"))
      ->capture_default_str();
  add_axis_options(cmd, fsdp);
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
  auto reduce = sim::reduce_dtype(text.reduce_dtype);
  if (!reduce) return reduce.error();
  fsdp.reduce = reduce.value();
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
  if (args.set_to_none) k.set_to_none = true;
  if (args.keep_grads) k.set_to_none = false;
  k.check = !args.no_checker;
  if (auto applied = apply_text_flags(args.text, k.mesh, k.allocator); !applied) {
    return applied.error();
  }
  return k;
}

namespace {

// simulate's own options: the policy, what it writes, a plan or a trainer to run, and the
// checkpointing and side streams.
void add_simulate_options(CLI::App* cmd, RunArgs& args) {
  sim::SimulateRequest& s = args.simulate;
  cmd->add_option("--policy", s.policy, policy_names(" or "))->capture_default_str();
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
  cmd->add_option("--checkpoint", s.checkpoint,
                  "none, every:K, selective, op-sac (torchtitan's op-level selective), op-sac-all "
                  "(the same, every matmul saved: torchtitan's graph trainer), segments:N or "
                  "reentrant-segments:N")
      ->capture_default_str();
  cmd->add_option("--side-streams", s.side_streams,
                  "Work on a side compute stream: none, or layers L and ranges A-B, "
                  "recompute, all-reduce (comma-separated)")
      ->capture_default_str();
}

// The pipeline's options (each stage on the mesh's options); with `simulate`, its checkpoint
// mode.
void add_pipeline_options(CLI::App* cmd, RunArgs& args, bool simulate) {
  sim::RunKnobs& a = args.run;
  add_stages_option(cmd, a.mesh, "Pipeline of N stages (--schedule), {bounds}; 1: no pipeline");
  // Their bounds are the request's (Note [One check for both edges]).
  cmd->add_option("--micro-batches", a.micro_batches, "Pipeline micro-batches, 1..1024")
      ->capture_default_str();
  cmd->add_option("--schedule", a.schedule,
                  "Pipeline schedule: gpipe (torchgpipe), 1f1b, interleaved-1f1b, "
                  "interleaved-zero-bubble or zbv (torch's Schedule1F1B, ScheduleInterleaved1F1B, "
                  "ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)")
      ->capture_default_str();
  cmd->add_option("--virtual-stages", a.virtual_stages,
                  "Stages a device under interleaved-1f1b and interleaved-zero-bubble, 1..64; "
                  "2 under zbv")
      ->capture_default_str();
  cmd->add_option("--split", a.split,
                  "How the model is cut into stages: layers (its transformer layers evenly, the "
                  "input and output one layer each: torchtitan's default), balanced (by forward "
                  "time), or the layer each stage after the first starts at, e.g. 8,16,24")
      ->capture_default_str();
  if (simulate) {
    cmd->add_option("--pipeline-checkpoint", args.simulate.pipeline_checkpoint,
                    "Pipeline checkpoint mode: always, except_last or never (default except_last "
                    "under gpipe, never under torch's schedules)");
  }
}

// The offload policies' knobs and the run's length.
void add_offload_options(CLI::App* cmd, RunArgs& args) {
  sim::RunKnobs& a = args.run;
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
  cmd->add_option("--horizon", a.horizon,
                  "ferry: bytes a forward may copy out before the rest stays on the device: "
                  "auto (what the link can hide, derived), none, or a byte count")
      ->capture_default_str();
}

}  // namespace

void add_run_options(CLI::App* cmd, RunArgs& args, bool simulate) {
  sim::RunKnobs& a = args.run;
  add_target_options(cmd, args.target);
  if (simulate) add_simulate_options(cmd, args);
  cmd->add_flag("--no-early-stop", args.no_early_stop, "Recompute whole checkpointed regions");
  CLI::Option* set_to_none =
      cmd->add_flag("--set-to-none", args.set_to_none,
                    "optimizer.zero_grad(set_to_none=True) between steps (the default of "
                    "single-device and FSDP runs): gradients allocated in backward, freed after "
                    "the step");
  cmd->add_flag("--keep-grads", args.keep_grads,
                "optimizer.zero_grad(set_to_none=False) between steps (gradient accumulation, "
                "Megatron-Core's buffers, pipelines): gradients kept from set-up on")
      ->excludes(set_to_none);
  cmd->add_flag("--paged-stash", a.paged_stash,
                "Megatron-Core's paged stash: saved tensors in static-capacity buffers "
                "(--expert-capacity) have their rows of data copied into pages of a device pool "
                "at the end of their layer's forward and back before its backward, the padded "
                "buffers freed between (docs/parallelism.md, Static capacity and the paged stash)");
  add_mesh_options(cmd, a.mesh, args.text);
  add_allocator_option(cmd, args.text);
  add_pipeline_options(cmd, args, simulate);
  add_offload_options(cmd, args);
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
