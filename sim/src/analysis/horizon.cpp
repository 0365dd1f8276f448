#include <algorithm>
#include <set>
#include <vector>

#include "ferry/sim/analysis/horizon.hpp"

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
      const TensorRole role = model.tensors[base_of(model, t)].role;
      if (role == TensorRole::Param || role == TensorRole::Buffer) continue;
      if (std::find(produced.begin(), produced.end(), t) != produced.end()) continue;
      if (std::find(inputs.begin(), inputs.end(), t) == inputs.end()) inputs.push_back(t);
    }
    for (const std::uint32_t t : model.ops[i].outputs) produced.push_back(t);
  }
  return inputs;
}

}  // namespace

std::optional<Bytes> offload_horizon(const Model& model, const DeviceProfile& device,
                                     const TrainingOptions& options) {
  if (options.offload.policy != Policy::Ferry || model.ops.empty()) return std::nullopt;
  const auto n = static_cast<std::uint32_t>(model.ops.size());
  const CheckpointPlan& plan = options.checkpoint;
  // The outermost non-reentrant region of each op (-1: none).
  std::vector<std::int32_t> region(n, -1);
  std::vector<RegionSpan> spans;
  for (std::size_t r = 0; r < plan.regions.size(); ++r) {
    const CheckpointRegion& reg = plan.regions[r];
    const auto& chosen = options.offload_selection.region_inputs;
    spans.push_back(RegionSpan{reg.first_op, reg.end_op, r >= chosen.size() || chosen[r]});
    if (reg.reentrant) continue;
    for (std::uint32_t i = reg.first_op; i < reg.end_op && i < n; ++i) {
      if (region[i] < 0) region[i] = static_cast<std::int32_t>(r);
    }
  }
  auto policy = [&](std::uint32_t i) {
    return i < plan.op_policy.size() ? plan.op_policy[i] : OpPolicy::PreferRecompute;
  };
  // When each op ends in forward, and the backward work after it.
  std::vector<std::int64_t> end(n);
  std::int64_t t = 0;
  for (std::uint32_t i = 0; i < n; ++i) {
    t += model.ops[i].duration.ns();
    end[i] = t;
  }
  const std::int64_t forward = t;
  std::vector<std::int64_t> after(n, 0);
  for (std::uint32_t i = n - 1; i-- > 0;) {
    const std::uint32_t j = i + 1;
    std::int64_t work = model.ops[j].backward_duration.ns();
    if (region[j] >= 0 && policy(j) == OpPolicy::PreferRecompute)
      work += model.ops[j].duration.ns();
    after[i] = after[j] + work;
  }

  const std::int64_t bandwidth = std::max<std::int64_t>(1, device.d2h.bandwidth.bytes_per_s());
  const std::int64_t latency = device.d2h.latency.ns();
  std::set<std::uint32_t> copied;
  std::int64_t link_free = 0;
  Bytes total;
  Bytes horizon;
  // Queues `t`'s storage at `at`; whether its copy ends by `need`.
  auto queue = [&](std::uint32_t tensor, std::int64_t at, std::int64_t need) {
    const std::uint32_t b = base_of(model, tensor);
    const ModelTensor& storage = model.tensors[b];
    if (storage.role == TensorRole::Param || storage.role == TensorRole::Buffer) return true;
    if (model.tensors[tensor].no_offload) return true;
    if (model.tensors[tensor].bytes < options.offload.min_bytes) return true;
    if (!copied.insert(b).second) return true;
    const Wide copy = static_cast<Wide>(storage.bytes.count()) * 1'000'000'000 / bandwidth;
    const std::int64_t done = std::max(at, link_free) + latency + static_cast<std::int64_t>(copy);
    link_free = done;
    total += storage.bytes;
    return done <= need;
  };
  for (std::uint32_t i = 0; i < n; ++i) {
    const ModelOp& op = model.ops[i];
    bool hidden = true;
    for (std::size_t k = 0; k < spans.size(); ++k) {
      // The inputs of a region inside another go to the outer region, not to the offloader.
      const RegionSpan& r = spans[k];
      if (r.first != i || region[i] != static_cast<std::int32_t>(k) || !r.offload_inputs) {
        continue;
      }
      for (const std::uint32_t in : region_inputs(model, r)) {
        hidden = queue(in, i > 0 ? end[i - 1] : 0, forward + after[r.end - 1]) && hidden;
      }
    }
    const auto& chosen = options.offload_selection.ops;
    const bool selected = !op.no_offload && (i >= chosen.size() || chosen[i]);
    if (region[i] < 0 && selected) {
      for (const std::uint32_t s : op.saved)
        hidden = queue(s, end[i], forward + after[i]) && hidden;
    } else if (region[i] >= 0 && selected && policy(i) == OpPolicy::Offload) {
      const RegionSpan& r = spans[static_cast<std::size_t>(region[i])];
      for (const std::uint32_t o : op.outputs) {
        if (model.tensors[o].view_of < 0) {
          hidden = queue(o, end[i], forward + after[r.end - 1]) && hidden;
        }
      }
    }
    if (!hidden) return horizon;
    horizon = total;
  }
  return std::nullopt;  // every copy is hidden: no limit
}

}  // namespace ferry::sim
