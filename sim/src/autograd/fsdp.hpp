#pragma once
// Private to the simulated autograd: FSDP2 on one rank, as step hooks beside the Trainer
// (Note [FSDP2, one rank] in fsdp.cpp, Note [Step hooks]).

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "ferry/sim/engine/collective_cost.hpp"
#include "step_hooks.hpp"

namespace ferry::sim::training {

// One fully_shard unit of FSDP2: a layer's parameters, the root's (those outside the layers),
// or under expert parallelism a layer's experts (Note [FSDP2, one rank] in fsdp.cpp).
struct FsdpUnit {
  std::int32_t layer = -1;     // -1: the root
  bool experts = false;        // a layer's experts, sharded over the expert shard group
  std::int32_t group = 1;      // the ranks it is sharded over
  GroupPlacement placement{};  // where they lie
  GroupPlacement post_forward_placement{};  // the ranks a 1/K shard kept after forward spans
  std::vector<std::uint32_t> params;        // base parameter tensors, in model order
  std::vector<Bytes> offsets;               // each one's offset in the unsharded buffer
  Bytes bytes;                              // unsharded, in the model's dtype
  Bytes master;                // unsharded, in the sharded dtype (f32 with mixed precision)
  std::int32_t first_op = -1;  // its layer's forward ops [first_op, last_op]
  std::int32_t last_op = -1;
  Device::Buffer shard{};                      // this rank's shard of the parameters, resident
  std::optional<Device::Buffer> moments;       // AdamW's two moments of the shard
  std::optional<Device::Buffer> sharded_grad;  // this rank's reduced gradient, until zero_grad
  std::optional<Device::Buffer> unsharded;     // the parameters, gathered
  std::optional<Device::Buffer> post_forward;  // the 1/k shard kept after forward
  std::optional<Device::Event> post_forward_event;
  std::optional<Device::Buffer> gathering;  // an all-gather's output, before its copy-out
  std::optional<Device::Event> gathered;    // recorded after that all-gather
};

// FSDP2 (`fully_shard` on every layer, then on the root) as one rank runs it: the units, the
// streams of their collectives, and the hooks that unshard, reshard and reduce them.
class Fsdp2 final : public StepHooks {
 public:
  // Keeps references to every argument; adds its streams at setup.
  Fsdp2(const Model& model, const Graph& graph, const TrainingOptions& options,
        const FsdpFaults& faults, RankContext& rank);

  [[nodiscard]] Status validate() const override;
  [[nodiscard]] bool holds(const ModelTensor& tensor) const override;
  void setup(std::vector<Region>& writes, std::vector<std::uint64_t>& values) override;
  void before_op(std::uint32_t op) override;
  void after_op(std::uint32_t op) override;
  void before_replay(std::uint32_t op) override;
  void backward_begin(const std::vector<std::uint32_t>& order) override;
  void before_node(std::uint32_t node) override;
  void after_node(std::size_t k, std::uint32_t node) override;
  void backward_end() override;
  void optimizer_step() override;

 private:
  // The rank's current stream: where the Trainer issues the hooked op or node.
  StreamId current() const { return rank_.current_stream(); }
  // Note [SimpleFSDP's pool]: the stream FSDP2 uses for a buffer (`stream`), or under
  // SimpleFSDP the compute stream, which allocates it and runs the kernels on it.
  bool simple() const { return parallelism_.impl == FsdpImpl::Simple; }
  /// torch 2.4's FSDP2: the reduce-scatter's copy-in on its stream (Note [torch 2.4's copy-in]).
  bool copy_in_on_rs_stream() const { return parallelism_.impl == FsdpImpl::Fsdp2Torch24; }
  StreamId or_compute(StreamId stream) const { return simple() ? current() : stream; }
  // The innermost unit op `i` runs under: its layer's experts' for the ops from the first to
  // the last that reads them, else its layer's, else the root's.
  std::size_t unit_of_op(std::uint32_t i) const;
  // Its layer's unit (or the root's), whether or not the op is among the experts'.
  std::size_t layer_unit_of_op(std::uint32_t i) const;
  // setup's steps: each base parameter's owner, its layer's or (-1) the root's; under expert
  // parallelism the experts' weights; the units they form; the ops each unit spans; and this
  // rank's shard of each, placed over its group.
  std::map<std::uint32_t, std::int32_t> param_owners() const;
  std::set<std::uint32_t> expert_weights(const std::map<std::uint32_t, std::int32_t>& owner) const;
  void form_units(const std::map<std::uint32_t, std::int32_t>& owner,
                  const std::set<std::uint32_t>& expert_params);
  void span_units(const std::set<std::uint32_t>& expert_params);
  void allocate_shards(std::vector<Region>& writes, std::vector<std::uint64_t>& values);
  void unshard(std::size_t u);
  void wait_for_unshard(std::size_t u, bool forward);
  void reshard(std::size_t u, bool after_forward);
  void reduce_gradients(std::size_t u);
  /// A unit's gradients copied into a new reduce-scatter input, on the stream its FSDP2 runs
  /// the copy-in on (Note [torch 2.4's copy-in]); the gradients freed.
  Device::Buffer copy_in(const FsdpUnit& unit, const std::vector<Region>& grads,
                         const std::vector<Device::Buffer>& held, Bytes input_bytes,
                         const std::string& name);
  /// copy_in as torch 2.5 on (and SimpleFSDP) runs it: on the current stream.
  Device::Buffer copy_in_on_current(const FsdpUnit& unit, const std::vector<Region>& grads,
                                    const std::vector<Device::Buffer>& held, Bytes input_bytes,
                                    const std::string& name);
  /// copy_in as torch 2.4 and before ran it: on the reduce-scatter stream.
  Device::Buffer copy_in_on_reduce_scatter(const FsdpUnit& unit, const std::vector<Region>& grads,
                                           const std::vector<Device::Buffer>& held,
                                           Bytes input_bytes, const std::string& name);
  /// The gradients `reduced` in the compute dtype cast into a new float32 shard of
  /// `shard_bytes`, after the collective on `stream` (Note [The reduce dtype]).
  Device::Buffer cast_to_shard(const FsdpUnit& unit, const Device::Buffer& reduced,
                               Bytes shard_bytes, StreamId stream);
  /// `buffer`, from `pool`'s pool, dropped if `last_reader` is that stream, else held in
  /// reduced_held_ (Note [The reduce dtype]).
  void release_reduced(const Device::Buffer& buffer, StreamId pool, StreamId last_reader);
  /// The input allocated on `stream` and the copy-in kernel run there.
  Device::Buffer copy_in_kernel(StreamId stream, const FsdpUnit& unit,
                                const std::vector<Region>& grads, Bytes input_bytes,
                                const std::string& name);
  void bind_unit(std::size_t u, Device::Buffer buffer);
  SimTime memory_time(Bytes bytes);
  const CollectiveLinks& links() const { return sim_.device_profile(dev_).collectives; }
  // `waiter` waits for the work issued on `on` so far.
  void comm_wait(StreamId waiter, StreamId on);

  const Model& model_;
  const Graph& graph_;
  const TrainingOptions& options_;
  const ParallelOptions& fsdp_;     // options_.parallel
  const Parallelism& parallelism_;  // fsdp_.mesh
  const FsdpFaults& faults_;
  RankContext& rank_;
  Simulator& sim_;  // rank_.sim()
  DeviceId dev_;    // rank_.device_id()
  Device& device_;  // rank_.device()

  std::vector<FsdpUnit> units_;  // the root first, then the layers in forward order
  std::map<std::int32_t, std::size_t> unit_of_layer_;
  std::map<std::int32_t, std::size_t> experts_of_layer_;  // layer -> its experts' unit
  StreamId copy_in_, all_gather_, reduce_scatter_, all_reduce_;
  // FSDP2's all_gather_state: the previous forward all-gather's output, freed once the AG
  // streams wait for its copy-out.
  std::optional<Device::Buffer> prev_gather_;
  std::optional<Device::Event> prev_copy_out_;
  // FSDP2's reduce_scatter_state: the previous reduce-scatter's input and its event.
  std::optional<Device::Buffer> prev_rs_input_;
  /// HSDP's all-reduced gradients from the reduce-scatter stream's pool, cast to their shards
  /// or accumulated already on the all-reduce stream, until the current stream waits for the
  /// last reduction (Note [The reduce dtype]).
  std::vector<Device::Buffer> reduced_held_;
  std::optional<Device::Event> prev_rs_event_;
  std::optional<Device::Event> last_reduce_;  // the last reduce (and all-reduce) of backward
  std::vector<std::size_t> backward_units_;   // units by first node in backward order
  std::vector<bool> pre_backward_done_;
  std::vector<std::int32_t> last_node_;  // per unit: its last node in backward order
  // Where rank 0's HSDP replica group lies (docs/fsdp.md, "The link model"); each unit holds
  // its shard group's.
  GroupPlacement replica_group_;
};

}  // namespace ferry::sim::training
