#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "executor.hpp"
#include "ferry/check.hpp"
#include "step_failure.hpp"

namespace ferry::sim::pipelining {

namespace {

// Note [A pipeline step is a warm one]: the executor simulates one step and reports it as a
// step of training, whose pinned pools already hold the blocks earlier steps pinned (both pools
// cache by size, docs/allocators.md). So pinning a block costs the host nothing here; a trainer
// run, of two steps or more, measures its last step, which pins nothing anew either.
std::vector<DeviceSpec> device_specs(const DeviceProfile& profile, std::uint32_t devices) {
  DeviceProfile warm = profile;
  warm.overheads.host_alloc = SimTime(0);
  std::vector<DeviceSpec> specs;
  for (std::uint32_t j = 0; j < devices; ++j) {
    specs.push_back(DeviceSpec{fmt::format("gpu{}", j), warm});
  }
  return specs;
}

}  // namespace

// Set-up, buffers, kernels and copies, and the schedule. Forward: executor_forward.cpp.
// Backward: executor_backward.cpp.

Executor::Executor(const Model& model, const DeviceProfile& profile, const PipelineOptions& options,
                   const PipelineFaults& faults, Plan plan, pipeline::Schedule schedule,
                   std::vector<std::int32_t> checkpoint_stops)
    : model_(model),
      profile_(profile),
      faults_(faults),
      plan_(std::move(plan)),
      schedule_(schedule),
      checkpoint_stops_(std::move(checkpoint_stops)),
      micro_batches_(static_cast<std::uint32_t>(options.micro_batches)),
      parts_(plan_.partitions()),
      ndev_(static_cast<std::uint32_t>(options.devices)),
      sim_(device_specs(profile, ndev_), stage_links(profile, options.mesh, ndev_), options.sim),
      portals_(faults.portal),
      rng_(plan_.generators),
      mesh_(options.mesh) {
  FERRY_CHECK(ndev_ > 0 && parts_ % ndev_ == 0, "{} partitions over {} devices", parts_, ndev_);
  std::vector<StreamId> compute;
  for (std::uint32_t d = 0; d < ndev_; ++d) {
    compute.push_back(sim_.add_stream(DeviceId(d), "compute"));
  }
  std::vector<Device*> devices;
  for (std::uint32_t d = 0; d < ndev_; ++d) {
    devices_.push_back(std::make_unique<Device>(sim_, DeviceId(d), compute[d]));
    devices.push_back(devices_.back().get());
  }
  std::vector<std::uint32_t> placement;
  for (std::uint32_t j = 0; j < parts_; ++j) {
    placement.push_back(pipeline::rank_of_stage(schedule_, j, ndev_));
  }
  streams_ = std::make_unique<Streams>(std::move(devices), std::move(placement));
  add_mesh_streams();
  holders_ = std::make_unique<Holders>(*streams_);
  FERRY_CHECK(checkpoint_stops_.size() == ndev_, "{} checkpoint stops for {} devices",
              checkpoint_stops_.size(), ndev_);
  if (any_offload(options)) {
    for (std::uint32_t d = 0; d < ndev_; ++d) {
      const StagePolicy policy = stage_policy(options, d);
      offloaders_.push_back(
          policy.offload.policy == Policy::None
              ? nullptr
              : std::make_unique<Offloader<Device>>(*devices_[d], policy.offload, faults.offload));
    }
  }
  tasks_.assign(micro_batches_, std::vector<Task>(parts_));
  forward_values_.assign(micro_batches_, std::vector<std::uint64_t>(model.tensors.size(), 0));
  resident_.resize(ndev_);
  param_grads_.resize(ndev_);
  state_.resize(ndev_);
  live_activations_.assign(ndev_, Bytes(0));
  peak_activations_.assign(ndev_, Bytes(0));
  live_cells_.resize(ndev_);
  peak_in_flight_.assign(ndev_, 0);
}

// Every task of the step in the schedule's order: GPipe's ticks fence all of a tick's cells
// before computing them; the other schedules issue each action's receives, then its compute.
void Executor::issue_tasks() {
  if (schedule_ == pipeline::Schedule::GPipe || schedule_ == pipeline::Schedule::Sequential) {
    for (const pipeline::Tick& tick : pipeline::clock(schedule_, micro_batches_, parts_)) {
      const bool forward = tick.phase == pipeline::Phase::Forward;
      for (const pipeline::Cell c : tick.cells) {
        forward ? forward_fence(c.micro_batch, c.partition)
                : backward_fence(c.micro_batch, c.partition);
      }
      for (const pipeline::Cell c : tick.cells) {
        forward ? forward_compute(c.micro_batch, c.partition)
                : backward_compute(c.micro_batch, c.partition);
      }
    }
  } else {
    // Each action's receives, then its compute (Note [Schedule orders]).
    const auto orders = pipeline::rank_orders(schedule_, micro_batches_, ndev_, parts_ / ndev_);
    for (const pipeline::Action& a : pipeline::issue_order(orders, parts_)) {
      const pipeline::Cell c = a.cell;
      if (a.phase == pipeline::Phase::Forward) {
        forward_fence(c.micro_batch, c.partition);
        forward_compute(c.micro_batch, c.partition);
      } else if (a.phase == pipeline::Phase::Weight) {
        weight_compute(c.micro_batch, c.partition);
      } else {
        backward_fence(c.micro_batch, c.partition);
        backward_compute(c.micro_batch, c.partition);
      }
    }
  }
}

PipelineRun Executor::run() {
  std::optional<Failure> failure;
  SimTime start;
  try {
    setup();
    start = sim_.host_time();
    for (const auto& off : offloaders_) {
      if (off) off->enter();
    }
    first_task_op_ = sim_.ops().size();
    issue_tasks();
    last_task_op_ = sim_.ops().size();
    for (const auto& off : offloaders_) {
      if (off) off->exit();
    }
    finish_step();
  } catch (const StepFailure& e) {
    failure = e.failure;
  } catch (const PortalError& e) {
    failure = Failure{FailureKind::Misuse, e.what()};
  } catch (const OffloadError& e) {
    failure = Failure{e.kind(), e.what()};
  }
  const SimTime step_time = sim_.host_time() - start;
  const std::int64_t left = release_leftovers();
  sim_.finish();
  for (PortalLifetime& l : lifetimes_) {
    // Freed when the last reference went: the pipeline's holders', or an offloader's.
    l.freed = sim_.buffers()[l.buffer.value()].freed_by;
    if (l.last_use.valid()) l.last_use_end = sim_.ops()[l.last_use.value()].end;
    if (l.freed.valid()) l.freed_at = sim_.ops()[l.freed.value()].issued;
  }
  std::vector<Bytes> peak_allocated;
  for (std::uint32_t d = 0; d < ndev_; ++d) {
    peak_allocated.push_back(sim_.device_allocator(DeviceId(d)).stats().allocated_peak);
  }
  const StageTimes times = stage_times();
  std::int64_t portal_frees = 0;
  for (const PortalLifetime& l : lifetimes_) portal_frees += l.freed.valid() ? 1 : 0;
  return PipelineRun{.sim = std::move(sim_),
                     .failure = std::move(failure),
                     .partition_starts = plan_.starts,
                     .stages = stage_spans(model_, plan_.starts),
                     .split = {},  // simulate_pipeline's to name
                     .step_time = step_time,
                     .peak_allocated = std::move(peak_allocated),
                     .peak_activations = peak_activations_,
                     .recompute_time = recompute_time_,
                     .portal_stats = portals_.stats(),
                     .portal_frees = portal_frees,
                     .buffers_left = left,
                     .param_grads = param_gradients(),
                     .portal_lifetimes = lifetimes_,
                     .telemetry = telemetry(),
                     .schedule = schedule_,
                     .pipeline_span = times.span,
                     .busy = times.busy,
                     .peak_in_flight = peak_in_flight_};
}

Executor::StageTimes Executor::stage_times() const {
  // Kernels of the tasks on each device's compute stream; the span runs from the first one's
  // start to the last one's end over all devices.
  StageTimes t;
  t.busy.assign(ndev_, SimTime(0));
  std::optional<SimTime> first;
  SimTime last;
  const auto& ops = sim_.ops();
  for (std::size_t o = first_task_op_; o < last_task_op_ && o < ops.size(); ++o) {
    const OpRecord& r = ops[o];
    if (r.kind != OpKind::Kernel || r.collective) continue;
    for (std::uint32_t d = 0; d < ndev_; ++d) {
      if (r.stream != devices_[d]->compute_stream().id) continue;
      t.busy[d] += r.end - r.start;
      first = first ? std::min(*first, r.start) : r.start;
      last = std::max(last, r.end);
    }
  }
  t.span = first ? last - *first : SimTime(0);
  return t;
}

TensorId Executor::allocate(std::uint32_t device, StreamRef stream, Bytes bytes, Kind kind,
                            std::int32_t holds, const std::string& label) {
  auto got = devices_[device]->try_allocate(Place::Device, bytes, streams_->stream(stream), label);
  if (!got.ok()) out_of_memory(got.error().message);
  Buf b;
  b.id = got.value().id;
  b.device = device;
  b.bytes = bytes;
  b.kind = kind;
  bufs_.push_back(std::move(b));
  const auto handle = holders_->adopt(got.value(), stream, holds);
  FERRY_CHECK(handle + 1 == bufs_.size(), "buffer handles out of step");
  if (kind == Kind::Activation) {
    live_activations_[device] += bytes;
    peak_activations_[device] = std::max(peak_activations_[device], live_activations_[device]);
    if (current_) {
      bufs_.back().cell = current_;
      if (live_cells_[device][*current_]++ == 0) {
        peak_in_flight_[device] = std::max(peak_in_flight_[device],
                                           static_cast<std::int32_t>(live_cells_[device].size()));
      }
    }
  }
  return TensorId(static_cast<std::uint32_t>(bufs_.size() - 1));
}

void Executor::release(TensorId h) {
  if (holders_->release(h.value())) let_go(h, false);
}

void Executor::free_buffer(TensorId h, bool at_step_end) {
  holders_->let_go(h.value());
  let_go(h, at_step_end);
}

void Executor::let_go(TensorId h, bool at_step_end) {
  Buf& b = buf(h);
  if (b.kind == Kind::Activation) {
    live_activations_[b.device] -= b.bytes;
    if (b.cell) {
      auto& cells = live_cells_[b.device];
      const auto it = cells.find(*b.cell);
      if (--it->second == 0) cells.erase(it);
    }
  }
  for (const std::size_t l : b.lifetimes) {
    lifetimes_[l].last_use = b.last_use;
    lifetimes_[l].freed_at_step_end = at_step_end;
  }
}

std::uint64_t Executor::content(TensorId h) const {
  const Buf& b = bufs_[h.value()];
  return content_.value(b.id, Bytes(0), b.bytes);
}

void Executor::set_content(TensorId h, std::uint64_t value) {
  const Buf& b = bufs_[h.value()];
  content_.write(b.id, Bytes(0), b.bytes, value);
}

void Executor::touched(TensorId h, StreamRef stream, OpId op) {
  buf(h).last_use = op;
  holders_->used_on(h.value(), stream);
}

void Executor::track(TensorId h, PortalKey key, bool gradient) {
  Buf& b = buf(h);
  PortalLifetime l;
  l.key = key;
  l.gradient = gradient;
  l.device = DeviceId(b.device);
  l.buffer = b.id;
  lifetimes_.push_back(l);
  b.lifetimes.push_back(lifetimes_.size() - 1);
}

Region Executor::region(TensorId h, std::uint32_t tensor) const {
  const Buf& b = bufs_[h.value()];
  const ModelTensor& t = model_.tensors[tensor];
  const bool view = t.view_of >= 0;
  return Region{b.id, view ? t.view_offset : Bytes(0), view ? t.bytes : b.bytes};
}

Region Executor::whole(TensorId h) const {
  const Buf& b = bufs_[h.value()];
  return Region{b.id, Bytes(0), b.bytes};
}

std::uint64_t Executor::read_value(TensorId h, std::uint32_t tensor) const {
  const std::uint64_t content = this->content(h);
  return model_.tensors[tensor].view_of >= 0 ? mix_content(content, tensor) : content;
}

OpId Executor::launch(std::uint32_t device, SimTime duration, const std::vector<Read>& reads,
                      const std::vector<Write>& writes, const std::string& label,
                      std::optional<CollectiveLane> lane) {
  std::vector<Region> read_regions;
  std::vector<Region> write_regions;
  std::vector<std::uint64_t> values;
  for (const Read& r : reads) {
    if (r.region.bytes.count() > 0) {
      const Bytes base = r.handle.valid() ? r.region.offset : r.expected_base;
      const ContentPiece expected{Bytes(0), r.region.bytes, r.expected, base};
      sim_.expect_content_at_next_kernel(r.region, std::span(&expected, 1));
    }
    read_regions.push_back(r.region);
  }
  for (const Write& w : writes) {
    write_regions.push_back(whole(w.handle));
    values.push_back(w.value);
  }
  const StreamRef stream = streams_->compute(device);
  const StreamId compute = streams_->stream(stream).id;
  OpId op;
  if (lane) {
    // Note [A pipeline on the mesh]: W1, the collective, W2.
    const StreamId comm = mesh_comm_[device];
    stream_wait(device, comm, compute, faults_.skip_collective_launch_wait);
    op = sim_.collective(comm, duration, read_regions, write_regions, label, values, *lane);
    stream_wait(device, compute, comm, faults_.skip_collective_output_wait);
  } else {
    op = sim_.kernel(compute, duration, read_regions, write_regions, label, values);
  }
  for (const Read& r : reads) {
    if (r.handle.valid()) touched(r.handle, stream, op);
  }
  for (const Write& w : writes) {
    touched(w.handle, stream, op);
    set_content(w.handle, w.value);
    buf(w.handle).sum = w.sum;
  }
  return op;
}

void Executor::copy(StreamRef stream, TensorId src, TensorId dst, const std::string& label) {
  const Buf& from = buf(src);
  const Buf& to = buf(dst);
  streams_->device(streams_->device_of(stream))
      .copy(streams_->stream(stream), Device::Buffer{from.id}, Bytes(0), Device::Buffer{to.id},
            Bytes(0), from.bytes, label);
  const OpId op(static_cast<std::uint32_t>(sim_.ops().size() - 1));
  touched(src, stream, op);
  touched(dst, stream, op);
  content_.arrive(to.id, Bytes(0), content_.slice(from.id, Bytes(0), from.bytes));
  buf(dst).sum = buf(src).sum;
}

void Executor::setup() {
  for (std::uint32_t j = 0; j < parts_; ++j) {
    std::vector<Write> writes;
    // Allocates each tensor of `tensors` the device does not hold yet, into `held`. A device
    // holding several stages (interleaved) keeps one replica of what they share.
    const auto hold = [&](const std::vector<std::uint32_t>& tensors,
                          std::map<std::uint32_t, TensorId>& held, std::string_view suffix,
                          auto content) {
      for (const std::uint32_t b : tensors) {
        if (held.contains(b)) continue;
        const ModelTensor& t = model_.tensors[b];
        const TensorId h = allocate(dev(j), streams_->compute(dev(j)), t.bytes, Kind::Static, 1,
                                    t.name + std::string(suffix));
        held[b] = h;
        writes.push_back(Write{h, content(b), 0});
      }
    };
    const auto param = [](std::uint32_t b) { return mix_content(tag::kParam, b); };
    hold(plan_.params_of[j], resident_[dev(j)], "", param);
    hold(plan_.grads_of[j], param_grads_[dev(j)], ".grad",
         [](std::uint32_t) { return grad_content(0); });
    // The optimizer state of the stage's parameters (Note [A stage's optimizer state]); under
    // FSDP that of their shards instead (gather_parameters), as Fsdp2 holds it.
    if (!mesh_.on()) hold(plan_.state_of[j], state_[dev(j)], "", param);
    // Initialization runs as kernels of at most kMaxWrites ranges each.
    for (std::size_t at = 0; at < writes.size(); at += kMaxWrites) {
      const auto end =
          writes.begin() + static_cast<std::ptrdiff_t>(std::min(writes.size(), at + kMaxWrites));
      launch(dev(j), SimTime(1), {},
             std::vector<Write>(writes.begin() + static_cast<std::ptrdiff_t>(at), end),
             "init parameters and gradients");
    }
  }
  if (mesh_.on()) gather_parameters();
}

PortalKey Executor::key(std::uint32_t skip, std::uint32_t i) const { return PortalKey{skip, i}; }

std::string Executor::mb_label(std::uint32_t i, std::string_view what) const {
  return fmt::format("mb{} {}", i, what);
}

}  // namespace ferry::sim::pipelining
