#pragma once
/// The simulated autograd: replays a model's training steps on the simulated device, with the
/// offloader's pack/unpack hooks, post-hooks and end-of-backward callback, as PyTorch's engine
/// would call them.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/failure.hpp"
#include "ferry/offload/faults.hpp"
#include "ferry/offload/options.hpp"
#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/autograd/checkpoint_plan.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/sim/mesh/mesh.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// Which of the offloader's packs may go to the host, as a plan decides (Note [Offload
/// selection] in trainer.cpp). Empty vectors: every pack may, as the policy's rules decide.
struct OffloadSelection {
  std::vector<bool> ops;            ///< by op index: its saved tensors and Offload-policy outputs
  std::vector<bool> region_inputs;  ///< by checkpoint region index: the region's inputs
};

/// Work the simulated model runs on a second compute stream of its device, `side`, as code
/// inside `with torch.cuda.stream(side):` does, with the edges torch and careful code add
/// (Note [Side streams] in trainer.cpp). Empty: everything runs on the compute stream.
struct SideStreamOptions {
  std::vector<std::int32_t> layers;  ///< these layers' ops (ModelOp::layer), forward and backward
  bool recompute = false;            ///< checkpoint replays, reentrant re-runs included
  /// Each parameter's gradient is all-reduced once final, on a stream of its own ("comm"), as
  /// DDP does; the compute stream waits for the all-reduces at the end of backward.
  bool all_reduce = false;
  [[nodiscard]] bool any() const { return !layers.empty() || recompute || all_reduce; }
};

/// Megatron-Core's paged stash (`moe_paged_stash`; torchtitan's `sac_and_paged_stash` memory
/// policy): saved tensors in static-capacity buffers (ModelTensor::capacity) have their rows of
/// data copied into pages of a device pool at the end of their layer's forward, on a stream of
/// its own, and the padded buffers freed; before the layer's backward they are copied back into
/// padded buffers (Note [Paged stash] in paged_stash.cpp). Off: such tensors are saved as any.
struct PagedStashOptions {
  bool on = false;
  std::int64_t page_rows = 64;  ///< rows a page (Megatron's and torchtitan's default)
  /// The pool's pages over the most a step's stashes hold at once (their default 1.10).
  double headroom = 1.10;
  friend bool operator==(const PagedStashOptions&, const PagedStashOptions&) = default;
};

/// How a step trains across GPUs: the mesh (FSDP2, `fully_shard` on each transformer layer and
/// on the root module, as one of `mesh`'s symmetric ranks runs it, Note [FSDP2, one rank] in
/// fsdp.cpp; and the tensor-, context- and expert-parallel groups a rank's cut model was made
/// for) and FSDP2's mixed precision. The default mesh: one GPU, the whole model on the device.
struct ParallelOptions {
  Mesh mesh{};
  /// MixedPrecisionPolicy(param_dtype=model dtype, reduce_dtype=f32) over f32 parameters:
  /// sharded parameters, gradients and AdamW moments are f32. Off: all in the model's dtype.
  bool mixed_precision = true;
  [[nodiscard]] bool on() const { return mesh.on(); }
  friend bool operator==(const ParallelOptions&, const ParallelOptions&) = default;
};

struct TrainingOptions {
  OffloadOptions offload;
  CheckpointPlan checkpoint;
  OffloadSelection offload_selection;
  SimOptions sim;
  std::int32_t steps = 1;
  /// Keep the graph after backward and run backward on it a second time (retain_graph=True).
  bool retain_graph = false;
  /// 0: backward nodes in reverse forward order; otherwise a random valid topological order.
  std::uint64_t order_seed = 0;
  /// Tell the offloader the node order at backward start (else it assumes decreasing ids).
  bool announce_order = true;
  /// Every n-th backward node keeps a view of its first unpacked tensor for one more node
  /// (0: never): the case where the reference offloader falls back to record_stream.
  std::int32_t escape_period = 0;
  /// Unpack every saved tensor twice (as when hooks read grad_fn._saved_* too).
  bool unpack_twice = false;
  /// Synchronize the device at the end of each step (as loss.item() does).
  bool sync_each_step = true;
  /// `optimizer.zero_grad(set_to_none=True)` after each step: a parameter's gradient is
  /// allocated where backward first writes it and freed after the step (torch 2's default, as
  /// torchtune, torchtitan and the Hugging Face Trainer on torch 2 run). Off: every gradient is
  /// allocated at set-up and kept, zeroed in place between steps (`set_to_none=False`).
  bool grads_set_to_none = false;
  /// Follow what each storage holds (Note [Content values] in values.hpp). Off, the run's
  /// times and memory are the same, its values are not: gradient_values comes back empty, and
  /// what reads them (sim.track_content, checkpoint.content_check) must be off too. The
  /// planner's unchecked runs turn it off.
  bool content_values = true;
  /// Right after this op's forward, run its backward node in a graph task of its own, as
  /// torch.autograd.grad inside a checkpointed function would (-1: never).
  std::int32_t backward_inside_op = -1;
  SideStreamOptions side;
  ParallelOptions parallel;
  PagedStashOptions paged_stash;
};

struct StepTimes {
  SimTime start;
  SimTime forward_end;
  SimTime end;
};

/// The offloader's decisions for the saved tensors one layer's ops packed in forward.
struct LayerDecisions {
  std::int64_t packed = 0;
  std::int64_t offloaded = 0;  ///< storages copied to the host
  std::int64_t kept = 0;       ///< left on the device (by rule, host cap, or past the horizon)
  std::int64_t deduplicated = 0;
  std::int64_t recomputed = 0;  ///< replays in backward of checkpointed regions the layer starts
  friend bool operator==(const LayerDecisions&, const LayerDecisions&) = default;
};

/// What the paged stash (PagedStashOptions) did in the last step run.
struct PagedStashStats {
  std::int64_t stashed = 0;  ///< saved tensors whose rows were copied into pages
  Bytes data{};              ///< those rows' bytes
  Bytes padded{};            ///< the padded buffers they were saved in
  Bytes pool{};              ///< the pools' bytes as allocated at set-up
  std::int64_t pages = 0;    ///< the pool's pages
};

struct TrainingRun {
  Simulator sim;
  DeviceId device{};   ///< the device it trained on, in `sim`
  StreamId compute{};  ///< that device's compute stream
  /// The offloader's counters over the last step run (pinned bytes: at the end, and the
  /// run's peak).
  OffloadTelemetry telemetry{};
  /// Set when the run stopped early: out of memory, or an error the offloader raised.
  std::optional<Failure> failure{};
  std::vector<StepTimes> steps{};
  Bytes baseline_allocated{};  ///< device bytes allocated before the first forward
  /// Device bytes allocated after each step, less frees deferred by record_stream (they
  /// return at the next allocation).
  std::vector<Bytes> allocated_after{};
  std::vector<std::size_t> tracked_after{};     ///< ids the offloader still tracks after each step
  std::vector<std::uint32_t> backward_order{};  ///< node order of the last backward
  SimTime recompute_time{};                     ///< kernel time spent recomputing, last step
  std::int64_t recomputations = 0;              ///< region replays, all steps
  /// For each replay in the last step: the last op it ran and the last op of its region
  /// that saves a tensor (equal with early stop).
  std::vector<std::pair<std::uint32_t, std::uint32_t>> replay_stops{};
  /// Content value of every parameter's gradient and of the batch's gradient, last step
  /// (none without TrainingOptions::content_values).
  std::vector<std::uint64_t> gradient_values{};
  /// What the offloader decided for the saved tensors packed in forward, per layer of the
  /// packing op (ModelOp::layer; -1 outside the layers), and the replays of the regions each
  /// layer starts: of the last step run.
  std::map<std::int32_t, LayerDecisions> layer_decisions{};
  PagedStashStats paged_stash{};
};

/// FSDP2's planted faults (ParallelOptions), each dropping one synchronization.
struct FsdpFaults {
  bool skip_all_gather_wait = false;  ///< a unit's copy-out does not wait for its all-gather
  /// The same for a layer's experts alone (their unit under expert parallelism).
  bool skip_expert_all_gather_wait = false;
  bool skip_copy_in_wait = false;         ///< a unit's all-gather does not wait for its copy-in
  bool skip_backward_unshard = false;     ///< backward reads parameters resharded after forward
  bool skip_reduce_scatter_wait = false;  ///< the reduce-scatter does not wait for the gradients
  /// SimpleFSDP's second backward accumulates the new gradient shard before the compute stream
  /// waits for the reduce-scatter that writes it.
  bool skip_accumulate_wait = false;
  /// The previous forward all-gather's output is freed before the all-gather streams wait for
  /// its copy-out.
  bool skip_gather_free_wait = false;
  /// The previous reduce-scatter's input is freed before the current stream waits for it.
  bool skip_reduce_input_free_wait = false;
  /// torch 2.4's FSDP2 frees the gradients before the current stream waits for their copy-in
  /// on the reduce-scatter stream.
  bool skip_copy_in_free_wait = false;
  /// zero_grad frees the gradient shards before the reduce-scatter stream waits for the
  /// optimizer step that reads them.
  bool skip_grad_shard_free_wait = false;
  /// With HSDP and gradients reduced in the compute dtype, the all-reduced gradients (cast to
  /// their shards) are freed before the reduce-scatter stream, whose pool they came from, waits
  /// for the current stream that waited for the last all-reduce.
  bool skip_reduced_free_wait = false;
};

/// The planted faults of the collective ops of a rank's model (docs/model-format.md, Collective
/// ops).
struct CollectiveFaults {
  /// A collective op's process-group stream does not wait for the current stream, which
  /// produced its inputs and allocated its outputs.
  bool skip_collective_launch_wait = false;
  /// The current stream does not wait for a collective op (`wait_tensor`) before the ops after
  /// it read its outputs.
  bool skip_collective_output_wait = false;
};

/// The paged stash's planted faults (PagedStashOptions).
struct PagedStashFaults {
  /// A stash copies before its stream waits for the compute stream that wrote the tensors.
  bool skip_stash_launch_wait = false;
  /// The padded buffers are freed before the compute stream waits for the stash that reads them.
  bool skip_stash_done_wait = false;
  /// Backward reads a restored tensor before the compute stream waits for its restore.
  bool skip_restore_wait = false;
  /// A restored tensor goes back to the stash stream's pool before that stream waits for the
  /// reads backward issued.
  bool skip_restored_free_wait = false;
  /// The pool is sized by the rows stashed rather than by their pages (the under-count torchtitan
  /// names in Megatron's sizing): a stash of rows that fill no whole page overflows it.
  bool pool_by_rows = false;
};

/// Test-only switches that break a training run on purpose (planted faults), kept out of the
/// options that production code builds. FSDP2's, the collective ops' and the paged stash's are
/// their units' own.
struct TrainingFaults {
  OffloadFaults offload{};
  bool skip_rng_restore = false;       ///< recompute draws fresh randomness
  std::int32_t drop_recomputed = -1;   ///< this region's replay saves one tensor fewer
  bool alter_recomputed_meta = false;  ///< replays report another size
  // Side streams (SideStreamOptions), DDP's all-reduce among them:
  bool skip_side_stream_wait = false;  ///< side or comm work does not wait for the stream before it
  bool skip_cross_stream_record = false;  ///< no record_stream for a tensor used on another stream
  /// Under grads_set_to_none, each gradient is freed as soon as its all-reduce is launched,
  /// while the comm stream may still read it (no record_stream, no wait).
  bool free_grad_at_all_reduce = false;
  /// A node run's ranks pin host memory at the same addresses: one buffer for two offloads.
  bool shared_pinned_pool = false;
  FsdpFaults fsdp{};               ///< the Fsdp2 unit's
  CollectiveFaults collectives{};  ///< the MeshCollectives unit's
  PagedStashFaults paged_stash{};  ///< the PagedStash unit's
};

/// Runs `options.steps` training steps of `model` (durations must be assigned) on one device;
/// `faults` is for tests only.
Result<TrainingRun> simulate_training(const CheckedModel& model, const DeviceProfile& device,
                                      const TrainingOptions& options,
                                      const TrainingFaults& faults = {});
/// check_model(model), then the run above: for a model simulated once (tests, examples); a
/// caller that runs one model again and again checks it once and passes the CheckedModel.
Result<TrainingRun> simulate_training(const Model& model, const DeviceProfile& device,
                                      const TrainingOptions& options,
                                      const TrainingFaults& faults = {});

/// The ranks of one node in one simulation, each a process of its own on its own device.
struct NodeRun {
  /// Every rank's device; its hazards and content mismatches are the node's. Its timings are
  /// not a prediction: the ranks' calls interleave on one host clock (Note [Processes]).
  Simulator sim;
  std::vector<std::optional<Failure>> failures;             ///< per rank
  std::vector<std::vector<std::uint64_t>> gradient_values;  ///< per rank, as TrainingRun's
};

/// Runs `ranks` FSDP ranks of one node side by side, interleaved op by op, each loading a
/// batch of its own and pinning host memory from its share of the node's: a check of what
/// the ranks share, which a one-rank simulation cannot see (Note [Node run] in node_run.cpp).
/// `options.parallel` must be on, with at least `ranks` ranks per node.
Result<NodeRun> simulate_node(const CheckedModel& model, const DeviceProfile& device,
                              const TrainingOptions& options, std::int32_t ranks,
                              const TrainingFaults& faults = {});
/// check_model(model), then the run above (as simulate_training's overload).
Result<NodeRun> simulate_node(const Model& model, const DeviceProfile& device,
                              const TrainingOptions& options, std::int32_t ranks,
                              const TrainingFaults& faults = {});

}  // namespace ferry::sim
