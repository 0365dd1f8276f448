#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <utility>

#include "ferry/check.hpp"
#include "step_failure.hpp"
#include "trainer.hpp"

namespace ferry::sim::training {

// Backward: unpacking, recomputation, the node order, gradients and the end of a step.

Bound Trainer::unpack(const Saved& s, std::uint32_t node) {
  if (s.kind == Saved::Kind::Param) {
    const Bound b = lookup(s.tensor);
    // The caller's reference. Not live only when a planted fault skipped the gather: the
    // kernel's read of freed memory is then the checker's to report.
    if (device_.use_count(b.buffer) > 0) device_.hold(b.buffer);
    return b;
  }
  if (s.kind == Saved::Kind::Hook) {
    const auto [buffer, offset] = saved_hooks_[s.hook]->unpack(s.packed);
    const Bound b{buffer, offset, value_of(s.expected)};
    note_arrival(b, s.expected);
    return b;
  }
  if (s.kind == Saved::Kind::Offload) {
    auto u = offloader_.unpack(s.id, NodeId(node));
    // The offloader orders the storage for the stream current at the unpack (Note [The compute
    // stream is the current one]); a use on another stream later (a recomputation's input
    // that backward reads on a side stream) is the caller's to record, as for what it
    // allocates itself (Note [Side streams]).
    const std::uint32_t id = u.storage.id.value();
    cover(alloc_stream_, id);
    if (!alloc_stream_[id].valid()) alloc_stream_[id] = current_;
    const Bound b{u.storage, u.offset, value_of(s.expected)};
    note_arrival(b, s.expected);
    return b;
  }
  const FrameId frame = checkpointer_.frame_of(s.holder);
  if (!checkpointer_.recomputed(frame, gid_)) recompute(frame, node);
  const Recomputed r = checkpointer_.take(s.holder, gid_);
  FrameInfo& info = frames_[frame.value()];
  // The last holder of a frame unpacked by a backward that frees the graph: nothing needs
  // the frame any more, so its saved inputs go now (the frame dies with its last node).
  if (++info.taken == checkpointer_.saved_count(frame) && last_pass_) release_frame(info);
  return Bound{r.buffer, r.offset, r.value};
}

void Trainer::release_saved(const Saved& s) {
  if (s.kind == Saved::Kind::Offload) offloader_.release(s.id);
  if (s.kind == Saved::Kind::Hook) saved_hooks_[s.hook]->release(s.packed);
}

void Trainer::release_frame(FrameInfo& info) {
  if (info.released) return;
  info.released = true;
  for (const Saved& s : info.inputs) {
    release_saved(s);
  }
  for (const auto& [t, b] : info.cache) device_.drop(b.buffer);
  for (const auto& [t, s] : info.offloaded) offloader_.release(s.id);
}

Generators Trainer::open_replay(const FrameInfo& info, std::uint32_t node) {
  std::vector<std::pair<std::uint32_t, Bound>> inputs;
  for (const Saved& s : info.inputs) inputs.emplace_back(s.tensor, unpack(s, node));
  Scope& scope = open_scope();
  for (const auto& [t, b] : inputs) {
    scope.bound[t] = b;
    scope.owned.push_back(b.buffer);
  }
  return begin_replay(generators_, info.generators, !faults_.skip_rng_restore);
}

Trainer::Scope& Trainer::open_scope() {
  if (spare_scopes_.empty())
    return scopes_.emplace_back(Scope{BoundTable(model_.tensors.size()), {}});
  scopes_.push_back(std::move(spare_scopes_.back()));
  spare_scopes_.pop_back();
  return scopes_.back();
}

void Trainer::close_scope() {
  Scope scope = std::move(scopes_.back());
  scopes_.pop_back();
  for (const Device::Buffer& b : scope.owned) device_.drop(b);
  scope.bound.clear();
  scope.owned.clear();
  spare_scopes_.push_back(std::move(scope));
}

void Trainer::recompute(FrameId frame, std::uint32_t node) {
  FrameInfo& info = frames_[frame.value()];
  const CheckpointRegion& reg = options_.checkpoint.regions[info.region];
  ++run_.recomputations;
  ++run_.layer_decisions[model_.ops[reg.first_op].layer].recomputed;
  const StreamId stream = options_.side.recompute ? switch_to(side_) : current_;
  const Generators outer = open_replay(info, node);
  contexts_.push_back(Context{Context::Kind::Recompute, frame});
  checkpointer_.recompute_begin(frame, gid_);
  const bool saved_stop = stop_replay_;
  stop_replay_ = false;
  dropped_in_replay_ = 0;
  std::uint32_t last_run = reg.first_op;
  const std::uint32_t last_saving = info.last_pack_op;
  const std::size_t open_before = open_.size();
  for (std::uint32_t i = reg.first_op; i < reg.end_op && !stop_replay_; ++i) {
    current_op_ = i;
    for (const std::uint32_t r :
         regions_starting(i, reg.first_op, reg.end_op, static_cast<std::int32_t>(info.region))) {
      begin_region(r);
    }
    replay_op(i, info);
    drop_dead_in_replay(i);
    last_run = i;
    while (open_.size() > open_before &&
           options_.checkpoint.regions[open_.back().region].end_op == i + 1) {
      end_region();
    }
  }
  while (open_.size() > open_before) end_region();  // early stop inside an inner region
  contexts_.pop_back();
  stop_replay_ = saved_stop;
  generators_ = outer;
  if (in_last_step_) run_.replay_stops.emplace_back(last_run, last_saving);
  close_scope();  // the replay's own references go once its kernels are issued
  checkpointer_.recompute_end();
  switch_to(stream);
}

// Note [A replay frees as the forward does]
// A checkpoint's recompute runs the region's forward again as Python runs it: an output nobody
// holds (a norm's squares, its float32 product before the cast) is freed once its last reader
// is done, not at the replay's end; what the replay saves the checkpointer holds. So a replayed
// op's scope reference goes after the same op as in forward (dropped_after), unless the tensor
// lives past the region (the region's outputs, dropped with the scope).
void Trainer::drop_dead_in_replay(std::uint32_t i) {
  Scope& scope = scopes_.back();
  for (const std::uint32_t t : dropped_after(i)) {
    const Bound* b = scope.bound.find(t);
    if (b == nullptr) continue;
    const auto owned = std::find_if(scope.owned.begin(), scope.owned.end(),
                                    [&](const Device::Buffer& o) { return o.id == b->buffer.id; });
    if (owned == scope.owned.end()) continue;
    device_.drop(*owned);
    scope.owned.erase(owned);
  }
}

void Trainer::replay_op(std::uint32_t i, FrameInfo& info) {
  const ModelOp& op = model_.ops[i];
  Scope& scope = scopes_.back();
  const OpPolicy p = policy(i);
  if (p != OpPolicy::PreferRecompute) {
    // Served from forward or dropped, the op still saves what it saves (its weights among
    // them): the replay runs its module's forward, whose pre-forward hooks (FSDP2 unsharding
    // the unit) run as for an op run again (run_op).
    hooks_->before_replay(i);
  }
  if (p == OpPolicy::Dropped) {
    // No backward reads its outputs: the replay binds none, and saves what the op saves
    // (inputs the replay has bound).
    for (const std::uint32_t t : op.saved) (void)pack(i, t);
    return;
  }
  if (p == OpPolicy::MustSave || p == OpPolicy::Offload) {
    // Served from forward instead of re-run.
    for (const std::uint32_t t : op.outputs) {
      if (model_.tensors[t].view_of >= 0) {
        const Bound b = lookup(base(t));
        const auto forward = info.view_values.find(t);
        const std::uint64_t value =
            forward != info.view_values.end() ? forward->second : mix_content(b.value, t);
        scope.bound[t] = Bound{b.buffer, b.offset + model_.tensors[t].view_offset, value};
        continue;
      }
      const auto cached = info.cache.find(t);
      const auto offloaded = info.offloaded.find(t);
      if (p == OpPolicy::MustSave ? cached == info.cache.end()
                                  : offloaded == info.offloaded.end()) {
        // A backward inside the region's forward replays past the op forward has reached
        // (early stop off): torch's selective checkpointing finds nothing stored for it.
        throw StepFailure{Failure{
            FailureKind::Misuse,
            fmt::format("checkpoint: op {} (\"{}\") encountered during backward, but not found "
                        "in storage: selective checkpointing serves it from forward, which has "
                        "not run it yet (a backward inside the region's forward replays it with "
                        "early stop off; torch raises the same)",
                        i, op.name)}};
      }
      Bound b;
      if (p == OpPolicy::MustSave) {
        b = cached->second;
        device_.hold(b.buffer);
      } else {
        b = unpack(offloaded->second, i);
      }
      scope.bound[t] = b;
      scope.owned.push_back(b.buffer);
    }
    for (const std::uint32_t t : op.saved) (void)pack(i, t);
    return;
  }
  // Note [A replay ends before the op it no longer needs]
  // torch's autograd kernel of an op saves its inputs before the op runs and its outputs after
  // (the generated VariableType code), and a trace lists an op's saved tensors in the order they
  // were packed. With early stop a replay ends in the pack hook that fills the frame's last
  // holder, so where that holder is one of the op's inputs the op never runs: the replay of a
  // checkpointed Llama layer ends before its down projection's matmul.
  std::size_t packed = 0;
  const std::size_t before = saved_before_running(op);
  if (before > 0 && !contexts_.empty() && contexts_.back().kind == Context::Kind::Recompute) {
    const std::optional<std::size_t> left = checkpointer_.holders_left();
    if (left && *left <= before) {
      hooks_->before_replay(i);  // the module's pre-forward hooks run before the op
      for (; packed < before; ++packed) {
        (void)pack(i, op.saved[packed]);
        if (stop_replay_) return;
      }
      // Past here only where a holder went unfilled (a planted fault drops one).
    }
  }
  run_op(i, true);
  for (; packed < op.saved.size(); ++packed) {
    (void)pack(i, op.saved[packed]);
    if (stop_replay_) break;
  }
}

std::vector<std::uint32_t> Trainer::backward_order() {
  std::vector<std::uint32_t> order;
  if (options_.order_seed == 0) {
    for (std::size_t i = model_.ops.size(); i-- > 0;) {
      if (graph_.needed[i]) order.push_back(static_cast<std::uint32_t>(i));
    }
    return order;
  }
  // A random valid order: a node runs once every needed op reading its outputs has run. A
  // reentrant region is one node of the outer graph: its ops form one unit, expanded in
  // reverse order when the unit runs.
  const auto ops = static_cast<std::uint32_t>(model_.ops.size());
  std::vector<std::uint32_t> unit(ops);
  for (std::uint32_t i = 0; i < ops; ++i) {
    const std::int32_t r = reentrant_region_of(i);
    unit[i] = r >= 0 ? options_.checkpoint.regions[static_cast<std::size_t>(r)].end_op - 1 : i;
  }
  std::vector<std::int32_t> waiting(ops, 0);
  std::vector<std::vector<std::uint32_t>> producers_of(ops);
  std::vector<std::int32_t> producer(model_.tensors.size(), -1);
  for (std::uint32_t i = 0; i < ops; ++i) {
    for (const std::uint32_t t : model_.ops[i].outputs)
      producer[base(t)] = static_cast<std::int32_t>(i);
  }
  for (std::uint32_t j = 0; j < ops; ++j) {
    if (!graph_.needed[j]) continue;
    const std::uint32_t uj = unit[j];
    for (const std::uint32_t t : model_.ops[j].inputs) {
      const std::int32_t p = producer[base(t)];
      if (p < 0 || !graph_.needed[static_cast<std::size_t>(p)]) continue;
      const std::uint32_t up = unit[static_cast<std::uint32_t>(p)];
      if (up == uj) continue;
      auto& list = producers_of[uj];
      if (std::find(list.begin(), list.end(), up) != list.end()) continue;
      list.push_back(up);
      ++waiting[up];
    }
  }
  std::mt19937_64 rng(options_.order_seed);
  std::vector<std::uint32_t> ready;
  for (std::uint32_t i = 0; i < ops; ++i) {
    if (graph_.needed[i] && unit[i] == i && waiting[i] == 0) ready.push_back(i);
  }
  while (!ready.empty()) {
    const std::size_t pick = static_cast<std::size_t>(rng() % ready.size());
    const std::uint32_t n = ready[pick];
    ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(pick));
    for (std::uint32_t i = n + 1; i-- > 0 && unit[i] == n;) {
      if (graph_.needed[i]) order.push_back(i);
    }
    for (const std::uint32_t up : producers_of[n]) {
      if (--waiting[up] == 0) ready.push_back(up);
    }
  }
  return order;
}

Device::Buffer& Trainer::grad(std::uint32_t t) {
  const std::uint32_t b = base(t);
  if (!grads_[b]) grads_[b] = must_allocate(allocated_bytes(model_.tensors[b]), grad_label(b));
  return *grads_[b];
}

std::int32_t Trainer::reentrant_region_of(std::uint32_t op) const {
  const std::int32_t r = region_of_op_[op];
  return r >= 0 && options_.checkpoint.regions[static_cast<std::size_t>(r)].reentrant ? r : -1;
}

void Trainer::unpack_node(std::uint32_t n, std::vector<Region>& reads, std::uint64_t& g,
                          std::vector<Device::Buffer>& unpacked) {
  for (const Saved& s : saved_[n]) {
    const Bound b = unpack(s, n);
    if (options_.unpack_twice) device_.drop(unpack(s, n).buffer);  // a holder refuses this
    const Region r{b.buffer.id, b.offset, model_.tensors[s.tensor].bytes};
    sim_.expect_content_at_next_kernel(r, s.expected);
    reads.push_back(r);
    unpacked.push_back(b.buffer);
    g = mix_content(g, b.value);
  }
}

void Trainer::write_input_grads(std::uint32_t n, std::uint64_t g, std::vector<Region>& reads,
                                std::vector<Region>& writes, std::vector<std::uint64_t>& values,
                                std::vector<std::uint32_t>& written,
                                std::vector<Device::Buffer>& spent) {
  for (const std::uint32_t t : model_.ops[n].inputs) {
    const std::uint32_t b = base(t);
    if (std::find(written.begin(), written.end(), b) != written.end()) continue;
    const TensorRole role = model_.tensors[b].role;
    if (role == TensorRole::Activation || role == TensorRole::Input) {
      written.push_back(b);
      const std::uint64_t v = mix_content(g, b);
      // A gradient reaching a tensor from several consumers accumulates (sum).
      grad_values_[b] = grads_[b] ? grad_values_[b] + v : v;
      writes.push_back(Region{grad(b).id, Bytes(0), model_.tensors[b].bytes});
      values.push_back(grad_values_[b]);
    } else if (role == TensorRole::Param) {
      written.push_back(b);
      const ModelTensor& view = model_.tensors[t];
      const bool whole_view =
          t != b && view.view_offset == Bytes(0) && view.bytes == model_.tensors[b].bytes;
      receive_param_grad(b, whole_view, mix_content(g, b), reads, writes, values, spent);
    }
  }
}

// Note [A parameter's gradients]
// The autograd engine hands each backward node's gradient of a parameter to the parameter's
// AccumulateGrad node, which runs once every node that writes one has run (a tied embedding's
// weight has two: the embedding's and the output head's). In between, the engine's input buffer
// sums them: in place when the first one is a tensor of its own, out of place when it is a view
// (the head's gradient comes back through the transpose `F.linear` takes of the weight, and a
// view shares its storage with its base): the sum is allocated while both addends live, three
// gradients' bytes at once (torch/csrc/autograd/input_buffer.cpp, `accumulate`, and its
// stealability test). AccumulateGrad then takes the sum as the parameter's gradient when there is
// none, or adds it in place into the one there is (a kept gradient, the next micro-batch's), after
// which it goes. A whole view (offset 0, the base's bytes: a transpose, a reshape) is taken as
// such a view; a slice's or an expansion's backward makes a tensor of its own.
void Trainer::receive_param_grad(std::uint32_t p, bool through_view, std::uint64_t v,
                                 std::vector<Region>& reads, std::vector<Region>& writes,
                                 std::vector<std::uint64_t>& values,
                                 std::vector<Device::Buffer>& spent) {
  const Bytes bytes = model_.tensors[p].bytes;
  const auto region = [&](const Device::Buffer& b) { return Region{b.id, Bytes(0), bytes}; };
  param_grad_values_[p] += v;
  GradSum& sum = grad_sums_[p];
  ++sum.arrived;
  const Device::Buffer incoming = must_allocate(bytes, grad_label(p));
  writes.push_back(region(incoming));
  values.push_back(v);
  if (!sum.buffer) {
    sum.buffer = incoming;
    sum.value = v;
    sum.in_place = !through_view;
  } else {
    reads.push_back(region(*sum.buffer));
    sum.value += v;
    if (!sum.in_place) {  // old + new into a third storage, then both go
      spent.push_back(*sum.buffer);
      sum.buffer = must_allocate(bytes, grad_label(p));
      sum.in_place = true;
    }
    spent.push_back(incoming);
    writes.push_back(region(*sum.buffer));
    values.push_back(sum.value);
  }
  if (sum.arrived < sum.producers) return;
  // AccumulateGrad: the sum becomes the gradient, or is added into it and goes.
  if (!param_grads_.contains(p)) {
    param_grads_[p] = *sum.buffer;
    values.back() = param_grad_values_[p];  // the last write was the sum's
  } else {
    spent.push_back(*sum.buffer);
    writes.push_back(region(param_grads_.at(p)));
    values.push_back(param_grad_values_[p]);
  }
  sum.arrived = 0;
  sum.buffer.reset();
}

void Trainer::let_go_after_node(std::uint32_t n, bool last_pass, std::size_t k,
                                const std::vector<Device::Buffer>& unpacked) {
  if (escaped_) {
    device_.drop(*escaped_);
    escaped_.reset();
  }
  const bool escape = options_.escape_period > 0 && !unpacked.empty() &&
                      k % static_cast<std::size_t>(options_.escape_period) == 0;
  for (std::size_t u = 0; u < unpacked.size(); ++u) {
    if (escape && u == 0) {
      escaped_ = unpacked[u];                         // a view of it lives on into the next node
    } else if (device_.use_count(unpacked[u]) > 0) {  // see unpack: a Param may not be held
      device_.drop(unpacked[u]);
    }
  }
  for (const std::uint32_t t : model_.ops[n].outputs) {
    const std::uint32_t b = base(t);
    if (grads_[b] && b != base(model_.loss)) {
      device_.drop(*grads_[b]);
      grads_[b].reset();
    }
  }
  offloader_.node_done(NodeId(n));
  if (last_pass) {
    for (const Saved& s : saved_[n]) {
      release_saved(s);
    }
  }
}

void Trainer::run_node(std::uint32_t n, bool last_pass, std::size_t k) {
  take_turn();
  const ModelOp& op = model_.ops[n];
  auto reads = region_scratch_.borrow();
  auto writes = region_scratch_.borrow();
  auto values = value_scratch_.borrow();
  auto unpacked = buffer_scratch_.borrow();
  auto written = index_scratch_.borrow();
  std::uint64_t g = mix_content(tag::kGrad, n + 1);
  switch_to(op_stream(n, false));  // the engine runs a node on its forward's stream
  unpack_node(n, *reads, g, *unpacked);
  if (escaped_) reads->push_back(Region{escaped_->id, Bytes(0), Bytes(1)});
  for (const std::uint32_t t : op.outputs) {
    const std::uint32_t b = base(t);
    if (grads_[b]) {
      reads->push_back(Region{grads_[b]->id, Bytes(0), model_.tensors[b].bytes});
      g = mix_content(g, grad_values_[b]);
    }
  }
  auto spent = buffer_scratch_.borrow();
  write_input_grads(n, g, *reads, *writes, *values, *written, *spent);
  used_on_current(*reads);
  used_on_current(*writes);
  const std::string_view label =
      labels_ ? std::string_view(label_.assign(op.name).append(" backward")) : std::string_view();
  const Launch launch{.op = n,
                      .phase = Launch::Phase::Backward,
                      .reads = *reads,
                      .writes = *writes,
                      .values = *values,
                      .label = label};
  if (!hooks_->launch(launch)) {
    sim_.kernel(current_, op.backward_duration, *reads, *writes, label, *values);
  }
  if (last_pass) {
    for (const std::uint32_t b : *written) {
      if (last_grad_node_.contains(b) && last_grad_node_.at(b) == n) hooks_->grad_ready(b);
    }
  }
  for (const Device::Buffer& b : *spent) device_.drop(b);
  let_go_after_node(n, last_pass, k, *unpacked);
}

void Trainer::backward_inside(std::uint32_t k) {
  ++gid_;
  const bool outer_last_pass = last_pass_;
  last_pass_ = false;
  std::vector<Region> reads;
  std::vector<Device::Buffer> unpacked;
  const StreamId stream = switch_to(op_stream(k, false));
  for (const Saved& s : saved_[k]) {
    const Bound b = unpack(s, k);
    const Region r{b.buffer.id, b.offset, model_.tensors[s.tensor].bytes};
    sim_.expect_content_at_next_kernel(r, s.expected);
    reads.push_back(r);
    unpacked.push_back(b.buffer);
  }
  const Device::Buffer scratch = must_allocate(Bytes(512), "grad inside forward");
  used_on_current(reads);
  const std::vector<Region> writes{Region{scratch.id, Bytes(0), Bytes(512)}};
  const std::string label = model_.ops[k].name + " backward inside forward";
  const Launch launch{.op = k,
                      .phase = Launch::Phase::Backward,
                      .reads = reads,
                      .writes = writes,
                      .values = {},
                      .label = label};
  if (!hooks_->launch(launch)) {
    sim_.kernel(current_, model_.ops[k].backward_duration, reads, writes, label);
  }
  for (const Device::Buffer& b : unpacked) device_.drop(b);
  device_.drop(scratch);
  offloader_.node_done(NodeId(k));
  for (const Recomputed& left : checkpointer_.drain(gid_)) device_.drop(left.buffer);
  last_pass_ = outer_last_pass;
  switch_to(stream);
}

void Trainer::run_reentrant(std::uint32_t r, bool last_pass, std::size_t k) {
  const CheckpointRegion& reg = options_.checkpoint.regions[r];
  FrameInfo& info = reentrant_inputs_.at(r);
  ++run_.recomputations;
  ++run_.layer_decisions[model_.ops[reg.first_op].layer].recomputed;
  const StreamId stream = options_.side.recompute ? switch_to(side_) : current_;
  const Generators outer = open_replay(info, reg.end_op - 1);
  for (std::uint32_t i = reg.first_op; i < reg.end_op; ++i) {
    run_op(i, true);
    for (const std::uint32_t t : model_.ops[i].saved) saved_[i].push_back(pack(i, t));
  }
  switch_to(stream);
  generators_ = outer;
  if (in_last_step_) run_.replay_stops.emplace_back(reg.end_op - 1, reg.end_op - 1);
  for (std::uint32_t i = reg.end_op; i-- > reg.first_op;) {
    if (graph_.needed[i]) {
      run_node(i, true, k);
    } else {
      // Off the path to the loss: the replay's graph frees what it saved.
      for (const Saved& s : saved_[i]) {
        release_saved(s);
      }
    }
    saved_[i].clear();
  }
  close_scope();
  // The checkpoint node itself (it unpacked the region's inputs as node end_op - 1) is done
  // once its inner backward is: its post-hook. A no-op when that op's own node ran it already.
  offloader_.node_done(NodeId(reg.end_op - 1));
  if (last_pass) release_frame(info);
}

void Trainer::backward(bool last_pass) {
  ++gid_;
  last_pass_ = last_pass;
  for (FrameInfo& info : frames_) info.taken = 0;
  const std::vector<std::uint32_t> order = backward_order();
  run_.backward_order = order;
  last_grad_node_.clear();
  grad_sums_.clear();
  for (const std::uint32_t n : order) {
    for (const std::uint32_t t : model_.ops[n].inputs) {
      const std::uint32_t b = base(t);
      if (model_.tensors[b].role != TensorRole::Param) continue;
      if (!last_grad_node_.contains(b) || last_grad_node_.at(b) != n) ++grad_sums_[b].producers;
      last_grad_node_[b] = n;
    }
  }
  std::vector<NodeId> nodes;
  for (const std::uint32_t n : order) nodes.push_back(NodeId(n));
  offloader_.backward_begin(options_.announce_order ? std::span<const NodeId>(nodes)
                                                    : std::span<const NodeId>());
  const std::uint32_t loss = base(model_.loss);
  grad_values_[loss] = mix_content(tag::kGrad, 0);
  switch_to(compute_);
  sim_.kernel(current_, SimTime(1), {},
              std::vector<Region>{Region{grad(loss).id, Bytes(0), model_.tensors[loss].bytes}},
              "loss grad", std::vector<std::uint64_t>{grad_values_[loss]});
  std::vector<bool> done_region(options_.checkpoint.regions.size(), false);
  hooks_->backward_begin(order);
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::uint32_t n = order[k];
    hooks_->before_node(n);
    const std::int32_t r = reentrant_region_of(n);
    if (r >= 0) {
      if (!done_region[static_cast<std::size_t>(r)]) {
        done_region[static_cast<std::size_t>(r)] = true;
        run_reentrant(static_cast<std::uint32_t>(r), last_pass, k);
      }
    } else {
      run_node(n, last_pass, k);
    }
    hooks_->after_node(k, n);
  }
  switch_to(compute_);  // backward() returns on the caller's stream, synced with the leaves'
  grad_sums_.for_each([&](std::uint32_t p, const GradSum& sum) {
    FERRY_CHECK(!sum.buffer, "the gradient of '{}' waits for {} more nodes after backward",
                model_.tensors[p].name, sum.producers - sum.arrived);
  });
  hooks_->backward_end();
  if (escaped_) {
    device_.drop(*escaped_);
    escaped_.reset();
  }
  offloader_.backward_end();
  for (const Recomputed& left : checkpointer_.drain(gid_)) device_.drop(left.buffer);
  for (auto& g : grads_) {
    if (g) {
      device_.drop(*g);
      g.reset();
    }
  }
  if (!last_pass) return;
  // The graph is freed: saved tensors of nodes that never ran go too, and the frames'
  // saved inputs and caches.
  for (std::uint32_t n = 0; n < saved_.size(); ++n) {
    for (const Saved& s : saved_[n]) {
      if (!graph_.needed[n]) release_saved(s);
    }
  }
  for (FrameInfo& info : frames_) release_frame(info);
  for (auto& [r, info] : reentrant_inputs_) {
    if (!done_region[r]) release_frame(info);  // none of its nodes ran
  }
  device_.drop(scopes_[0].bound.at(loss).buffer);
  for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
    const ModelTensor& tensor = model_.tensors[t];
    if (tensor.role == TensorRole::Input && tensor.view_of < 0)
      device_.drop(scopes_[0].bound.at(t).buffer);
  }
  scopes_[0].bound.clear();
}

void Trainer::optimizer_step() {
  auto reads = region_scratch_.borrow();
  auto writes = region_scratch_.borrow();
  auto values = value_scratch_.borrow();
  Bytes params;
  Bytes grads;
  Bytes state;
  for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
    const ModelTensor& tensor = model_.tensors[t];
    const bool param = tensor.role == TensorRole::Param;
    if (tensor.view_of >= 0 || !params_.contains(t)) continue;
    if (!param && tensor.role != TensorRole::OptimizerState) continue;
    const Region where = region(t);
    reads->push_back(where);
    writes->push_back(where);
    values->push_back(params_.at(t).value);  // what a tensor holds is named by the tensor
    (param ? params : state) += tensor.bytes;
    if (param && param_grads_.contains(t)) {
      reads->push_back(Region{param_grads_.at(t).id, Bytes(0), tensor.bytes});
      grads += tensor.bytes;
    }
  }
  const StepCost cost = optimizer_step_cost(model_, params, grads, state);
  if (cost.moved <= Bytes(0)) return;
  std::vector<Device::Buffer> temporaries;
  for (const Bytes bytes : cost.temporaries) {
    temporaries.push_back(must_allocate(bytes, "optimizer step temporaries"));
    writes->push_back(Region{temporaries.back().id, Bytes(0), bytes});
    values->push_back(mix_content(tag::kGrad, temporaries.back().id.value()));
  }
  used_on_current(*reads);
  used_on_current(*writes);
  sim_.kernel(current_, streaming_time(sim_.device_profile(dev_), cost.moved), *reads, *writes,
              "optimizer step", *values);
  for (const Device::Buffer& b : temporaries) device_.drop(b);
}

void Trainer::step() {
  in_last_step_ = step_ + 1 == options_.steps;
  // The offloader's counters and decisions are reported for the last step run, like every
  // other figure of a run: the counts start again with each step.
  step_start_telemetry_ = offloader_.telemetry();
  run_.layer_decisions.clear();
  if (in_last_step_) {
    run_.recompute_time = SimTime(0);
    run_.replay_stops.clear();
  }
  StepTimes times;
  times.start = sim_.host_time();
  // The offload context spans the step, forward and backward, as the reference's trainer
  // enters it.
  offloader_.enter();
  hooks_->step_begin();
  forward();
  times.forward_end = sim_.host_time();
  param_grad_values_.clear();
  const int passes = options_.retain_graph ? 2 : 1;
  for (int pass = 0; pass < passes; ++pass) backward(pass == passes - 1);
  offloader_.exit();
  if (!options_.parallel.on()) optimizer_step();
  hooks_->optimizer_step();
  if (options_.sync_each_step) sim_.sync_device(dev_);
  if (options_.grads_set_to_none) {
    // zero_grad(set_to_none=True): after the step, when the compute stream has waited for the
    // side and comm streams that used the gradients (backward's end), so the frees need no
    // record_stream.
    param_grads_.for_each(
        [&](std::uint32_t, const Device::Buffer& buffer) { device_.drop(buffer); });
    param_grads_.clear();
  }
  times.end = sim_.host_time();
  run_.steps.push_back(times);
  run_.allocated_after.push_back(allocated());
  run_.tracked_after.push_back(offloader_.tracked());
  hooks_->report(run_);
  run_.gradient_values.clear();
  if (options_.content_values) {
    param_grad_values_.for_each(
        [&](std::uint32_t, std::uint64_t v) { run_.gradient_values.push_back(v); });
  }
  ++step_;
}

}  // namespace ferry::sim::training
