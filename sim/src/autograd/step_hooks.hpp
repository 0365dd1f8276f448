#pragma once
// Private to the simulated autograd: the hooks a parallelism sets on a training step, and the
// part of the rank they reach (Note [Step hooks]).

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/result.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/device/device.hpp"
#include "graph.hpp"
#include "values.hpp"

namespace ferry::sim::training {

// Note [Step hooks]
// A parallelism (DDP's all-reduce, FSDP2) acts on a training step the way torch's does on a real
// one: it hooks the modules' forward (pre- and post-forward of the ops of each unit), the autograd
// engine's nodes and its final callback, and the optimizer step, and the engine itself never
// asks which parallelism runs. The Trainer is that engine: it calls every hook of one
// StepHooks object at fixed points of the step, and a run with no parallelism gets the base
// class, whose hooks do nothing. The hooks reach the rank through a RankContext, which names
// everything they may touch: the simulator and the device, the current stream, allocation on a
// chosen stream, where each parameter lives, the parameters' gradients, and the saved-tensor
// hooks around the step's packs. Which hooks a run gets is decided once, in make_step_hooks; a
// new parallelism is a new StepHooks there.
//
// A technique that is no parallelism takes the same channel. The paged stash (Note [Paged
// stash] in paged_stash.cpp) is a StepHooks unit: it allocates its pool at set-up (reserve),
// starts its free lists over at each step (step_begin), issues and awaits its copies at the
// forward's op boundaries and the backward's nodes, and reports its figures into the run
// (report); the saved tensors it keeps reach it through the SavedTensorHook it pushes on the
// rank, as torch's saved_tensors_hooks context pushes a pack/unpack pair on the engine. Chained
// with a parallelism, its hooks run after the parallelism's at every point (HookChain's
// followers). The Trainer names none of DDP, FSDP2 and the stash.

/// A parameter's content value: its index (Note [Content values]).
[[nodiscard]] constexpr std::uint64_t param_value(std::uint32_t p) {
  return mix_content(tag::kParam, p);
}

/// A pack/unpack pair around the step's saved tensors, as torch's saved_tensors_hooks (Note
/// [Step hooks]): the Trainer offers it every pack outside a checkpoint, before the offloader,
/// and hands back to it the unpacks and releases of what it took. Ops and nodes are model op
/// indices; a tensor is a model tensor index.
class SavedTensorHook {
 public:
  SavedTensorHook() = default;
  SavedTensorHook(const SavedTensorHook&) = delete;
  SavedTensorHook& operator=(const SavedTensorHook&) = delete;

  /// Whether the hook packs tensor `t`, which op `op` saves; if not, the next hook out (or the
  /// offloader) does.
  [[nodiscard]] virtual bool takes(std::uint32_t op, std::uint32_t t) const = 0;
  /// Packs tensor `t`, which op `op` saves and which lives at `offset` in `buffer`; the hook
  /// holds a reference. Returns its id for unpack and release.
  virtual std::uint32_t pack(std::uint32_t op, std::uint32_t t, Device::Buffer buffer,
                             Bytes offset) = 0;
  /// The tensor behind `id` (where it lives, at which offset), and a reference for the caller.
  virtual std::pair<Device::Buffer, Bytes> unpack(std::uint32_t id) = 0;
  /// Autograd lets go of `id`.
  virtual void release(std::uint32_t id) = 0;

 protected:
  ~SavedTensorHook() = default;
};

/// What a parallelism's hooks reach of the rank they run on (Note [Step hooks]).
class RankContext {
 public:
  RankContext() = default;
  RankContext(const RankContext&) = delete;
  RankContext& operator=(const RankContext&) = delete;

  /// The simulator the rank runs on.
  virtual Simulator& sim() = 0;
  /// The rank's device in sim().
  [[nodiscard]] virtual DeviceId device_id() const = 0;
  /// The Backend over that device.
  virtual Device& device() = 0;
  /// The stream the rank's work is issued on now.
  [[nodiscard]] virtual StreamId current_stream() const = 0;
  /// Allocates from `stream`'s pool, as the caching allocator does; no room ends the step.
  virtual Device::Buffer allocate_on(StreamId stream, Bytes bytes, std::string_view name) = 0;
  /// Parameter `p` (a base tensor) lives at `offset` in `buffer` from now on.
  virtual void bind_param(std::uint32_t p, Device::Buffer buffer, Bytes offset) = 0;
  /// Takes parameter `p`'s gradient, if backward wrote one: the caller owns that reference.
  virtual std::optional<Device::Buffer> take_param_grad(std::uint32_t p) = 0;
  /// Parameter `p`'s gradient, which backward wrote, and its content value; the rank keeps its
  /// reference.
  [[nodiscard]] virtual std::pair<Device::Buffer, std::uint64_t> param_grad(
      std::uint32_t p) const = 0;
  /// Bytes [offset, offset + bytes) of `buffer` hold content value `value` now.
  virtual void note_write(Device::Buffer buffer, Bytes offset, Bytes bytes,
                          std::uint64_t value) = 0;
  /// From now on `hook` is offered the step's packs, inside the hooks pushed before it; it must
  /// outlive the rank's step hooks.
  virtual void push_saved_tensor_hook(SavedTensorHook& hook) = 0;

 protected:
  ~RankContext() = default;
};

/// A kernel of an op as the Trainer is about to issue it on the current stream: op `op`'s
/// forward, a recomputation of it, or its backward node, with what it reads and writes (the
/// outputs already allocated on the current stream) and the content values of its writes.
struct Launch {
  enum class Phase : std::uint8_t { Forward, Replay, Backward };
  std::uint32_t op = 0;
  Phase phase = Phase::Forward;
  std::span<const Region> reads;
  std::span<const Region> writes;
  std::span<const std::uint64_t> values;  ///< one per write, or empty
  std::string_view label;
};

/// The hooks a parallelism sets on a training step; each default does nothing (Note [Step
/// hooks]). Ops and nodes are model op indices.
class StepHooks {
 public:
  StepHooks() = default;
  StepHooks(const StepHooks&) = delete;
  StepHooks& operator=(const StepHooks&) = delete;
  virtual ~StepHooks() = default;

  /// Checks the run's options against the device, before set-up.
  [[nodiscard]] virtual Status validate() const { return Ok{}; }
  /// Whether the parallelism holds this tensor's storage itself: the Trainer neither allocates
  /// it nor, for a parameter, saves it through the offloader.
  [[nodiscard]] virtual bool holds(const ModelTensor& /*tensor*/) const { return false; }
  /// At set-up, once the Trainer has allocated what it holds: what the parallelism holds, with
  /// its initial bytes added to the parameters' initialization kernel.
  virtual void setup(std::vector<Region>& /*writes*/, std::vector<std::uint64_t>& /*values*/) {}
  /// At set-up, after the Trainer's cuBLAS workspaces: what the unit holds for the whole run
  /// beside the parameters (the paged stash's pool).
  virtual void reserve() {}
  /// At a step's start, inside its offload context, before forward.
  virtual void step_begin() {}
  /// Before forward op `op` runs (and before any checkpoint region starting there opens).
  virtual void before_op(std::uint32_t /*op*/) {}
  /// After forward op `op` and the checkpoint regions ending there.
  virtual void after_op(std::uint32_t /*op*/) {}
  /// Before a recomputation runs forward op `op` again.
  virtual void before_replay(std::uint32_t /*op*/) {}
  /// At the start of a backward that runs nodes in `order`.
  virtual void backward_begin(const std::vector<std::uint32_t>& /*order*/) {}
  /// Before backward node `node` runs.
  virtual void before_node(std::uint32_t /*node*/) {}
  /// Backward, in a pass that frees the graph, once the last node that writes parameter `p`'s
  /// gradient has issued its kernel: the gradient is final (torch's post-accumulate-grad hook,
  /// where DDP's reducer starts its all-reduce).
  virtual void grad_ready(std::uint32_t /*p*/) {}
  /// After backward node `node`, the `k`-th in the backward's order.
  virtual void after_node(std::size_t /*k*/, std::uint32_t /*node*/) {}
  /// The engine's final callback, back on the caller's stream.
  virtual void backward_end() {}
  /// After the step's last backward: the optimizer step and zero_grad.
  virtual void optimizer_step() {}
  /// Issues `launch` itself and returns true (as a DTensor's dispatch issues a collective on
  /// its process group's stream), or returns false: the Trainer issues it as a kernel of the
  /// op's duration on the current stream. Asked for every op, recomputation and node.
  virtual bool launch(const Launch& /*launch*/) { return false; }
  /// At a step's end: what the unit reports of the step into `run`.
  virtual void report(TrainingRun& /*run*/) const {}
};

/// Several units' hooks on one step. The wrappers come in the order they nest, outermost first
/// (FSDP2 wraps the modules whose ops run collectives): hooks before an event are called outer
/// to inner, hooks after it inner to outer, as nested module hooks run. The followers wrap no
/// module (the paged stash, keyed to op and node boundaries): at every point each of their
/// hooks runs after all the wrappers', in list order. validate returns the first error, holds
/// is any unit's answer, and the first unit that takes a launch issues it.
class HookChain final : public StepHooks {
 public:
  HookChain(std::vector<std::unique_ptr<StepHooks>> wrappers,
            std::vector<std::unique_ptr<StepHooks>> followers)
      : wrappers_(std::move(wrappers)), followers_(std::move(followers)) {}

  [[nodiscard]] Status validate() const override;
  [[nodiscard]] bool holds(const ModelTensor& tensor) const override;
  void setup(std::vector<Region>& writes, std::vector<std::uint64_t>& values) override;
  void reserve() override;
  void step_begin() override;
  void before_op(std::uint32_t op) override;
  void after_op(std::uint32_t op) override;
  void before_replay(std::uint32_t op) override;
  void backward_begin(const std::vector<std::uint32_t>& order) override;
  void before_node(std::uint32_t node) override;
  void grad_ready(std::uint32_t p) override;
  void after_node(std::size_t k, std::uint32_t node) override;
  void backward_end() override;
  void optimizer_step() override;
  bool launch(const Launch& launch) override;
  void report(TrainingRun& run) const override;

 private:
  // Calls `hook` on every wrapper outer to inner (or inner to outer), then on every follower.
  template <typename Hook>
  void outer_to_inner(Hook&& hook) const;
  template <typename Hook>
  void inner_to_outer(Hook&& hook) const;

  std::vector<std::unique_ptr<StepHooks>> wrappers_;
  std::vector<std::unique_ptr<StepHooks>> followers_;
};

/// The hooks a run of `options` gets: its parallelism's (DDP's all-reduce or FSDP2's; the mesh
/// collectives' when the model has collective ops) and the paged stash's when it is on,
/// chained, or the no-op base. They keep references to every argument.
[[nodiscard]] std::unique_ptr<StepHooks> make_step_hooks(const Model& model, const Graph& graph,
                                                         const TrainingOptions& options,
                                                         const TrainingFaults& faults,
                                                         RankContext& rank);

}  // namespace ferry::sim::training
