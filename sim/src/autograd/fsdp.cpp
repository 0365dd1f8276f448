#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <utility>

#include "fsdp.hpp"

namespace ferry::sim {
namespace training {

// Note [FSDP2, one rank]
// FSDP2 (`fully_shard` on every transformer layer, then on the root) as rank 0 of `ranks`
// runs it. Ranks are symmetric: every rank runs the same program on its own shard, so one
// rank is simulated and the others are the link model (skew between ranks is not modelled: a
// collective starts when this rank reaches it and takes the ring time). Per unit (a layer's
// parameters, or the root's: those read outside the layers), following torch 2.11's
// `_fsdp_param_group.py` and `_fsdp_collectives.py`:
//
//  * resident: this rank's shard of the parameters and, from the first optimizer step, AdamW's
//    two moments of it (f32 with mixed precision); the reduced gradient shard from the
//    reduce-scatter to zero_grad.
//  * unshard (pre-forward, pre-backward, backward prefetch): on the all-gather copy-in stream
//    the all-gather output is allocated and this rank's part cast into it; the all-gather
//    stream waits for the copy-in and runs the collective; an event is recorded.
//  * wait_for_unshard: the current stream waits for that event and copies the output out into
//    the unsharded parameters (allocated there). In forward the output stays until the next
//    unit's wait (all_gather_state: the AG streams wait for this copy-out first), so the next
//    all-gather overlaps this copy-out; in backward the AG streams wait for the copy-out and
//    the output goes at once. The root's post-forward frees the last one.
//  * reshard: after a layer's forward (not the root's), the unsharded parameters go; with an
//    int k a 1/k shard is kept first (its event is waited for by the AG streams), and the
//    backward all-gather is over k ranks. After a unit's backward they go in any case; the
//    root's at the end of backward (FSDP2's final callback), since its forward spans them all.
//  * reduce (post-backward): the previous reduce-scatter input is freed once the current
//    stream waits for it; on the current stream the gradients are copied into a reduce-scatter
//    input in the reduce dtype and freed; the reduce-scatter stream waits and runs the
//    collective into the new gradient shard; with replicas (HSDP) the all-reduce stream
//    all-reduces that shard. At the end of backward the current stream waits for the last.
//  * the optimizer step reads and writes the shards; zero_grad(set_to_none) frees the
//    gradient shards.
//
// A shard group of one rank (--fsdp 1, or HSDP with one rank per group) gathers and
// reduce-scatters nothing: the shard is copied into the unsharded parameters on the current
// stream, and the reduce-scatter input into the gradient shard on the reduce-scatter stream.
//
// Collectives run on the device's collective engine (Note [Collectives]). The backward
// prefetch is FSDP2's default, one unit ahead; forward has no explicit prefetch, the host
// running ahead of the device issues the next all-gather early, as in a real run.
//
// The Trainer knows none of this: Fsdp2 is its StepHooks (Note [Step hooks]), as FSDP2 is
// module and autograd hooks in torch. before_op and after_op are a unit's pre- and
// post-forward (the root's around the whole forward), before_node its pre-backward with the
// prefetch, after_node its post-backward at its last node, backward_end the final callback,
// before_replay the pre-forward of a recomputation, and optimizer_step the step and zero_grad.

// Note [SimpleFSDP's pool]
// SimpleFSDP (torchtitan's `simple_fsdp.py`, run by its graph trainer; Zhang et al., "SimpleFSDP:
// Simpler Fully Sharded Data Parallel with torch.compile", arXiv:2411.00284) shards the same
// parameters and runs the same collectives, as functional collectives in the step's graph: each
// one's output is allocated by the stream that issues it, the compute stream, and the
// collective runs on the communicator's stream, which the compute stream waits for before it
// reads the output (`wait_tensor`). So every buffer of its collectives comes from the compute
// stream's pool, where FSDP2 allocates the all-gather output on its copy-in stream and the
// gradient shard on its reduce-scatter stream, whose pools keep what they freed for those
// streams only (docs/fsdp.md, SimpleFSDP). `Parallelism::impl` Simple runs FSDP2's schedule
// and collectives with the copy-in (this rank's shard cast into the all-gather input) on the
// compute stream, as the graph runs it, and the all-gather output and the gradient shard
// allocated there (and a second backward's accumulation into the shard run there, after the
// reduce-scatter). A collective's stream waits for the compute stream before it writes a block
// from that pool, and the compute stream waits for the collective before it reads or frees the
// block, so a block is never handed out again while a collective may still use it
// (SimpleFsdp.PlantedFaultsAreReported).

namespace {

Bytes ceil_div(Bytes bytes, std::int64_t parts) {
  return Bytes((bytes.count() + parts - 1) / parts);
}

constexpr std::size_t kRootUnit = 0;  // Fsdp2::units_: the root first

}  // namespace

Fsdp2::Fsdp2(const Model& model, const Graph& graph, const TrainingOptions& options,
             const FsdpFaults& faults, RankContext& rank)
    : model_(model),
      graph_(graph),
      options_(options),
      fsdp_(options.parallel),
      parallelism_(options.parallel.mesh),
      faults_(faults),
      rank_(rank),
      sim_(rank.sim()),
      dev_(rank.device_id()),
      device_(rank.device()) {}

// The mesh was checked against the device where it was chosen (Mesh::make).
Status Fsdp2::validate() const {
  if (options_.side.all_reduce) {
    return Error{"FSDP reduce-scatters gradients: DDP's all-reduce does not apply"};
  }
  return Ok{};
}

// The parameters are sharded per unit, and the optimizer's state is FSDP's own.
bool Fsdp2::holds(const ModelTensor& tensor) const {
  return tensor.role == TensorRole::Param || tensor.role == TensorRole::OptimizerState;
}

std::size_t Fsdp2::layer_unit_of_op(std::uint32_t i) const {
  const auto it = unit_of_layer_.find(model_.ops[i].layer);
  return it == unit_of_layer_.end() ? 0 : it->second;
}

std::size_t Fsdp2::unit_of_op(std::uint32_t i) const {
  const auto it = experts_of_layer_.find(model_.ops[i].layer);
  if (it != experts_of_layer_.end()) {
    const FsdpUnit& experts = units_[it->second];
    const auto at = static_cast<std::int32_t>(i);
    if (at >= experts.first_op && at <= experts.last_op) return it->second;
  }
  return layer_unit_of_op(i);
}

SimTime Fsdp2::memory_time(Bytes bytes) { return streaming_time(sim_.device_profile(dev_), bytes); }

void Fsdp2::comm_wait(StreamId waiter, StreamId on) {
  const Device::Event e = device_.make_event();
  device_.record(e, Device::Stream{on});
  device_.wait(Device::Stream{waiter}, e);
}

void Fsdp2::bind_unit(std::size_t u, Device::Buffer buffer) {
  const FsdpUnit& unit = units_[u];
  for (std::size_t j = 0; j < unit.params.size(); ++j) {
    rank_.bind_param(unit.params[j], buffer, unit.offsets[j]);
  }
}

void Fsdp2::setup(std::vector<Region>& writes, std::vector<std::uint64_t>& values) {
  // The groups of rank 0 (Note [FSDP2, one rank]) as the mesh lays them out.
  replica_group_ = fsdp_.mesh.group(Mesh::Axis::Replicate).placement();
  copy_in_ = sim_.add_stream(dev_, "all_gather_copy_in");
  all_gather_ = sim_.add_stream(dev_, "all_gather");
  reduce_scatter_ = sim_.add_stream(dev_, "reduce_scatter");
  if (parallelism_.replicas > 1) all_reduce_ = sim_.add_stream(dev_, "all_reduce");
  const std::map<std::uint32_t, std::int32_t> owner = param_owners();
  const std::set<std::uint32_t> experts = expert_weights(owner);
  form_units(owner, experts);
  span_units(experts);
  allocate_shards(writes, values);
}

std::map<std::uint32_t, std::int32_t> Fsdp2::param_owners() const {
  // A parameter belongs to the layer whose ops read it, or to the root when read outside the
  // layers or by several (a tied embedding).
  std::map<std::uint32_t, std::int32_t> owner;
  for (const ModelOp& op : model_.ops) {
    for (const std::uint32_t t : op.inputs) {
      const std::uint32_t b = graph_.base[t];
      if (model_.tensors[b].role != TensorRole::Param) continue;
      const auto [it, fresh] = owner.emplace(b, op.layer);
      if (!fresh && it->second != op.layer) it->second = -1;
    }
  }
  return owner;
}

std::set<std::uint32_t> Fsdp2::expert_weights(
    const std::map<std::uint32_t, std::int32_t>& owner) const {
  // Under expert parallelism a layer's experts (the weights of its grouped matmuls) are a unit
  // of their own, as torchtitan applies fully_shard to them over the expert shard group.
  std::set<std::uint32_t> expert_params;
  if (parallelism_.ep <= 1) return expert_params;
  for (const ModelOp& op : model_.ops) {
    if (!is_grouped_matmul_kind(op.kind) || op.layer < 0) continue;
    for (const std::uint32_t t : op.inputs) {
      const std::uint32_t b = graph_.base[t];
      if (model_.tensors[b].role == TensorRole::Param && owner.at(b) == op.layer) {
        expert_params.insert(b);
      }
    }
  }
  return expert_params;
}

void Fsdp2::form_units(const std::map<std::uint32_t, std::int32_t>& owner,
                       const std::set<std::uint32_t>& expert_params) {
  units_.assign(1, FsdpUnit{});
  unit_of_layer_ = {{-1, 0}};  // the root
  experts_of_layer_.clear();
  for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
    const ModelTensor& tensor = model_.tensors[t];
    if (tensor.role != TensorRole::Param || tensor.view_of >= 0) continue;
    const auto it = owner.find(t);
    const std::int32_t layer = it == owner.end() ? -1 : it->second;
    const bool experts = expert_params.contains(t);
    auto& units = experts ? experts_of_layer_ : unit_of_layer_;
    const auto [slot, fresh] = units.emplace(layer, units_.size());
    if (fresh) {
      FsdpUnit& added = units_.emplace_back();
      added.layer = layer;
      added.experts = experts;
    }
    FsdpUnit& unit = units_[slot->second];
    unit.params.push_back(t);
    unit.offsets.push_back(unit.bytes);
    unit.bytes += tensor.bytes;
    unit.master += fsdp_.mixed_precision
                       ? Bytes(tensor.bytes.count() / dtype_size(tensor.dtype) * 4)
                       : tensor.bytes;
  }
}

void Fsdp2::span_units(const std::set<std::uint32_t>& expert_params) {
  // A layer's experts span the ops from the first that reads their weights to the last; its
  // unit, the layer's other ops.
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(model_.ops.size()); ++i) {
    const ModelOp& op = model_.ops[static_cast<std::size_t>(i)];
    const auto experts = experts_of_layer_.find(op.layer);
    if (experts == experts_of_layer_.end()) continue;
    FsdpUnit& unit = units_[experts->second];
    const bool reads = std::ranges::any_of(
        op.inputs, [&](std::uint32_t t) { return expert_params.contains(graph_.base[t]); });
    if (!reads) continue;
    if (unit.first_op < 0) unit.first_op = i;
    unit.last_op = i;
  }
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(model_.ops.size()); ++i) {
    const auto op = static_cast<std::uint32_t>(i);
    const std::size_t u = layer_unit_of_op(op);
    FsdpUnit& unit = units_[u];
    if (unit.layer < 0 || unit_of_op(op) != u) continue;
    if (unit.first_op < 0) unit.first_op = i;
    unit.last_op = i;
  }
}

void Fsdp2::allocate_shards(std::vector<Region>& writes, std::vector<std::uint64_t>& values) {
  // A layer's unit shards over the shard group, a layer's experts over an expert's shard group.
  const Mesh& mesh = fsdp_.mesh;
  const bool keeps_shard = parallelism_.reshard_after_forward.ranks() > 1;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = units_[u];
    const Mesh::Axis axis = unit.experts ? Mesh::Axis::ExpertShard : Mesh::Axis::Shard;
    const MeshGroup group = mesh.group(axis);
    unit.group = group.size;
    unit.placement = group.placement();
    if (keeps_shard) unit.post_forward_placement = mesh.kept_shard(axis).placement();
    const Bytes shard = std::max(Bytes(1), ceil_div(unit.master, unit.group));
    unit.shard = rank_.allocate_on(current(), shard, fmt::format("unit {} shard", unit.layer));
    writes.push_back(Region{unit.shard.id, Bytes(0), shard});
    values.push_back(mix_content(tag::kShard, u));
    rank_.note_write(unit.shard, Bytes(0), shard, values.back());
    for (const std::uint32_t p : unit.params) rank_.bind_param(p, unit.shard, Bytes(0));
  }
}

void Fsdp2::unshard(std::size_t u) {
  FsdpUnit& unit = units_[u];
  if (unit.unsharded || unit.gathering || unit.params.empty()) return;
  std::int32_t group = unit.group;
  if (group == 1) {
    // A shard group of one rank: FSDP2 gathers nothing. It records an event on the current
    // stream, and wait_for_unshard copies the shard (cast) into the unsharded parameters.
    device_.hold(unit.shard);
    unit.gathering = unit.shard;
    unit.gathered = device_.make_event();
    device_.record(*unit.gathered, Device::Stream{current()});
    return;
  }
  Region source{unit.shard.id, Bytes(0), ceil_div(unit.master, group)};
  if (unit.post_forward) {
    // Resharded to k ranks after forward: gather from that shard over them.
    group = parallelism_.reshard_after_forward.ranks();
    source = Region{unit.post_forward->id, Bytes(0), ceil_div(unit.bytes, group)};
    device_.wait(Device::Stream{copy_in_}, *unit.post_forward_event);
    device_.wait(Device::Stream{all_gather_}, *unit.post_forward_event);
  }
  const Bytes part = ceil_div(unit.bytes, group);
  const std::string name = fmt::format("unit {} all-gather", unit.layer);
  const StreamId copy = or_compute(copy_in_);
  unit.gathering = rank_.allocate_on(copy, std::int64_t{group} * part, name + " output");
  const Region mine{unit.gathering->id, Bytes(0), part};
  const Region whole{unit.gathering->id, Bytes(0), std::int64_t{group} * part};
  sim_.kernel(copy, memory_time(source.bytes + part), std::vector<Region>{source},
              std::vector<Region>{mine}, name + " copy-in");
  if (!faults_.skip_copy_in_wait) comm_wait(all_gather_, copy);
  const GroupPlacement placement = unit.post_forward ? unit.post_forward_placement : unit.placement;
  sim_.collective(
      all_gather_,
      collective_time(CollectiveKind::AllGather, std::int64_t{group} * part, placement, links()),
      std::vector<Region>{mine}, std::vector<Region>{whole}, name);
  unit.gathered = device_.make_event();
  device_.record(*unit.gathered, Device::Stream{all_gather_});
}

void Fsdp2::wait_for_unshard(std::size_t u, bool forward) {
  FsdpUnit& unit = units_[u];
  if (!unit.gathering) return;
  const std::vector<StreamId> ag_streams{copy_in_, all_gather_};
  if (forward && prev_gather_) {
    for (const StreamId s : ag_streams) {
      if (!faults_.skip_gather_free_wait) device_.wait(Device::Stream{s}, *prev_copy_out_);
    }
    device_.drop(*prev_gather_);
    prev_gather_.reset();
  }
  if (!faults_.skip_all_gather_wait && !(unit.experts && faults_.skip_expert_all_gather_wait)) {
    device_.wait(Device::Stream{current()}, *unit.gathered);
  }
  const Device::Buffer params =
      rank_.allocate_on(current(), unit.bytes, fmt::format("unit {} params", unit.layer));
  // Each parameter holds its own value again, whichever gather put it there.
  std::vector<Region> writes;
  std::vector<std::uint64_t> values;
  for (std::size_t j = 0; j < unit.params.size(); ++j) {
    const std::uint32_t p = unit.params[j];
    writes.push_back(Region{params.id, unit.offsets[j], model_.tensors[p].bytes});
    values.push_back(param_value(p));
    rank_.note_write(params, unit.offsets[j], model_.tensors[p].bytes, param_value(p));
  }
  sim_.kernel(current(), memory_time(std::int64_t{2} * unit.bytes),
              std::vector<Region>{Region{unit.gathering->id, Bytes(0), unit.bytes}}, writes,
              fmt::format("unit {} all-gather copy-out", unit.layer), values);
  unit.unsharded = params;
  bind_unit(u, params);
  if (unit.post_forward) {
    device_.drop(*unit.post_forward);
    unit.post_forward.reset();
    unit.post_forward_event.reset();
  }
  const Device::Event copied = device_.make_event();
  device_.record(copied, Device::Stream{current()});
  if (forward) {
    prev_gather_ = unit.gathering;
    prev_copy_out_ = copied;
  } else {
    for (const StreamId s : ag_streams) device_.wait(Device::Stream{s}, copied);
    device_.drop(*unit.gathering);
  }
  unit.gathering.reset();
  unit.gathered.reset();
}

void Fsdp2::reshard(std::size_t u, bool after_forward) {
  FsdpUnit& unit = units_[u];
  if (!unit.unsharded) return;
  const Reshard reshard = parallelism_.reshard_after_forward;
  if (after_forward && (unit.layer < 0 || reshard == Reshard::False())) {
    return;  // the root stays unsharded
  }
  if (after_forward && reshard.kind() == Reshard::Kind::K) {
    const std::int32_t k = reshard.ranks();
    const Bytes part = ceil_div(unit.bytes, k);
    unit.post_forward =
        rank_.allocate_on(current(), part, fmt::format("unit {} post-forward shard", unit.layer));
    sim_.kernel(current(), memory_time(std::int64_t{2} * part),
                std::vector<Region>{Region{unit.unsharded->id, Bytes(0), part}},
                std::vector<Region>{Region{unit.post_forward->id, Bytes(0), part}},
                fmt::format("unit {} reshard to {}", unit.layer, k));
    unit.post_forward_event = device_.make_event();
    device_.record(*unit.post_forward_event, Device::Stream{current()});
  }
  // The bindings stay: a read before the next unshard is a read of freed memory, which the
  // checker reports (the planted fault skip_backward_unshard).
  device_.drop(*unit.unsharded);
  unit.unsharded.reset();
}

// Note [torch 2.4's copy-in]
// FSDP2 copies a unit's gradients into the reduce-scatter input (in the reduce dtype) on the
// current stream since pytorch/pytorch#129721 (June 2024, torch 2.5): the input comes from the
// current stream's pool, one buffer in flight, freed once the current stream waited for its
// reduce-scatter. Before it (torch 2.3 and 2.4, `foreach_reduce_scatter` in
// `_fsdp_collectives.py`), the reduce-scatter stream waited for the current stream, allocated
// the input and ran the copy-in itself; the current stream waited for that copy-in before the
// gradients were freed; the input was freed on the reduce-scatter stream after its collective,
// so it stayed in that stream's pool, which the current stream cannot reuse. `--fsdp-impl
// fsdp2-torch2.4` runs the latter (PlantedFaultsAreReported drops its wait).
Device::Buffer Fsdp2::copy_in(const FsdpUnit& unit, const std::vector<Region>& grads,
                              const std::vector<Device::Buffer>& held, Bytes input_bytes,
                              const std::string& name) {
  return copy_in_on_rs_stream() ? copy_in_on_reduce_scatter(unit, grads, held, input_bytes, name)
                                : copy_in_on_current(unit, grads, held, input_bytes, name);
}

Device::Buffer Fsdp2::copy_in_on_current(const FsdpUnit& unit, const std::vector<Region>& grads,
                                         const std::vector<Device::Buffer>& held, Bytes input_bytes,
                                         const std::string& name) {
  if (prev_rs_event_) {  // one input in flight: the previous one freed once its collective ran
    if (!faults_.skip_reduce_input_free_wait) {
      device_.wait(Device::Stream{current()}, *prev_rs_event_);
    }
    device_.drop(*prev_rs_input_);
    prev_rs_input_.reset();
  }
  const Device::Buffer input = copy_in_kernel(current(), unit, grads, input_bytes, name);
  for (const Device::Buffer& g : held) device_.drop(g);
  if (!faults_.skip_reduce_scatter_wait) comm_wait(reduce_scatter_, current());
  return input;
}

Device::Buffer Fsdp2::copy_in_on_reduce_scatter(const FsdpUnit& unit,
                                                const std::vector<Region>& grads,
                                                const std::vector<Device::Buffer>& held,
                                                Bytes input_bytes, const std::string& name) {
  if (!faults_.skip_reduce_scatter_wait) comm_wait(reduce_scatter_, current());
  const Device::Buffer input = copy_in_kernel(reduce_scatter_, unit, grads, input_bytes, name);
  if (!faults_.skip_copy_in_free_wait) comm_wait(current(), reduce_scatter_);
  for (const Device::Buffer& g : held) device_.drop(g);
  return input;
}

Device::Buffer Fsdp2::copy_in_kernel(StreamId stream, const FsdpUnit& unit,
                                     const std::vector<Region>& grads, Bytes input_bytes,
                                     const std::string& name) {
  const Device::Buffer input = rank_.allocate_on(stream, input_bytes, name + " input");
  sim_.kernel(stream, memory_time(unit.bytes + input_bytes), grads,
              std::vector<Region>{Region{input.id, Bytes(0), input_bytes}}, name + " copy-in");
  return input;
}

void Fsdp2::reduce_gradients(std::size_t u) {
  FsdpUnit& unit = units_[u];
  std::vector<Region> grads;
  std::vector<Device::Buffer> held;
  for (const std::uint32_t p : unit.params) {
    const std::optional<Device::Buffer> grad = rank_.take_param_grad(p);
    if (!grad) continue;
    grads.push_back(Region{grad->id, Bytes(0), model_.tensors[p].bytes});
    held.push_back(*grad);
  }
  if (grads.empty()) return;
  const std::string name = fmt::format("unit {} reduce-scatter", unit.layer);
  // Note [The reduce dtype]
  const bool float32 = fsdp_.mixed_precision && parallelism_.reduce == ReduceDtype::Float32;
  const Bytes input_bytes = float32 ? unit.master : unit.bytes;
  const Device::Buffer input = copy_in(unit, grads, held, input_bytes, name);
  const std::int32_t group = unit.group;
  const Bytes out_bytes = ceil_div(input_bytes, group);
  const Bytes shard_bytes = fsdp_.mixed_precision ? ceil_div(unit.master, group) : out_bytes;
  const bool cast = shard_bytes != out_bytes;
  const Device::Buffer out = rank_.allocate_on(
      or_compute(reduce_scatter_), out_bytes,
      fmt::format("unit {} {}", unit.layer, cast ? "reduced gradients" : "grad shard"));
  const Region out_region{out.id, Bytes(0), out_bytes};
  const std::vector<Region> rs_reads{Region{input.id, Bytes(0), input_bytes}};
  const std::vector<Region> rs_writes{out_region};
  if (group > 1) {
    sim_.collective(
        reduce_scatter_,
        collective_time(CollectiveKind::ReduceScatter, input_bytes, unit.placement, links()),
        rs_reads, rs_writes, name);
  } else {  // one rank: FSDP2 copies the input to the output on the reduce-scatter stream
    sim_.kernel(reduce_scatter_, memory_time(input_bytes + out_bytes), rs_reads, rs_writes,
                name + " (one rank: a copy)");
  }
  if (copy_in_on_rs_stream()) {
    device_.drop(input);  // freed on the stream it was allocated on, after its last use there
  } else {
    prev_rs_event_ = device_.make_event();
    device_.record(*prev_rs_event_, Device::Stream{reduce_scatter_});
    prev_rs_input_ = input;
  }
  StreamId last = reduce_scatter_;  // the stream that wrote the shard last
  if (parallelism_.replicas > 1) {
    comm_wait(all_reduce_, last);
    sim_.collective(all_reduce_,
                    collective_time(CollectiveKind::AllReduce, out_bytes, replica_group_, links()),
                    std::vector<Region>{out_region}, std::vector<Region>{out_region},
                    fmt::format("unit {} all-reduce", unit.layer));
    last = all_reduce_;
  }
  StreamId shard_pool = or_compute(reduce_scatter_);  // the pool the new shard came from
  Device::Buffer shard = out;
  if (cast) {
    shard = cast_to_shard(unit, out, shard_bytes, last);
    last = shard_pool = or_compute(last);
  }
  if (unit.sharded_grad) {
    // A second backward (retain_graph): accumulate on the stream that wrote the new shard last.
    // SimpleFSDP's graph accumulates on the compute stream once it waited for the collective.
    const StreamId written = last;
    last = or_compute(written);
    if (simple() && !faults_.skip_accumulate_wait) comm_wait(last, written);
    const Region acc{unit.sharded_grad->id, Bytes(0), shard_bytes};
    sim_.kernel(last, memory_time(std::int64_t{3} * shard_bytes),
                std::vector<Region>{Region{shard.id, Bytes(0), shard_bytes}, acc},
                std::vector<Region>{acc}, name + " accumulate");
    release_reduced(shard, shard_pool, last);
  } else {
    unit.sharded_grad = shard;
  }
  last_reduce_ = device_.make_event();
  device_.record(*last_reduce_, Device::Stream{last});
}

// Note [The reduce dtype]
// FSDP2 reduces a unit's gradients in its MixedPrecisionPolicy's reduce_dtype, else in the
// gradients' own dtype, the parameters' compute dtype (`foreach_reduce` in
// `_fsdp_collectives.py`: reduce_dtype or grad_dtype; a reduce_dtype equal to param_dtype is
// dropped in `_fsdp_param.py`). Under `--reduce-dtype float32` (torchtitan's
// `mixed_precision_reduce` default) the copy-in casts the gradients into a float32 input, the
// collective moves float32 and writes the float32 shard. Under `param` (torch's default, and the
// bf16 policy of accelerate and the Hugging Face Trainer) the input, the collective and, with
// HSDP, the all-reduce are in the compute dtype, half the bytes with bf16; after them, on the
// stream that ran the last, the reduced shard is cast to the float32 sharded parameter's dtype
// (`_to_dtype_if_needed`) into a new buffer and freed. Without mixed precision the two agree.

// SimpleFSDP's graph casts on the compute stream once it waited for the collective (the wait
// its accumulation takes too); FSDP2 casts on the collective's stream. The reduced buffer is
// released as release_reduced says.
Device::Buffer Fsdp2::cast_to_shard(const FsdpUnit& unit, const Device::Buffer& reduced,
                                    Bytes shard_bytes, StreamId stream) {
  const Bytes reduced_bytes = ceil_div(unit.bytes, unit.group);
  const StreamId on = or_compute(stream);
  const Device::Buffer shard =
      rank_.allocate_on(on, shard_bytes, fmt::format("unit {} grad shard", unit.layer));
  if (simple() && !faults_.skip_accumulate_wait) comm_wait(on, stream);
  sim_.kernel(on, memory_time(reduced_bytes + shard_bytes),
              std::vector<Region>{Region{reduced.id, Bytes(0), reduced_bytes}},
              std::vector<Region>{Region{shard.id, Bytes(0), shard_bytes}},
              fmt::format("unit {} reduce-scatter cast", unit.layer));
  release_reduced(reduced, or_compute(reduce_scatter_), on);
  return shard;
}

// A buffer last read on its own pool's stream goes at once. One read on another (HSDP's
// all-reduce stream reading a buffer of the reduce-scatter stream's pool) is held, as FSDP2
// holds its all-reduce input, until the current stream waited for the last reduction
// (backward_end).
void Fsdp2::release_reduced(const Device::Buffer& buffer, StreamId pool, StreamId last_reader) {
  if (pool == last_reader) {
    device_.drop(buffer);
  } else {
    reduced_held_.push_back(buffer);
  }
}

void Fsdp2::before_op(std::uint32_t i) {
  if (i == 0) {
    // The root's pre-forward: the AG streams wait for the current stream (the optimizer).
    comm_wait(copy_in_, current());
    comm_wait(all_gather_, current());
    unshard(0);
    wait_for_unshard(0, true);
  }
  // The layer's pre-forward, then its experts' (a unit nested in the layer's).
  for (const std::size_t u : {layer_unit_of_op(i), unit_of_op(i)}) {
    if (u != 0 && units_[u].first_op == static_cast<std::int32_t>(i)) {
      unshard(u);
      wait_for_unshard(u, true);
    }
  }
}

void Fsdp2::after_op(std::uint32_t i) {
  for (const std::size_t u : {unit_of_op(i), layer_unit_of_op(i)}) {
    if (u != 0 && units_[u].last_op == static_cast<std::int32_t>(i)) reshard(u, true);
  }
  if (i + 1 == model_.ops.size() && prev_gather_) {
    // The root's post-forward frees the last all-gather output.
    for (const StreamId s : {copy_in_, all_gather_}) {
      device_.wait(Device::Stream{s}, *prev_copy_out_);
    }
    device_.drop(*prev_gather_);
    prev_gather_.reset();
  }
}

void Fsdp2::backward_begin(const std::vector<std::uint32_t>& order) {
  backward_units_.clear();
  pre_backward_done_.assign(units_.size(), false);
  last_node_.assign(units_.size(), -1);
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::size_t u = unit_of_op(order[k]);
    if (last_node_[u] < 0) backward_units_.push_back(u);
    last_node_[u] = static_cast<std::int32_t>(k);
  }
}

void Fsdp2::before_node(std::uint32_t n) {
  const std::size_t u = unit_of_op(n);
  if (pre_backward_done_[u]) return;
  pre_backward_done_[u] = true;
  if (faults_.skip_backward_unshard) return;
  unshard(u);
  wait_for_unshard(u, false);
  // FSDP2's default backward prefetch: the next unit in backward order.
  const auto& units = backward_units_;
  const auto at = std::find(units.begin(), units.end(), u);
  if (at != units.end() && at + 1 != units.end()) unshard(*(at + 1));
}

void Fsdp2::after_node(std::size_t k, std::uint32_t n) {
  const std::size_t u = unit_of_op(n);
  // The root's post-backward is the final callback's (backward_end).
  if (u == kRootUnit || last_node_[u] != static_cast<std::int32_t>(k)) return;
  reshard(u, false);
  reduce_gradients(u);
}

void Fsdp2::backward_end() {
  // The post-backward final callback. The root's post-backward runs in it: FSDP2 hooks a
  // unit's post-backward on its forward's inputs, and the root's forward spans the model, so
  // its parameters stay unsharded through backward, whichever layers read them (a parameter
  // shared by several layers is the root's). Then the current stream waits for the last
  // reduction.
  reshard(kRootUnit, false);
  reduce_gradients(kRootUnit);
  if (last_reduce_) device_.wait(Device::Stream{current()}, *last_reduce_);
  last_reduce_.reset();
  if (prev_rs_input_) device_.drop(*prev_rs_input_);
  prev_rs_input_.reset();
  prev_rs_event_.reset();
  // HSDP's held gradients came from the reduce-scatter stream's pool: it waits, as it does
  // before its next allocation (the checker judges a free where it is issued).
  if (!reduced_held_.empty() && !faults_.skip_reduced_free_wait) {
    comm_wait(reduce_scatter_, current());
  }
  for (const Device::Buffer& reduced : reduced_held_) device_.drop(reduced);
  reduced_held_.clear();
  // It reshards what is still unsharded (a unit no backward node reached).
  for (std::size_t u = 0; u < units_.size(); ++u) {
    wait_for_unshard(u, false);
    reshard(u, false);
  }
}

void Fsdp2::before_replay(std::uint32_t i) {
  // A recompute runs the unit's forward again: its parameters must be there (FSDP2's
  // pre-forward hook of an inner unit does the same for a replay that spans units).
  if (faults_.skip_backward_unshard) return;
  const std::size_t u = unit_of_op(i);
  unshard(u);
  wait_for_unshard(u, false);
}

void Fsdp2::optimizer_step() {
  std::vector<Region> reads;
  std::vector<Region> writes;
  Bytes params;
  Bytes grads;
  Bytes state;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = units_[u];
    if (!unit.sharded_grad) continue;
    const Bytes shard = sim_.buffers()[unit.shard.id.value()].bytes;
    if (!unit.moments) {
      unit.moments = rank_.allocate_on(current(), std::int64_t{2} * shard,
                                       fmt::format("unit {} AdamW moments", unit.layer));
    }
    const Region shard_params{unit.shard.id, Bytes(0), shard};
    const Region moments{unit.moments->id, Bytes(0), std::int64_t{2} * shard};
    const Region grad{unit.sharded_grad->id, Bytes(0),
                      sim_.buffers()[unit.sharded_grad->id.value()].bytes};
    reads.insert(reads.end(), {shard_params, moments, grad});
    writes.insert(writes.end(), {shard_params, moments});
    params += shard;
    grads += grad.bytes;
    state += moments.bytes;
  }
  if (reads.empty()) return;
  // The shards' share of the step (Note [The optimizer step] in model.cpp): their bytes of the
  // model's parameters, the foreach kernels' temporaries included.
  const StepCost cost = optimizer_step_cost(model_, params, grads, state);
  std::vector<Device::Buffer> temporaries;
  for (const Bytes bytes : cost.temporaries) {
    temporaries.push_back(rank_.allocate_on(current(), bytes, "optimizer step temporaries"));
    writes.push_back(Region{temporaries.back().id, Bytes(0), bytes});
  }
  sim_.kernel(current(), memory_time(std::max(cost.moved, Bytes(1))), reads, writes,
              "optimizer step (AdamW)");
  for (const Device::Buffer& b : temporaries) device_.drop(b);
  // zero_grad(set_to_none=True) frees the gradient shards, which came from the reduce-scatter
  // stream's pool: that stream waits for the optimizer first. FSDP2 makes this wait before
  // the next reduce-scatter allocates (foreach_reduce); the checker judges a free where it is
  // issued (Note [Latent reuse]), so it is made here.
  // With HSDP a cast shard came from the all-reduce stream's pool (Note [The reduce dtype]).
  if (!faults_.skip_grad_shard_free_wait) {
    comm_wait(reduce_scatter_, current());
    if (parallelism_.replicas > 1) comm_wait(all_reduce_, current());
  }
  for (FsdpUnit& unit : units_) {
    if (unit.sharded_grad) device_.drop(*unit.sharded_grad);
    unit.sharded_grad.reset();
  }
}

}  // namespace training
}  // namespace ferry::sim
