#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>

#include "executor.hpp"
#include "ferry/check.hpp"

namespace ferry::sim::pipelining {

// Forward: the fence that brings a partition its inputs, and its ops in each pass.

void Executor::forward_fence(std::uint32_t i, std::uint32_t j) {
  issuing(i, j);
  Task& task = tasks_[i][j];
  streams_->begin_fence();
  // Skip tensors first, by source partition (PortalCopy), then the chain (Copy).
  for (const std::uint32_t s : plan_.skips_into[j]) {
    const SkipPlan& skip = plan_.skips[s];
    const StreamRef stream = streams_->copy(dev(skip.from), dev(j));
    if (!faults_.skip_portal_copy_wait) {
      streams_->wait_for(stream, Phase::Forward, Cell{i, skip.from});
    }
    const ModelTensor& t = model_.tensors[skip.tensor];
    const TensorId dst = allocate(dev(j), stream, t.bytes, Kind::Activation, 1,
                                  mb_label(i, fmt::format("{} (portal copy)", t.name)));
    track(dst, key(s, i), false);
    const TensorId src = portals_.copy_tensor(key(s, i), dst);
    copy(stream, src, dst,
         mb_label(i, fmt::format("portal {} gpu{}->gpu{}", t.name, skip.from, j)));
    release(src);
    if (!faults_.skip_portal_arrival_wait) streams_->arrived(Cell{i, j}, stream);
  }
  if (j == 0 || plan_.chain_in[j].empty()) return;
  // On one rank, the sender's buffers themselves (Note [Stages on one rank]).
  const bool local = local_handoff(j);
  const StreamRef stream =
      local ? StreamRef{0} : streams_->copy_after(Phase::Forward, Cell{i, j - 1}, dev(j));
  const StreamRef home = local ? StreamRef{0} : receive_stream(j, stream);
  Task& prev = tasks_[i][j - 1];
  const bool checkpointed = this->checkpointed(i, j);
  for (const std::uint32_t b : plan_.chain_in[j]) {
    const ModelTensor& t = model_.tensors[b];
    const Counts counts =
        plan_.chain_counts[j].contains(b) ? plan_.chain_counts[j].at(b) : Counts{};
    const bool relay = j + 1 < parts_ && std::binary_search(plan_.chain_in[j + 1].begin(),
                                                            plan_.chain_in[j + 1].end(), b);
    const std::int32_t holds = counts.reads + (checkpointed ? 1 : counts.saves) + (relay ? 1 : 0);
    const bool produced_before =
        plan_.partition_of[static_cast<std::uint32_t>(plan_.producer[b])] == j - 1;
    const TensorId src = produced_before ? prev.local.at(b) : prev.chain.at(b);
    if (local) {
      // The send's holder hands over to this task's readers and savers.
      hold(src, holds);
      release(src);
      task.chain[b] = src;
      continue;
    }
    const TensorId dst = allocate(dev(j), home, t.bytes, Kind::Activation, holds,
                                  mb_label(i, fmt::format("{} (received)", t.name)));
    copy(stream, src, dst, mb_label(i, fmt::format("{} gpu{}->gpu{}", t.name, j - 1, j)));
    release(src);
    task.chain[b] = dst;
  }
  if (local) return;
  if (!point_to_point() || !faults_.skip_receive_arrival_wait)
    streams_->arrived(Cell{i, j}, stream);
}

StreamRef Executor::receive_stream(std::uint32_t j, StreamRef s) {
  if (!point_to_point()) return s;
  if (!faults_.skip_receive_wait) streams_->receive_after_compute(s);
  return streams_->compute(dev(j));
}

void Executor::forward_compute(std::uint32_t i, std::uint32_t j) {
  issuing(i, j);
  Task& task = tasks_[i][j];
  task.checkpointed = checkpointed(i, j);
  streams_->start(Cell{i, j});
  task.rng = rng_;
  load_inputs(i, j);
  run_ops(i, j, task.checkpointed ? Pass::NoGrad : Pass::Forward);
  streams_->finish(Phase::Forward, Cell{i, j});
}

void Executor::load_inputs(std::uint32_t i, std::uint32_t j) {
  Task& task = tasks_[i][j];
  std::vector<Write> writes;
  for (const std::uint32_t b : plan_.inputs_of[j]) {
    const ModelTensor& t = model_.tensors[b];
    const TensorId h = allocate(dev(j), streams_->compute(dev(j)), t.bytes, Kind::Activation, 1,
                                mb_label(i, t.name));
    task.inputs[b] = h;
    writes.push_back(Write{h, mix_content(mix_content(tag::kInput, b), i), 0});
  }
  FERRY_CHECK(writes.size() <= kMaxWrites, "{} batch inputs on one device", writes.size());
  if (!writes.empty()) launch(dev(j), SimTime(1), {}, writes, mb_label(i, "load batch"));
}

TensorId Executor::source(const Task& task, std::uint32_t j, const Access& a) const {
  switch (a.route) {
    case Route::Resident:
      return resident_[dev(j)].at(a.base);
    case Route::Input:
      return task.inputs.at(a.base);
    case Route::Local:
      return task.local.at(a.base);
    case Route::Chain:
      return task.chain.at(a.base);
    case Route::Portal:
      return task.popped.at(a.skip);
  }
  return TensorId();
}

std::uint64_t Executor::forward_content(std::uint32_t i, const Task& task, std::uint32_t j,
                                        const Access& a) const {
  if (a.route == Route::Resident || a.route == Route::Input) {
    return content(source(task, j, a));
  }
  return forward_values_[i][a.base];
}

void Executor::hold_chain_inputs(Task& task, std::uint32_t j) {
  for (const std::uint32_t b : plan_.chain_in[j]) {
    const auto it = plan_.chain_counts[j].find(b);
    if (it == plan_.chain_counts[j].end()) continue;
    const std::int32_t n = it->second.reads + it->second.saves;
    if (n > 0) hold(task.chain.at(b), n);
  }
}

void Executor::pop_skips(std::uint32_t i, std::uint32_t k, Task& task, bool grad) {
  // orange(): the consumer takes the skip tensor out of its portal.
  for (const std::uint32_t s : plan_.pops[k]) {
    const PortalUse use = portals_.use_tensor(key(s, i));
    hold(use.tensor, 1 + (grad ? plan_.portal_saves[s] : 0));
    if (use.released) release(use.tensor);
    task.popped[s] = use.tensor;
  }
}

std::uint64_t Executor::gather_reads(std::uint32_t i, const Task& task, std::uint32_t j,
                                     std::uint32_t k, std::vector<Read>& reads) {
  std::uint64_t value = mix_content(mix_content(tag::kForward, k), i);
  std::vector<std::uint32_t> read_tensors;
  for (const Access& a : plan_.reads[k]) {
    const TensorId h = source(task, j, a);
    value = mix_content(value, read_value(h, a.tensor));
    if (std::find(read_tensors.begin(), read_tensors.end(), a.tensor) != read_tensors.end()) {
      continue;
    }
    read_tensors.push_back(a.tensor);
    reads.push_back(Read{h, region(h, a.tensor), content(h)});
  }
  if (model_.ops[k].draws_rng) {
    const std::uint32_t g = plan_.generator_of[k];
    value = mix_content(value, mix_content(mix_content(tag::kRng, g), rng_.draw(g)));
  }
  return value;
}

void Executor::allocate_outputs(std::uint32_t i, std::uint32_t j, std::uint32_t k, Pass pass,
                                std::uint64_t value, Task& task, std::vector<Write>& writes,
                                std::vector<TensorId>& created) {
  const bool grad = pass != Pass::NoGrad;
  const bool recompute = pass == Pass::Recompute;
  const ModelOp& op = model_.ops[k];
  for (std::uint32_t o = 0; o < op.outputs.size(); ++o) {
    const std::uint32_t b = op.outputs[o];
    const ModelTensor& t = model_.tensors[b];
    if (t.view_of >= 0) continue;
    std::int32_t holds = 1 + plan_.local_counts[b].reads;
    if (grad) holds += plan_.local_counts[b].saves;
    if (!recompute) {
      const bool sent = j + 1 < parts_ && std::binary_search(plan_.chain_in[j + 1].begin(),
                                                             plan_.chain_in[j + 1].end(), b);
      holds += sent ? 1 : 0;
      holds += b == plan_.base[model_.loss] ? 1 : 0;
    }
    const TensorId h = allocate(dev(j), streams_->compute(dev(j)), t.bytes, Kind::Activation, holds,
                                mb_label(i, t.name + pass_suffix(pass)));
    const std::uint64_t content = mix_content(value, o + 1);
    writes.push_back(Write{h, content, 0});
    created.push_back(h);
    task.local[b] = h;
    if (!recompute) forward_values_[i][b] = content;
    if (!recompute && b == plan_.base[model_.loss]) task.output = h;
  }
}

void Executor::save_for_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k, Task& task,
                                 bool recompute) {
  for (const Access& a : plan_.saves[k]) {
    SavedRef ref{a, source(task, j, a), forward_content(i, task, j, a), TensorId()};
    if (!recompute && a.route == Route::Local && offloader(j) != nullptr) {
      ref.offloaded = pack(i, j, k, ref);
    }
    task.saved[k - plan_.starts[j]].push_back(ref);
  }
}

void Executor::stash_skips(std::uint32_t i, std::uint32_t k, Task& task, Pass pass) {
  // The stash: put into the portal, then blue() takes it out once.
  for (const std::uint32_t s : plan_.stashes[k]) {
    const TensorId h = task.local.at(plan_.skips[s].tensor);
    const PortalStash stash = portals_.stash(key(s, i), h, pass == Pass::NoGrad);
    hold(h);
    track(h, key(s, i), false);
    if (stash.dropped) release(*stash.dropped);
    const PortalUse blue = portals_.use_tensor(key(s, i));
    if (blue.released) release(blue.tensor);
  }
}

const char* Executor::pass_suffix(Pass pass) {
  switch (pass) {
    case Pass::Forward:
      return "";
    case Pass::NoGrad:
      return " (no grad)";
    case Pass::Recompute:
      return " (recompute)";
  }
  return "";
}

void Executor::run_ops(std::uint32_t i, std::uint32_t j, Pass pass) {
  Task& task = tasks_[i][j];
  const bool grad = pass != Pass::NoGrad;
  const bool recompute = pass == Pass::Recompute;
  const std::uint32_t first = plan_.starts[j];
  const std::uint32_t last = plan_.starts[j + 1];
  task.local.clear();
  task.popped.clear();
  if (grad) task.saved.assign(last - first, {});
  if (recompute) hold_chain_inputs(task, j);
  std::vector<Read> reads;
  std::vector<Write> writes;
  std::vector<TensorId> created;
  for (std::uint32_t k = first; k < last; ++k) {
    const ModelOp& op = model_.ops[k];
    pop_skips(i, k, task, grad);
    reads.clear();
    writes.clear();
    created.clear();
    const std::uint64_t value = gather_reads(i, task, j, k, reads);
    allocate_outputs(i, j, k, pass, value, task, writes, created);
    launch(dev(j), op.duration, reads, writes, mb_label(i, op.name + pass_suffix(pass)),
           collective_lane(k, false));
    if (recompute) recompute_time_ += op.duration;
    for (const Access& a : plan_.uses[k]) release(source(task, j, a));
    if (grad) save_for_backward(i, j, k, task, recompute);
    stash_skips(i, k, task, pass);
    for (const TensorId h : created) release(h);
  }
}

}  // namespace ferry::sim::pipelining
