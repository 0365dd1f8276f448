#include <algorithm>
#include <set>
#include <vector>

#include "ferry/sim/runs/horizon.hpp"

namespace ferry::sim {

// Note [Deriving the offload horizon]
// The ferry policy's horizon (Note [Offload horizon] in ferry_policy.hpp) from a model and a
// device: the forward is laid out op after op at the ops' roofline durations (no launch
// overhead, no stall), and every storage the policy would copy (in pack order: a region's
// inputs when the region starts, an op's saved tensors when it ends, the outputs a region
// offloads; parameters, buffers, tensors under `min_bytes`, no-offload ops and ops a plan keeps
// left out; a storage copied once) is queued on the device-to-host link behind the copies
// before it, at the profile's bandwidth and latency. A copy is hidden when it ends before
// backward needs the tensor: the forward's end plus the backward work of every later op (and
// the recomputation of every later region). Copies end later and later, and backward needs
// the tensors sooner and sooner, so the hidden ones are a prefix: the horizon is the bytes
// copied by the ops before the first op with a copy that is not hidden (none when every copy
// is hidden). The forward window's stalls are left out; they only lengthen forward and give
// copies more time, so the horizon errs on the side of keeping.

namespace {

// 128-bit products of bytes and nanoseconds.
__extension__ using Wide = __int128;

struct RegionSpan {
  std::uint32_t first = 0;
  std::uint32_t end = 0;
  bool offload_inputs = false;
};

std::uint32_t base_of(const Model& model, std::uint32_t t) {
  while (model.tensors[t].view_of >= 0) t = static_cast<std::uint32_t>(model.tensors[t].view_of);
  return t;
}

// What the region's ops read from before it (the trainer's region inputs).
std::vector<std::uint32_t> region_inputs(const Model& model, const RegionSpan& r) {
  std::vector<std::uint32_t> inputs;
  std::vector<std::uint32_t> produced;
  for (std::uint32_t i = r.first; i < r.end; ++i) {
    for (const std::uint32_t t : model.ops[i].inputs) {
      if (is_resident(model.tensors[base_of(model, t)].role)) continue;
      if (std::find(produced.begin(), produced.end(), t) != produced.end()) continue;
      if (std::find(inputs.begin(), inputs.end(), t) == inputs.end()) inputs.push_back(t);
    }
    for (const std::uint32_t t : model.ops[i].outputs) produced.push_back(t);
  }
  return inputs;
}

// The checkpoint regions of `options`: each one's span, and each op's outermost non-reentrant
// region (-1: none).
struct Regions {
  std::vector<RegionSpan> spans;
  std::vector<std::int32_t> of_op;
};

Regions outermost_regions(const TrainingOptions& options, std::uint32_t n) {
  const CheckpointPlan& plan = options.checkpoint;
  Regions out{{}, std::vector<std::int32_t>(n, -1)};
  for (std::size_t r = 0; r < plan.regions.size(); ++r) {
    const CheckpointRegion& reg = plan.regions[r];
    const auto& chosen = options.offload_selection.region_inputs;
    out.spans.push_back(RegionSpan{reg.first_op, reg.end_op, r >= chosen.size() || chosen[r]});
    if (reg.reentrant) continue;
    for (std::uint32_t i = reg.first_op; i < reg.end_op && i < n; ++i) {
      if (out.of_op[i] < 0) out.of_op[i] = static_cast<std::int32_t>(r);
    }
  }
  return out;
}

// The forward laid out op after op: when each op ends, and the backward work after it (the
// later ops' backward, and their recomputation inside a region).
struct Timeline {
  std::vector<std::int64_t> end;
  std::vector<std::int64_t> after;
  std::int64_t forward = 0;
};

Timeline lay_out(const Model& model, const CheckpointPlan& plan,
                 const std::vector<std::int32_t>& region) {
  const auto n = static_cast<std::uint32_t>(model.ops.size());
  Timeline tl{std::vector<std::int64_t>(n), std::vector<std::int64_t>(n, 0), 0};
  for (std::uint32_t i = 0; i < n; ++i) {
    tl.forward += model.ops[i].duration.ns();
    tl.end[i] = tl.forward;
  }
  for (std::uint32_t i = n - 1; i-- > 0;) {
    const std::uint32_t j = i + 1;
    std::int64_t work = model.ops[j].backward_duration.ns();
    const bool recomputed =
        j >= plan.op_policy.size() || plan.op_policy[j] == OpPolicy::PreferRecompute;
    if (region[j] >= 0 && recomputed) work += model.ops[j].duration.ns();
    tl.after[i] = tl.after[j] + work;
  }
  return tl;
}

// The device-to-host link, copying the storages the policy would copy, each once, in order.
class LinkQueue {
 public:
  LinkQueue(const Model& model, const DeviceProfile& device, Bytes min_bytes)
      : model_(model),
        bandwidth_(std::max<std::int64_t>(1, device.d2h.bandwidth.bytes_per_s())),
        latency_(device.d2h.latency.ns()),
        min_bytes_(min_bytes) {}

  // Queues `tensor`'s storage at `at`; whether its copy ends by `need` (true for what the
  // policy does not copy).
  bool queue(std::uint32_t tensor, std::int64_t at, std::int64_t need) {
    const std::uint32_t b = base_of(model_, tensor);
    const ModelTensor& storage = model_.tensors[b];
    if (is_resident(storage.role)) return true;
    if (model_.tensors[tensor].no_offload) return true;
    if (model_.tensors[tensor].bytes < min_bytes_) return true;
    if (!copied_.insert(b).second) return true;
    const Wide copy = static_cast<Wide>(storage.bytes.count()) * 1'000'000'000 / bandwidth_;
    const std::int64_t done = std::max(at, link_free_) + latency_ + static_cast<std::int64_t>(copy);
    link_free_ = done;
    total_ += storage.bytes;
    return done <= need;
  }

  // The bytes queued so far.
  [[nodiscard]] Bytes total() const { return total_; }

 private:
  const Model& model_;
  std::int64_t bandwidth_;
  std::int64_t latency_;
  Bytes min_bytes_;
  std::set<std::uint32_t> copied_;
  std::int64_t link_free_ = 0;
  Bytes total_;
};

}  // namespace

std::optional<Bytes> offload_horizon(const Model& model, const DeviceProfile& device,
                                     const TrainingOptions& options) {
  if (options.offload.policy != Policy::Ferry || model.ops.empty()) return std::nullopt;
  const auto n = static_cast<std::uint32_t>(model.ops.size());
  const CheckpointPlan& plan = options.checkpoint;
  const Regions regions = outermost_regions(options, n);
  const std::vector<std::int32_t>& region = regions.of_op;
  const Timeline tl = lay_out(model, plan, region);
  LinkQueue link(model, device, options.offload.min_bytes);
  Bytes horizon;
  for (std::uint32_t i = 0; i < n; ++i) {
    const ModelOp& op = model.ops[i];
    bool hidden = true;
    for (std::size_t k = 0; k < regions.spans.size(); ++k) {
      // The inputs of a region inside another go to the outer region, not to the offloader.
      const RegionSpan& r = regions.spans[k];
      if (r.first != i || region[i] != static_cast<std::int32_t>(k) || !r.offload_inputs) {
        continue;
      }
      for (const std::uint32_t in : region_inputs(model, r)) {
        hidden =
            link.queue(in, i > 0 ? tl.end[i - 1] : 0, tl.forward + tl.after[r.end - 1]) && hidden;
      }
    }
    const auto& chosen = options.offload_selection.ops;
    const bool selected = !op.no_offload && (i >= chosen.size() || chosen[i]);
    const bool offloaded_output =
        i < plan.op_policy.size() && plan.op_policy[i] == OpPolicy::Offload;
    if (region[i] < 0 && selected) {
      for (const std::uint32_t s : op.saved) {
        hidden = link.queue(s, tl.end[i], tl.forward + tl.after[i]) && hidden;
      }
    } else if (region[i] >= 0 && selected && offloaded_output) {
      const RegionSpan& r = regions.spans[static_cast<std::size_t>(region[i])];
      for (const std::uint32_t o : op.outputs) {
        if (model.tensors[o].view_of < 0) {
          hidden = link.queue(o, tl.end[i], tl.forward + tl.after[r.end - 1]) && hidden;
        }
      }
    }
    if (!hidden) return horizon;
    horizon = link.total();
  }
  return std::nullopt;  // every copy is hidden: no limit
}

}  // namespace ferry::sim
