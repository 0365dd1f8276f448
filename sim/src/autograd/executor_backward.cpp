#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "executor.hpp"
#include "ferry/check.hpp"
#include "ferry/sim/workload/model.hpp"
#include "ferry/units.hpp"
#include "step_failure.hpp"

namespace ferry::sim::pipelining {

// Backward, offload in stages, and the end of the step.

void Executor::backward_fence(std::uint32_t i, std::uint32_t j) {
  issuing(i, j);
  Task& task = tasks_[i][j];
  streams_->begin_fence();
  if (j + 1 < parts_ && !plan_.grad_back[j + 1].empty() && local_handoff(j + 1)) {
    // On one rank, the input gradients themselves, with their holder (Note [Stages on one
    // rank]).
    Task& next = tasks_[i][j + 1];
    for (const std::uint32_t b : plan_.grad_back[j + 1]) {
      task.grads[b] = next.grads.at(b);
      next.grads.erase(b);
    }
  } else if (j + 1 < parts_ && !plan_.grad_back[j + 1].empty()) {
    Task& next = tasks_[i][j + 1];
    const StreamRef stream = streams_->copy_after(Phase::Backward, Cell{i, j + 1}, dev(j));
    const StreamRef home = receive_stream(j, stream);
    for (const std::uint32_t b : plan_.grad_back[j + 1]) {
      const ModelTensor& t = model_.tensors[b];
      const TensorId src = next.grads.at(b);
      const TensorId dst = allocate(dev(j), home, t.bytes, Kind::Gradient, 1,
                                    mb_label(i, fmt::format("{}.grad (received)", t.name)));
      copy(stream, src, dst, mb_label(i, fmt::format("{}.grad gpu{}->gpu{}", t.name, j + 1, j)));
      release(src);
      next.grads.erase(b);
      task.grads[b] = dst;
    }
    if (!point_to_point() || !faults_.skip_receive_arrival_wait) {
      streams_->arrived(Cell{i, j}, stream);
    }
  }
  // PortalCopy's backward: the gradient the orange node put goes back to the stash's device.
  for (const std::uint32_t s : plan_.skips_from[j]) {
    const SkipPlan& skip = plan_.skips[s];
    const StreamRef stream = streams_->copy_after(Phase::Backward, Cell{i, skip.to}, dev(j));
    const ModelTensor& t = model_.tensors[skip.tensor];
    const TensorId src = portals_.use_grad(key(s, i));
    const TensorId dst = allocate(dev(j), stream, t.bytes, Kind::Gradient, 1,
                                  mb_label(i, fmt::format("{}.grad (portal copy)", t.name)));
    copy(stream, src, dst,
         mb_label(i, fmt::format("portal {}.grad gpu{}->gpu{}", t.name, skip.to, j)));
    release(src);
    track(dst, key(s, i), true);
    if (const auto dropped = portals_.put_grad(key(s, i), dst)) release(*dropped);
    streams_->arrived(Cell{i, j}, stream);
  }
}

void Executor::backward_compute(std::uint32_t i, std::uint32_t j) {
  issuing(i, j);
  Task& task = tasks_[i][j];
  const std::uint32_t first = plan_.starts[j];
  const std::uint32_t last = plan_.starts[j + 1];
  // The recompute needs no gradient: it is issued before the waits for the incoming ones.
  if (task.checkpointed) {
    const Generators outer = begin_replay(rng_, task.rng, !faults_.skip_rng_restore);
    run_ops(i, j, Pass::Recompute);
    rng_ = outer;
  }
  streams_->start(Cell{i, j});
  if (Offloader<Device>* off = offloader(j)) {
    std::vector<NodeId> order;
    for (std::uint32_t k = last; k-- > first;) {
      if (plan_.needed[k]) order.push_back(node_id(i, k));
    }
    off->backward_begin(order);
  }
  if (j + 1 == parts_) {
    const std::uint32_t loss = plan_.base[model_.loss];
    const ModelTensor& t = model_.tensors[loss];
    const TensorId h = allocate(dev(j), streams_->compute(dev(j)), t.bytes, Kind::Gradient, 1,
                                mb_label(i, t.name + ".grad"));
    const std::uint64_t seed = mix_content(tag::kLoss, i);
    launch(dev(j), SimTime(1), {}, {Write{h, grad_content(seed), seed}}, mb_label(i, "loss grad"));
    task.grads[loss] = h;
    if (task.output) release(*task.output);
    task.output.reset();
  }
  for (std::uint32_t k = last; k-- > first;) {
    if (!plan_.needed[k]) continue;
    blue_backward(i, j, k);
    op_backward(i, j, k);
  }
  if (Offloader<Device>* off = offloader(j)) off->backward_end();
  streams_->finish(Phase::Backward, Cell{i, j});
  // Split, the weight step reads what the graph keeps: it is freed after that step.
  if (!split_backward()) free_graph(i, j);
  for (const auto& [b, h] : task.grads) {
    FERRY_CHECK(std::binary_search(plan_.grad_back[j].begin(), plan_.grad_back[j].end(), b),
                "gradient of '{}' left on gpu{} after its backward", model_.tensors[b].name, j);
  }
}

void Executor::blue_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k) {
  Task& task = tasks_[i][j];
  for (const std::uint32_t s : plan_.stashes[k]) {
    if (!plan_.skips[s].grad) continue;
    const std::uint32_t b = plan_.skips[s].tensor;
    const TensorId g = portals_.use_grad(key(s, i));
    const auto it = task.grads.find(b);
    if (it == task.grads.end()) {
      task.grads[b] = g;
      continue;
    }
    const TensorId acc = it->second;
    const std::uint64_t sum = buf(acc).sum + buf(g).sum;
    const Bytes bytes = model_.tensors[b].bytes;
    const SimTime duration = profile_.memory_bandwidth.bytes_per_s() > 0
                                 ? std::max(SimTime(1), transfer_time(Bytes(3 * bytes.count()),
                                                                      profile_.memory_bandwidth))
                                 : SimTime(1);
    launch(dev(j), duration, {Read{g, whole(g), content(g)}, Read{acc, whole(acc), content(acc)}},
           {Write{acc, grad_content(sum), sum}},
           mb_label(i, fmt::format("{}.grad += portal grad", model_.tensors[b].name)));
    release(g);
  }
}

NodeId Executor::node_id(std::uint32_t i, std::uint32_t k) const {
  return NodeId(static_cast<std::uint32_t>(i * model_.ops.size() + k));
}

TensorId Executor::pack(std::uint32_t i, std::uint32_t j, std::uint32_t k, const SavedRef& ref) {
  const ModelTensor& t = model_.tensors[ref.access.tensor];
  const Buf& b = buf(ref.handle);
  TensorFacts facts;
  facts.bytes = t.bytes;
  facts.storage_bytes = b.bytes;
  facts.view_offset = t.view_of >= 0 ? t.view_offset : Bytes(0);
  facts.storage = b.id.value();
  facts.address = static_cast<std::uint64_t>(sim_.buffers()[b.id.value()].address.count());
  facts.dtype = static_cast<std::uint32_t>(t.dtype);
  facts.no_offload = t.no_offload;
  facts.node = node_id(i, k);
  Offloader<Device>& off = *offloaders_[dev(j)];
  const bool region = model_.ops[k].no_offload;
  if (region) off.push_no_offload();
  const TensorId id = off.pack(facts, Device::Buffer{b.id});
  if (region) off.pop_no_offload();
  release(ref.handle);
  return id;
}

std::vector<Device::Buffer> Executor::unpack_saved(std::uint32_t i, std::uint32_t j,
                                                   std::uint32_t k, std::vector<Read>& reads,
                                                   std::uint64_t& h) {
  std::vector<Device::Buffer> unpacked;
  for (const SavedRef& ref : tasks_[i][j].saved[k - plan_.starts[j]]) {
    if (!ref.offloaded.valid()) {
      reads.push_back(Read{ref.handle, region(ref.handle, ref.access.tensor), ref.expected});
      h = mix_content(h, read_value(ref.handle, ref.access.tensor));
      continue;
    }
    const Unpacked<Device::Buffer> u = offloaders_[dev(j)]->unpack(ref.offloaded, node_id(i, k));
    const ModelTensor& t = model_.tensors[ref.access.tensor];
    const bool view = t.view_of >= 0;
    reads.push_back(Read{TensorId(), Region{u.storage.id, u.offset, t.bytes}, ref.expected,
                         view ? t.view_offset : Bytes(0)});
    h = mix_content(h, view ? mix_content(ref.expected, ref.access.tensor) : ref.expected);
    unpacked.push_back(u.storage);
  }
  return unpacked;
}

void Executor::let_go_saved(std::uint32_t j, const SavedRef& ref) {
  if (ref.offloaded.valid()) {
    offloaders_[dev(j)]->release(ref.offloaded);
  } else if (ref.access.held()) {
    release(ref.handle);
  }
}

std::vector<OffloadTelemetry> Executor::telemetry() const {
  std::vector<OffloadTelemetry> out;
  // A device without a policy moved nothing: its telemetry is zero.
  for (const auto& off : offloaders_) out.push_back(off ? off->telemetry() : OffloadTelemetry{});
  return out;
}

std::vector<std::uint32_t> Executor::read_output_grads(std::uint32_t i, std::uint32_t j,
                                                       std::uint32_t k, std::vector<Read>& reads,
                                                       std::uint64_t& h) {
  const Task& task = tasks_[i][j];
  const ModelOp& op = model_.ops[k];
  std::vector<std::uint32_t> out_bases;
  for (const std::uint32_t t : op.outputs) {
    const std::uint32_t b = plan_.base[t];
    if (!plan_.grad_flows[b]) continue;
    if (std::find(out_bases.begin(), out_bases.end(), b) != out_bases.end()) continue;
    out_bases.push_back(b);
    const auto it = task.grads.find(b);
    FERRY_CHECK(it != task.grads.end(), "no gradient for '{}' at the backward of '{}'",
                model_.tensors[b].name, op.name);
    reads.push_back(Read{it->second, whole(it->second), content(it->second)});
    h = mix_content(h, content(it->second));
  }
  return out_bases;
}

TensorId Executor::grad_target(std::uint32_t i, std::uint32_t j, const Access& a,
                               GradTargets& targets) {
  const TensorRole role = model_.tensors[a.base].role;
  if (role == TensorRole::Param) return param_grads_[dev(j)].at(a.base);
  if (role != TensorRole::Activation) return TensorId();
  const bool portal = a.route == Route::Portal;
  std::map<std::uint32_t, TensorId>& grads = portal ? targets.portal_grads : tasks_[i][j].grads;
  const std::uint32_t key = portal ? a.skip : a.base;
  auto it = grads.find(key);
  if (it == grads.end()) {
    const ModelTensor& t = model_.tensors[a.base];
    it = grads
             .emplace(key, allocate(dev(j), streams_->compute(dev(j)), t.bytes, Kind::Gradient, 1,
                                    mb_label(i, t.name + (portal ? ".grad (portal)" : ".grad"))))
             .first;
    targets.fresh.insert(it->second.value());
  }
  return it->second;
}

void Executor::let_go_after_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k,
                                     const std::vector<std::uint32_t>& out_bases,
                                     const GradTargets& targets,
                                     const std::vector<Device::Buffer>& unpacked) {
  Task& task = tasks_[i][j];
  std::vector<SavedRef>& saved = task.saved[k - plan_.starts[j]];
  // The pipeline's holders let go first, so each free follows its last use at once; then the
  // offloader's post-hook runs (Note [Offload in stages]).
  for (const SavedRef& ref : saved) {
    if (!ref.offloaded.valid()) let_go_saved(j, ref);
  }
  for (const std::uint32_t b : out_bases) {
    release(task.grads.at(b));
    task.grads.erase(b);
  }
  // The orange node's backward puts the gradient into the portal.
  for (const auto& [s, g] : targets.portal_grads) {
    track(g, key(s, i), true);
    if (const auto dropped = portals_.put_grad(key(s, i), g)) release(*dropped);
  }
  for (const Device::Buffer& b : unpacked) devices_[dev(j)]->drop(b);
  if (Offloader<Device>* off = offloader(j)) off->node_done(node_id(i, k));
  for (const SavedRef& ref : saved) {
    if (ref.offloaded.valid()) let_go_saved(j, ref);
  }
  saved.clear();
}

bool Executor::has_weight(std::uint32_t k) const {
  for (const Access& a : plan_.reads[k]) {
    if (model_.tensors[a.base].role == TensorRole::Param) return true;
  }
  return false;
}

SimTime Executor::input_share(std::uint32_t k) const {
  const SimTime whole = model_.ops[k].backward_duration;
  return has_weight(k) ? SimTime(std::max<std::int64_t>(1, whole.ns() / 2)) : whole;
}

void Executor::op_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k) {
  const ModelOp& op = model_.ops[k];
  const bool split = split_backward() && has_weight(k);
  std::vector<Read> reads;
  std::uint64_t h = mix_content(mix_content(tag::kBackward, k), i);
  const std::vector<Device::Buffer> unpacked = unpack_saved(i, j, k, reads, h);
  const std::vector<std::uint32_t> out_bases = read_output_grads(i, j, k, reads, h);
  // Contributions per target buffer; a target created here starts from zero. Split, the
  // parameters' wait for the weight step.
  GradTargets targets;
  for (std::uint32_t slot = 0; slot < op.inputs.size(); ++slot) {
    const Access& a = plan_.reads[k][slot];
    if (split && model_.tensors[a.base].role == TensorRole::Param) continue;
    const TensorId target = grad_target(i, j, a, targets);
    if (target.valid()) targets.add[target.value()] += mix_content(h, slot + 1);
  }
  std::vector<Write> writes;
  for (const auto& [handle, c] : targets.add) {
    const TensorId target(handle);
    const bool fresh = targets.fresh.contains(handle);
    const std::uint64_t before = fresh ? 0 : buf(target).sum;
    if (!fresh) reads.push_back(Read{target, whole(target), content(target)});
    writes.push_back(Write{target, grad_content(before + c), before + c});
  }
  const std::vector<TensorId> made =
      split ? std::vector<TensorId>() : new_param_grads(i, j, k, writes);
  if (!split) {
    launch(dev(j), op.backward_duration, reads, writes, mb_label(i, op.name + " backward"),
           collective_lane(k, true));
    for (const TensorId g : made) release(g);
    let_go_after_backward(i, j, k, out_bases, targets, unpacked);
    return;
  }
  launch(dev(j), input_share(k), reads, writes, mb_label(i, op.name + " backward input"),
         collective_lane(k, true));
  // Kept for the weight step: the outputs' gradients (moved out of the task's) and the saved
  // tensors (left in task.saved).
  Task& task = tasks_[i][j];
  std::vector<TensorId>& kept = task.deferred[k];
  for (const std::uint32_t b : out_bases) {
    kept.push_back(task.grads.at(b));
    task.grads.erase(b);
  }
  FERRY_CHECK(targets.portal_grads.empty() && unpacked.empty(),
              "a split backward with portals or offload");
}

// The gradients node k makes of its parameters, before they are added into the kept ones (Note
// [A parameter's gradients] in trainer_backward.cpp): written by its kernel, released by the
// caller once it is launched (a split backward's at its weight step).
std::vector<TensorId> Executor::new_param_grads(std::uint32_t i, std::uint32_t j, std::uint32_t k,
                                                std::vector<Write>& writes) {
  std::vector<TensorId> made;
  std::vector<std::uint32_t> bases;
  for (const Access& a : plan_.reads[k]) {
    if (model_.tensors[a.base].role != TensorRole::Param) continue;
    if (std::find(bases.begin(), bases.end(), a.base) != bases.end()) continue;
    bases.push_back(a.base);
    const ModelTensor& t = model_.tensors[a.base];
    const TensorId g = allocate(dev(j), streams_->compute(dev(j)), t.bytes, Kind::Gradient, 1,
                                mb_label(i, t.name + ".grad (new)"));
    const std::uint64_t c = mix_content(mix_content(tag::kBackward, k), a.base);
    writes.push_back(Write{g, grad_content(c), c});
    made.push_back(g);
  }
  return made;
}

void Executor::weight_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k) {
  const ModelOp& op = model_.ops[k];
  Task& task = tasks_[i][j];
  std::vector<Read> reads;
  std::uint64_t h = mix_content(mix_content(tag::kBackward, k), i);
  const std::vector<Device::Buffer> unpacked = unpack_saved(i, j, k, reads, h);
  FERRY_CHECK(unpacked.empty(), "a split backward with offload");
  const std::vector<TensorId> kept = task.deferred.at(k);
  for (const TensorId g : kept) {
    reads.push_back(Read{g, whole(g), content(g)});
    h = mix_content(h, content(g));
  }
  std::map<std::uint32_t, std::uint64_t> add;
  for (std::uint32_t slot = 0; slot < op.inputs.size(); ++slot) {
    const Access& a = plan_.reads[k][slot];
    if (model_.tensors[a.base].role != TensorRole::Param) continue;
    add[param_grads_[dev(j)].at(a.base).value()] += mix_content(h, slot + 1);
  }
  std::vector<Write> writes;
  for (const auto& [handle, c] : add) {
    const TensorId target(handle);
    const std::uint64_t before = buf(target).sum;
    reads.push_back(Read{target, whole(target), content(target)});
    writes.push_back(Write{target, grad_content(before + c), before + c});
  }
  const std::vector<TensorId> made = new_param_grads(i, j, k, writes);
  launch(dev(j), op.backward_duration - input_share(k), reads, writes,
         mb_label(i, op.name + " backward weight"));
  for (const TensorId g : made) release(g);
  std::vector<SavedRef>& saved = task.saved[k - plan_.starts[j]];
  for (const SavedRef& ref : saved) let_go_saved(j, ref);
  saved.clear();
  for (const TensorId g : kept) release(g);
  task.deferred.erase(k);
}

void Executor::weight_compute(std::uint32_t i, std::uint32_t j) {
  issuing(i, j);
  Task& task = tasks_[i][j];
  for (std::uint32_t k = plan_.starts[j + 1]; k-- > plan_.starts[j];) {
    if (task.deferred.contains(k)) weight_backward(i, j, k);
  }
  FERRY_CHECK(task.deferred.empty(), "mb{} on stage {}: a weight step left", i, j);
  free_graph(i, j);
}

void Executor::free_graph(std::uint32_t i, std::uint32_t j) {
  Task& task = tasks_[i][j];
  // The checkpoint's kept input, what nodes that never ran (or whose weight step ran) saved,
  // the batch.
  if (task.checkpointed) {
    for (const std::uint32_t b : plan_.chain_in[j]) release(task.chain.at(b));
  }
  for (auto& refs : task.saved) {
    for (const SavedRef& ref : refs) let_go_saved(j, ref);
    refs.clear();
  }
  for (const auto& [b, h] : task.inputs) release(h);
  task.inputs.clear();
}

void Executor::finish_step() {
  // The optimizer reads every parameter gradient: each must hold its full sum.
  // Under FSDP it reads the gradients' shard after their reduce-scatter, and the parameters'.
  for (std::uint32_t d = 0; d < ndev_; ++d) {
    std::vector<Read> reads;
    if (mesh_.on()) {
      reads = reduce_gradients(d);
    } else {
      for (const auto& [b, h] : param_grads_[d]) reads.push_back(Read{h, whole(h), content(h)});
    }
    optimizer_step(d, std::move(reads));
  }
  for (std::uint32_t d = 0; d < ndev_; ++d) sim_.sync_device(DeviceId(d));
}

// The optimizer's step reads the gradients, the parameters and the state and writes the last
// two, a kernel bound by the device's memory bandwidth, with what the optimizer makes and frees
// on the way (Note [The optimizer step] in model.cpp, as Fsdp2::optimizer_step). A model that
// names no optimizer (no state, no traced step) reads the gradients for 1 ns.
void Executor::optimizer_step(std::uint32_t d, std::vector<Read> reads) {
  if (reads.empty()) return;
  std::vector<TensorId> updated;
  Bytes grads;
  Bytes params;
  Bytes state;
  for (const Read& r : reads) grads += r.region.bytes;
  if (mesh_.on()) {
    updated = param_shards_[d];  // which reduce_gradients lists among the reads
    for (const TensorId h : updated) params += buf(h).bytes;
    grads -= params;
    for (const TensorId h : moment_shards_[d]) {
      reads.push_back(Read{h, whole(h), content(h)});
      updated.push_back(h);
      state += buf(h).bytes;
    }
  } else {
    for (const auto& [b, h] : param_grads_[d]) {
      updated.push_back(resident_[d].at(b));
      params += buf(resident_[d].at(b)).bytes;
    }
    for (const auto& [b, h] : state_[d]) {
      updated.push_back(h);
      state += buf(h).bytes;
    }
    for (std::size_t i = 0; i < updated.size(); ++i) {
      const TensorId h = updated[i];
      reads.push_back(Read{h, whole(h), content(h)});
    }
  }
  const StepCost cost = optimizer_step_cost(model_, params, grads, state);
  if (cost.moved <= Bytes(0)) {
    launch(d, SimTime(1), reads, {}, "optimizer step");
    return;
  }
  std::vector<Write> writes;
  for (const TensorId h : updated) writes.push_back(Write{h, content(h), buf(h).sum});
  std::vector<TensorId> temporaries;
  for (const Bytes bytes : cost.temporaries) {
    temporaries.push_back(
        allocate(d, streams_->compute(d), bytes, Kind::Static, 1, "optimizer step temporaries"));
    writes.push_back(
        Write{temporaries.back(), mix_content(tag::kGrad, temporaries.back().value()), 0});
  }
  launch(d, streaming_time(profile_, cost.moved), reads, writes, "optimizer step");
  for (const TensorId h : temporaries) release(h);
}

std::int64_t Executor::release_leftovers() {
  // The portal's own references end with the step (torchgpipe makes new trackers per batch).
  static_cast<void>(portals_.clear());
  std::int64_t left = 0;
  for (std::uint32_t h = 0; h < bufs_.size(); ++h) {
    const Buf& b = bufs_[h];
    if (!holders_->live(h) || b.kind == Kind::Static) continue;
    free_buffer(TensorId(h), true);
    ++left;
  }
  return left;
}

std::vector<ParamGradient> Executor::param_gradients() const {
  std::map<std::uint32_t, std::uint64_t> sums;
  for (std::uint32_t d = 0; d < ndev_; ++d) {
    for (const auto& [b, h] : param_grads_[d]) sums[b] += bufs_[h.value()].sum;
  }
  std::vector<ParamGradient> grads;
  for (const auto& [b, sum] : sums) grads.push_back(ParamGradient{b, grad_content(sum)});
  return grads;
}

}  // namespace ferry::sim::pipelining
