#include "ferry/sim/autograd.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "ferry/check.hpp"
#include "ferry/offloader.hpp"
#include "ferry/sim/device.hpp"

namespace ferry::sim {

namespace {

using Pieces = std::vector<ContentPiece>;

// Overwrites [lo, hi) of a piece list (offsets relative to a storage) with value `id`.
void overwrite(Pieces& pieces, std::int64_t lo, std::int64_t hi, std::uint64_t id) {
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
  out.push_back(ContentPiece{Bytes(lo), Bytes(hi - lo), id, Bytes(0)});
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
    out.push_back(ContentPiece{Bytes(a - lo), Bytes(b - a), p.id, p.base + Bytes(a - p.offset.count())});
    pos = b;
  }
  if (pos < hi) out.push_back(ContentPiece{Bytes(pos - lo), Bytes(hi - pos), 0, Bytes(0)});
  return out;
}

struct Saved {
  TensorId id;
  std::uint32_t tensor;
  Pieces expected;
};

class Trainer {
 public:
  Trainer(const Model& model, const DeviceProfile& profile, const TrainingOptions& options)
      : model_(model),
        options_(options),
        run_{Simulator({DeviceSpec{"gpu0", profile}}, {}, options.sim), {}, std::nullopt, {}, {}, {}, {}, {}},
        compute_(run_.sim.add_stream(DeviceId(0), "compute")),
        device_(run_.sim, DeviceId(0), compute_),
        offloader_(device_, options.offload),
        storage_(model.tensors.size()),
        content_(model.tensors.size()),
        grads_(model.tensors.size()) {
    // An activation's forward reference ends after its last forward use (at once if unused);
    // the loss lives until the graph is freed.
    std::vector<std::int32_t> last_use(model.tensors.size(), -1);
    for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
      for (const std::uint32_t t : model.ops[i].outputs) last_use[base(t)] = std::max<std::int32_t>(last_use[base(t)], static_cast<std::int32_t>(i));
      for (const std::uint32_t t : model.ops[i].inputs) last_use[base(t)] = static_cast<std::int32_t>(i);
    }
    drop_after_.resize(model.ops.size());
    for (std::uint32_t t = 0; t < model.tensors.size(); ++t) {
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.view_of >= 0 || tensor.role != TensorRole::Activation || t == base(model.loss) ||
          last_use[t] < 0) {
        continue;
      }
      drop_after_[static_cast<std::size_t>(last_use[t])].push_back(t);
    }
    needed_ = needed_nodes();
  }

  Result<TrainingRun> run() {
    try {
      setup();
      run_.baseline_allocated = allocated();
      for (std::int32_t step = 0; step < options_.steps && !run_.failure; ++step) this->step();
    } catch (const OffloadError& e) {
      run_.failure = e.what();
    }
    run_.sim.finish();
    if (!options_.sync_each_step && !run_.steps.empty()) run_.steps.back().end = run_.sim.makespan();
    run_.telemetry = offloader_.telemetry();
    return std::move(run_);
  }

 private:
  std::uint32_t base(std::uint32_t t) const {
    const ModelTensor& tensor = model_.tensors[t];
    return tensor.view_of >= 0 ? static_cast<std::uint32_t>(tensor.view_of) : t;
  }

  // Device bytes allocated, less blocks whose free waits behind record_stream markers: those
  // return at the next allocation (as in PyTorch), so they are not held by the step.
  Bytes allocated() const {
    const CachingAllocator& alloc = run_.sim.device_allocator(DeviceId(0));
    Bytes pending;
    for (const BlockInfo& b : alloc.live_blocks()) {
      if (b.state == BlockInfo::State::PendingFree) pending += b.size;
    }
    return alloc.stats().allocated - pending;
  }

  Region region(std::uint32_t t) const {
    const ModelTensor& tensor = model_.tensors[t];
    return Region{storage_[base(t)].id, tensor.view_offset, tensor.bytes};
  }

  Device::Buffer must_allocate(Bytes bytes, const std::string& name) {
    auto buf = device_.allocate(Place::Device, bytes, Device::Stream{compute_}, name);
    if (!buf) throw OffloadError(device_.last_error());
    return *buf;
  }

  // Ops whose backward node runs: those with an output on the path to the loss.
  std::vector<bool> needed_nodes() const {
    std::vector<bool> needed(model_.ops.size(), false);
    std::vector<bool> grad_flows(model_.tensors.size(), false);
    grad_flows[base(model_.loss)] = true;
    for (std::size_t i = model_.ops.size(); i-- > 0;) {
      const ModelOp& op = model_.ops[i];
      for (const std::uint32_t t : op.outputs) needed[i] = needed[i] || grad_flows[base(t)];
      if (!needed[i]) continue;
      for (const std::uint32_t t : op.inputs) {
        const TensorRole role = model_.tensors[base(t)].role;
        if (role == TensorRole::Activation) grad_flows[base(t)] = true;
      }
    }
    return needed;
  }

  void setup() {
    std::vector<Region> writes;
    std::vector<std::uint32_t> written;
    for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
      const ModelTensor& tensor = model_.tensors[t];
      if (tensor.view_of >= 0) continue;
      if (tensor.role == TensorRole::Param || tensor.role == TensorRole::Buffer) {
        storage_[t] = must_allocate(tensor.bytes, tensor.name);
        writes.push_back(region(t));
        written.push_back(t);
        if (tensor.role == TensorRole::Param) {
          param_grads_.emplace(t, must_allocate(tensor.bytes, tensor.name + ".grad"));
        }
      }
    }
    write_kernel(writes, "init parameters", {}, SimTime(1), written);
  }

  // A kernel on the compute stream that writes `writes`, keeping the expected content.
  OpId write_kernel(const std::vector<Region>& writes, const std::string& name,
                    const std::vector<Region>& reads = {}, SimTime duration = SimTime(1),
                    const std::vector<std::uint32_t>& tensors = {}) {
    const OpId k = run_.sim.kernel(compute_, duration, reads, writes, name);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const std::uint32_t t = tensors[i];
      const ModelTensor& tensor = model_.tensors[t];
      overwrite(content_[base(t)], tensor.view_offset.count(),
                (tensor.view_offset + tensor.bytes).count(),
                written_content(k, static_cast<std::uint32_t>(i)));
    }
    return k;
  }

  void step() {
    StepTimes times;
    times.start = run_.sim.host_time();
    forward();
    times.forward_end = run_.sim.host_time();
    const int passes = options_.retain_graph ? 2 : 1;
    for (int pass = 0; pass < passes; ++pass) backward(pass == passes - 1);
    if (options_.sync_each_step) run_.sim.sync_device(DeviceId(0));
    times.end = run_.sim.host_time();
    run_.steps.push_back(times);
    run_.allocated_after.push_back(allocated());
    run_.tracked_after.push_back(offloader_.tracked());
  }

  void forward() {
    // The batch.
    std::vector<Region> batch;
    std::vector<std::uint32_t> batch_tensors;
    for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
      const ModelTensor& tensor = model_.tensors[t];
      if (tensor.role != TensorRole::Input || tensor.view_of >= 0) continue;
      storage_[t] = must_allocate(tensor.bytes, tensor.name);
      content_[t].clear();
      batch.push_back(region(t));
      batch_tensors.push_back(t);
    }
    write_kernel(batch, "load batch", {}, SimTime(1), batch_tensors);

    saved_.assign(model_.ops.size(), {});
    std::vector<Region> reads;
    std::vector<Region> writes;
    for (std::uint32_t i = 0; i < model_.ops.size(); ++i) {
      const ModelOp& op = model_.ops[i];
      if (op.no_offload) offloader_.push_no_offload();
      for (const std::uint32_t t : op.outputs) {
        if (model_.tensors[t].view_of >= 0) continue;
        storage_[t] = must_allocate(model_.tensors[t].bytes, model_.tensors[t].name);
        content_[t].clear();
      }
      reads.clear();
      writes.clear();
      for (const std::uint32_t t : op.inputs) reads.push_back(region(t));
      for (const std::uint32_t t : op.outputs) writes.push_back(region(t));
      write_kernel(writes, op.name, reads, op.duration, op.outputs);
      for (const std::uint32_t t : op.saved) pack(i, t);
      if (op.no_offload) offloader_.pop_no_offload();
      for (const std::uint32_t b : drop_after_[i]) device_.drop(storage_[b]);
    }
  }

  void pack(std::uint32_t node, std::uint32_t t) {
    const ModelTensor& tensor = model_.tensors[t];
    const std::uint32_t b = base(t);
    const ModelTensor& storage = model_.tensors[b];
    TensorFacts facts;
    facts.bytes = tensor.bytes;
    facts.storage_bytes = storage.bytes;
    facts.view_offset = tensor.view_offset;
    facts.storage = storage_[b].id.value();
    facts.on_device = true;
    facts.is_param = storage.role == TensorRole::Param || storage.role == TensorRole::Buffer;
    facts.no_offload = tensor.no_offload;
    facts.node = NodeId(node);
    const TensorId id = offloader_.pack(facts, storage_[b]);
    saved_[node].push_back(Saved{
        id, t,
        slice(content_[b], tensor.view_offset.count(), (tensor.view_offset + tensor.bytes).count())});
  }

  std::vector<std::uint32_t> backward_order() {
    std::vector<std::uint32_t> order;
    if (options_.order_seed == 0) {
      for (std::size_t i = model_.ops.size(); i-- > 0;) {
        if (needed_[i]) order.push_back(static_cast<std::uint32_t>(i));
      }
      return order;
    }
    // A random valid order: a node runs once every needed op reading its outputs has run.
    std::vector<std::int32_t> waiting(model_.ops.size(), 0);
    std::vector<std::vector<std::uint32_t>> producers_of(model_.ops.size());
    std::vector<std::int32_t> producer(model_.tensors.size(), -1);
    for (std::uint32_t i = 0; i < model_.ops.size(); ++i) {
      for (const std::uint32_t t : model_.ops[i].outputs) producer[base(t)] = static_cast<std::int32_t>(i);
    }
    for (std::uint32_t j = 0; j < model_.ops.size(); ++j) {
      if (!needed_[j]) continue;
      std::vector<std::uint32_t> seen;
      for (const std::uint32_t t : model_.ops[j].inputs) {
        const std::int32_t p = producer[base(t)];
        if (p < 0 || static_cast<std::uint32_t>(p) == j || !needed_[static_cast<std::size_t>(p)]) continue;
        const auto up = static_cast<std::uint32_t>(p);
        if (std::find(seen.begin(), seen.end(), up) != seen.end()) continue;
        seen.push_back(up);
        ++waiting[up];
        producers_of[j].push_back(up);
      }
    }
    std::mt19937_64 rng(options_.order_seed);
    std::vector<std::uint32_t> ready;
    for (std::uint32_t i = 0; i < model_.ops.size(); ++i) {
      if (needed_[i] && waiting[i] == 0) ready.push_back(i);
    }
    while (!ready.empty()) {
      const std::size_t pick = static_cast<std::size_t>(rng() % ready.size());
      const std::uint32_t n = ready[pick];
      ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(pick));
      order.push_back(n);
      for (const std::uint32_t up : producers_of[n]) {
        if (--waiting[up] == 0) ready.push_back(up);
      }
    }
    return order;
  }

  Device::Buffer& grad(std::uint32_t t) {
    const std::uint32_t b = base(t);
    if (!grads_[b]) grads_[b] = must_allocate(model_.tensors[b].bytes, model_.tensors[b].name + ".grad");
    return *grads_[b];
  }

  void backward(bool last_pass) {
    const std::vector<std::uint32_t> order = backward_order();
    run_.backward_order = order;
    std::vector<NodeId> nodes;
    for (const std::uint32_t n : order) nodes.push_back(NodeId(n));
    offloader_.backward_begin(options_.announce_order ? std::span<const NodeId>(nodes)
                                                      : std::span<const NodeId>());
    // d(loss)/d(loss)
    const std::uint32_t loss = base(model_.loss);
    write_kernel({Region{grad(loss).id, Bytes(0), model_.tensors[loss].bytes}}, "loss grad");

    std::optional<Device::Buffer> escaped;
    std::vector<Region> reads;
    std::vector<Region> writes;
    std::vector<Device::Buffer> unpacked;
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::uint32_t n = order[k];
      const ModelOp& op = model_.ops[n];
      reads.clear();
      writes.clear();
      unpacked.clear();
      for (const Saved& s : saved_[n]) {
        auto u = offloader_.unpack(s.id, NodeId(n));
        if (options_.unpack_twice) {
          auto again = offloader_.unpack(s.id, NodeId(n));
          device_.drop(again.storage);
        }
        const Region r{u.storage.id, u.offset, model_.tensors[s.tensor].bytes};
        run_.sim.expect_content_at_next_kernel(r, s.expected);
        reads.push_back(r);
        unpacked.push_back(u.storage);
      }
      if (escaped) reads.push_back(Region{escaped->id, Bytes(0), Bytes(1)});
      for (const std::uint32_t t : op.outputs) {
        const std::uint32_t b = base(t);
        if (grads_[b]) reads.push_back(Region{grads_[b]->id, Bytes(0), model_.tensors[b].bytes});
      }
      for (const std::uint32_t t : op.inputs) {
        const std::uint32_t b = base(t);
        const TensorRole role = model_.tensors[b].role;
        if (role == TensorRole::Activation) {
          writes.push_back(Region{grad(b).id, Bytes(0), model_.tensors[b].bytes});
        } else if (role == TensorRole::Param) {
          writes.push_back(Region{param_grads_.at(b).id, Bytes(0), model_.tensors[b].bytes});
        }
      }
      std::sort(writes.begin(), writes.end(), [](const Region& a, const Region& b) {
        return a.buffer < b.buffer;
      });
      writes.erase(std::unique(writes.begin(), writes.end(),
                               [](const Region& a, const Region& b) { return a.buffer == b.buffer; }),
                   writes.end());
      run_.sim.kernel(compute_, op.backward_duration, reads, writes, op.name + " backward");
      if (escaped) {
        device_.drop(*escaped);
        escaped.reset();
      }
      const bool escape = options_.escape_period > 0 && !unpacked.empty() &&
                          k % static_cast<std::size_t>(options_.escape_period) == 0;
      for (std::size_t u = 0; u < unpacked.size(); ++u) {
        if (escape && u == 0) {
          escaped = unpacked[u];  // a view of it lives on into the next node
        } else {
          device_.drop(unpacked[u]);
        }
      }
      for (const std::uint32_t t : op.outputs) {
        const std::uint32_t b = base(t);
        if (grads_[b]) {
          device_.drop(*grads_[b]);
          grads_[b].reset();
        }
      }
      offloader_.node_done(NodeId(n));
      if (last_pass) {
        for (const Saved& s : saved_[n]) offloader_.release(s.id);
      }
    }
    if (escaped) device_.drop(*escaped);
    offloader_.backward_end();
    for (auto& g : grads_) {
      if (g) {
        device_.drop(*g);
        g.reset();
      }
    }
    if (!last_pass) return;
    // The graph is freed: saved tensors of nodes that never ran go too.
    for (std::uint32_t n = 0; n < saved_.size(); ++n) {
      if (needed_[n]) continue;
      for (const Saved& s : saved_[n]) offloader_.release(s.id);
    }
    // The loss and the batch are dropped with the graph.
    device_.drop(storage_[base(model_.loss)]);
    for (std::uint32_t t = 0; t < model_.tensors.size(); ++t) {
      const ModelTensor& tensor = model_.tensors[t];
      if (tensor.role == TensorRole::Input && tensor.view_of < 0) device_.drop(storage_[t]);
    }
  }

  const Model& model_;
  const TrainingOptions& options_;
  TrainingRun run_;
  StreamId compute_;
  Device device_;
  Offloader<Device> offloader_;
  std::vector<Device::Buffer> storage_;       // by base tensor
  std::vector<Pieces> content_;               // by base tensor: what forward wrote where
  std::vector<std::optional<Device::Buffer>> grads_;
  std::map<std::uint32_t, Device::Buffer> param_grads_;
  std::vector<std::vector<std::uint32_t>> drop_after_;  // by op: storages whose forward use ends
  std::vector<bool> needed_;
  std::vector<std::vector<Saved>> saved_;
};

}  // namespace

Result<TrainingRun> simulate_training(const Model& model, const DeviceProfile& device,
                                      const TrainingOptions& options) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  Trainer trainer(model, device, options);
  return trainer.run();
}

SimTime compute_stall(const Simulator& sim, StreamId compute, SimTime from, SimTime to) {
  std::int64_t stall = 0;
  std::int64_t last_end = 0;
  for (const OpRecord& r : sim.ops()) {
    if (r.stream != compute) continue;
    if (r.kind == OpKind::Kernel) {
      last_end = r.end.ns();
    } else if (r.kind == OpKind::Wait) {
      const std::int64_t ready = std::max(r.issued.ns(), last_end);
      if (r.end.ns() > ready && r.issued >= from && r.issued < to) stall += r.end.ns() - ready;
      last_end = std::max(last_end, r.end.ns());
    }
  }
  return SimTime(stall);
}

std::int64_t copy_overlap_permille(const Simulator& sim) {
  std::vector<std::pair<std::int64_t, std::int64_t>> kernels;
  std::vector<std::pair<std::int64_t, std::int64_t>> copies;
  for (const OpRecord& r : sim.ops()) {
    if (r.end <= r.start) continue;
    if (r.kind == OpKind::Kernel) kernels.emplace_back(r.start.ns(), r.end.ns());
    if (r.kind == OpKind::Copy) copies.emplace_back(r.start.ns(), r.end.ns());
  }
  std::sort(kernels.begin(), kernels.end());
  // Kernels of one device never overlap each other (one compute engine).
  std::int64_t total = 0;
  std::int64_t overlapped = 0;
  for (const auto& [lo, hi] : copies) {
    total += hi - lo;
    auto it = std::lower_bound(kernels.begin(), kernels.end(), std::make_pair(lo, std::int64_t{0}));
    if (it != kernels.begin()) --it;
    for (; it != kernels.end() && it->first < hi; ++it) {
      overlapped += std::max<std::int64_t>(0, std::min(hi, it->second) - std::max(lo, it->first));
    }
  }
  return total == 0 ? 0 : overlapped * 1000 / total;
}

}  // namespace ferry::sim
