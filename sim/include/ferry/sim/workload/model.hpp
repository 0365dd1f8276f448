#pragma once
/// A model scenario: the tensors and ops of one training step's forward, with what each op
/// saves for backward. Input of the simulated autograd; JSON form in docs/model-format.md.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/ids.hpp"
#include "ferry/parallelism.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/collective_cost.hpp"
#include "ferry/sim/engine/device_profile.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "ferry/sim/workload/op_family.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// Element type of a tensor.
enum class DType : std::uint8_t { F32, BF16, F16, U8, I64 };

/// Bytes per element of a dtype.
[[nodiscard]] std::int64_t dtype_size(DType dtype);
/// "f32", "bf16", "f16", "u8", "i64".
[[nodiscard]] const char* dtype_name(DType dtype);

/// What a tensor is to the step: who allocates it and whether it may be offloaded.
enum class TensorRole : std::uint8_t {
  Input,       ///< the batch: allocated before forward, lives for the step
  Param,       ///< a weight: resident, never offloaded (excluded like nn.Parameter)
  Buffer,      ///< a module buffer (e.g. running stats): resident, never offloaded
  Activation,  ///< produced by a forward op
  /// An optimizer's state (AdamW's moments): resident, never offloaded; FSDP shards it
  OptimizerState,
};

/// "input", "param", "buffer", "activation", "optimizer_state".
[[nodiscard]] const char* tensor_role_name(TensorRole role);

/// Whether a tensor of `role` is the model's for the whole step (a parameter, a buffer or an
/// optimizer's state): allocated at set-up, never offloaded, never produced by an op.
[[nodiscard]] constexpr bool is_resident(TensorRole role) {
  return role == TensorRole::Param || role == TensorRole::Buffer ||
         role == TensorRole::OptimizerState;
}

/// A tensor. A view shares its base's storage (its bytes lie inside the base's).
struct ModelTensor {
  std::string name;                          ///< unique in the model
  Bytes bytes;                               ///< logical bytes (elements x dtype size)
  DType dtype = DType::BF16;                 ///< element type
  TensorRole role = TensorRole::Activation;  ///< who allocates it
  std::int32_t view_of = -1;  ///< base tensor's index, or -1: a tensor with its own storage
  Bytes view_offset;          ///< byte offset in the base's storage
  bool no_offload = false;    ///< per-tensor opt-out
  /// A static-capacity buffer (docs/parallelism.md, Static capacity and the paged stash): the
  /// bytes allocated for the tensor, of which its first `bytes` hold data; 0: `bytes`. Only a
  /// base activation has one.
  Bytes capacity;
  /// The rows of data in such a buffer (the routed rows its experts compute): a paged stash
  /// pages them. 0 exactly when there is no capacity.
  std::int64_t rows = 0;
  /// The training loop keeps a reference to this base activation past backward (`pred =
  /// model(x)` with no `del pred`): its storage lives until the next step's forward produces it
  /// again (Note [Held activations] in sim/src/autograd/trainer.cpp).
  bool held = false;

  friend bool operator==(const ModelTensor&, const ModelTensor&) = default;
};

/// The bytes a tensor's storage takes: its capacity where it has one, else its bytes.
[[nodiscard]] inline Bytes allocated_bytes(const ModelTensor& tensor) {
  return tensor.capacity > tensor.bytes ? tensor.capacity : tensor.bytes;
}

/// The shape of a matrix product: `batch` products of (m x k) by (k x n); FLOPs 2 m n k batch.
/// All zero: not known (the op is not a matmul, or the file gives no shape).
struct GemmShape {
  std::int64_t m = 0;      ///< rows of the output
  std::int64_t n = 0;      ///< columns of the output
  std::int64_t k = 0;      ///< the contracted dim
  std::int64_t batch = 0;  ///< independent products (bmm's batch); 1 for mm
  [[nodiscard]] bool known() const { return batch > 0; }
  friend bool operator==(const GemmShape&, const GemmShape&) = default;
};

/// The collective a rank's op runs over one axis of the device mesh (the op's "collective",
/// docs/model-format.md, Collective ops): what its forward (and a recomputation of it) and its
/// backward node run over a group of `ranks` ranks spanning `nodes` nodes. Either may be none
/// (tensor parallelism's identity forward with an all-reduce backward). Its time is the link
/// model's for the bytes its tensors hold (collective_op_bytes); it computes nothing else.
struct OpCollective {
  std::optional<CollectiveKind> forward;   ///< none: the forward moves nothing
  std::optional<CollectiveKind> backward;  ///< none: the backward node moves nothing
  MeshAxis axis = MeshAxis::Tensor;
  std::int32_t ranks = 0;  ///< the group's size; 0: the op runs no collective
  std::int32_t nodes = 1;  ///< nodes the group spans: one is the intra-node link
  /// groups of its axis crossing a node's links at once, each with that share of the
  /// inter-node link (Note [Groups sharing a node's links] in collective_cost.cpp)
  std::int32_t sharing = 1;
  [[nodiscard]] bool any() const { return ranks > 0; }
  friend bool operator==(const OpCollective&, const OpCollective&) = default;
};

/// Most groups of one axis crossing a node's links at once (OpCollective::sharing): a node's
/// GPUs, at most 1024.
inline constexpr std::int32_t kMaxGroupsSharingANode = 1024;

/// Largest group a collective op may run over: 2^20 ranks.
inline constexpr std::int32_t kMaxCollectiveRanks = std::int32_t{1} << 20;

/// One forward op and its backward node.
struct ModelOp {
  std::string name;  ///< unique in the model
  /// The operator it runs, `namespace.name.overload` ("aten.mm.default"; empty: not known), with
  /// its family (Operator::family, Note [Operator families]): what the checkpoint policies, the
  /// kernel timing and the rank cuts go by (docs/model-format.md, Op kinds).
  Operator kind;
  std::int32_t layer = -1;             ///< transformer layer, -1 outside the stack
  std::int64_t flops = 0;              ///< forward FLOPs
  Bytes bytes;                         ///< forward bytes read + written (for the roofline)
  std::int64_t backward_flops = 0;     ///< backward FLOPs
  Bytes backward_bytes;                ///< backward bytes read + written
  SimTime duration;                    ///< forward time on the device (from the roofline)
  SimTime backward_duration;           ///< backward time on the device
  std::vector<std::uint32_t> inputs;   ///< tensors read (activations, params, inputs)
  std::vector<std::uint32_t> outputs;  ///< tensors produced (activations, views allowed)
  std::vector<std::uint32_t> saved;    ///< tensors saved for backward
  bool no_offload = false;             ///< runs inside a no-offload region (e.g. the output head)
  bool draws_rng = false;              ///< draws from the device's random generator (dropout)
  bool draws_cpu_rng = false;          ///< draws from the CPU generator (e.g. host-side sampling)
  /// The forward product's shape, for a matmul (optional in the file, "gemm"): backward's two
  /// products follow from it. See docs/model-format.md, Kernel timing.
  GemmShape gemm{};
  /// The collective it runs over a mesh axis (optional in the file, "collective").
  OpCollective collective{};
  /// A grouped matmul's rows in each group, in group order: the rows the router gave each
  /// expert (optional in the file, "group_rows"; `ferry.trace` writes it where the offsets
  /// follow its routing assumption). Empty: not known, taken as balanced.
  std::vector<std::int64_t> group_rows{};

  friend bool operator==(const ModelOp&, const ModelOp&) = default;
};

/// What a trace of a mixture-of-experts model assumed for the routing its shapes depend on
/// (the file's "routing" member, docs/model-format.md, Routing). Recorded with the scenario
/// and written back; the simulation does not read it: the ops' shapes already follow it.
struct RoutingAssumption {
  /// "balanced", "loads" or "random"; empty: the file has no "routing" member.
  std::string assumption{};
  std::vector<double> loads{};  ///< "loads": each expert's relative load
  std::int64_t seed = 0;        ///< "random": the seed
  double capacity_factor = 0;   ///< "random": 0 none, else at least 1

  friend bool operator==(const RoutingAssumption&, const RoutingAssumption&) = default;
};

/// What one optimizer step costs, as a trace measured it over the whole model's parameters (the
/// file's "optimizer_step" member, docs/model-format.md): the bytes its kernels move and the
/// tensors it makes that are alive together at its peak (torch's foreach AdamW: one a
/// parameter, Note [The optimizer step] in sim/src/workload/model.cpp). A rank that steps part
/// of the parameters (a shard, a stage) pays their share.
struct OptimizerStep {
  Bytes bytes;                     ///< read and written by the step's kernels
  std::vector<Bytes> temporaries;  ///< the step's tensors alive at its peak, in creation order

  friend bool operator==(const OptimizerStep&, const OptimizerStep&) = default;
};

/// A training step's forward: tensors, ops in forward order and the loss.
struct Model {
  std::string name;                  ///< e.g. the preset name
  std::vector<ModelTensor> tensors;  ///< ops refer to tensors by index here
  std::vector<ModelOp> ops;          ///< in forward order; backward runs them in reverse
  /// Tensor whose gradient starts backward (the loss); must be produced by the last op.
  std::uint32_t loss = 0;
  /// The file's "parallelism" section, if any (`python -m ferry trace --fsdp N` writes one):
  /// commands train this way unless their own --fsdp says otherwise.
  Parallelism parallelism{};

  /// The file's "allocator" member ("default" or "expandable", read once with the file;
  /// `ferry.trace` writes "expandable" under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True),
  /// none when absent: commands run this caching allocator unless their own --allocator says
  /// otherwise.
  std::optional<AllocatorMode> allocator;
  /// The file's "routing" member, if any (`ferry.trace` of a model whose shapes follow its
  /// routing).
  RoutingAssumption routing{};
  /// The file's "optimizer_step" member: none when absent, and then a model with optimizer
  /// state steps as fused AdamW does (Note [The optimizer step]).
  std::optional<OptimizerStep> optimizer_step;
  /// The file's "matmul_fp32_precision" member: true for "tf32" (the trace ran with torch's
  /// float32 matmul precision at "high" or "medium"), when a float32 product runs on the tensor
  /// cores at the profile's tf32_flops_per_s (Note [Kernel timing]); false for "ieee" or absent,
  /// torch's default.
  bool matmul_tf32 = false;
  /// The file's "conv_fp32_precision" member: true for "tf32" or absent (torch's default,
  /// torch.backends.cudnn.conv.fp32_precision "tf32"), when a float32 convolution runs on the
  /// tensor cores at the profile's tf32_flops_per_s (Note [Kernel timing]); false for "ieee".
  bool conv_tf32 = true;

  friend bool operator==(const Model&, const Model&) = default;
};

/// Whether any tensor of `model` lies in a static-capacity buffer (ModelTensor::capacity).
[[nodiscard]] bool has_static_capacity(const Model& model);

/// Shapes of a transformer stack.
struct TransformerShape {
  /// GPT-2 (LayerNorm, GeLU MLP, dropout), Llama (RMSNorm, GQA, rotary, SwiGLU; one op per
  /// module), or a Llama as `python -m ferry trace` lists a Hugging Face one (aten ops, float32
  /// norms and loss, the head tied to the embedding, AdamW state; flash attention).
  enum class Kind : std::uint8_t { Gpt, Llama, LlamaTraced } kind = Kind::Gpt;
  std::int64_t layers = 1;       ///< transformer blocks
  std::int64_t hidden = 768;     ///< h
  std::int64_t heads = 12;       ///< a, attention heads (divides h)
  std::int64_t kv_heads = 12;    ///< Llama: grouped-query attention (divides heads); GPT ignores it
  std::int64_t ffn = 3072;       ///< MLP inner size (GPT: 4h; Llama: SwiGLU size)
  std::int64_t vocab = 50257;    ///< vocabulary size
  std::int64_t sequence = 1024;  ///< s, tokens per sequence
  std::int64_t micro_batch = 1;  ///< b, sequences per step
  DType dtype = DType::BF16;     ///< activations and params (f32, bf16 or f16)
  bool flash_attention = false;  ///< no s^2 tensors saved (Llama presets use it)
  /// The loss on float32 logits, as torchtitan's `cross_entropy(pred.float(), labels)`: the
  /// logits upcast, their log-softmax saved for backward in float32.
  bool float32_loss = false;
};

/// Builds a transformer training step (embedding, `layers` blocks, final norm, output head
/// inside a no-offload region, loss). Timing is left zero: see assign_roofline_durations.
[[nodiscard]] Model make_transformer(const TransformerShape& shape, std::string name);

/// Per-layer bytes the Korthikanti et al. (2022) formula gives: s*b*h*(34 + 5*a*s/h).
[[nodiscard]] Bytes korthikanti_layer_bytes(const TransformerShape& shape);

/// Sum of the bytes of the distinct activation tensors saved by the ops of `layer`
/// (ModelOp::layer), each tensor counted once and with its own bytes (a view counts its bytes, not
/// its base's). The accounting of Korthikanti et al.; see Note [Counting saved bytes] in model.cpp.
[[nodiscard]] Bytes saved_activation_bytes(const Model& model, std::int32_t layer);

/// Assumed fraction of peak FLOP/s a kernel reaches, in thousandths (an assumption, not measured):
/// the flat roofline's, for profiles without kernel figures and kernels they give none for.
inline constexpr std::int64_t kRooflineFlopsPermille = 600;
/// Assumed fraction of memory bandwidth a kernel reaches, in thousandths (an assumption): the
/// flat roofline's, for profiles without a measured `kernels.memory_permille`.
inline constexpr std::int64_t kRooflineBandwidthPermille = 800;

/// Largest m, n, k or batch of a GemmShape: 2^40.
inline constexpr std::int64_t kMaxGemmDim = std::int64_t{1} << 40;
/// Most groups of a grouped matmul's ModelOp::group_rows: 2^20.
inline constexpr std::int32_t kMaxGroups = std::int32_t{1} << 20;

/// The fraction of HBM bandwidth, in thousandths, that `device`'s kernels reach: its
/// `kernels.memory_permille`, else kRooflineBandwidthPermille.
[[nodiscard]] inline std::int64_t memory_permille(const DeviceProfile& device) {
  return device.kernels.memory_permille > 0 ? device.kernels.memory_permille
                                            : kRooflineBandwidthPermille;
}

/// The experts a grouped matmul's weights hold: one `gemm` k x n matrix each in its largest
/// parameter input (or a view of one); nullopt where it reads no parameter or has no shape.
[[nodiscard]] std::optional<std::int64_t> grouped_matmul_experts(const Model& model,
                                                                 const ModelOp& op);

/// Bytes of the parameters an optimizer steps: the tensors of role Param (a frozen parameter is
/// a Buffer), each storage once.
[[nodiscard]] Bytes trainable_param_bytes(const Model& model);

/// `figure` scaled by `part` / `whole` (both positive), rounded up: a part's share of a whole
/// model's measured figure.
[[nodiscard]] Bytes share_of(Bytes figure, Bytes part, Bytes whole);
/// Each figure of `step` (its bytes, each temporary) scaled so.
[[nodiscard]] OptimizerStep share_of(const OptimizerStep& step, Bytes part, Bytes whole);

/// What a rank's optimizer step costs: the bytes its kernels move and the tensors it makes and
/// frees, alive together at its peak (Note [The optimizer step] in model.cpp).
struct StepCost {
  Bytes moved;
  std::vector<Bytes> temporaries;
};

/// The step of `params` bytes of `model`'s parameters, with `grads` bytes of their gradients and
/// `state` bytes of optimizer state: their share of the traced figures (Model::optimizer_step),
/// or, without them, what fused AdamW moves (reads parameters, gradients and state, writes
/// parameters and state) and no temporaries. Nothing when the model names no optimizer (no
/// figures and no state).
[[nodiscard]] StepCost optimizer_step_cost(const Model& model, Bytes params, Bytes grads,
                                           Bytes state);

/// The time of a kernel bound by `device`'s memory bandwidth that moves `bytes`: at
/// memory_permille of the bandwidth, at least 1 ns.
[[nodiscard]] SimTime streaming_time(const DeviceProfile& device, Bytes bytes);

/// Whether every op's roofline times on `device` are at most kMaxJsonNanoseconds, the longest
/// duration the format allows (a slow device profile and a large op can give more), and the
/// device has the link each collective op runs over; the error names the op's count
/// ("ops[3].flops: ...") or collective. Call before assign_roofline_durations.
Status check_roofline(const Model& model, const DeviceProfile& device);

/// The bytes the ring formula takes (collective_time) for `op`'s collective in its forward
/// (`backward`: in its backward node, which moves the gradients of the forward's outputs into
/// those of its inputs): an all-gather's output, a reduce-scatter's input, an all-reduce's
/// buffer, the larger of an all-to-all's input and output, each summed over the op's tensors.
/// 0 when that direction runs no collective.
[[nodiscard]] Bytes collective_op_bytes(const Model& model, const ModelOp& op, bool backward);

/// Sets every op's forward and backward duration from the device's peak FLOP/s and memory
/// bandwidth: max(compute, bytes / (bandwidth x memory_permille)), rounded up to whole
/// nanoseconds and at least 1 ns. Compute is flops / (peak x 0.6) on a profile without kernel
/// figures; with them, a matmul with a shape is timed by tiles and waves, attention by its
/// kernel's efficiency (docs/model-format.md, Kernel timing). A collective op takes its
/// collective's time over the device's links (collective_time; 1 ns in a direction that runs
/// none). The model must pass check_roofline on `device`.
void assign_roofline_durations(Model& model, const DeviceProfile& device);

/// Names of the built-in presets ("gpt2-small-s1024", "llama3-8b-s8192", ...).
[[nodiscard]] std::vector<std::string> model_preset_names();
/// A built-in preset by name; the error lists the names.
Result<Model> model_preset(std::string_view name);
/// The shape a built-in preset is made from; the error lists the names.
Result<TransformerShape> model_preset_shape(std::string_view name);

/// Largest FLOP count of one op (forward or backward): 10^18, a million seconds at 1 PFLOP/s.
/// Byte counts are bounded by kMaxJsonBytes and durations by kMaxJsonNanoseconds, as in JSON.
inline constexpr std::int64_t kMaxModelFlops = 1'000'000'000'000'000'000;

/// Checks a model's consistency (indices in range, counts within bounds, views inside bases, each
/// activation produced once before use, the loss produced by the last op); the error names the
/// place. A valid model survives model_to_json and parse_model unchanged.
Status validate_model(const Model& model);

/// A model validate_model accepted, checked once (its durations assigned first, if they are to
/// be): the simulations take it and do not check it again, so a plan's search, which runs
/// hundreds of them on one model, checks it once. Only check_model, parse_checked_model (whose
/// reader checks what it reads) and with_roofline_durations make one; copies share the model,
/// which no one changes.
class CheckedModel {
 public:
  [[nodiscard]] const Model& model() const { return *model_; }
  const Model& operator*() const { return *model_; }
  const Model* operator->() const { return model_.get(); }

 private:
  explicit CheckedModel(std::shared_ptr<Model> model) : model_(std::move(model)) {}
  friend Result<CheckedModel> check_model(Model model);
  friend Result<CheckedModel> parse_checked_model(std::string_view text, std::string_view source);
  friend Result<CheckedModel> with_roofline_durations(CheckedModel model,
                                                      const DeviceProfile& device);

  std::shared_ptr<Model> model_;  // changed only by with_roofline_durations, while unshared
};

/// How many of `op`'s saved tensors, in order, are its inputs (and not its outputs): torch's
/// autograd kernel packs those before the op runs (Note [A replay ends before the op it no
/// longer needs] in sim/src/autograd/trainer_backward.cpp).
[[nodiscard]] std::size_t saved_before_running(const ModelOp& op);

/// `model` as a CheckedModel, or validate_model's error.
Result<CheckedModel> check_model(Model model);

/// `model` with every op's durations from `device`'s roofline: check_roofline's error, or the
/// model with assign_roofline_durations applied. The durations are all that changes, and
/// check_roofline has bounded them as validate_model bounds them, so the model is not checked
/// again. A model no copy shares is changed in place.
Result<CheckedModel> with_roofline_durations(CheckedModel model, const DeviceProfile& device);

}  // namespace ferry::sim
