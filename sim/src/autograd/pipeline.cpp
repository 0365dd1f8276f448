#include "ferry/sim/autograd/pipeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/check.hpp"
#include "ferry/offload/offloader.hpp"
#include "ferry/pipeline/schedule.hpp"
#include "ferry/pipeline/streams.hpp"
#include "ferry/sim/device/device.hpp"
#include "graph.hpp"
#include "step_failure.hpp"
#include "values.hpp"

namespace ferry::sim {

const char* checkpoint_mode_name(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::Always:
      return "always";
    case CheckpointMode::ExceptLast:
      return "except_last";
    case CheckpointMode::Never:
      return "never";
  }
  return "unknown";
}

Result<std::vector<std::uint32_t>> balance_by_duration(const Model& model,
                                                       std::int32_t partitions) {
  const std::size_t n = model.ops.size();
  if (partitions < 1 || static_cast<std::size_t>(partitions) > n) {
    return Error{
        fmt::format("cannot split {} ops into {} partitions: each partition needs at "
                    "least one op (use between 1 and {} devices)",
                    n, partitions, n)};
  }
  const auto p = static_cast<std::size_t>(partitions);
  std::vector<std::int64_t> prefix(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + model.ops[i].duration.ns();
  // best[k][e]: the smallest possible largest sum when ops [0, e) form k partitions.
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  std::vector<std::vector<std::int64_t>> best(p + 1, std::vector<std::int64_t>(n + 1, kNone));
  best[0][0] = 0;
  for (std::size_t k = 1; k <= p; ++k) {
    for (std::size_t e = k; e <= n; ++e) {
      for (std::size_t s = k - 1; s < e; ++s) {
        if (best[k - 1][s] == kNone) continue;
        best[k][e] = std::min(best[k][e], std::max(best[k - 1][s], prefix[e] - prefix[s]));
      }
    }
  }
  // Walk back from the end; among equally good splits the last partition is kept smallest.
  std::vector<std::uint32_t> starts(p + 1, 0);
  starts[p] = static_cast<std::uint32_t>(n);
  std::size_t e = n;
  for (std::size_t k = p; k >= 1; --k) {
    for (std::size_t s = e; s-- > k - 1;) {
      if (best[k - 1][s] != kNone &&
          std::max(best[k - 1][s], prefix[e] - prefix[s]) == best[k][e]) {
        starts[k - 1] = static_cast<std::uint32_t>(s);
        e = s;
        break;
      }
    }
  }
  FERRY_CHECK(starts[0] == 0, "balance did not reach the first op");
  return starts;
}

namespace {

// See Note [Content values] in values.hpp.
constexpr std::uint64_t kForwardTag = 0x46;
constexpr std::uint64_t kBackwardTag = 0x42;
constexpr std::uint64_t kParamTag = 0x50;
constexpr std::uint64_t kInputTag = 0x49;
constexpr std::uint64_t kRngTag = 0x52;
constexpr std::uint64_t kGradTag = 0x47;
constexpr std::uint64_t kLossTag = 0x4c;

[[nodiscard]] std::uint64_t grad_content(std::uint64_t sum) { return mix_content(kGradTag, sum); }

/// How an op reaches a tensor it reads or saves.
enum class Route : std::uint8_t {
  Resident,  ///< a parameter or module buffer: a replica on every device that uses it
  Input,     ///< the batch: loaded on every device that uses it, per micro-batch
  Local,     ///< produced in the same partition
  Chain,     ///< produced in an earlier partition, copied along the partition chain
  Portal,    ///< a skip connection's tensor, taken from its portal
};

struct Access {
  std::uint32_t tensor = 0;  ///< the model tensor (a view or a base)
  std::uint32_t base = 0;    ///< the tensor owning the storage
  Route route = Route::Local;
  std::uint32_t skip = 0;  ///< Portal only

  [[nodiscard]] bool same_source(const Access& other) const {
    return route == other.route && base == other.base &&
           (route != Route::Portal || skip == other.skip);
  }
  [[nodiscard]] bool held() const {
    return route == Route::Local || route == Route::Chain || route == Route::Portal;
  }
};

struct SkipPlan {
  std::uint32_t tensor = 0;
  std::uint32_t consumer = 0;
  std::uint32_t producer = 0;
  std::uint32_t from = 0;  ///< partition of the producer
  std::uint32_t to = 0;    ///< partition of the consumer
  bool cross = false;      ///< from != to: through a portal (else a plain local tensor)
  bool grad = false;       ///< the consumer's backward runs, so a gradient comes back
};

struct Counts {
  std::int32_t reads = 0;  ///< ops reading it
  std::int32_t saves = 0;  ///< saved-tensor entries naming it
};

// What runs where, derived once from the model, the partition starts and the skips.
struct Plan {
  std::vector<std::uint32_t> starts;
  std::vector<std::uint32_t> partition_of;  ///< per op
  std::vector<std::uint32_t> generator_of;  ///< per op: the random generator it draws from
  std::uint32_t generators = 1;
  std::vector<std::uint32_t> base;     ///< per tensor
  std::vector<std::int32_t> producer;  ///< per tensor: the op producing it, or -1
  std::vector<bool> needed;            ///< per op: its backward runs
  std::vector<bool> grad_flows;        ///< per base: a gradient reaches it
  std::vector<SkipPlan> skips;
  std::vector<std::vector<Access>> reads;              ///< per op, per input slot
  std::vector<std::vector<Access>> saves;              ///< per op, per saved entry
  std::vector<std::vector<Access>> uses;               ///< per op: distinct held sources it reads
  std::vector<std::vector<std::uint32_t>> pops;        ///< per op: cross skips it consumes
  std::vector<std::vector<std::uint32_t>> stashes;     ///< per op: cross skips of its outputs
  std::vector<std::vector<std::uint32_t>> skips_into;  ///< per partition: cross skips, by source
  std::vector<std::vector<std::uint32_t>> skips_from;  ///< per partition: cross skips with grads
  std::vector<std::vector<std::uint32_t>> chain_in;    ///< per partition: bases copied in
  std::vector<std::vector<std::uint32_t>> grad_back;   ///< per partition: gradients sent back
  std::vector<std::map<std::uint32_t, Counts>> chain_counts;  ///< per partition, per base
  std::vector<Counts> local_counts;                           ///< per base
  std::vector<std::int32_t> portal_saves;                     ///< per skip
  std::vector<std::vector<std::uint32_t>> inputs_of;          ///< per partition: batch inputs used
  std::vector<std::vector<std::uint32_t>> params_of;  ///< per partition: resident tensors used
  std::vector<std::vector<std::uint32_t>> grads_of;   ///< per partition: params read (grads)

  [[nodiscard]] std::uint32_t partitions() const {
    return static_cast<std::uint32_t>(starts.size() - 1);
  }
};

Status check_skips(const Model& model, const std::vector<SkipConnection>& skips) {
  for (std::size_t s = 0; s < skips.size(); ++s) {
    const SkipConnection& skip = skips[s];
    if (skip.tensor >= model.tensors.size() || skip.consumer >= model.ops.size()) {
      return Error{fmt::format("skip {}: tensor {} or op {} is out of range ({} tensors, {} ops)",
                               s, skip.tensor, skip.consumer, model.tensors.size(),
                               model.ops.size())};
    }
    const ModelTensor& tensor = model.tensors[skip.tensor];
    if (tensor.role != TensorRole::Activation || tensor.view_of >= 0) {
      return Error{
          fmt::format("skip {}: tensor '{}' is not an activation with its own storage; "
                      "stash the base tensor",
                      s, tensor.name)};
    }
    const ModelOp& consumer = model.ops[skip.consumer];
    if (std::find(consumer.inputs.begin(), consumer.inputs.end(), skip.tensor) ==
        consumer.inputs.end()) {
      return Error{fmt::format("skip {}: op '{}' does not read '{}'; name an op that pops it", s,
                               consumer.name, tensor.name)};
    }
    for (std::size_t other = 0; other < s; ++other) {
      if (skips[other] == skip) {
        return Error{fmt::format("skip {} repeats skip {} ('{}' into '{}')", s, other, tensor.name,
                                 consumer.name)};
      }
    }
  }
  return Ok{};
}

Status check_model(const Model& model) {
  Status valid = validate_model(model);
  if (!valid.ok()) return valid;
  for (const ModelOp& op : model.ops) {
    for (const std::uint32_t t : op.outputs) {
      const std::int32_t base = model.tensors[t].view_of;
      if (base < 0) continue;
      if (std::find(op.outputs.begin(), op.outputs.end(), static_cast<std::uint32_t>(base)) ==
          op.outputs.end()) {
        return Error{
            fmt::format("op '{}' outputs view '{}' of a tensor it does not produce; the "
                        "pipeline needs views produced with their base",
                        op.name, model.tensors[t].name)};
      }
    }
  }
  return Ok{};
}

Plan make_plan(const Model& model, std::vector<std::uint32_t> starts,
               std::vector<std::uint32_t> generator_of, const std::vector<SkipConnection>& skips) {
  Plan plan;
  plan.starts = std::move(starts);
  plan.generator_of = std::move(generator_of);
  plan.generators = 1;
  for (const std::uint32_t g : plan.generator_of) {
    plan.generators = std::max(plan.generators, g + 1);
  }
  const std::size_t ops = model.ops.size();
  const std::size_t tensors = model.tensors.size();
  const std::uint32_t parts = plan.partitions();
  plan.partition_of.resize(ops);
  for (std::uint32_t j = 0; j < parts; ++j) {
    for (std::uint32_t k = plan.starts[j]; k < plan.starts[j + 1]; ++k) plan.partition_of[k] = j;
  }
  Graph graph = make_graph(model);
  plan.base = std::move(graph.base);
  plan.producer = std::move(graph.producer);
  plan.needed = std::move(graph.needed);
  plan.grad_flows = std::move(graph.grad_flows);
  plan.pops.resize(ops);
  plan.stashes.resize(ops);
  plan.skips_into.resize(parts);
  plan.skips_from.resize(parts);
  for (std::uint32_t s = 0; s < skips.size(); ++s) {
    SkipPlan sp;
    sp.tensor = skips[s].tensor;
    sp.consumer = skips[s].consumer;
    sp.producer = static_cast<std::uint32_t>(plan.producer[sp.tensor]);
    sp.from = plan.partition_of[sp.producer];
    sp.to = plan.partition_of[sp.consumer];
    sp.cross = sp.from != sp.to;
    sp.grad = plan.needed[sp.consumer];
    plan.skips.push_back(sp);
    if (!sp.cross) continue;
    plan.pops[sp.consumer].push_back(s);
    plan.stashes[sp.producer].push_back(s);
    plan.skips_into[sp.to].push_back(s);
    if (sp.grad) plan.skips_from[sp.from].push_back(s);
  }
  // torchgpipe copies skips into a partition ordered by their source partition.
  for (auto& list : plan.skips_into) {
    std::stable_sort(list.begin(), list.end(), [&](std::uint32_t a, std::uint32_t b) {
      return plan.skips[a].from < plan.skips[b].from;
    });
  }
  for (auto& list : plan.skips_from) {
    std::stable_sort(list.begin(), list.end(), [&](std::uint32_t a, std::uint32_t b) {
      return plan.skips[a].to < plan.skips[b].to;
    });
  }
  const auto access = [&](std::uint32_t k, std::uint32_t t) {
    Access a;
    a.tensor = t;
    a.base = plan.base[t];
    const ModelTensor& storage = model.tensors[a.base];
    if (storage.role == TensorRole::Param || storage.role == TensorRole::Buffer) {
      a.route = Route::Resident;
    } else if (storage.role == TensorRole::Input) {
      a.route = Route::Input;
    } else {
      FERRY_CHECK(plan.producer[a.base] >= 0, "op {} uses '{}', which no op produces", k,
                  storage.name);
      const auto from = static_cast<std::uint32_t>(plan.producer[a.base]);
      a.route = plan.partition_of[from] == plan.partition_of[k] ? Route::Local : Route::Chain;
      for (const std::uint32_t s : plan.pops[k]) {
        if (plan.skips[s].tensor == t) {
          a.route = Route::Portal;
          a.skip = s;
        }
      }
    }
    return a;
  };
  plan.reads.resize(ops);
  plan.saves.resize(ops);
  plan.uses.resize(ops);
  plan.chain_counts.resize(parts);
  plan.local_counts.resize(tensors);
  plan.portal_saves.assign(skips.size(), 0);
  plan.chain_in.resize(parts);
  std::vector<std::set<std::uint32_t>> chain_in(parts);
  std::vector<std::set<std::uint32_t>> inputs_of(parts);
  std::vector<std::set<std::uint32_t>> params_of(parts);
  std::vector<std::set<std::uint32_t>> grads_of(parts);
  const auto route_in = [&](std::uint32_t k, const Access& a) {
    const std::uint32_t j = plan.partition_of[k];
    if (a.route == Route::Input) inputs_of[j].insert(a.base);
    if (a.route == Route::Resident) params_of[j].insert(a.base);
    if (a.route == Route::Chain) {
      const std::uint32_t from =
          plan.partition_of[static_cast<std::uint32_t>(plan.producer[a.base])];
      for (std::uint32_t p = from + 1; p <= j; ++p) chain_in[p].insert(a.base);
    }
  };
  for (std::uint32_t k = 0; k < ops; ++k) {
    const ModelOp& op = model.ops[k];
    const std::uint32_t j = plan.partition_of[k];
    for (const std::uint32_t t : op.inputs) {
      const Access a = access(k, t);
      plan.reads[k].push_back(a);
      route_in(k, a);
      if (a.route == Route::Resident && model.tensors[a.base].role == TensorRole::Param) {
        grads_of[j].insert(a.base);
      }
      if (!a.held()) continue;
      const bool seen = std::any_of(plan.uses[k].begin(), plan.uses[k].end(),
                                    [&](const Access& u) { return u.same_source(a); });
      if (seen) continue;
      plan.uses[k].push_back(a);
      if (a.route == Route::Local) ++plan.local_counts[a.base].reads;
      if (a.route == Route::Chain) ++plan.chain_counts[j][a.base].reads;
    }
    for (const std::uint32_t t : op.saved) {
      // A saved tensor is the one the op read, if it read it; else its own output or a tensor
      // reachable like a read.
      Access a = access(k, t);
      for (const Access& r : plan.reads[k]) {
        if (r.tensor == t) a = r;
      }
      plan.saves[k].push_back(a);
      route_in(k, a);
      if (a.route == Route::Local) ++plan.local_counts[a.base].saves;
      if (a.route == Route::Chain) ++plan.chain_counts[j][a.base].saves;
      if (a.route == Route::Portal) ++plan.portal_saves[a.skip];
    }
  }
  plan.grad_back.resize(parts);
  // A chain tensor's gradient exists on partition j when a needed op there reads it, or when
  // partition j + 1 sends one back.
  std::vector<std::set<std::uint32_t>> grad_at(parts + 1);
  for (std::uint32_t j = parts; j-- > 0;) {
    plan.chain_in[j].assign(chain_in[j].begin(), chain_in[j].end());
    for (const std::uint32_t b : plan.chain_in[j]) {
      bool has = grad_at[j + 1].contains(b);
      for (std::uint32_t k = plan.starts[j]; k < plan.starts[j + 1] && !has; ++k) {
        if (!plan.needed[k]) continue;
        for (const Access& r : plan.reads[k]) has = has || (r.route == Route::Chain && r.base == b);
      }
      if (has) {
        grad_at[j].insert(b);
        plan.grad_back[j].push_back(b);
      }
    }
  }
  plan.inputs_of.resize(parts);
  plan.params_of.resize(parts);
  plan.grads_of.resize(parts);
  for (std::uint32_t j = 0; j < parts; ++j) {
    plan.inputs_of[j].assign(inputs_of[j].begin(), inputs_of[j].end());
    plan.params_of[j].assign(params_of[j].begin(), params_of[j].end());
    plan.grads_of[j].assign(grads_of[j].begin(), grads_of[j].end());
  }
  return plan;
}

enum class Kind : std::uint8_t { Static, Activation, Gradient };

enum class Pass : std::uint8_t {
  Forward,    ///< grad mode: ops keep what they save
  NoGrad,     ///< the forward of a checkpointed partition: only its input is kept
  Recompute,  ///< the checkpointed partition again, right before its backward
};

using pipeline::Cell;
using pipeline::Phase;
using pipeline::StreamRef;
using Streams = pipeline::Choreography<Device>;
using Holders = pipeline::SharedBuffers<Device>;

// A device buffer the pipeline holds. Who holds it, and on which streams it was used, is the
// core's (pipeline::SharedBuffers); see Note [Receive buffers and record_stream].
struct Buf {
  BufferId id;
  std::uint32_t device = 0;
  Bytes bytes;
  Kind kind = Kind::Static;
  OpId last_use;
  std::uint64_t sum = 0;               ///< gradients: the sum behind its content
  std::vector<std::size_t> lifetimes;  ///< PortalLifetime records naming it
};

struct SavedRef {
  Access access;
  TensorId handle;
  std::uint64_t expected = 0;  ///< the storage's content at forward
  TensorId offloaded;          ///< the offloader's id when the stage's offloader packed it
};

struct Task {
  bool checkpointed = false;
  std::map<std::uint32_t, TensorId> local;   ///< base -> produced in the current pass
  std::map<std::uint32_t, TensorId> chain;   ///< base -> received from the previous partition
  std::map<std::uint32_t, TensorId> popped;  ///< skip -> taken from its portal this pass
  std::map<std::uint32_t, TensorId> inputs;  ///< base -> batch input loaded here
  std::vector<std::vector<SavedRef>> saved;  ///< per op of the partition
  std::map<std::uint32_t, TensorId> grads;   ///< base -> its gradient on this device
  Generators rng;                            ///< the generators when the forward began
  std::optional<TensorId> output;            ///< the loss, held for the backward
};

std::vector<DeviceSpec> device_specs(const DeviceProfile& profile, std::uint32_t devices) {
  std::vector<DeviceSpec> specs;
  for (std::uint32_t j = 0; j < devices; ++j) {
    specs.push_back(DeviceSpec{fmt::format("gpu{}", j), profile});
  }
  return specs;
}

// Streams, events and the holders of shared buffers are the core's: Note [Pipeline streams]
// and Note [Receive buffers and record_stream] in ferry/pipeline/streams.hpp. With an offload
// policy, each stage's saved tensors go through an Offloader on that stage's device: see
// Note [Offload in stages].
//
// Note [Offload in stages]
// Each device runs the offload policy on its own: one Offloader over the stage's Backend, its
// own copy streams. A tensor a partition produced and one of its ops saves in grad-mode forward
// is packed (node id: micro-batch * ops + op, unique within the step); the saved slot's holder
// then lets go, the offloader keeping its own reference. The stage's backward of a micro-batch
// is one backward pass for the offloader (backward_begin with its nodes in order, node_done
// after each, backward_end), and the step is one offload context (enter, exit). What crossed
// devices (chain, portal), parameters, the batch, and what a recompute saves stay as they are:
// a recompute's saved tensors are used at once, and a checkpointed forward saves nothing.

class Executor {
 public:
  Executor(const Model& model, const DeviceProfile& profile, const PipelineOptions& options,
           const PipelineFaults& faults, Plan plan, pipeline::Schedule schedule,
           std::int32_t checkpoint_stop)
      : model_(model),
        profile_(profile),
        options_(options),
        faults_(faults),
        plan_(std::move(plan)),
        schedule_(schedule),
        checkpoint_stop_(checkpoint_stop),
        micro_batches_(static_cast<std::uint32_t>(options.micro_batches)),
        parts_(plan_.partitions()),
        sim_(device_specs(profile, plan_.partitions()), {}, options.sim),
        portals_(faults.portal),
        rng_(plan_.generators) {
    std::vector<StreamId> compute;
    for (std::uint32_t j = 0; j < parts_; ++j) {
      compute.push_back(sim_.add_stream(DeviceId(j), "compute"));
    }
    std::vector<Device*> devices;
    for (std::uint32_t j = 0; j < parts_; ++j) {
      devices_.push_back(std::make_unique<Device>(sim_, DeviceId(j), compute[j]));
      devices.push_back(devices_.back().get());
    }
    streams_ = std::make_unique<Streams>(std::move(devices));
    holders_ = std::make_unique<Holders>(*streams_);
    if (options.offload.policy != Policy::None) {
      for (std::uint32_t j = 0; j < parts_; ++j) {
        offloaders_.push_back(
            std::make_unique<Offloader<Device>>(*devices_[j], options.offload, faults.offload));
      }
    }
    tasks_.assign(micro_batches_, std::vector<Task>(parts_));
    forward_values_.assign(micro_batches_, std::vector<std::uint64_t>(model.tensors.size(), 0));
    resident_.resize(parts_);
    param_grads_.resize(parts_);
    live_activations_.assign(parts_, Bytes(0));
    peak_activations_.assign(parts_, Bytes(0));
  }

  PipelineRun run() {
    std::optional<Failure> failure;
    SimTime start;
    try {
      setup();
      start = sim_.host_time();
      for (const auto& off : offloaders_) off->enter();
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
      for (const auto& off : offloaders_) off->exit();
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
    for (std::uint32_t j = 0; j < parts_; ++j) {
      peak_allocated.push_back(sim_.device_allocator(DeviceId(j)).stats().allocated_peak);
    }
    std::int64_t portal_frees = 0;
    for (const PortalLifetime& l : lifetimes_) portal_frees += l.freed.valid() ? 1 : 0;
    return PipelineRun{.sim = std::move(sim_),
                       .failure = std::move(failure),
                       .partition_starts = plan_.starts,
                       .step_time = step_time,
                       .peak_allocated = std::move(peak_allocated),
                       .peak_activations = peak_activations_,
                       .recompute_time = recompute_time_,
                       .portal_stats = portals_.stats(),
                       .portal_frees = portal_frees,
                       .buffers_left = left,
                       .param_grads = param_gradients(),
                       .portal_lifetimes = lifetimes_,
                       .telemetry = telemetry()};
  }

 private:
  // ----- buffers -----

  Buf& buf(TensorId h) { return bufs_[h.value()]; }

  TensorId allocate(std::uint32_t device, StreamRef stream, Bytes bytes, Kind kind,
                    std::int32_t holds, const std::string& label) {
    auto got =
        devices_[device]->try_allocate(Place::Device, bytes, streams_->stream(stream), label);
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
    }
    return TensorId(static_cast<std::uint32_t>(bufs_.size() - 1));
  }

  void hold(TensorId h, std::int32_t n = 1) { holders_->hold(h.value(), n); }

  void release(TensorId h) {
    if (holders_->release(h.value())) let_go(h, false);
  }

  void free_buffer(TensorId h, bool at_step_end) {
    holders_->let_go(h.value());
    let_go(h, at_step_end);
  }

  // The pipeline's holders let go of `h`: the storage is freed unless an offloader keeps it.
  void let_go(TensorId h, bool at_step_end) {
    Buf& b = buf(h);
    if (b.kind == Kind::Activation) live_activations_[b.device] -= b.bytes;
    for (const std::size_t l : b.lifetimes) {
      lifetimes_[l].last_use = b.last_use;
      lifetimes_[l].freed_at_step_end = at_step_end;
    }
  }

  /// What buffer `h` holds as a whole (Note [Content values]).
  std::uint64_t content(TensorId h) const {
    const Buf& b = bufs_[h.value()];
    return content_.value(b.id, Bytes(0), b.bytes);
  }

  void set_content(TensorId h, std::uint64_t value) {
    const Buf& b = bufs_[h.value()];
    content_.write(b.id, Bytes(0), b.bytes, value);
  }

  void touched(TensorId h, StreamRef stream, OpId op) {
    buf(h).last_use = op;
    holders_->used_on(h.value(), stream);
  }

  void track(TensorId h, PortalKey key, bool gradient) {
    Buf& b = buf(h);
    PortalLifetime l;
    l.key = key;
    l.gradient = gradient;
    l.device = DeviceId(b.device);
    l.buffer = b.id;
    lifetimes_.push_back(l);
    b.lifetimes.push_back(lifetimes_.size() - 1);
  }

  Region region(TensorId h, std::uint32_t tensor) const {
    const Buf& b = bufs_[h.value()];
    const ModelTensor& t = model_.tensors[tensor];
    const bool view = t.view_of >= 0;
    return Region{b.id, view ? t.view_offset : Bytes(0), view ? t.bytes : b.bytes};
  }

  Region whole(TensorId h) const {
    const Buf& b = bufs_[h.value()];
    return Region{b.id, Bytes(0), b.bytes};
  }

  /// The value a kernel folds in for reading `tensor` from `h`.
  std::uint64_t read_value(TensorId h, std::uint32_t tensor) const {
    const std::uint64_t content = this->content(h);
    return model_.tensors[tensor].view_of >= 0 ? mix_content(content, tensor) : content;
  }

  // ----- kernels and copies -----

  struct Read {
    Read(TensorId h, Region r, std::uint64_t e, Bytes base = Bytes(0))
        : handle(h), region(r), expected(e), expected_base(base) {}
    TensorId handle;
    Region region;
    std::uint64_t expected = 0;  ///< content id of the storage the region lies in
    /// Where the region started in that storage when it was computed (a reload may put it
    /// elsewhere); read when `handle` is invalid (a storage the pipeline does not hold).
    Bytes expected_base;
  };
  struct Write {
    TensorId handle;
    std::uint64_t value = 0;
    std::uint64_t sum = 0;
  };

  OpId launch(std::uint32_t device, SimTime duration, const std::vector<Read>& reads,
              const std::vector<Write>& writes, const std::string& label) {
    std::vector<Region> read_regions;
    std::vector<Region> write_regions;
    std::vector<std::uint64_t> values;
    for (const Read& r : reads) {
      if (r.region.bytes.count() > 0) {
        const Bytes base = r.handle.valid() ? r.region.offset : r.expected_base;
        sim_.expect_content_at_next_kernel(
            r.region, {ContentPiece{Bytes(0), r.region.bytes, r.expected, base}});
      }
      read_regions.push_back(r.region);
    }
    for (const Write& w : writes) {
      write_regions.push_back(whole(w.handle));
      values.push_back(w.value);
    }
    const StreamRef stream = streams_->compute(device);
    const OpId op = sim_.kernel(streams_->stream(stream).id, duration, read_regions, write_regions,
                                label, values);
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

  void copy(StreamRef stream, TensorId src, TensorId dst, const std::string& label) {
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

  // ----- set-up and schedule -----

  static constexpr std::size_t kMaxWrites = 128;

  void setup() {
    for (std::uint32_t j = 0; j < parts_; ++j) {
      std::vector<Write> writes;
      for (const std::uint32_t b : plan_.params_of[j]) {
        const ModelTensor& t = model_.tensors[b];
        const TensorId h = allocate(j, streams_->compute(j), t.bytes, Kind::Static, 1, t.name);
        resident_[j][b] = h;
        writes.push_back(Write{h, mix_content(kParamTag, b), 0});
      }
      for (const std::uint32_t b : plan_.grads_of[j]) {
        const ModelTensor& t = model_.tensors[b];
        const TensorId h =
            allocate(j, streams_->compute(j), t.bytes, Kind::Static, 1, t.name + ".grad");
        param_grads_[j][b] = h;
        writes.push_back(Write{h, grad_content(0), 0});
      }
      // A kernel writes at most 255 ranges: initialize in chunks.
      for (std::size_t at = 0; at < writes.size(); at += kMaxWrites) {
        const auto end =
            writes.begin() + static_cast<std::ptrdiff_t>(std::min(writes.size(), at + kMaxWrites));
        launch(j, SimTime(1), {},
               std::vector<Write>(writes.begin() + static_cast<std::ptrdiff_t>(at), end),
               "init parameters and gradients");
      }
    }
  }

  [[nodiscard]] PortalKey key(std::uint32_t skip, std::uint32_t i) const {
    return PortalKey{skip, i};
  }

  std::string mb_label(std::uint32_t i, std::string_view what) const {
    return fmt::format("mb{} {}", i, what);
  }

  // ----- forward -----

  void forward_fence(std::uint32_t i, std::uint32_t j) {
    Task& task = tasks_[i][j];
    streams_->begin_fence();
    // Skip tensors first, by source partition (PortalCopy), then the chain (Copy).
    for (const std::uint32_t s : plan_.skips_into[j]) {
      const SkipPlan& skip = plan_.skips[s];
      const StreamRef stream = streams_->copy(skip.from, j);
      if (!faults_.skip_portal_copy_wait) {
        streams_->wait_for(stream, Phase::Forward, Cell{i, skip.from});
      }
      const ModelTensor& t = model_.tensors[skip.tensor];
      const TensorId dst = allocate(j, stream, t.bytes, Kind::Activation, 1,
                                    mb_label(i, fmt::format("{} (portal copy)", t.name)));
      track(dst, key(s, i), false);
      const TensorId src = portals_.copy_tensor(key(s, i), dst);
      copy(stream, src, dst,
           mb_label(i, fmt::format("portal {} gpu{}->gpu{}", t.name, skip.from, j)));
      release(src);
      if (!faults_.skip_portal_arrival_wait) streams_->arrived(Cell{i, j}, stream);
    }
    if (j == 0 || plan_.chain_in[j].empty()) return;
    const StreamRef stream = streams_->copy_after(Phase::Forward, Cell{i, j - 1}, j);
    Task& prev = tasks_[i][j - 1];
    const bool checkpointed = static_cast<std::int32_t>(i) < checkpoint_stop_;
    for (const std::uint32_t b : plan_.chain_in[j]) {
      const ModelTensor& t = model_.tensors[b];
      const Counts counts =
          plan_.chain_counts[j].contains(b) ? plan_.chain_counts[j].at(b) : Counts{};
      const bool relay = j + 1 < parts_ && std::binary_search(plan_.chain_in[j + 1].begin(),
                                                              plan_.chain_in[j + 1].end(), b);
      const std::int32_t holds = counts.reads + (checkpointed ? 1 : counts.saves) + (relay ? 1 : 0);
      const TensorId dst = allocate(j, stream, t.bytes, Kind::Activation, holds,
                                    mb_label(i, fmt::format("{} (received)", t.name)));
      const bool produced_before =
          plan_.partition_of[static_cast<std::uint32_t>(plan_.producer[b])] == j - 1;
      const TensorId src = produced_before ? prev.local.at(b) : prev.chain.at(b);
      copy(stream, src, dst, mb_label(i, fmt::format("{} gpu{}->gpu{}", t.name, j - 1, j)));
      release(src);
      task.chain[b] = dst;
    }
    streams_->arrived(Cell{i, j}, stream);
  }

  void forward_compute(std::uint32_t i, std::uint32_t j) {
    Task& task = tasks_[i][j];
    task.checkpointed = static_cast<std::int32_t>(i) < checkpoint_stop_;
    streams_->start(Cell{i, j});
    task.rng = rng_;
    load_inputs(i, j);
    run_ops(i, j, task.checkpointed ? Pass::NoGrad : Pass::Forward);
    streams_->finish(Phase::Forward, Cell{i, j});
  }

  void load_inputs(std::uint32_t i, std::uint32_t j) {
    Task& task = tasks_[i][j];
    std::vector<Write> writes;
    for (const std::uint32_t b : plan_.inputs_of[j]) {
      const ModelTensor& t = model_.tensors[b];
      const TensorId h =
          allocate(j, streams_->compute(j), t.bytes, Kind::Activation, 1, mb_label(i, t.name));
      task.inputs[b] = h;
      writes.push_back(Write{h, mix_content(mix_content(kInputTag, b), i), 0});
    }
    FERRY_CHECK(writes.size() <= kMaxWrites, "{} batch inputs on one device", writes.size());
    if (!writes.empty()) launch(j, SimTime(1), {}, writes, mb_label(i, "load batch"));
  }

  TensorId source(const Task& task, std::uint32_t j, const Access& a) const {
    switch (a.route) {
      case Route::Resident:
        return resident_[j].at(a.base);
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

  /// What a saved tensor held at forward: backward expects the same bytes, recomputed or not.
  std::uint64_t forward_content(std::uint32_t i, const Task& task, std::uint32_t j,
                                const Access& a) const {
    if (a.route == Route::Resident || a.route == Route::Input) {
      return content(source(task, j, a));
    }
    return forward_values_[i][a.base];
  }

  void run_ops(std::uint32_t i, std::uint32_t j, Pass pass) {
    Task& task = tasks_[i][j];
    const bool grad = pass != Pass::NoGrad;
    const bool recompute = pass == Pass::Recompute;
    const std::uint32_t first = plan_.starts[j];
    const std::uint32_t last = plan_.starts[j + 1];
    task.local.clear();
    task.popped.clear();
    if (grad) task.saved.assign(last - first, {});
    if (recompute) {
      for (const std::uint32_t b : plan_.chain_in[j]) {
        const auto it = plan_.chain_counts[j].find(b);
        if (it == plan_.chain_counts[j].end()) continue;
        const std::int32_t n = it->second.reads + it->second.saves;
        if (n > 0) hold(task.chain.at(b), n);
      }
    }
    const char* suffix = recompute ? " (recompute)" : grad ? "" : " (no grad)";
    std::vector<Read> reads;
    std::vector<Write> writes;
    std::vector<TensorId> created;
    for (std::uint32_t k = first; k < last; ++k) {
      const ModelOp& op = model_.ops[k];
      // orange(): the consumer takes the skip tensor out of its portal.
      for (const std::uint32_t s : plan_.pops[k]) {
        const PortalUse use = portals_.use_tensor(key(s, i));
        hold(use.tensor, 1 + (grad ? plan_.portal_saves[s] : 0));
        if (use.released) release(use.tensor);
        task.popped[s] = use.tensor;
      }
      reads.clear();
      writes.clear();
      created.clear();
      std::uint64_t value = mix_content(mix_content(kForwardTag, k), i);
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
      if (op.draws_rng) {
        const std::uint32_t g = plan_.generator_of[k];
        value = mix_content(value, mix_content(mix_content(kRngTag, g), rng_.draw(g)));
      }
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
        const TensorId h = allocate(j, streams_->compute(j), t.bytes, Kind::Activation, holds,
                                    mb_label(i, t.name + suffix));
        const std::uint64_t content = mix_content(value, o + 1);
        writes.push_back(Write{h, content, 0});
        created.push_back(h);
        task.local[b] = h;
        if (!recompute) forward_values_[i][b] = content;
        if (!recompute && b == plan_.base[model_.loss]) task.output = h;
      }
      launch(j, op.duration, reads, writes, mb_label(i, op.name + suffix));
      if (recompute) recompute_time_ += op.duration;
      for (const Access& a : plan_.uses[k]) release(source(task, j, a));
      if (grad) {
        for (const Access& a : plan_.saves[k]) {
          SavedRef ref{a, source(task, j, a), forward_content(i, task, j, a), TensorId()};
          if (!recompute && a.route == Route::Local && !offloaders_.empty()) {
            ref.offloaded = pack(i, j, k, ref);
          }
          task.saved[k - first].push_back(ref);
        }
      }
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
      for (const TensorId h : created) release(h);
    }
  }

  // ----- backward -----

  void backward_fence(std::uint32_t i, std::uint32_t j) {
    Task& task = tasks_[i][j];
    streams_->begin_fence();
    if (j + 1 < parts_ && !plan_.grad_back[j + 1].empty()) {
      Task& next = tasks_[i][j + 1];
      const StreamRef stream = streams_->copy_after(Phase::Backward, Cell{i, j + 1}, j);
      for (const std::uint32_t b : plan_.grad_back[j + 1]) {
        const ModelTensor& t = model_.tensors[b];
        const TensorId src = next.grads.at(b);
        const TensorId dst = allocate(j, stream, t.bytes, Kind::Gradient, 1,
                                      mb_label(i, fmt::format("{}.grad (received)", t.name)));
        copy(stream, src, dst, mb_label(i, fmt::format("{}.grad gpu{}->gpu{}", t.name, j + 1, j)));
        release(src);
        next.grads.erase(b);
        task.grads[b] = dst;
      }
      streams_->arrived(Cell{i, j}, stream);
    }
    // PortalCopy's backward: the gradient the orange node put goes back to the stash's device.
    for (const std::uint32_t s : plan_.skips_from[j]) {
      const SkipPlan& skip = plan_.skips[s];
      const StreamRef stream = streams_->copy_after(Phase::Backward, Cell{i, skip.to}, j);
      const ModelTensor& t = model_.tensors[skip.tensor];
      const TensorId src = portals_.use_grad(key(s, i));
      const TensorId dst = allocate(j, stream, t.bytes, Kind::Gradient, 1,
                                    mb_label(i, fmt::format("{}.grad (portal copy)", t.name)));
      copy(stream, src, dst,
           mb_label(i, fmt::format("portal {}.grad gpu{}->gpu{}", t.name, skip.to, j)));
      release(src);
      track(dst, key(s, i), true);
      if (const auto dropped = portals_.put_grad(key(s, i), dst)) release(*dropped);
      streams_->arrived(Cell{i, j}, stream);
    }
  }

  void backward_compute(std::uint32_t i, std::uint32_t j) {
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
    if (!offloaders_.empty()) {
      std::vector<NodeId> order;
      for (std::uint32_t k = last; k-- > first;) {
        if (plan_.needed[k]) order.push_back(node_id(i, k));
      }
      offloaders_[j]->backward_begin(order);
    }
    if (j + 1 == parts_) {
      const std::uint32_t loss = plan_.base[model_.loss];
      const ModelTensor& t = model_.tensors[loss];
      const TensorId h = allocate(j, streams_->compute(j), t.bytes, Kind::Gradient, 1,
                                  mb_label(i, t.name + ".grad"));
      const std::uint64_t seed = mix_content(kLossTag, i);
      launch(j, SimTime(1), {}, {Write{h, grad_content(seed), seed}}, mb_label(i, "loss grad"));
      task.grads[loss] = h;
      if (task.output) release(*task.output);
      task.output.reset();
    }
    for (std::uint32_t k = last; k-- > first;) {
      if (!plan_.needed[k]) continue;
      blue_backward(i, j, k);
      op_backward(i, j, k);
    }
    if (!offloaders_.empty()) offloaders_[j]->backward_end();
    streams_->finish(Phase::Backward, Cell{i, j});
    // The graph is freed: the checkpoint's kept input, what nodes that never ran saved, the batch.
    if (task.checkpointed) {
      for (const std::uint32_t b : plan_.chain_in[j]) release(task.chain.at(b));
    }
    for (auto& refs : task.saved) {
      for (const SavedRef& ref : refs) let_go_saved(j, ref);
      refs.clear();
    }
    for (const auto& [b, h] : task.inputs) release(h);
    task.inputs.clear();
    for (const auto& [b, h] : task.grads) {
      FERRY_CHECK(std::binary_search(plan_.grad_back[j].begin(), plan_.grad_back[j].end(), b),
                  "gradient of '{}' left on gpu{} after its backward", model_.tensors[b].name, j);
    }
  }

  /// PortalBlue's backward: the gradient from the skip's consumer joins the local one.
  void blue_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k) {
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
      launch(j, duration, {Read{g, whole(g), content(g)}, Read{acc, whole(acc), content(acc)}},
             {Write{acc, grad_content(sum), sum}},
             mb_label(i, fmt::format("{}.grad += portal grad", model_.tensors[b].name)));
      release(g);
    }
  }

  // ----- offload in stages (Note [Offload in stages]) -----

  [[nodiscard]] NodeId node_id(std::uint32_t i, std::uint32_t k) const {
    return NodeId(static_cast<std::uint32_t>(i * model_.ops.size() + k));
  }

  /// Packs a saved tensor the partition produced through its stage's offloader; the saved
  /// slot's holder lets go (the offloader keeps its own reference).
  TensorId pack(std::uint32_t i, std::uint32_t j, std::uint32_t k, const SavedRef& ref) {
    const ModelTensor& t = model_.tensors[ref.access.tensor];
    const Buf& b = buf(ref.handle);
    TensorFacts facts;
    facts.bytes = t.bytes;
    facts.storage_bytes = b.bytes;
    facts.view_offset = t.view_of >= 0 ? t.view_offset : Bytes(0);
    facts.storage = b.id.value();
    facts.no_offload = t.no_offload;
    facts.node = node_id(i, k);
    Offloader<Device>& off = *offloaders_[j];
    const bool region = model_.ops[k].no_offload;
    if (region) off.push_no_offload();
    const TensorId id = off.pack(facts, Device::Buffer{b.id});
    if (region) off.pop_no_offload();
    release(ref.handle);
    return id;
  }

  /// The saved tensors of node k as the kernel reads them; folds their values into `h`.
  /// Returns the storages unpacked from the offloader (the caller drops one reference each).
  std::vector<Device::Buffer> unpack_saved(std::uint32_t i, std::uint32_t j, std::uint32_t k,
                                           std::vector<Read>& reads, std::uint64_t& h) {
    std::vector<Device::Buffer> unpacked;
    for (const SavedRef& ref : tasks_[i][j].saved[k - plan_.starts[j]]) {
      if (!ref.offloaded.valid()) {
        reads.push_back(Read{ref.handle, region(ref.handle, ref.access.tensor), ref.expected});
        h = mix_content(h, read_value(ref.handle, ref.access.tensor));
        continue;
      }
      const Unpacked<Device::Buffer> u = offloaders_[j]->unpack(ref.offloaded, node_id(i, k));
      const ModelTensor& t = model_.tensors[ref.access.tensor];
      const bool view = t.view_of >= 0;
      reads.push_back(Read{TensorId(), Region{u.storage.id, u.offset, t.bytes}, ref.expected,
                           view ? t.view_offset : Bytes(0)});
      h = mix_content(h, view ? mix_content(ref.expected, ref.access.tensor) : ref.expected);
      unpacked.push_back(u.storage);
    }
    return unpacked;
  }

  /// The graph lets go of a saved tensor: its holder, or its offloader id.
  void let_go_saved(std::uint32_t j, const SavedRef& ref) {
    if (ref.offloaded.valid()) {
      offloaders_[j]->release(ref.offloaded);
    } else if (ref.access.held()) {
      release(ref.handle);
    }
  }

  [[nodiscard]] std::vector<OffloadTelemetry> telemetry() const {
    std::vector<OffloadTelemetry> out;
    for (const auto& off : offloaders_) out.push_back(off->telemetry());
    return out;
  }

  void op_backward(std::uint32_t i, std::uint32_t j, std::uint32_t k) {
    Task& task = tasks_[i][j];
    const ModelOp& op = model_.ops[k];
    const std::uint32_t first = plan_.starts[j];
    std::vector<Read> reads;
    std::uint64_t h = mix_content(mix_content(kBackwardTag, k), i);
    const std::vector<Device::Buffer> unpacked = unpack_saved(i, j, k, reads, h);
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
    // Contributions per target buffer; a target created here starts from zero.
    std::map<std::uint32_t, std::uint64_t> add;  // buffer handle -> contribution
    std::set<std::uint32_t> fresh;
    std::map<std::uint32_t, TensorId> portal_grads;  // skip -> gradient for its portal
    for (std::uint32_t slot = 0; slot < op.inputs.size(); ++slot) {
      const Access& a = plan_.reads[k][slot];
      const std::uint64_t c = mix_content(h, slot + 1);
      const TensorRole role = model_.tensors[a.base].role;
      TensorId target;
      if (role == TensorRole::Param) {
        target = param_grads_[j].at(a.base);
      } else if (role != TensorRole::Activation) {
        continue;
      } else if (a.route == Route::Portal) {
        auto it = portal_grads.find(a.skip);
        if (it == portal_grads.end()) {
          const ModelTensor& t = model_.tensors[a.base];
          it = portal_grads
                   .emplace(a.skip, allocate(j, streams_->compute(j), t.bytes, Kind::Gradient, 1,
                                             mb_label(i, t.name + ".grad (portal)")))
                   .first;
          fresh.insert(it->second.value());
        }
        target = it->second;
      } else {
        auto it = task.grads.find(a.base);
        if (it == task.grads.end()) {
          const ModelTensor& t = model_.tensors[a.base];
          it = task.grads
                   .emplace(a.base, allocate(j, streams_->compute(j), t.bytes, Kind::Gradient, 1,
                                             mb_label(i, t.name + ".grad")))
                   .first;
          fresh.insert(it->second.value());
        }
        target = it->second;
      }
      add[target.value()] += c;
    }
    std::vector<Write> writes;
    for (const auto& [handle, c] : add) {
      const TensorId target(handle);
      const std::uint64_t before = fresh.contains(handle) ? 0 : buf(target).sum;
      if (!fresh.contains(handle)) {
        reads.push_back(Read{target, whole(target), content(target)});
      }
      writes.push_back(Write{target, grad_content(before + c), before + c});
    }
    launch(j, op.backward_duration, reads, writes, mb_label(i, op.name + " backward"));
    for (const Device::Buffer& b : unpacked) devices_[j]->drop(b);
    if (!offloaders_.empty()) offloaders_[j]->node_done(node_id(i, k));
    for (const SavedRef& ref : task.saved[k - first]) let_go_saved(j, ref);
    task.saved[k - first].clear();
    for (const std::uint32_t b : out_bases) {
      release(task.grads.at(b));
      task.grads.erase(b);
    }
    // The orange node's backward puts the gradient into the portal.
    for (const auto& [s, g] : portal_grads) {
      track(g, key(s, i), true);
      if (const auto dropped = portals_.put_grad(key(s, i), g)) release(*dropped);
    }
  }

  // ----- end of step -----

  void finish_step() {
    // The optimizer reads every parameter gradient: each must hold its full sum.
    for (std::uint32_t j = 0; j < parts_; ++j) {
      std::vector<Read> reads;
      for (const auto& [b, h] : param_grads_[j]) reads.push_back(Read{h, whole(h), content(h)});
      if (!reads.empty()) launch(j, SimTime(1), reads, {}, "optimizer step");
    }
    for (std::uint32_t j = 0; j < parts_; ++j) sim_.sync_device(DeviceId(j));
  }

  /// Frees what is still held when the step ends (after a failure, or what a portal leaked);
  /// returns how many buffers that was.
  std::int64_t release_leftovers() {
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

  std::vector<ParamGradient> param_gradients() const {
    std::map<std::uint32_t, std::uint64_t> sums;
    for (std::uint32_t j = 0; j < parts_; ++j) {
      for (const auto& [b, h] : param_grads_[j]) sums[b] += bufs_[h.value()].sum;
    }
    std::vector<ParamGradient> grads;
    for (const auto& [b, sum] : sums) grads.push_back(ParamGradient{b, grad_content(sum)});
    return grads;
  }

  const Model& model_;
  const DeviceProfile& profile_;
  const PipelineOptions& options_;
  PipelineFaults faults_;
  Plan plan_;
  pipeline::Schedule schedule_;
  std::int32_t checkpoint_stop_;
  std::uint32_t micro_batches_;
  std::uint32_t parts_;
  Simulator sim_;
  PortalTable portals_;
  std::vector<std::unique_ptr<Device>> devices_;                ///< one Backend per device
  std::unique_ptr<Streams> streams_;                            ///< the core's choreography
  std::unique_ptr<Holders> holders_;                            ///< who holds each buffer
  std::vector<std::unique_ptr<Offloader<Device>>> offloaders_;  ///< per device, with a policy
  std::vector<std::vector<Task>> tasks_;                        ///< [micro-batch][partition]
  std::vector<std::vector<std::uint64_t>> forward_values_;      ///< [micro-batch][base]
  std::vector<std::map<std::uint32_t, TensorId>> resident_;     ///< per device
  std::vector<std::map<std::uint32_t, TensorId>> param_grads_;  ///< per device
  Generators rng_;                                              ///< per generator: draws so far
  ContentMap content_;
  std::vector<Buf> bufs_;
  std::vector<PortalLifetime> lifetimes_;
  std::vector<Bytes> live_activations_;
  std::vector<Bytes> peak_activations_;
  SimTime recompute_time_;
};

/// Each device has its own random generator: op k draws from its partition's.
std::vector<std::uint32_t> generators_by_partition(const std::vector<std::uint32_t>& starts) {
  std::vector<std::uint32_t> generator_of(starts.back(), 0);
  for (std::uint32_t j = 0; j + 1 < starts.size(); ++j) {
    for (std::uint32_t k = starts[j]; k < starts[j + 1]; ++k) generator_of[k] = j;
  }
  return generator_of;
}

Status check_options(const Model& model, const PipelineOptions& options) {
  if (options.micro_batches < 1) {
    return Error{fmt::format("micro_batches is {}; use at least 1", options.micro_batches)};
  }
  Status valid = check_model(model);
  if (!valid.ok()) return valid;
  return check_skips(model, options.skips);
}

}  // namespace

Result<PipelineRun> simulate_pipeline(const Model& model, const DeviceProfile& device,
                                      const PipelineOptions& options,
                                      const PipelineFaults& faults) {
  Status valid = check_options(model, options);
  if (!valid.ok()) return valid.error();
  auto starts = balance_by_duration(model, options.devices);
  if (!starts.ok()) return starts.error();
  std::vector<std::uint32_t> generator_of = generators_by_partition(starts.value());
  const std::int32_t m = options.micro_batches;
  const std::int32_t stop = options.checkpoint == CheckpointMode::Always       ? m
                            : options.checkpoint == CheckpointMode::ExceptLast ? m - 1
                                                                               : 0;
  Executor executor(
      model, device, options, faults,
      make_plan(model, std::move(starts).value(), std::move(generator_of), options.skips),
      pipeline::Schedule::GPipe, stop);
  return executor.run();
}

Result<PipelineRun> simulate_reference(const Model& model, const DeviceProfile& device,
                                       const PipelineOptions& options) {
  Status valid = check_options(model, options);
  if (!valid.ok()) return valid.error();
  auto starts = balance_by_duration(model, options.devices);
  if (!starts.ok()) return starts.error();
  std::vector<std::uint32_t> generator_of = generators_by_partition(starts.value());
  PipelineOptions reference = options;
  reference.devices = 1;
  std::vector<std::uint32_t> single = {0, static_cast<std::uint32_t>(model.ops.size())};
  Executor executor(model, device, reference, PipelineFaults{},
                    make_plan(model, std::move(single), std::move(generator_of), reference.skips),
                    pipeline::Schedule::Sequential, 0);
  return executor.run();
}

}  // namespace ferry::sim
