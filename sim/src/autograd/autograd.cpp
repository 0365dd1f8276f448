#include "ferry/sim/autograd/autograd.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <random>
#include <utility>

#include "ferry/check.hpp"
#include "ferry/checkpoint.hpp"
#include "ferry/offload/offloader.hpp"
#include "ferry/sim/device/device.hpp"
#include "step_failure.hpp"

namespace ferry::sim {

namespace {

using Pieces = std::vector<ContentPiece>;

// Overwrites [lo, hi) of a piece list (offsets relative to a storage) with bytes
// [base, base + hi - lo) of value `id`.
void overwrite(Pieces& pieces, std::int64_t lo, std::int64_t hi, std::uint64_t id,
               std::int64_t base = 0) {
  Pieces out;
  for (const ContentPiece& p : pieces) {
    const std::int64_t plo = p.offset.count();
    const std::int64_t phi = plo + p.bytes.count();
    if (phi <= lo || plo >= hi) {
      out.push_back(p);
      continue;
    }
    if (plo < lo) out.push_back(ContentPiece{p.offset, Bytes(lo - plo), p.id, p.base});
    if (phi > hi) {
      out.push_back(ContentPiece{Bytes(hi), Bytes(phi - hi), p.id, p.base + Bytes(hi - plo)});
    }
  }
  out.push_back(ContentPiece{Bytes(lo), Bytes(hi - lo), id, Bytes(base)});
  std::sort(out.begin(), out.end(),
            [](const ContentPiece& a, const ContentPiece& b) { return a.offset < b.offset; });
  pieces = std::move(out);
}

// The pieces of [lo, hi), relative to lo, with never-written gaps as id 0.
Pieces slice(const Pieces& pieces, std::int64_t lo, std::int64_t hi) {
  Pieces out;
  std::int64_t pos = lo;
  for (const ContentPiece& p : pieces) {
    const std::int64_t a = std::max(lo, p.offset.count());
    const std::int64_t b = std::min(hi, p.offset.count() + p.bytes.count());
    if (a >= b) continue;
    if (a > pos) out.push_back(ContentPiece{Bytes(pos - lo), Bytes(a - pos), 0, Bytes(0)});
    out.push_back(
        ContentPiece{Bytes(a - lo), Bytes(b - a), p.id, p.base + Bytes(a - p.offset.count())});
    pos = b;
  }
  if (pos < hi) out.push_back(ContentPiece{Bytes(pos - lo), Bytes(hi - pos), 0, Bytes(0)});
  return out;
}

// Note [Simulated values]
// Every tensor has a content value: forward ops compute theirs from the op, the output
// index, their inputs' values and (dropout) a draw from the device generator; backward nodes
// derive gradient values from everything they read. Kernels write these values as the
// simulator's content ids, so a recomputed tensor holds the same content as the original
// exactly when its inputs and random draws were the same, and a gradient differs exactly
// when something it was computed from did. Parameter gradients accumulate with a sum
// (modular), so the order of backward nodes does not matter, as in exact arithmetic.

struct Bound {
  Device::Buffer buffer;
  Bytes offset;
  std::uint64_t value = 0;
};

// How a saved tensor was packed.
struct Saved {
  enum class Kind : std::uint8_t { Offload, Holder } kind = Kind::Offload;
  TensorId id;
  HolderId holder;
  std::uint32_t tensor = 0;
  Pieces expected;  // what its bytes held in forward
};

// What the checkpointer keeps for a recomputed tensor: a storage reference and the value.
struct Recomputed {
  Device::Buffer buffer;
  Bytes offset;
  std::uint64_t value = 0;
};

// The innermost saved-tensor hook: the offloader (none pushed), a frame, or a recomputation.
struct Context {
  enum class Kind : std::uint8_t { Frame, Recompute, NoGrad } kind;
  FrameId frame;
};

// The random generators' states (draws so far): the device's and the CPU's.
struct Generators {
  std::uint64_t device = 0;
  std::uint64_t cpu = 0;
};

struct FrameInfo {
  std::uint32_t region = 0;
  std::vector<Saved> inputs;                 // the region's inputs, saved by the parent
  Generators generators;                     // at the region's start
  std::map<std::uint32_t, Bound> cache;      // MustSave outputs (forward references)
  std::map<std::uint32_t, Saved> offloaded;  // Offload-policy outputs
  std::uint32_t last_pack_op = 0;            // op during which its last holder was packed
  std::size_t taken = 0;                     // holders taken in the current backward
  bool released = false;                     // inputs and caches let go
};

constexpr std::uint64_t kGradSalt = 0x67726164;  // "grad"

// The one device: the simulator numbers devices in the order of their specs.
constexpr DeviceId kDevice(0);

class Trainer {
 public:
  Trainer(const Model& model, const DeviceProfile& profile, const TrainingOptions& options,
          const TrainingFaults& faults)
      : model_(model),
        options_(options),
        run_{.sim = Simulator({DeviceSpec{"gpu0", profile}}, {}, options.sim), .device = kDevice},
        compute_(run_.sim.add_stream(kDevice, "compute")),
        device_(run_.sim, kDevice, compute_),
        offloader_(device_, options.offload, faults.offload),
        faults_(faults) {
    run_.compute = compute_;
    const std::size_t n = model.tensors.size();
    // An activation's forward reference ends after its last forward use (at once if unused);
    // the loss lives until the graph is freed.
    last_use_.assign(n, -1);
    for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
      for (const std::uint32_t t : model.ops[i].outputs) {
        last_use_[base(t)] =
            std::max<std::int32_t>(last_use_[base(t)], static_cast<std::int32_t>(i));
      }
      for (const std::uint32_t t : model.ops[i].inputs)
        last_use_[base(t)] = static_cast<std::int32_t>(i);
    }
    drop_after_.resize(model.ops.size());
    for (std::uint32_t t = 0; t < n; ++t) {
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.view_of >= 0 || tensor.role != TensorRole::Activation || t == base(model.loss) ||
          last_use_[t] < 0) {
        continue;
      }
      drop_after_[static_cast<std::size_t>(last_use_[t])].push_back(t);
    }
    needed_ = needed_nodes();
    grads_.resize(n);
    grad_values_.assign(n, 0);
    const CheckpointPlan& plan = options.checkpoint;
    region_of_op_.assign(model.ops.size(), -1);
    for (std::size_t r = 0; r < plan.regions.size(); ++r) {
      const CheckpointRegion& reg = plan.regions[r];
      for (std::uint32_t i = reg.first_op; i < reg.end_op; ++i) {
        // The innermost region wins (regions are listed outer before inner).
        region_of_op_[i] = static_cast<std::int32_t>(r);
      }
    }
    checkpointer_.set_global_early_stop(plan.global_early_stop);
  }

  Result<TrainingRun> run() {
    if (auto valid = validate_plan(); !valid) return valid.error();
    try {
      setup();
      run_.baseline_allocated = allocated();
      for (std::int32_t step = 0; step < options_.steps && !run_.failure; ++step) this->step();
    } catch (const StepFailure& e) {
      run_.failure = e.failure;
    } catch (const OffloadError& e) {
      run_.failure = Failure{e.kind(), e.what()};
    } catch (const CheckpointError& e) {
      run_.failure = Failure{FailureKind::Misuse, e.what()};
    }
    run_.sim.finish();
    if (!options_.sync_each_step && !run_.steps.empty())
      run_.steps.back().end = run_.sim.makespan();
    run_.telemetry = offloader_.telemetry();
    return std::move(run_);
  }

 private:
  // --- set-up and validation --------------------------------------------------------------

  Status validate_plan() const {
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

  std::uint32_t base(std::uint32_t t) const {
    const ModelTensor& tensor = model_.tensors[t];
    return tensor.view_of >= 0 ? static_cast<std::uint32_t>(tensor.view_of) : t;
  }

  // Device bytes allocated, less blocks whose free waits behind record_stream markers: those
  // return at the next allocation (as in PyTorch), so they are not held by the step.
  Bytes allocated() const {
    const CachingAllocator& alloc = run_.sim.device_allocator(kDevice);
    Bytes pending;
    for (const BlockInfo& b : alloc.live_blocks()) {
      if (b.state == BlockInfo::State::PendingFree) pending += b.size;
    }
    return alloc.stats().allocated - pending;
  }

  Device::Buffer must_allocate(Bytes bytes, const std::string& name) {
    auto buf = device_.try_allocate(Place::Device, bytes, Device::Stream{compute_}, name);
    if (!buf) out_of_memory(buf.error().message);
    return buf.value();
  }

  std::vector<bool> needed_nodes() const {
    std::vector<bool> needed(model_.ops.size(), false);
    std::vector<bool> grad_flows(model_.tensors.size(), false);
    grad_flows[base(model_.loss)] = true;
    for (std::size_t i = model_.ops.size(); i-- > 0;) {
      const ModelOp& op = model_.ops[i];
      for (const std::uint32_t t : op.outputs) needed[i] = needed[i] || grad_flows[base(t)];
      if (!needed[i]) continue;
      for (const std::uint32_t t : op.inputs) {
        if (model_.tensors[base(t)].role == TensorRole::Activation) grad_flows[base(t)] = true;
      }
    }
    return needed;
  }

  void setup() {
    scopes_.emplace_back();
    std::vector<Region> writes;
    std::vector<std::uint64_t> values;
    for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
      const ModelTensor& tensor = model_.tensors[t];
      if (tensor.view_of >= 0) continue;
      if (tensor.role == TensorRole::Param || tensor.role == TensorRole::Buffer) {
        const Device::Buffer buf = must_allocate(tensor.bytes, tensor.name);
        params_[t] = Bound{buf, Bytes(0), mix_content(0x706172616d, t)};
        writes.push_back(Region{buf.id, Bytes(0), tensor.bytes});
        values.push_back(params_[t].value);
        note_write(buf, Bytes(0), tensor.bytes, params_[t].value);
        if (tensor.role == TensorRole::Param) {
          param_grads_.emplace(t, must_allocate(tensor.bytes, tensor.name + ".grad"));
        }
      }
    }
    run_.sim.kernel(compute_, SimTime(1), {}, writes, "init parameters", values);
    device_rng_initialized_ = !options_.checkpoint.lazy_device_rng;
  }

  // --- tensors, scopes and content ----------------------------------------------------------

  // Where tensor t lives now: the innermost scope binding it (views through their base).
  Bound lookup(std::uint32_t t) const {
    const ModelTensor& tensor = model_.tensors[t];
    if (tensor.role == TensorRole::Param || tensor.role == TensorRole::Buffer) {
      const std::uint32_t b = base(t);
      const Bound& p = params_.at(b);
      return Bound{p.buffer, tensor.view_offset, p.value};
    }
    for (std::size_t s = scopes_.size(); s-- > 0;) {
      auto it = scopes_[s].bound.find(t);
      if (it != scopes_[s].bound.end()) return it->second;
    }
    FERRY_CHECK(false, "tensor {} is not live", tensor.name);
    return {};
  }

  Region region(std::uint32_t t) const {
    const Bound b = lookup(t);
    return Region{b.buffer.id, b.offset, model_.tensors[t].bytes};
  }

  void note_write(Device::Buffer buf, Bytes offset, Bytes bytes, std::uint64_t value) {
    overwrite(content_[buf.id.value()], offset.count(), (offset + bytes).count(), value);
  }

  // A tensor came back (reloaded, or served from forward) at `where`: it holds what it held
  // when it was saved.
  void note_arrival(const Bound& where, const Pieces& saved) {
    Pieces& pieces = content_[where.buffer.id.value()];
    for (const ContentPiece& p : saved) {
      const std::int64_t lo = (where.offset + p.offset).count();
      overwrite(pieces, lo, lo + p.bytes.count(), p.id, p.base.count());
    }
  }

  Pieces expected_of(std::uint32_t t) const {
    const Bound b = lookup(t);
    auto it = content_.find(b.buffer.id.value());
    const Pieces none;
    return slice(it == content_.end() ? none : it->second, b.offset.count(),
                 (b.offset + model_.tensors[t].bytes).count());
  }

  struct Scope {
    std::map<std::uint32_t, Bound> bound;  // tensor -> where it lives in this scope
    std::vector<Device::Buffer> owned;     // references this scope drops at its end
  };

  // --- forward ops ----------------------------------------------------------------------------

  // Runs forward op i in the innermost scope. In a replay, outputs are owned by the scope.
  void run_op(std::uint32_t i, bool replay) {
    const ModelOp& op = model_.ops[i];
    Scope& scope = scopes_.back();
    std::uint64_t seed = mix_content(0x6f70, i + 1);
    for (const std::uint32_t t : op.inputs) seed = mix_content(seed, lookup(t).value);
    if (op.draws_rng) {
      if (!device_rng_initialized_) device_rng_initialized_ = true;
      seed = mix_content(seed, mix_content(0x726e67, generators_.device++));
    }
    if (op.draws_cpu_rng) seed = mix_content(seed, mix_content(0x637075, generators_.cpu++));
    std::vector<Region> reads;
    std::vector<Region> writes;
    std::vector<std::uint64_t> values;
    for (const std::uint32_t t : op.inputs) reads.push_back(region(t));
    for (std::uint32_t k = 0; k < op.outputs.size(); ++k) {
      const std::uint32_t t = op.outputs[k];
      const ModelTensor& tensor = model_.tensors[t];
      const std::uint64_t value = mix_content(seed, k);
      if (tensor.view_of < 0) {
        const Device::Buffer buf = must_allocate(tensor.bytes, tensor.name);
        scope.bound[t] = Bound{buf, Bytes(0), value};
        if (replay) scope.owned.push_back(buf);
      } else {
        const Bound b = lookup(base(t));
        scope.bound[t] = Bound{b.buffer, b.offset + tensor.view_offset, value};
      }
      const Bound out = scope.bound[t];
      writes.push_back(Region{out.buffer.id, out.offset, tensor.bytes});
      values.push_back(value);
      note_write(out.buffer, out.offset, tensor.bytes, value);
    }
    run_.sim.kernel(compute_, op.duration, reads, writes, replay ? op.name + " recompute" : op.name,
                    values);
    if (replay && in_last_step_) run_.recompute_time += op.duration;
  }

  // Saves tensor t of op `node` through the innermost hook.
  Saved pack(std::uint32_t node, std::uint32_t t) {
    const ModelTensor& tensor = model_.tensors[t];
    const std::uint32_t b = base(t);
    const Bound where = lookup(t);
    Saved saved;
    saved.tensor = t;
    saved.expected = expected_of(t);
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
      const Recomputed kept{where.buffer, where.offset, tensor_value(expected_of(t))};
      const RecomputePack done = checkpointer_.recompute_pack(meta, kept);
      if (done != RecomputePack::Ignored) device_.hold(where.buffer);  // the checkpointer's
      if (done == RecomputePack::KeptLast) stop_replay_ = true;
      return saved;
    }
    const ModelTensor& storage = model_.tensors[b];
    TensorFacts facts;
    facts.bytes = tensor.bytes;
    facts.storage_bytes = tensor.role == TensorRole::Param || tensor.role == TensorRole::Buffer
                              ? storage.bytes
                              : run_.sim.buffers()[where.buffer.id.value()].bytes;
    facts.view_offset = where.offset;
    facts.storage = where.buffer.id.value();
    facts.is_param = storage.role == TensorRole::Param || storage.role == TensorRole::Buffer;
    facts.no_offload = tensor.no_offload;
    facts.node = NodeId(node);
    saved.kind = Saved::Kind::Offload;
    saved.id = offloader_.pack(facts, where.buffer);
    return saved;
  }

  SavedMeta meta_of(std::uint32_t t, std::uint64_t value) const {
    const ModelTensor& tensor = model_.tensors[t];
    return SavedMeta{tensor.bytes, static_cast<std::uint8_t>(tensor.dtype), 0, value};
  }

  // Inputs of ops [first, end) produced before `first` (activations and the batch).
  std::vector<std::uint32_t> region_inputs(std::uint32_t first, std::uint32_t end) const {
    std::vector<std::uint32_t> produced;
    std::vector<std::uint32_t> inputs;
    for (std::uint32_t i = first; i < end; ++i) {
      for (const std::uint32_t t : model_.ops[i].inputs) {
        const TensorRole role = model_.tensors[base(t)].role;
        if (role == TensorRole::Param || role == TensorRole::Buffer) continue;
        if (std::find(produced.begin(), produced.end(), t) != produced.end()) continue;
        if (std::find(inputs.begin(), inputs.end(), t) == inputs.end()) inputs.push_back(t);
      }
      for (const std::uint32_t t : model_.ops[i].outputs) produced.push_back(t);
    }
    return inputs;
  }

  OpPolicy policy(std::uint32_t op) const {
    const auto& p = options_.checkpoint.op_policy;
    return op < p.size() ? p[op] : OpPolicy::PreferRecompute;
  }

  // Regions that start at op i, outermost first / end at op i + 1, innermost first.
  std::vector<std::uint32_t> regions_starting(std::uint32_t i, std::uint32_t within_first,
                                              std::uint32_t within_end, std::int32_t except) const {
    std::vector<std::uint32_t> out;
    const auto& regions = options_.checkpoint.regions;
    // Inside a replay of region `except`, only regions listed after it (nested in it) begin.
    for (auto r = static_cast<std::uint32_t>(except + 1); r < regions.size(); ++r) {
      if (regions[r].first_op == i && regions[r].first_op >= within_first &&
          regions[r].end_op <= within_end) {
        out.push_back(r);
      }
    }
    std::stable_sort(out.begin(), out.end(), [&](std::uint32_t a, std::uint32_t b) {
      return regions[a].end_op > regions[b].end_op;  // outermost first
    });
    return out;
  }

  void begin_region(std::uint32_t r) {
    const CheckpointRegion& reg = options_.checkpoint.regions[r];
    FrameInfo info;
    info.region = r;
    info.generators = generators_;
    for (const std::uint32_t t : region_inputs(reg.first_op, reg.end_op)) {
      info.inputs.push_back(pack(reg.end_op - 1, t));
    }
    if (reg.reentrant) {
      contexts_.push_back(Context{Context::Kind::NoGrad, FrameId()});
      open_.push_back(OpenRegion{r, FrameId(), device_rng_initialized_});
      reentrant_inputs_[r] = std::move(info);
      return;
    }
    FrameOptions fo;
    fo.early_stop = reg.early_stop.value_or(true);
    fo.determinism_check = options_.checkpoint.determinism_check;
    fo.content_check = options_.checkpoint.content_check;
    const FrameId frame = checkpointer_.begin(fo);
    if (frames_.size() <= frame.value()) frames_.resize(frame.value() + 1);
    frames_[frame.value()] = std::move(info);
    contexts_.push_back(Context{Context::Kind::Frame, frame});
    open_.push_back(OpenRegion{r, frame, device_rng_initialized_});
  }

  void end_region() {
    const OpenRegion open = open_.back();
    open_.pop_back();
    contexts_.pop_back();
    if (open.frame.valid()) {
      checkpointer_.end(open.frame);
      // A region that saved nothing is referenced by no holder: its inputs go now.
      if (checkpointer_.saved_count(open.frame) == 0) release_frame(frames_[open.frame.value()]);
    }
    if (options_.checkpoint.preserve_rng && !open.had_device_rng && device_rng_initialized_ &&
        !replaying()) {
      throw CheckpointError(
          "PyTorch's device state was initialized in the forward pass of a Checkpoint, which is "
          "not allowed. Please open an issue if you need this feature.");
    }
  }

  bool replaying() const {
    return std::any_of(contexts_.begin(), contexts_.end(),
                       [](const Context& c) { return c.kind == Context::Kind::Recompute; });
  }

  // Saves the op's tensors, honouring the selective policy inside a frame.
  void save_op(std::uint32_t i) {
    const ModelOp& op = model_.ops[i];
    const bool in_frame = !contexts_.empty() && contexts_.back().kind == Context::Kind::Frame;
    if (!contexts_.empty() && contexts_.back().kind == Context::Kind::NoGrad) return;
    if (in_frame && policy(i) != OpPolicy::PreferRecompute) {
      FrameInfo& info = frames_[contexts_.back().frame.value()];
      for (const std::uint32_t t : op.outputs) {
        if (model_.tensors[t].view_of >= 0) continue;
        const Bound b = lookup(t);
        if (policy(i) == OpPolicy::MustSave) {
          device_.hold(b.buffer);
          info.cache[t] = b;
        } else {
          // Offloaded through the ambient offloader, not through the frame.
          const std::vector<Context> saved_contexts = std::exchange(contexts_, {});
          info.offloaded[t] = pack(i, t);
          contexts_ = saved_contexts;
        }
      }
    }
    auto& list = saved_[i];
    for (const std::uint32_t t : op.saved) list.push_back(pack(i, t));
  }

  void forward() {
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
      const std::uint64_t value = mix_content(mix_content(0x6261746368, step_), t);
      scopes_[0].bound[t] = Bound{buf, Bytes(0), value};
      batch.push_back(Region{buf.id, Bytes(0), tensor.bytes});
      values.push_back(value);
      note_write(buf, Bytes(0), tensor.bytes, value);
    }
    run_.sim.kernel(compute_, SimTime(1), {}, batch, "load batch", values);

    saved_.assign(model_.ops.size(), {});
    for (std::uint32_t i = 0; i < model_.ops.size(); ++i) {
      const ModelOp& op = model_.ops[i];
      current_op_ = i;
      for (const std::uint32_t r :
           regions_starting(i, 0, static_cast<std::uint32_t>(model_.ops.size()), -1)) {
        begin_region(r);
      }
      if (op.no_offload) offloader_.push_no_offload();
      run_op(i, false);
      save_op(i);
      if (op.no_offload) offloader_.pop_no_offload();
      if (options_.backward_inside_op == static_cast<std::int32_t>(i)) backward_inside(i);
      while (!open_.empty() && options_.checkpoint.regions[open_.back().region].end_op == i + 1) {
        end_region();
      }
      for (const std::uint32_t b : drop_after_[i]) device_.drop(scopes_[0].bound.at(b).buffer);
    }
  }

  // --- backward ---------------------------------------------------------------------------

  // Gets a saved tensor back for node `node`: from the offloader, or from its frame (which is
  // recomputed first if this graph task has not done so). The caller owns one reference.
  Bound unpack(const Saved& s, std::uint32_t node) {
    if (s.kind == Saved::Kind::Offload) {
      auto u = offloader_.unpack(s.id, NodeId(node));
      const Bound b{u.storage, u.offset, tensor_value(s.expected)};
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

  void release_frame(FrameInfo& info) {
    if (info.released) return;
    info.released = true;
    for (const Saved& s : info.inputs) {
      if (s.kind == Saved::Kind::Offload) offloader_.release(s.id);
    }
    for (const auto& [t, b] : info.cache) device_.drop(b.buffer);
    for (const auto& [t, s] : info.offloaded) offloader_.release(s.id);
  }

  // What a saved tensor's bytes amount to, from their content pieces: the same whether it
  // comes back from the host or from a recomputation.
  static std::uint64_t tensor_value(const Pieces& pieces) {
    if (pieces.size() == 1 && pieces[0].base.count() == 0) return pieces[0].id;
    std::uint64_t v = 0x7069656365;
    for (const ContentPiece& p : pieces) {
      v = mix_content(mix_content(v, p.id), static_cast<std::uint64_t>(p.base.count()));
    }
    return v;
  }

  // Opens a replay of a region: its saved inputs come back (which may first recompute a parent,
  // Note [Nestable checkpoint]) into a new scope that owns those references, and the
  // generators go back to where they stood when the region began. Returns the live states.
  Generators open_replay(const FrameInfo& info, std::uint32_t node) {
    std::vector<std::pair<std::uint32_t, Bound>> inputs;
    for (const Saved& s : info.inputs) inputs.emplace_back(s.tensor, unpack(s, node));
    scopes_.emplace_back();
    for (const auto& [t, b] : inputs) {
      scopes_.back().bound[t] = b;
      scopes_.back().owned.push_back(b.buffer);
    }
    const Generators outer = generators_;
    if (!faults_.skip_rng_restore) generators_ = info.generators;
    return outer;
  }

  // Ends the innermost scope, dropping the references it owns.
  void close_scope() {
    Scope scope = std::move(scopes_.back());
    scopes_.pop_back();
    for (const Device::Buffer& b : scope.owned) device_.drop(b);
  }

  void recompute(FrameId frame, std::uint32_t node) {
    FrameInfo& info = frames_[frame.value()];
    const CheckpointRegion& reg = options_.checkpoint.regions[info.region];
    ++run_.recomputations;
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
  }

  void replay_op(std::uint32_t i, FrameInfo& info) {
    const ModelOp& op = model_.ops[i];
    Scope& scope = scopes_.back();
    const OpPolicy p = policy(i);
    if (p == OpPolicy::MustSave || p == OpPolicy::Offload) {
      // Served from forward instead of re-run.
      for (const std::uint32_t t : op.outputs) {
        if (model_.tensors[t].view_of >= 0) {
          const Bound b = lookup(base(t));
          scope.bound[t] =
              Bound{b.buffer, b.offset + model_.tensors[t].view_offset, mix_content(b.value, t)};
          continue;
        }
        Bound b;
        if (p == OpPolicy::MustSave) {
          b = info.cache.at(t);
          device_.hold(b.buffer);
        } else {
          b = unpack(info.offloaded.at(t), i);
        }
        scope.bound[t] = b;
        scope.owned.push_back(b.buffer);
      }
      for (const std::uint32_t t : op.saved) (void)pack(i, t);
      return;
    }
    run_op(i, true);
    for (const std::uint32_t t : op.saved) {
      (void)pack(i, t);
      if (stop_replay_) break;
    }
  }

  std::vector<std::uint32_t> backward_order() {
    std::vector<std::uint32_t> order;
    if (options_.order_seed == 0) {
      for (std::size_t i = model_.ops.size(); i-- > 0;) {
        if (needed_[i]) order.push_back(static_cast<std::uint32_t>(i));
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
      if (!needed_[j]) continue;
      const std::uint32_t uj = unit[j];
      for (const std::uint32_t t : model_.ops[j].inputs) {
        const std::int32_t p = producer[base(t)];
        if (p < 0 || !needed_[static_cast<std::size_t>(p)]) continue;
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
      if (needed_[i] && unit[i] == i && waiting[i] == 0) ready.push_back(i);
    }
    while (!ready.empty()) {
      const std::size_t pick = static_cast<std::size_t>(rng() % ready.size());
      const std::uint32_t n = ready[pick];
      ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(pick));
      for (std::uint32_t i = n + 1; i-- > 0 && unit[i] == n;) {
        if (needed_[i]) order.push_back(i);
      }
      for (const std::uint32_t up : producers_of[n]) {
        if (--waiting[up] == 0) ready.push_back(up);
      }
    }
    return order;
  }

  Device::Buffer& grad(std::uint32_t t) {
    const std::uint32_t b = base(t);
    if (!grads_[b])
      grads_[b] = must_allocate(model_.tensors[b].bytes, model_.tensors[b].name + ".grad");
    return *grads_[b];
  }

  std::int32_t reentrant_region_of(std::uint32_t op) const {
    const std::int32_t r = region_of_op_[op];
    return r >= 0 && options_.checkpoint.regions[static_cast<std::size_t>(r)].reentrant ? r : -1;
  }

  // Backward node n: unpack, one kernel reading what it needs and writing gradients, drop,
  // post-hook, release.
  void run_node(std::uint32_t n, bool last_pass, std::size_t k) {
    const ModelOp& op = model_.ops[n];
    std::vector<Region> reads;
    std::vector<Region> writes;
    std::vector<std::uint64_t> values;
    std::vector<Device::Buffer> unpacked;
    std::uint64_t g = mix_content(kGradSalt, n + 1);
    for (const Saved& s : saved_[n]) {
      const Bound b = unpack(s, n);
      if (options_.unpack_twice) device_.drop(unpack(s, n).buffer);  // a holder refuses this
      const Region r{b.buffer.id, b.offset, model_.tensors[s.tensor].bytes};
      run_.sim.expect_content_at_next_kernel(r, s.expected);
      reads.push_back(r);
      unpacked.push_back(b.buffer);
      g = mix_content(g, b.value);
    }
    if (escaped_) reads.push_back(Region{escaped_->id, Bytes(0), Bytes(1)});
    for (const std::uint32_t t : op.outputs) {
      const std::uint32_t b = base(t);
      if (grads_[b]) {
        reads.push_back(Region{grads_[b]->id, Bytes(0), model_.tensors[b].bytes});
        g = mix_content(g, grad_values_[b]);
      }
    }
    std::vector<std::uint32_t> written;
    for (const std::uint32_t t : op.inputs) {
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
        param_grad_values_[b] += mix_content(g, b);
        writes.push_back(Region{param_grads_.at(b).id, Bytes(0), model_.tensors[b].bytes});
        values.push_back(param_grad_values_[b]);
      }
    }
    run_.sim.kernel(compute_, op.backward_duration, reads, writes, op.name + " backward", values);
    if (escaped_) {
      device_.drop(*escaped_);
      escaped_.reset();
    }
    const bool escape = options_.escape_period > 0 && !unpacked.empty() &&
                        k % static_cast<std::size_t>(options_.escape_period) == 0;
    for (std::size_t u = 0; u < unpacked.size(); ++u) {
      if (escape && u == 0) {
        escaped_ = unpacked[u];  // a view of it lives on into the next node
      } else {
        device_.drop(unpacked[u]);
      }
    }
    for (const std::uint32_t t : op.outputs) {
      const std::uint32_t b = base(t);
      if (grads_[b] && b != base(model_.loss)) {
        device_.drop(*grads_[b]);
        grads_[b].reset();
      }
    }
    offloader_.node_done(NodeId(n));
    if (last_pass) {
      for (const Saved& s : saved_[n]) {
        if (s.kind == Saved::Kind::Offload) offloader_.release(s.id);
      }
    }
  }

  // A backward through node k in a graph task of its own, in the middle of forward: its saved
  // tensors come back (a frame still running is recomputed from its inputs), its kernel runs
  // into a scratch result, and nothing is released: the real backward needs them again.
  void backward_inside(std::uint32_t k) {
    ++gid_;
    const bool outer_last_pass = last_pass_;
    last_pass_ = false;
    std::vector<Region> reads;
    std::vector<Device::Buffer> unpacked;
    for (const Saved& s : saved_[k]) {
      const Bound b = unpack(s, k);
      const Region r{b.buffer.id, b.offset, model_.tensors[s.tensor].bytes};
      run_.sim.expect_content_at_next_kernel(r, s.expected);
      reads.push_back(r);
      unpacked.push_back(b.buffer);
    }
    const Device::Buffer scratch = must_allocate(Bytes(512), "grad inside forward");
    run_.sim.kernel(compute_, model_.ops[k].backward_duration, reads,
                    std::vector<Region>{Region{scratch.id, Bytes(0), Bytes(512)}},
                    model_.ops[k].name + " backward inside forward");
    for (const Device::Buffer& b : unpacked) device_.drop(b);
    device_.drop(scratch);
    offloader_.node_done(NodeId(k));
    for (const Recomputed& left : checkpointer_.drain(gid_)) device_.drop(left.buffer);
    last_pass_ = outer_last_pass;
  }

  // The reentrant variant: at the region's last node, re-run its forward (with the ambient
  // hooks), then its nodes in reverse, as a nested backward would.
  void run_reentrant(std::uint32_t r, bool last_pass, std::size_t k) {
    const CheckpointRegion& reg = options_.checkpoint.regions[r];
    FrameInfo& info = reentrant_inputs_.at(r);
    ++run_.recomputations;
    const Generators outer = open_replay(info, reg.end_op - 1);
    for (std::uint32_t i = reg.first_op; i < reg.end_op; ++i) {
      run_op(i, true);
      for (const std::uint32_t t : model_.ops[i].saved) saved_[i].push_back(pack(i, t));
    }
    generators_ = outer;
    if (in_last_step_) run_.replay_stops.emplace_back(reg.end_op - 1, reg.end_op - 1);
    for (std::uint32_t i = reg.end_op; i-- > reg.first_op;) {
      if (needed_[i]) {
        run_node(i, true, k);
      } else {
        // Off the path to the loss: the replay's graph frees what it saved.
        for (const Saved& s : saved_[i]) {
          if (s.kind == Saved::Kind::Offload) offloader_.release(s.id);
        }
      }
      saved_[i].clear();
    }
    close_scope();
    if (last_pass) release_frame(info);
  }

  void backward(bool last_pass) {
    ++gid_;
    last_pass_ = last_pass;
    for (FrameInfo& info : frames_) info.taken = 0;
    const std::vector<std::uint32_t> order = backward_order();
    run_.backward_order = order;
    std::vector<NodeId> nodes;
    for (const std::uint32_t n : order) nodes.push_back(NodeId(n));
    offloader_.backward_begin(options_.announce_order ? std::span<const NodeId>(nodes)
                                                      : std::span<const NodeId>());
    const std::uint32_t loss = base(model_.loss);
    grad_values_[loss] = mix_content(kGradSalt, 0);
    run_.sim.kernel(
        compute_, SimTime(1), {},
        std::vector<Region>{Region{grad(loss).id, Bytes(0), model_.tensors[loss].bytes}},
        "loss grad", std::vector<std::uint64_t>{grad_values_[loss]});
    std::vector<bool> done_region(options_.checkpoint.regions.size(), false);
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::uint32_t n = order[k];
      const std::int32_t r = reentrant_region_of(n);
      if (r >= 0) {
        if (!done_region[static_cast<std::size_t>(r)]) {
          done_region[static_cast<std::size_t>(r)] = true;
          run_reentrant(static_cast<std::uint32_t>(r), last_pass, k);
        }
        continue;
      }
      run_node(n, last_pass, k);
    }
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
        if (s.kind == Saved::Kind::Offload && !needed_[n]) offloader_.release(s.id);
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

  void step() {
    in_last_step_ = step_ + 1 == options_.steps;
    if (in_last_step_) {
      run_.recompute_time = SimTime(0);
      run_.replay_stops.clear();
    }
    StepTimes times;
    times.start = run_.sim.host_time();
    // The offload context spans the step, forward and backward, as the reference's trainer
    // enters it.
    offloader_.enter();
    forward();
    times.forward_end = run_.sim.host_time();
    param_grad_values_.clear();
    const int passes = options_.retain_graph ? 2 : 1;
    for (int pass = 0; pass < passes; ++pass) backward(pass == passes - 1);
    offloader_.exit();
    if (options_.sync_each_step) run_.sim.sync_device(kDevice);
    times.end = run_.sim.host_time();
    run_.steps.push_back(times);
    run_.allocated_after.push_back(allocated());
    run_.tracked_after.push_back(offloader_.tracked());
    run_.gradient_values.clear();
    for (const auto& [p, v] : param_grad_values_) run_.gradient_values.push_back(v);
    ++step_;
  }

  struct OpenRegion {
    std::uint32_t region;
    FrameId frame;
    bool had_device_rng;
  };

  const Model& model_;
  const TrainingOptions& options_;
  TrainingRun run_;
  StreamId compute_;
  Device device_;
  Offloader<Device> offloader_;
  TrainingFaults faults_;
  Checkpointer<Recomputed> checkpointer_;
  std::vector<Scope> scopes_;
  std::map<std::uint32_t, Bound> params_;
  std::map<std::uint32_t, Device::Buffer> param_grads_;
  std::map<std::uint32_t, std::uint64_t> param_grad_values_;
  std::map<std::uint32_t, Pieces> content_;  // by buffer id: what was written where
  std::vector<std::optional<Device::Buffer>> grads_;
  std::vector<std::uint64_t> grad_values_;
  std::vector<std::int32_t> last_use_;
  std::vector<std::vector<std::uint32_t>> drop_after_;
  std::vector<bool> needed_;
  std::vector<std::vector<Saved>> saved_;
  std::vector<std::int32_t> region_of_op_;
  std::vector<Context> contexts_;
  std::vector<OpenRegion> open_;
  // By FrameId. A deque: replays begin new frames while references to older ones are held.
  std::deque<FrameInfo> frames_;
  std::map<std::uint32_t, FrameInfo> reentrant_inputs_;
  std::optional<Device::Buffer> escaped_;
  Generators generators_;
  bool device_rng_initialized_ = true;
  std::uint64_t gid_ = 0;
  std::int32_t step_ = 0;
  bool in_last_step_ = false;
  bool stop_replay_ = false;
  int dropped_in_replay_ = 0;
  std::uint32_t current_op_ = 0;  // the forward op being run or replayed
  bool last_pass_ = true;         // the current backward frees the graph
};

}  // namespace

Result<TrainingRun> simulate_training(const Model& model, const DeviceProfile& device,
                                      const TrainingOptions& options,
                                      const TrainingFaults& faults) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  Trainer trainer(model, device, options, faults);
  return trainer.run();
}

}  // namespace ferry::sim
