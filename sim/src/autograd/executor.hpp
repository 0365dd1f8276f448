#pragma once
// Private to the simulated autograd: the pipeline driver. It runs a step (GPipe's clock, or
// torch's 1F1B or interleaved 1F1B orders) over one sim::Device per pipeline rank, each holding
// one partition or, interleaved, several, on the toolkit it shares with the single-device Trainer
// (graph.hpp, values.hpp), with the core's choreography (ferry/pipeline) and, per stage, the
// core's Offloader.

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/offload/offloader.hpp"
#include "ferry/pipeline/schedule.hpp"
#include "ferry/pipeline/streams.hpp"
#include "ferry/portal.hpp"
#include "ferry/sim/autograd/pipeline.hpp"
#include "ferry/sim/device/device.hpp"
#include "pipeline_plan.hpp"
#include "values.hpp"

namespace ferry::sim::pipelining {

[[nodiscard]] inline std::uint64_t grad_content(std::uint64_t sum) {
  return mix_content(tag::kGrad, sum);
}

enum class Kind : std::uint8_t { Static, Activation, Gradient };

enum class Pass : std::uint8_t {
  Forward,    ///< grad mode: ops keep what they save
  NoGrad,     ///< the forward of a checkpointed partition: only its input is kept
  Recompute,  ///< the checkpointed partition again, right before its backward
};

using pipeline::Cell;
using pipeline::Phase;
using pipeline::StreamRef;
using Streams = pipeline::Choreography<Device>;
using Holders = pipeline::SharedBuffers<Device>;

// A device buffer the pipeline holds. Who holds it, and on which streams it was used, is the
// core's (pipeline::SharedBuffers); see Note [Receive buffers and record_stream].
struct Buf {
  BufferId id;
  std::uint32_t device = 0;
  Bytes bytes;
  Kind kind = Kind::Static;
  OpId last_use;
  std::uint64_t sum = 0;               ///< gradients: the sum behind its content
  std::vector<std::size_t> lifetimes;  ///< PortalLifetime records naming it
  /// Activations: the task (micro-batch, partition) that allocated it, for the in-flight count.
  std::optional<std::array<std::uint32_t, 2>> cell;
};

struct SavedRef {
  Access access;
  TensorId handle;
  std::uint64_t expected = 0;  ///< the storage's content at forward
  TensorId offloaded;          ///< the offloader's id when the stage's offloader packed it
};

struct Task {
  bool checkpointed = false;
  std::map<std::uint32_t, TensorId> local;   ///< base -> produced in the current pass
  std::map<std::uint32_t, TensorId> chain;   ///< base -> received from the previous partition
  std::map<std::uint32_t, TensorId> popped;  ///< skip -> taken from its portal this pass
  std::map<std::uint32_t, TensorId> inputs;  ///< base -> batch input loaded here
  std::vector<std::vector<SavedRef>> saved;  ///< per op of the partition
  std::map<std::uint32_t, TensorId> grads;   ///< base -> its gradient on this device
  Generators rng;                            ///< the generators when the forward began
  std::optional<TensorId> output;            ///< the loss, held for the backward
  /// Zero bubble: node -> its output gradients, kept from its input-gradient step for its
  /// weight-gradient step (Note [Split backward]).
  std::map<std::uint32_t, std::vector<TensorId>> deferred;
};

// Streams, events and the holders of shared buffers are the core's: Note [Pipeline streams]
// and Note [Receive buffers and record_stream] in ferry/pipeline/streams.hpp. With an offload
// policy, each stage's saved tensors go through an Offloader on that stage's device: see
// Note [Offload in stages].
//
// Note [Stages on one rank]
// Under torch's V placement (ScheduleZBVZeroBubble) stages pp - 1 and pp run on one rank, and
// torch's runtime passes their tensors without a send: the forward's outputs become the next
// stage's inputs (set_local_fwd_input, a detached alias of the same storage), and the input
// gradients become the previous stage's output gradients (get_local_bwd_output,
// set_local_bwd_input). The receiving task takes the sender's buffer itself, with the holds a
// received copy would have had; no copy stream, no event: both tasks run on the rank's compute
// stream, so stream order is the only wait, and the hazard checker sees it.
//
// Note [Split backward]
// Zero-bubble schedules split a stage's backward in two steps, as torch's stage does
// (backward_one_chunk with the weights left out, then backward_weight_one_chunk): the
// input-gradient step runs every node's backward for the gradients of its activation inputs,
// which the previous stage waits for, and the weight-gradient step later adds each node's
// contribution to its parameters' gradients. A node that reads a parameter keeps what its
// backward reads (its saved tensors, its outputs' gradients) from the first step to the second;
// the first takes half its backward time and the second the other half (a matmul's input and
// weight gradients cost the same flops); a node without a parameter runs whole in the first.
// The weight kernel reads the same bytes, so its contribution is the one the whole backward
// would add. The stage's graph (what the nodes saved) is freed after the weight step.
//
// Note [Offload in stages]
// Each device runs its offload policy on its own: one Offloader over the stage's Backend, its
// own copy streams; a device without a policy (Note [Per-stage policies] in pipeline.cpp) has
// none and keeps what it saves. A tensor a partition produced and one of its ops saves in grad-mode
// forward is packed (node id: micro-batch * ops + op, unique within the step); the saved slot's
// holder then lets go, the offloader keeping its own reference. The stage's backward of a
// micro-batch is one backward pass for the offloader (backward_begin with its nodes in order,
// node_done after each, backward_end), and the step is one offload context (enter, exit). In a
// node's backward the pipeline's holders let go before the offloader's post-hook, so what the
// pipeline frees is still freed right after its last use. What crossed devices (chain,
// portal), parameters, the batch, and what a recompute saves stay as they are: a recompute's
// saved tensors are used at once, and a checkpointed forward saves nothing.

/// The links between the devices of a pipeline's stages that lie on different nodes, each way
/// (Note [Sends between nodes] in executor_mesh.cpp); sends between the others take the
/// profile's peer link.
[[nodiscard]] std::vector<ProgramLink> stage_links(const DeviceProfile& profile, const Mesh& mesh,
                                                   std::uint32_t devices);

class Executor {
 public:
  Executor(const Model& model, const DeviceProfile& profile, const PipelineOptions& options,
           const PipelineFaults& faults, Plan plan, pipeline::Schedule schedule,
           std::vector<std::int32_t> checkpoint_stops);

  PipelineRun run();

 private:
  // ----- buffers -----

  /// Partition j's device's offloader, or null (no policy there).
  [[nodiscard]] Offloader<Device>* offloader(std::uint32_t j) const {
    return offloaders_.empty() ? nullptr : offloaders_[dev(j)].get();
  }

  /// Whether micro-batch i runs partition j checkpointed.
  [[nodiscard]] bool checkpointed(std::uint32_t i, std::uint32_t j) const {
    return static_cast<std::int32_t>(i) < checkpoint_stops_[dev(j)];
  }

  /// The device partition j runs on.
  [[nodiscard]] std::uint32_t dev(std::uint32_t j) const {
    return streams_->device_of_partition(j);
  }

  /// The task being issued: its activations count as that task's in flight.
  void issuing(std::uint32_t i, std::uint32_t j) { current_ = std::array<std::uint32_t, 2>{i, j}; }

  /// Under torch.distributed.pipelining's schedules, sends and receives (Note [Point-to-point
  /// receives]) rather than torchgpipe's copies.
  [[nodiscard]] bool point_to_point() const {
    return schedule_ == pipeline::Schedule::OneFOneB ||
           schedule_ == pipeline::Schedule::Interleaved1F1B || split_backward();
  }

  /// Each backward is split into an input-gradient and a weight-gradient step.
  [[nodiscard]] bool split_backward() const { return pipeline::splits_backward(schedule_); }

  /// Partitions j - 1 and j share a device under sends and receives: torch's stage hands its
  /// tensors over without a send (Note [Stages on one rank]).
  [[nodiscard]] bool local_handoff(std::uint32_t j) const {
    return point_to_point() && j > 0 && dev(j - 1) == dev(j);
  }

  /// The stream a receive into partition j from copy stream `s` allocates on, after the
  /// receive's wait when sends and receives move the data.
  StreamRef receive_stream(std::uint32_t j, StreamRef s);

  struct StageTimes {
    SimTime span;               ///< first task kernel's start to last one's end, all devices
    std::vector<SimTime> busy;  ///< per device: summed task kernel time on its compute stream
  };
  [[nodiscard]] StageTimes stage_times() const;

  Buf& buf(TensorId h) { return bufs_[h.value()]; }

  TensorId allocate(std::uint32_t device, StreamRef stream, Bytes bytes, Kind kind,
                    std::int32_t holds, const std::string& label);

  void hold(TensorId h, std::int32_t n = 1) { holders_->hold(h.value(), n); }

  void release(TensorId h);

  void free_buffer(TensorId h, bool at_step_end);

  // The pipeline's holders let go of `h`: the storage is freed unless an offloader keeps it.
  void let_go(TensorId h, bool at_step_end);

  /// What buffer `h` holds as a whole (Note [Content values]).
  std::uint64_t content(TensorId h) const;

  void set_content(TensorId h, std::uint64_t value);

  void touched(TensorId h, StreamRef stream, OpId op);

  void track(TensorId h, PortalKey key, bool gradient);

  Region region(TensorId h, std::uint32_t tensor) const;

  Region whole(TensorId h) const;

  /// The value a kernel folds in for reading `tensor` from `h`.
  std::uint64_t read_value(TensorId h, std::uint32_t tensor) const;

  // ----- kernels and copies -----

  struct Read {
    Read(TensorId h, Region r, std::uint64_t e, Bytes base = Bytes(0))
        : handle(h), region(r), expected(e), expected_base(base) {}
    TensorId handle;
    Region region;
    std::uint64_t expected = 0;  ///< content id of the storage the region lies in
    /// Where the region started in that storage when it was computed (a reload may put it
    /// elsewhere); read when `handle` is invalid (a storage the pipeline does not hold).
    Bytes expected_base;
  };
  struct Write {
    TensorId handle;
    std::uint64_t value = 0;
    std::uint64_t sum = 0;
  };

  /// A kernel on the device's compute stream; with `lane`, a collective on the device's stream
  /// for the mesh's collectives between two waits (Note [A pipeline on the mesh]).
  OpId launch(std::uint32_t device, SimTime duration, const std::vector<Read>& reads,
              const std::vector<Write>& writes, const std::string& label,
              std::optional<CollectiveLane> lane = std::nullopt);

  // ----- the stage's mesh (executor_mesh.cpp) -----

  /// The lane op k's forward (or backward) collective runs on; none when that direction runs
  /// no collective, or the op is none.
  [[nodiscard]] std::optional<CollectiveLane> collective_lane(std::uint32_t k, bool backward) const;

  /// Adds each device's streams for its mesh's collectives and its FSDP collectives.
  void add_mesh_streams();

  /// `waiter` waits for what `on` has issued so far, on device d, unless `drop` (a fault).
  void stream_wait(std::uint32_t d, StreamId waiter, StreamId on, bool drop);

  /// Under FSDP: each device's shard of its parameters, all-gathered into the resident ones
  /// before its first forward.
  void gather_parameters();

  /// Under FSDP: device d's gradients reduce-scattered into its shard after its last backward
  /// (all-reduced over HSDP's replicas); returns what the optimizer reads.
  std::vector<Read> reduce_gradients(std::uint32_t d);

  /// Buffers FSDP shards over one group: `held`, `bytes` in all, over `axis`'s group.
  struct ShardGroup {
    Mesh::Axis axis = Mesh::Axis::Shard;
    std::vector<TensorId> held;
    Bytes bytes;
  };

  /// The parameters (or their gradients) `held` in FSDP's groups: the experts' weights over the
  /// expert shard group, the rest over the shard group; the groups with none left out.
  [[nodiscard]] std::vector<ShardGroup> shard_groups(
      const std::map<std::uint32_t, TensorId>& held) const;

  /// The shard of `g` one rank holds (rounded up).
  [[nodiscard]] Bytes shard_of(const ShardGroup& g) const;

  void copy(StreamRef stream, TensorId src, TensorId dst, const std::string& label);

  // ----- set-up and schedule -----

  static constexpr std::size_t kMaxWrites = 128;

  void setup();
  void issue_tasks();

  [[nodiscard]] PortalKey key(std::uint32_t skip, std::uint32_t i) const;

  std::string mb_label(std::uint32_t i, std::string_view what) const;

  // ----- forward -----

  void forward_fence(std::uint32_t i, std::uint32_t j);

  void forward_compute(std::uint32_t i, std::uint32_t j);

  void load_inputs(std::uint32_t i, std::uint32_t j);

  TensorId source(const Task& task, std::uint32_t j, const Access& a) const;

  /// What a saved tensor held at forward: backward expects the same bytes, recomputed or not.
  std::uint64_t forward_content(std::uint32_t i, const Task& task, std::uint32_t j,
                                const Access& a) const;

  /// Runs partition j's ops for micro-batch i in one pass (Pass).
  void run_ops(std::uint32_t i, std::uint32_t j, Pass pass);

  /// A recompute reads the chain inputs again: held once per read and save.
  void hold_chain_inputs(Task& task, std::uint32_t j);

  /// Takes op k's skip tensors out of their portals (orange()).
  void pop_skips(std::uint32_t i, std::uint32_t k, Task& task, bool grad);

  /// Op k's reads, once per tensor; returns the value its outputs derive from.
  std::uint64_t gather_reads(std::uint32_t i, const Task& task, std::uint32_t j, std::uint32_t k,
                             std::vector<Read>& reads);

  /// Allocates op k's outputs, held by their readers (and savers, senders, the loss).
  void allocate_outputs(std::uint32_t i, std::uint32_t j, std::uint32_t k, Pass pass,
                        std::uint64_t value, Task& task, std::vector<Write>& writes,
                        std::vector<TensorId>& created);

  /// Records what op k saves; a grad-mode forward packs local tensors through the offloader.
  void save_for_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k, Task& task,
                         bool recompute);

  /// Puts op k's skip tensors into their portals; blue() takes each out once.
  void stash_skips(std::uint32_t i, std::uint32_t k, Task& task, Pass pass);

  /// The label suffix of a pass: "", " (no grad)", " (recompute)".
  static const char* pass_suffix(Pass pass);

  // ----- backward -----

  void backward_fence(std::uint32_t i, std::uint32_t j);

  void backward_compute(std::uint32_t i, std::uint32_t j);

  /// PortalBlue's backward: the gradient from the skip's consumer joins the local one.
  void blue_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k);

  // ----- offload in stages (Note [Offload in stages]) -----

  [[nodiscard]] NodeId node_id(std::uint32_t i, std::uint32_t k) const;

  /// Packs a saved tensor the partition produced through its stage's offloader; the saved
  /// slot's holder lets go (the offloader keeps its own reference).
  TensorId pack(std::uint32_t i, std::uint32_t j, std::uint32_t k, const SavedRef& ref);

  /// The saved tensors of node k as the kernel reads them; folds their values into `h`.
  /// Returns the storages unpacked from the offloader (the caller drops one reference each).
  std::vector<Device::Buffer> unpack_saved(std::uint32_t i, std::uint32_t j, std::uint32_t k,
                                           std::vector<Read>& reads, std::uint64_t& h);

  /// The graph lets go of a saved tensor: its holder, or its offloader id.
  void let_go_saved(std::uint32_t j, const SavedRef& ref);

  [[nodiscard]] std::vector<OffloadTelemetry> telemetry() const;

  /// Node k's backward for micro-batch i on partition j: one kernel, then the let-gos. Under
  /// split_backward() it computes the input gradients only and, if k has a weight, keeps what
  /// its weight step reads (Note [Split backward]).
  void op_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k);

  /// Whether node k reads a parameter: it has a weight-gradient step of its own.
  [[nodiscard]] bool has_weight(std::uint32_t k) const;

  /// The share of node k's backward time its input-gradient step takes under split_backward().
  [[nodiscard]] SimTime input_share(std::uint32_t k) const;

  /// The weight-gradient step of micro-batch i on partition j: each deferred node's weight
  /// kernel, then the graph is freed.
  void weight_compute(std::uint32_t i, std::uint32_t j);

  /// The graph of micro-batch i on partition j is freed: the checkpoint's kept input, what the
  /// nodes saved, the batch.
  void free_graph(std::uint32_t i, std::uint32_t j);

  /// Node k's weight-gradient kernel: reads what its input-gradient step read, adds to the
  /// parameters' gradients, then lets go.
  void weight_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k);
  std::vector<TensorId> new_param_grads(std::uint32_t i, std::uint32_t j, std::uint32_t k,
                                        std::vector<Write>& writes);

  // The gradients one node's backward adds to.
  struct GradTargets {
    std::map<std::uint32_t, std::uint64_t> add;      ///< buffer handle -> contribution
    std::set<std::uint32_t> fresh;                   ///< created here: they start from zero
    std::map<std::uint32_t, TensorId> portal_grads;  ///< skip -> gradient for its portal
  };

  /// Reads the gradients of node k's outputs (each base once); returns those bases.
  std::vector<std::uint32_t> read_output_grads(std::uint32_t i, std::uint32_t j, std::uint32_t k,
                                               std::vector<Read>& reads, std::uint64_t& h);

  /// The gradient buffer input `a` contributes to, allocated on first use; invalid when
  /// the input takes no gradient.
  TensorId grad_target(std::uint32_t i, std::uint32_t j, const Access& a, GradTargets& targets);

  /// After node k's backward kernel: the holders let go, the portal gets its gradients, and
  /// the offloader's post-hook runs.
  void let_go_after_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k,
                             const std::vector<std::uint32_t>& out_bases,
                             const GradTargets& targets,
                             const std::vector<Device::Buffer>& unpacked);

  // ----- end of step -----

  void finish_step();
  /// Device d's optimizer step, reading `reads` (its gradients) and its state.
  void optimizer_step(std::uint32_t d, std::vector<Read> reads);

  /// Frees what is still held when the step ends (after a failure, or what a portal leaked);
  /// returns how many buffers that was.
  std::int64_t release_leftovers();

  std::vector<ParamGradient> param_gradients() const;

  const Model& model_;
  const DeviceProfile& profile_;
  PipelineFaults faults_;
  Plan plan_;
  pipeline::Schedule schedule_;
  /// Per device: micro-batches below this run its stages checkpointed.
  std::vector<std::int32_t> checkpoint_stops_;
  std::uint32_t micro_batches_;
  std::uint32_t parts_;
  std::uint32_t ndev_;  ///< devices; partition j runs on pipeline::rank_of_stage's device
  Simulator sim_;
  PortalTable portals_;
  std::vector<std::unique_ptr<Device>> devices_;  ///< one Backend per device
  std::unique_ptr<Streams> streams_;              ///< the core's choreography
  std::unique_ptr<Holders> holders_;              ///< who holds each buffer
  /// Per device: its offloader, null without a policy; empty when no device has one.
  std::vector<std::unique_ptr<Offloader<Device>>> offloaders_;
  std::vector<std::vector<Task>> tasks_;                        ///< [micro-batch][partition]
  std::vector<std::vector<std::uint64_t>> forward_values_;      ///< [micro-batch][base]
  std::vector<std::map<std::uint32_t, TensorId>> resident_;     ///< per device
  std::vector<std::map<std::uint32_t, TensorId>> param_grads_;  ///< per device
  std::vector<std::map<std::uint32_t, TensorId>> state_;        ///< per device: optimizer state
  Generators rng_;                                              ///< per generator: draws so far
  ContentMap content_;
  std::vector<Buf> bufs_;
  std::vector<PortalLifetime> lifetimes_;
  std::vector<Bytes> live_activations_;
  std::vector<Bytes> peak_activations_;
  SimTime recompute_time_;
  std::optional<std::array<std::uint32_t, 2>> current_;  ///< (micro-batch, partition) issuing
  /// Per device: live activation buffers per task (micro-batch, partition).
  std::vector<std::map<std::array<std::uint32_t, 2>, std::int32_t>> live_cells_;
  std::vector<std::int32_t> peak_in_flight_;
  std::size_t first_task_op_ = 0;    ///< the first op the schedule issued
  std::size_t last_task_op_ = 0;     ///< one past the last
  Mesh mesh_;                        ///< each stage's mesh
  std::vector<StreamId> mesh_comm_;  ///< per device: tp/cp/ep collectives; empty: none
  std::vector<StreamId> fsdp_comm_;  ///< per device: FSDP's; empty without FSDP
  std::vector<std::vector<TensorId>> param_shards_;   ///< per device, under FSDP: per group
  std::vector<std::vector<TensorId>> moment_shards_;  ///< per device, under FSDP: per group
  std::set<std::uint32_t> expert_params_;             ///< under expert parallelism
};

}  // namespace ferry::sim::pipelining
