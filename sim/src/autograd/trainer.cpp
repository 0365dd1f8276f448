#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "ferry/check.hpp"
#include "step_failure.hpp"
#include "trainer.hpp"

namespace ferry::sim::training {

// Set-up, forward and saving. Checkpoint regions: trainer_regions.cpp. Backward:
// trainer_backward.cpp.

namespace {

// A node run's ranks train on the shared simulator; their own is a placeholder that checks
// nothing.
SimOptions own_options(const TrainingOptions& options, const NodeRank& rank) {
  if (rank.sim == nullptr) return options.sim;
  return SimOptions{.check_hazards = false, .track_content = false};
}

}  // namespace

Trainer::Trainer(const Model& model, const DeviceProfile& profile, const TrainingOptions& options,
                 const TrainingFaults& faults, NodeRank rank)
    : model_(model),
      options_(options),
      graph_(make_graph(model)),
      run_{.sim = Simulator({DeviceSpec{"gpu0", options.parallel.mesh.rank_profile(profile)}}, {},
                            own_options(options, rank)),
           .device = rank.sim != nullptr ? rank.device : DeviceId(0)},
      sim_(rank.sim != nullptr ? *rank.sim : run_.sim),
      dev_(run_.device),
      take_turn_(std::move(rank.take_turn)),
      compute_(sim_.add_stream(dev_, "compute")),
      current_(compute_),
      device_(sim_, dev_, compute_),
      offloader_(device_, options.offload, faults.offload),
      faults_(faults),
      blas_workspace_(profile.blas_workspace),
      content_(options.content_values) {
  run_.compute = compute_;
  labels_ = rank.sim != nullptr || options.sim.timeline;
  reserve_calls();
  if (options.side.any()) side_ = sim_.add_stream(dev_, "side");
  const std::size_t n = model.tensors.size();
  // An activation's forward reference ends after its last forward use (at once if unused);
  // the loss lives until the graph is freed.
  last_use_.assign(n, -1);
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    for (const std::uint32_t t : model.ops[i].outputs) {
      last_use_[base(t)] = std::max<std::int32_t>(last_use_[base(t)], static_cast<std::int32_t>(i));
    }
    for (const std::uint32_t t : model.ops[i].inputs)
      last_use_[base(t)] = static_cast<std::int32_t>(i);
  }
  const auto dropped = [&](std::uint32_t t) {
    const ModelTensor& tensor = model.tensors[t];
    return tensor.view_of < 0 && tensor.role == TensorRole::Activation && t != base(model.loss) &&
           last_use_[t] >= 0;
  };
  drop_start_.assign(model.ops.size() + 1, 0);
  for (std::uint32_t t = 0; t < n; ++t) {
    if (dropped(t)) ++drop_start_[static_cast<std::size_t>(last_use_[t]) + 1];
  }
  for (std::size_t i = 1; i < drop_start_.size(); ++i) drop_start_[i] += drop_start_[i - 1];
  drop_list_.resize(drop_start_.back());
  std::vector<std::uint32_t> next(drop_start_.begin(), drop_start_.end() - 1);
  for (std::uint32_t t = 0; t < n; ++t) {
    if (dropped(t)) drop_list_[next[static_cast<std::size_t>(last_use_[t])]++] = t;
  }
  grads_.resize(n);
  grad_values_.assign(n, 0);
  params_ = TensorSlots<Bound>(n);
  held_ = TensorSlots<Device::Buffer>(n);
  param_grads_ = TensorSlots<Device::Buffer>(n);
  param_grad_values_ = TensorSlots<std::uint64_t>(n);
  last_grad_node_ = TensorSlots<std::uint32_t>(n);
  grad_sums_ = TensorSlots<GradSum>(n);
  const CheckpointPlan& plan = options.checkpoint;
  region_of_op_.assign(model.ops.size(), -1);
  for (std::size_t r = 0; r < plan.regions.size(); ++r) {
    const CheckpointRegion& reg = plan.regions[r];
    for (std::uint32_t i = reg.first_op; i < reg.end_op; ++i) {
      // The innermost region wins (regions are listed outer before inner).
      region_of_op_[i] = static_cast<std::int32_t>(r);
    }
  }
  region_inputs_.resize(plan.regions.size());
  starting_.resize(model.ops.size());
  for (std::uint32_t r = 0; r < plan.regions.size(); ++r) {
    if (plan.regions[r].first_op < model.ops.size())
      starting_[plan.regions[r].first_op].push_back(r);
  }
  for (auto& at : starting_) {
    std::stable_sort(at.begin(), at.end(), [&](std::uint32_t a, std::uint32_t b) {
      return plan.regions[a].end_op > plan.regions[b].end_op;  // outermost first
    });
  }
  checkpointer_.set_global_early_stop(plan.global_early_stop);
  hooks_ = make_step_hooks(model_, graph_, options_, faults_, *this);
}

void Trainer::reserve_calls() {
  // Calls the planner's runs make a step: a traced Llama's at most about 10 an op, the
  // presets', whose few ops hold many tensors each, up to 12.2 a tensor (TRL's offloader on
  // Llama 3 8B with kept gradients; measured over BM_PlanTraced's, BM_Plan's and
  // BM_Llama8BStep's runs); about 3 allocations a tensor, and a parameter's new gradient (Note
  // [A parameter's gradients]). Room for that up front spares the record vectors'
  // regrowth, which copies them into fresh pages; a longer run grows them as before. A rank of a
  // node run shares the node's simulator, which is left alone.
  if (&sim_ != &run_.sim) return;
  const auto steps = static_cast<std::size_t>(std::max(options_.steps, 1));
  const std::size_t ops = model_.ops.size();
  const std::size_t tensors = model_.tensors.size();
  const auto params = static_cast<std::size_t>(
      std::count_if(model_.tensors.begin(), model_.tensors.end(),
                    [](const ModelTensor& t) { return t.role == TensorRole::Param; }));
  sim_.reserve(steps * std::max(8 * ops + 4 * tensors, 13 * tensors),
               steps * (3 * tensors + params));
}

Result<TrainingRun> Trainer::run() {
  if (auto valid = validate_plan(); !valid) return valid.error();
  if (auto valid = hooks_->validate(); !valid) return valid.error();
  try {
    take_turn();
    setup();
    run_.baseline_allocated = allocated();
    for (std::int32_t step = 0; step < options_.steps && !run_.failure; ++step) this->step();
    if (!run_.failure) release_held();
  } catch (const StepFailure& e) {
    run_.failure = e.failure;
  } catch (const OffloadError& e) {
    run_.failure = Failure{e.kind(), e.what()};
  } catch (const CheckpointError& e) {
    run_.failure = Failure{FailureKind::Misuse, e.what()};
  }
  if (!take_turn_) {  // a node run finishes the shared simulator once every rank is done
    sim_.finish();
    if (!options_.sync_each_step && !run_.steps.empty()) run_.steps.back().end = sim_.makespan();
  }
  run_.telemetry = telemetry_since(offloader_.telemetry(), step_start_telemetry_);
  return std::move(run_);
}

Status Trainer::validate_plan() const {
  if (!options_.content_values &&
      (options_.sim.track_content || options_.checkpoint.content_check)) {
    return Error{
        "content_values is off, but sim.track_content or checkpoint.content_check reads the "
        "values: turn those off too, or keep content_values on"};
  }
  const auto& regions = options_.checkpoint.regions;
  for (std::size_t r = 0; r < regions.size(); ++r) {
    const CheckpointRegion& a = regions[r];
    if (a.first_op >= a.end_op || a.end_op > model_.ops.size()) {
      return Error{fmt::format("checkpoint region {}: ops [{}, {}) is empty or out of range", r,
                               a.first_op, a.end_op)};
    }
    for (std::size_t q = 0; q < r; ++q) {
      const CheckpointRegion& b = regions[q];
      const bool disjoint = a.first_op >= b.end_op || b.first_op >= a.end_op;
      const bool nested = b.first_op <= a.first_op && a.end_op <= b.end_op;
      const bool inside_later = a.first_op <= b.first_op && b.end_op <= a.end_op &&
                                (a.first_op != b.first_op || a.end_op != b.end_op);
      if ((!disjoint && !nested) || inside_later) {
        return Error{
            fmt::format("checkpoint regions {} and {} overlap without nesting, or the "
                        "inner one is listed first (list outer regions first)",
                        q, r)};
      }
      if (!disjoint && (a.reentrant || b.reentrant)) {
        return Error{fmt::format("checkpoint region {}: reentrant regions do not nest", r)};
      }
    }
    if (a.reentrant && model_.ops[a.end_op - 1].outputs.empty()) {
      return Error{fmt::format("checkpoint region {}: needs an output", r)};
    }
  }
  return Ok{};
}

Bytes Trainer::allocated() const {
  const CachingAllocator& alloc = sim_.device_allocator(dev_);
  return alloc.stats().allocated - alloc.pending_free_bytes();
}

Device::Buffer Trainer::allocate_on(StreamId stream, Bytes bytes, std::string_view name) {
  auto buf = device_.try_allocate(Place::Device, bytes, Device::Stream{stream}, name);
  if (!buf) out_of_memory(buf.error().message);
  const std::uint32_t id = buf.value().id.value();
  cover(alloc_stream_, id);
  alloc_stream_[id] = stream;
  return buf.value();
}

void Trainer::bind_param(std::uint32_t p, Device::Buffer buffer, Bytes offset) {
  params_[p] = Bound{buffer, offset, param_value(p)};
}

std::pair<Device::Buffer, std::uint64_t> Trainer::param_grad(std::uint32_t p) const {
  return {param_grads_.at(p), param_grad_values_.at(p)};
}

std::optional<Device::Buffer> Trainer::take_param_grad(std::uint32_t p) {
  if (!param_grads_.contains(p)) return std::nullopt;
  const Device::Buffer grad = param_grads_.at(p);
  param_grads_.erase(p);
  return grad;
}

// Note [Side streams]
// SideStreamOptions puts some of the model's work on a second compute stream, `side`, as code
// inside `with torch.cuda.stream(side):` does (a layer's module, a checkpoint's recompute).
// The trainer keeps a current stream and switches it at the boundaries of that work:
//
//  * A switch is `to.wait_stream(from)`: an event recorded on the stream that was current,
//    waited on by the new one. Entering the side stream it is the wait code must write before
//    using the side stream; leaving it, `current_stream().wait_stream(side)` after the block.
//    In backward the engine runs a node on the stream its forward ran on and syncs a consumer's
//    stream with its producer's (InputBuffer::add): the same edge at the same place.
//  * Every kernel runs on the current stream, and what it allocates comes from the current
//    stream's pool. A tensor the trainer allocated on one stream and used on the other gets
//    record_stream for the other (once), as torch's notes on streams ask of such code; its
//    free then waits for that stream's work.
//  * The device's current stream follows (Device::set_current_stream): an offloader that asks
//    `compute_stream()` at each pack and unpack gets the stream the work runs on, orders its
//    D2H copy after the stream that produced the tensor and makes the stream that will read
//    it wait for the reload.
//
// A recompute triggered by an unpack switches to the side stream for the whole replay (its
// inputs' unpacks included) and back to the node's stream after. An all-reduce of a finished
// gradient goes to the comm stream after it waits for the stream that wrote the gradient, and
// the compute stream waits for the comm stream at the end of backward (DDP's pattern, the Ddp
// unit of the step hooks in ddp.cpp); the host's current stream does not change for it. The planted
// faults (TrainingFaults) drop one part each: the wait before side or comm work, or the
// record_stream; the cached stream of TRL before #7195 is the core's own planted fault
// (OffloadFaults::stale_compute_stream).

StreamId Trainer::op_stream(std::uint32_t i, bool replay) const {
  if (!side_.valid()) return compute_;
  if (options_.side.recompute && replay) return side_;
  const auto& layers = options_.side.layers;
  return std::find(layers.begin(), layers.end(), model_.ops[i].layer) != layers.end() ? side_
                                                                                      : compute_;
}

StreamId Trainer::switch_to(StreamId to) {
  const StreamId from = current_;
  if (to == from) return from;
  if (!(faults_.skip_side_stream_wait && to == side_)) {
    const Device::Event e = device_.make_event();
    device_.record(e, Device::Stream{from});
    device_.wait(Device::Stream{to}, e);
  }
  current_ = to;
  device_.set_current_stream(Device::Stream{to});
  return from;
}

void Trainer::used_on_current(const std::vector<Region>& regions) {
  if (!side_.valid() || faults_.skip_cross_stream_record) return;
  for (const Region& r : regions) {
    const std::uint32_t id = r.buffer.value();
    if (id >= alloc_stream_.size() || !alloc_stream_[id].valid() || alloc_stream_[id] == current_)
      continue;
    if (recorded_.emplace(id, current_.value()).second) {
      device_.record_stream(Device::Buffer{r.buffer}, Device::Stream{current_});
    }
  }
}

void Trainer::setup() {
  open_scope();
  std::vector<Region> writes;
  std::vector<std::uint64_t> values;
  for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
    const ModelTensor& tensor = model_.tensors[t];
    if (tensor.view_of >= 0) continue;
    if (hooks_->holds(tensor)) continue;  // the parallelism's own (FSDP's shards)
    if (is_resident(tensor.role)) {
      const Device::Buffer buf = must_allocate(tensor.bytes, tensor.name);
      params_[t] = Bound{buf, Bytes(0), param_value(t)};
      writes.push_back(Region{buf.id, Bytes(0), tensor.bytes});
      values.push_back(params_[t].value);
      note_write(buf, Bytes(0), tensor.bytes, params_[t].value);
      if (tensor.role == TensorRole::Param && !options_.grads_set_to_none &&
          !param_grads_.contains(t)) {
        param_grads_[t] = must_allocate(tensor.bytes, grad_label(t));
      }
    }
  }
  hooks_->setup(writes, values);
  allocate_blas_workspaces();
  hooks_->reserve();
  sim_.kernel(current_, SimTime(1), {}, writes, "init parameters", values);
  device_rng_initialized_ = !options_.checkpoint.lazy_device_rng;
}

// Note [Library workspaces]
// torch gives each cuBLAS handle, on each stream it runs on, a workspace taken from the caching
// allocator at its first matmul and kept for the life of the process
// (aten/src/ATen/cuda/CublasHandlePool.cpp: setWorkspaceForHandle, one block per (handle,
// stream) of getChosenWorkspaceSize(): 32 MiB on Hopper, 8 MiB + 128 KiB elsewhere). Handles
// are per thread, and backward runs on the autograd engine's thread for the device: a training
// step holds two, forward's and backward's (a checkpoint's recompute runs on backward's). The
// device profile names the size (`blas_workspace_bytes`, docs/devices.md); a model that does
// no math (no op with FLOPs) takes none. Both are allocated at set-up, before the first step:
// in torch backward's comes at the first backward matmul of the first step, and every later
// step, the one measured among them, starts with both held either way.
void Trainer::allocate_blas_workspaces() {
  if (blas_workspace_.count() == 0) return;
  const bool math = std::ranges::any_of(
      model_.ops, [](const ModelOp& op) { return op.flops > 0 || op.backward_flops > 0; });
  if (!math) return;
  for (const char* thread : {"forward", "backward"}) {
    (void)must_allocate(blas_workspace_, fmt::format("cuBLAS workspace ({} thread)", thread));
  }
}

Bound Trainer::lookup(std::uint32_t t) const {
  const ModelTensor& tensor = model_.tensors[t];
  if (is_resident(tensor.role)) {
    const std::uint32_t b = base(t);
    const Bound& p = params_.at(b);
    return Bound{p.buffer, p.offset + tensor.view_offset, p.value};
  }
  for (std::size_t s = scopes_.size(); s-- > 0;) {
    if (const Bound* b = scopes_[s].bound.find(t)) return *b;
  }
  FERRY_CHECK(false, "tensor {} is not live", tensor.name);
  return {};
}

Region Trainer::region(std::uint32_t t) const {
  const Bound b = lookup(t);
  return Region{b.buffer.id, b.offset, model_.tensors[t].bytes};
}

void Trainer::note_write(Device::Buffer buf, Bytes offset, Bytes bytes, std::uint64_t value) {
  content_.write(buf.id, offset, bytes, value);
}

void Trainer::note_arrival(const Bound& where, const Pieces& saved) {
  content_.arrive(where.buffer.id, where.offset, saved);
}

Pieces Trainer::expected_of(std::uint32_t t, const Bound& b) const {
  return content_.slice(b.buffer.id, b.offset, model_.tensors[t].bytes);
}

void Trainer::run_op(std::uint32_t i, bool replay) {
  take_turn();
  const ModelOp& op = model_.ops[i];
  switch_to(op_stream(i, replay));
  if (replay) hooks_->before_replay(i);
  Scope& scope = scopes_.back();
  auto reads = region_scratch_.borrow();
  auto writes = region_scratch_.borrow();
  auto values = value_scratch_.borrow();
  std::uint64_t seed = mix_content(0x6f70, i + 1);
  for (const std::uint32_t t : op.inputs) {
    const Bound b = lookup(t);
    seed = mix_content(seed, b.value);
    reads->push_back(Region{b.buffer.id, b.offset, model_.tensors[t].bytes});
  }
  if (op.draws_rng) {
    if (!device_rng_initialized_) device_rng_initialized_ = true;
    seed = mix_content(seed, mix_content(tag::kRng, generators_.draw(kDeviceRng)));
  }
  if (op.draws_cpu_rng)
    seed = mix_content(seed, mix_content(tag::kCpuRng, generators_.draw(kCpuRng)));
  for (std::uint32_t k = 0; k < op.outputs.size(); ++k) {
    const std::uint32_t t = op.outputs[k];
    const ModelTensor& tensor = model_.tensors[t];
    const std::uint64_t value = mix_content(seed, k);
    if (tensor.view_of < 0) {
      const Device::Buffer buf = must_allocate(allocated_bytes(tensor), tensor.name);
      scope.bound[t] = Bound{buf, Bytes(0), value};
      if (replay) scope.owned.push_back(buf);
    } else {
      const Bound b = lookup(base(t));
      scope.bound[t] = Bound{b.buffer, b.offset + tensor.view_offset, value};
    }
    const Bound out = scope.bound[t];
    writes->push_back(Region{out.buffer.id, out.offset, tensor.bytes});
    values->push_back(value);
    note_write(out.buffer, out.offset, tensor.bytes, value);
  }
  // Outputs that share bytes (a storage and its views, or several views of one storage, as a
  // trace lists the views of a storage where it is written): the later writes win, so each
  // output's value is what its bytes hold once the op is done, which is also what a save of it
  // records. An output no later one overlaps keeps its own value.
  if (op.outputs.size() > 1) {
    for (const std::uint32_t t : op.outputs) {
      Bound& out = scope.bound[t];
      out.value = content_.value(out.buffer.id, out.offset, model_.tensors[t].bytes);
    }
  }
  used_on_current(*reads);
  used_on_current(*writes);
  const bool replay_label = replay && labels_;
  if (replay_label) label_.assign(op.name).append(" recompute");
  const Launch launch{.op = i,
                      .phase = replay ? Launch::Phase::Replay : Launch::Phase::Forward,
                      .reads = *reads,
                      .writes = *writes,
                      .values = *values,
                      .label = replay_label ? std::string_view(label_) : std::string_view(op.name)};
  if (!hooks_->launch(launch)) {
    sim_.kernel(current_, op.duration, *reads, *writes, launch.label, *values);
  }
  if (replay && in_last_step_) run_.recompute_time += op.duration;
}

Saved Trainer::pack(std::uint32_t node, std::uint32_t t) {
  const ModelTensor& tensor = model_.tensors[t];
  const std::uint32_t b = base(t);
  const Bound where = lookup(t);
  Saved saved;
  saved.tensor = t;
  saved.expected = expected_of(t, where);
  const Context* top = contexts_.empty() ? nullptr : &contexts_.back();
  if (top != nullptr && top->kind == Context::Kind::Frame) {
    saved.kind = Saved::Kind::Holder;
    saved.holder = checkpointer_.pack(top->frame, meta_of(t, where.value));
    frames_[top->frame.value()].last_pack_op = current_op_;
    return saved;
  }
  if (top != nullptr && top->kind == Context::Kind::Recompute) {
    // The replay fills the frame's holders; the checkpointer keeps a reference.
    saved.kind = Saved::Kind::Holder;
    const FrameInfo& info = frames_.at(top->frame.value());
    if (faults_.drop_recomputed == static_cast<std::int32_t>(info.region) &&
        ++dropped_in_replay_ == 1) {
      return saved;  // test: one tensor fewer
    }
    SavedMeta meta = meta_of(t, where.value);
    if (faults_.alter_recomputed_meta) meta.bytes += Bytes(1);
    const Recomputed kept{where.buffer, where.offset, value_of(expected_of(t, where))};
    const RecomputePack done = checkpointer_.recompute_pack(meta, kept);
    if (done != RecomputePack::Ignored) device_.hold(where.buffer);  // the checkpointer's
    if (done == RecomputePack::KeptLast) stop_replay_ = true;
    return saved;
  }
  if (model_.tensors[b].role == TensorRole::Param && hooks_->holds(model_.tensors[b])) {
    saved.kind = Saved::Kind::Param;
    return saved;
  }
  // Outside a checkpoint, the saved-tensor hooks the step hooks pushed, innermost first, then
  // the offloader (Note [Step hooks]).
  for (std::size_t h = saved_hooks_.size(); top == nullptr && h-- > 0;) {
    if (!saved_hooks_[h]->takes(node, t)) continue;
    saved.kind = Saved::Kind::Hook;
    saved.hook = static_cast<std::uint32_t>(h);
    saved.packed = saved_hooks_[h]->pack(node, t, where.buffer, where.offset);
    return saved;
  }
  const ModelTensor& storage = model_.tensors[b];
  TensorFacts facts;
  facts.bytes = tensor.bytes;
  facts.storage_bytes =
      is_resident(tensor.role) ? storage.bytes : sim_.buffers()[where.buffer.id.value()].bytes;
  facts.view_offset = where.offset;
  facts.storage = where.buffer.id.value();
  facts.address =
      static_cast<std::uint64_t>(sim_.buffers()[where.buffer.id.value()].address.count());
  facts.dtype = static_cast<std::uint32_t>(tensor.dtype);
  facts.is_param = is_resident(storage.role);
  facts.no_offload = tensor.no_offload;
  facts.node = NodeId(node);
  saved.kind = Saved::Kind::Offload;
  const OffloadTelemetry before = offloader_.telemetry();
  saved.id = offloader_.pack(facts, where.buffer);
  if (!replaying()) {
    // Per layer of the packing op, as a real run attributes each pack to the layer whose
    // forward is running (`python -m ferry validate`).
    const OffloadTelemetry& after = offloader_.telemetry();
    LayerDecisions& d = run_.layer_decisions[model_.ops[node].layer];
    d.packed += after.packed - before.packed;
    d.offloaded += after.offloaded - before.offloaded;
    d.kept += after.kept - before.kept;
    d.deduplicated += after.deduplicated - before.deduplicated;
  }
  return saved;
}

SavedMeta Trainer::meta_of(std::uint32_t t, std::uint64_t value) const {
  const ModelTensor& tensor = model_.tensors[t];
  return SavedMeta{tensor.bytes, static_cast<std::uint8_t>(tensor.dtype), 0, value};
}

void Trainer::save_op(std::uint32_t i) {
  const ModelOp& op = model_.ops[i];
  const bool in_frame = !contexts_.empty() && contexts_.back().kind == Context::Kind::Frame;
  if (!contexts_.empty() && contexts_.back().kind == Context::Kind::NoGrad) return;
  if (in_frame && policy(i) != OpPolicy::PreferRecompute && policy(i) != OpPolicy::Dropped) {
    FrameInfo& info = frames_[contexts_.back().frame.value()];
    for (const std::uint32_t t : op.outputs) {
      if (model_.tensors[t].view_of >= 0) {
        // A replay serves the view from its base with the value forward gave it.
        info.view_values[t] = lookup(t).value;
        continue;
      }
      const Bound b = lookup(t);
      if (policy(i) == OpPolicy::MustSave) {
        device_.hold(b.buffer);
        info.cache[t] = b;
      } else {
        // Offloaded through the ambient offloader, not through the frame.
        std::vector<Context> saved_contexts = std::exchange(contexts_, {});
        info.offloaded[t] = pack(i, t);
        contexts_ = std::move(saved_contexts);
      }
    }
  }
  auto& list = saved_[i];
  list.reserve(list.size() + op.saved.size());
  for (const std::uint32_t t : op.saved) list.push_back(pack(i, t));
}

void Trainer::forward() {
  checkpointer_.reset();
  frames_.clear();
  reentrant_inputs_.clear();
  // The batch.
  std::vector<Region> batch;
  std::vector<std::uint64_t> values;
  for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
    const ModelTensor& tensor = model_.tensors[t];
    if (tensor.role != TensorRole::Input || tensor.view_of >= 0) continue;
    const Device::Buffer buf = must_allocate(tensor.bytes, tensor.name);
    // Each rank of a node run loads a batch of its own.
    std::uint64_t value = mix_content(mix_content(tag::kBatch, step_), t);
    if (dev_.value() > 0) value = mix_content(value, dev_.value());  // the rank
    scopes_[0].bound[t] = Bound{buf, Bytes(0), value};
    batch.push_back(Region{buf.id, Bytes(0), tensor.bytes});
    values.push_back(value);
    note_write(buf, Bytes(0), tensor.bytes, value);
  }
  sim_.kernel(current_, SimTime(1), {}, batch, "load batch", values);
  // Views of the batch: bytes of their base's buffer, as views of parameters are.
  for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
    const ModelTensor& tensor = model_.tensors[t];
    if (tensor.role != TensorRole::Input || tensor.view_of < 0) continue;
    const Bound whole = scopes_[0].bound.at(base(t));
    scopes_[0].bound[t] = Bound{whole.buffer, tensor.view_offset, whole.value};
  }

  // Each op's list is emptied, not freed: the next step saves as many again.
  saved_.resize(model_.ops.size());
  for (auto& list : saved_) list.clear();
  for (std::uint32_t i = 0; i < model_.ops.size(); ++i) {
    const ModelOp& op = model_.ops[i];
    current_op_ = i;
    switch_to(op_stream(i, false));  // a checkpoint call inside the block packs on its stream
    hooks_->before_op(i);
    for (const std::uint32_t r :
         regions_starting(i, 0, static_cast<std::uint32_t>(model_.ops.size()), -1)) {
      begin_region(r);
    }
    // Note [Offload selection]: a plan keeps an op's saved tensors on the device the way a
    // no-offload region does, so the offloader's own rules (size, params, host cap) still apply
    // to the rest. Region inputs are chosen per region in begin_region.
    const auto& chosen = options_.offload_selection.ops;
    const bool keep = op.no_offload || (i < chosen.size() && !chosen[i]);
    if (keep) offloader_.push_no_offload();
    run_op(i, false);
    save_op(i);
    if (keep) offloader_.pop_no_offload();
    if (options_.backward_inside_op == static_cast<std::int32_t>(i)) backward_inside(i);
    while (!open_.empty() && options_.checkpoint.regions[open_.back().region].end_op == i + 1) {
      end_region();
    }
    hooks_->after_op(i);
    for (const std::uint32_t b : dropped_after(i)) {
      if (!model_.tensors[b].held) device_.drop(scopes_[0].bound.at(b).buffer);
    }
    hold_outputs(i);
  }
  switch_to(compute_);
}

// Note [Held activations]
// A training loop that keeps the model's output in a variable (`pred = model(x)`, then `loss =
// loss_fn(pred, y)` and `loss.backward()`, with no `del pred`: torchtitan's train.py until its
// commit e29b6b4, June 2024) holds that tensor through backward, the optimizer step and the
// next step's forward, until the assignment of the next step's output drops it. A held
// tensor's forward reference moves to held_ after the op that produces it, where it replaces
// (and frees) the previous step's; the loop's last reference goes when the run ends. A
// recomputation of it inside a checkpoint region is no such reference: the replay drops it as
// any other (drop_dead_in_replay).
void Trainer::hold_outputs(std::uint32_t i) {
  for (const std::uint32_t t : model_.ops[i].outputs) {
    if (!model_.tensors[t].held) continue;
    if (held_.contains(t)) device_.drop(held_.at(t));
    held_[t] = scopes_[0].bound.at(t).buffer;
  }
}

void Trainer::release_held() {
  held_.for_each([&](std::uint32_t, const Device::Buffer& buffer) { device_.drop(buffer); });
  held_.clear();
}

}  // namespace ferry::sim::training
