#pragma once
/// Pipeline training on simulated devices: a model split into contiguous partitions (stages),
/// micro-batches on GPipe's fill-drain clock with copy streams, checkpoint and recompute and skip
/// connections through portals, or in the order of torch's 1F1B and interleaved 1F1B with sends
/// and receives. See docs/pipeline.md.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/failure.hpp"
#include "ferry/ids.hpp"
#include "ferry/offload/faults.hpp"
#include "ferry/offload/options.hpp"
#include "ferry/pipeline/schedule.hpp"
#include "ferry/portal.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/simulator.hpp"
#include "ferry/sim/mesh/mesh.hpp"
#include "ferry/sim/workload/model.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// Which micro-batches run their partitions under checkpoint (torchgpipe's `checkpoint=`).
enum class CheckpointMode : std::uint8_t {
  Always,      ///< every micro-batch
  ExceptLast,  ///< all but the last (its recompute would follow its forward at once)
  Never,       ///< none: every partition keeps what its ops save
};

/// "always", "except_last", "never".
[[nodiscard]] const char* checkpoint_mode_name(CheckpointMode mode);

/// A skip connection: `consumer` reads `tensor` through a portal instead of the partition chain.
struct SkipConnection {
  std::uint32_t tensor = 0;    ///< the stashed activation (a model tensor index, not a view)
  std::uint32_t consumer = 0;  ///< the op that pops it (a model op index); it reads `tensor`

  friend bool operator==(const SkipConnection&, const SkipConnection&) = default;
};

/// Test-only switches that each drop one safety rule (planted faults), passed apart from the
/// options.
struct PipelineFaults {
  bool skip_rng_restore = false;          ///< recompute draws from the live generator
  bool skip_portal_copy_wait = false;     ///< PortalCopy does not wait for the stashing compute
  bool skip_portal_arrival_wait = false;  ///< the popping compute does not wait for PortalCopy
  /// Under 1F1B and interleaved 1F1B, a receive does not wait for the receiving compute stream
  /// it allocated its buffer on (Note [Point-to-point receives]).
  bool skip_receive_wait = false;
  /// Under 1F1B and interleaved 1F1B, the receiving compute does not wait for the receive.
  bool skip_receive_arrival_wait = false;
  /// A stage's collective op (tensor, context or expert parallelism) does not wait for the
  /// compute stream before it runs, or the compute stream does not wait for it (Note
  /// [A pipeline on the mesh] in sim/src/autograd/executor_mesh.cpp).
  bool skip_collective_launch_wait = false;
  bool skip_collective_output_wait = false;
  /// Under FSDP: a stage's all-gather of its parameters does not wait for their
  /// initialization, or its first forward does not wait for the all-gather; its reduce-scatter
  /// of the gradients does not wait for the last backward, or the optimizer does not wait for
  /// the reduce-scatter.
  bool skip_gather_launch_wait = false;
  bool skip_gather_arrival_wait = false;
  bool skip_reduce_launch_wait = false;
  bool skip_reduce_arrival_wait = false;
  PortalFaults portal;    ///< wrong tensor lives
  OffloadFaults offload;  ///< each stage's offloader (with an offload policy)
};

/// The order of the micro-batches' tasks (Note [Schedule orders] in ferry/pipeline/schedule.cpp).
using pipeline::Schedule;

/// One device's checkpoint mode and offload policy in place of the pipeline-wide ones
/// (PipelineOptions::stages; Note [Per-stage policies] in sim/src/autograd/pipeline.cpp).
struct StagePolicy {
  CheckpointMode checkpoint = CheckpointMode::ExceptLast;
  OffloadOptions offload{.policy = Policy::None};  ///< none: the device offloads nothing
};

/// How the model is cut into its devices * virtual_stages contiguous partitions (stages).
struct PipelineSplit {
  enum class Rule : std::uint8_t {
    /// torchtitan's default (generate_llm_fqn_per_model_part): the transformer layers
    /// (ModelOp::layer) evenly over the stages, the input and the output each counted as one
    /// layer; a model whose layers cannot be counted (none, or not contiguous in op order) is
    /// balanced instead (Note [Pipeline splits]).
    Layers,
    Balanced,  ///< balance_by_duration: the smallest largest sum of forward durations
    Points,    ///< `points`: torchtitan's pipeline_parallel_split_points, by layer index
  };
  Rule rule = Rule::Layers;
  /// Points: the layer each stage after the first starts at, increasing.
  std::vector<std::int32_t> points;

  friend bool operator==(const PipelineSplit&, const PipelineSplit&) = default;
};

/// Parses `--split`: "layers", "balanced", or layer indices "L1,L2,..." (e.g. "8,17,25").
Result<PipelineSplit> parse_split(std::string_view text);
/// "layers", "balanced" or "8,17,25" (parse_split's spelling).
[[nodiscard]] std::string split_name(const PipelineSplit& split);

/// What one partition (stage) holds: ops [begin, end), and the transformer layers among them
/// (first_layer -1: none).
struct StageSpan {
  std::uint32_t begin = 0;
  std::uint32_t end = 0;
  std::int32_t first_layer = -1;
  std::int32_t last_layer = -1;

  friend bool operator==(const StageSpan&, const StageSpan&) = default;
};

/// The spans of the partitions that `starts` (partitions + 1 op indices) gives.
[[nodiscard]] std::vector<StageSpan> stage_spans(const Model& model,
                                                 const std::vector<std::uint32_t>& starts);
/// "s0 gpu0 ops 0-57 layers 0-7, s1 gpu1 ...": stage s on the device `schedule` places it on
/// (pipeline::rank_of_stage).
[[nodiscard]] std::string stage_spans_text(const std::vector<StageSpan>& spans, Schedule schedule,
                                           std::int32_t devices);

struct PipelineOptions {
  std::int32_t devices = 2;        ///< devices (pipeline ranks)
  std::int32_t micro_batches = 4;  ///< micro-batches; the model describes one
  /// GPipe (torchgpipe's clock, copies and portals), OneFOneB, Interleaved1F1B,
  /// InterleavedZeroBubble or ZeroBubbleV (torch's Schedule1F1B, ScheduleInterleaved1F1B,
  /// ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble, with sends and receives).
  Schedule schedule = Schedule::GPipe;
  /// Stages a device holds: devices * virtual_stages partitions, stage s on device
  /// pipeline::rank_of_stage(schedule, s, devices). Above 1 only with the interleaved
  /// schedules and ZeroBubbleV (exactly 2).
  std::int32_t virtual_stages = 1;
  /// How the model is cut into stages: by layers (torchtitan's default) unless given.
  PipelineSplit split;
  CheckpointMode checkpoint = CheckpointMode::ExceptLast;
  std::vector<SkipConnection> skips;  ///< portal routes; see Note [Portal tensor life]
  /// Each stage's offload policy and knobs; none by default (Note [Offload in stages]).
  OffloadOptions offload{.policy = Policy::None};
  /// Empty: every device runs `checkpoint` and `offload`. Else one entry a device (pipeline
  /// rank), each replacing both for every stage the device holds.
  std::vector<StagePolicy> stages;
  /// Each stage's mesh (one GPU by default): the model is a rank's under its tensor, context
  /// and expert parallelism (rank_workload), and under FSDP each stage gathers its parameters
  /// once and reduces its gradients once a step (Note [A pipeline on the mesh]).
  Mesh mesh;
  SimOptions sim;
};

/// Device `device`'s checkpoint mode and offload policy: its entry in `options.stages`, or the
/// pipeline-wide ones.
[[nodiscard]] StagePolicy stage_policy(const PipelineOptions& options, std::size_t device);

/// Whether some device runs an offload policy.
[[nodiscard]] bool any_offload(const PipelineOptions& options);

/// One buffer a portal held: when its last user was issued and when it was freed.
struct PortalLifetime {
  PortalKey key;
  bool gradient = false;  ///< a gradient in the portal rather than the tensor
  DeviceId device;
  BufferId buffer;
  OpId last_use;         ///< the last kernel or copy that touched it
  OpId freed;            ///< the free call (invalid: never freed)
  SimTime last_use_end;  ///< when the last use completed on the device
  /// Host time of the free call. It may precede last_use_end: the allocator hands the block
  /// out again only in stream order or after record_stream's marker (Note [Receive buffers
  /// and record_stream] in ferry/pipeline/streams.hpp), which the hazard checker verifies.
  SimTime freed_at;
  /// The free was requested when the step ended (the portal or a holder leaked it).
  bool freed_at_step_end = false;
};

/// A parameter's gradient after the step: its content id (summed over micro-batches and over
/// the devices that hold a replica). Equal values mean equal gradients (Note [Content values]).
struct ParamGradient {
  std::uint32_t tensor = 0;  ///< model tensor index
  std::uint64_t value = 0;   ///< content id

  friend bool operator==(const ParamGradient&, const ParamGradient&) = default;
};

struct PipelineRun {
  Simulator sim;
  /// Set when the step stopped early: out of memory, or a portal misuse (PortalError).
  std::optional<Failure> failure;
  /// Partition j runs ops [partition_starts[j], partition_starts[j + 1]); devices + 1 entries.
  std::vector<std::uint32_t> partition_starts;
  std::vector<StageSpan> stages;  ///< what each partition holds (stage_spans)
  /// The split that cut them (split_name), with why when layers fell back to balanced.
  std::string split;
  SimTime step_time;                    ///< from the first forward call to the end of the step
  std::vector<Bytes> peak_allocated;    ///< per device: the caching allocator's allocated peak
  std::vector<Bytes> peak_activations;  ///< per device: most forward-tensor bytes held at once
  SimTime recompute_time;               ///< summed kernel time of recomputed forward ops
  PortalStats portal_stats;             ///< the portal table's counters
  std::int64_t portal_frees = 0;        ///< buffers a portal held that were freed
  /// Device buffers other than parameters and their gradients still held when the step ended
  /// (freed then): 0 unless a failure stopped the step or a holder leaked.
  std::int64_t buffers_left = 0;
  std::vector<ParamGradient> param_grads;        ///< by tensor index
  std::vector<PortalLifetime> portal_lifetimes;  ///< in the order the portals took them
  std::vector<OffloadTelemetry> telemetry;       ///< per device; empty without a policy
  Schedule schedule = Schedule::GPipe;
  /// From the start of the first task kernel to the end of the last, over all devices.
  SimTime pipeline_span;
  /// Per device: the summed time of its task kernels (forward, recompute and backward ops)
  /// on its compute stream. Its bubble is 1 - busy / pipeline_span.
  std::vector<SimTime> busy;
  /// Per device: the most tasks (micro-batch, stage) holding activation buffers at once.
  std::vector<std::int32_t> peak_in_flight;

  [[nodiscard]] const std::vector<Hazard>& hazards() const { return sim.hazards(); }
  [[nodiscard]] const std::vector<ContentMismatch>& content_mismatches() const {
    return sim.content_mismatches();
  }
};

/// Device `device`'s bubble: the share of the pipeline span its compute stream ran no task
/// kernel, 1 - busy / span (0 without a span).
[[nodiscard]] double device_bubble(const PipelineRun& run, std::size_t device);
/// The step's bubble: the devices' idle compute time over devices x span.
[[nodiscard]] double step_bubble(const PipelineRun& run);

/// Splits the ops into `partitions` contiguous non-empty ranges that minimize the largest sum
/// of forward durations. Returns partitions + 1 start indices (the last is the op count).
Result<std::vector<std::uint32_t>> balance_by_duration(const Model& model, std::int32_t partitions);

/// The layer counts torchtitan's default gives `stages` stages of a model of `layers` layers
/// (generate_llm_fqn_per_model_part with input and output weight 1): layers + 2 layer
/// equivalents spread evenly, the first stages taking one more where they do not divide, the
/// input counted on the first stage and the output on the last. An error where stages exceed
/// layers + 2, as torchtitan refuses.
Result<std::vector<std::int32_t>> layers_per_stage(std::int32_t layers, std::int32_t stages);

/// The partitions `split` gives: partitions + 1 start indices (the last is the op count), and
/// split_name with the reason where Layers fell back to balanced. Errors name `--split` and say
/// what would be accepted.
struct Partitions {
  std::vector<std::uint32_t> starts;
  std::string split;
};
Result<Partitions> partition_model(const Model& model, std::int32_t partitions,
                                   const PipelineSplit& split);

/// Simulates one pipeline training step (`options.schedule`) of `model` (durations assigned) on
/// `options.devices` devices with the same profile. Bad options or models are errors; a failure
/// during the step is reported in PipelineRun::failure.
Result<PipelineRun> simulate_pipeline(const CheckedModel& model, const DeviceProfile& device,
                                      const PipelineOptions& options,
                                      const PipelineFaults& faults = {});
/// check_model(model), then the run above: for a model simulated once.
Result<PipelineRun> simulate_pipeline(const Model& model, const DeviceProfile& device,
                                      const PipelineOptions& options,
                                      const PipelineFaults& faults = {});

/// The single-device reference: one device, one stream, the micro-batches one after another
/// (forward, then backward), no checkpoint, copies or portals. Ops draw random numbers from the
/// generator of the partition they belong to in the `options.devices` layout, so that both runs
/// draw the same numbers. Faults, the checkpoint mode and the offload policy are ignored.
Result<PipelineRun> simulate_reference(const Model& model, const DeviceProfile& device,
                                       const PipelineOptions& options);

}  // namespace ferry::sim
