#include "ferry/sim/planner/bound.hpp"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

#include "ferry/sim/planner/lower.hpp"
#include "tensors.hpp"

namespace ferry::sim {

namespace {

using planning::base_of;
using planning::Wide;

// Note [What the link can carry in forward]
// The bytes of saved activations the device-to-host link can copy before the forward pass
// ends. A storage can be copied only once the op that first saves it has run: with the ops laid
// out at their roofline durations (no launch overhead, so every release is as early as it can
// be), each storage that could be offloaded (an activation, not in a no-offload region) joins
// the link's queue when its op ends. The link works whenever something is queued, at the
// profile's bandwidth, with no latency; the bytes it has copied by the measured forward time
// `forward` are the same in any order (a busy link does the same work whatever it copies),
// and a copy under way counts for its part done. Before, the bound let the link carry its
// bandwidth times the whole forward, including the time before anything was saved and the
// bytes saved in the last instants.
Wide carried_in_forward(const Model& model, const DeviceProfile& device, SimTime forward) {
  const Wide bandwidth = std::max<std::int64_t>(1, device.d2h.bandwidth.bytes_per_s());
  std::set<std::uint32_t> queued;
  Wide carried = 0;
  Wide link_free = 0;  // in ns
  std::int64_t t = 0;
  for (const ModelOp& op : model.ops) {
    t += op.duration.ns();
    if (t >= forward.ns()) break;
    if (op.no_offload) continue;
    for (const std::uint32_t saved : op.saved) {
      const std::uint32_t b = base_of(model, saved);
      if (!planning::is_activation(model, saved) || model.tensors[saved].no_offload) continue;
      if (!queued.insert(b).second) continue;
      const Wide bytes = model.tensors[b].bytes.count();
      const Wide start = std::max<Wide>(link_free, t);
      const Wide room = (static_cast<Wide>(forward.ns()) - start) * bandwidth / 1'000'000'000;
      carried += std::min(bytes, std::max<Wide>(room, 0));
      link_free = start + bytes * 1'000'000'000 / bandwidth;
    }
  }
  return carried;
}

// Note [The bytes a plan must free]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A plan fits when its reserved peak is within the budget, and its allocated peak is at most its
// reserved one; so a plan that fits frees at least the no-offload allocated peak less the budget
// at that peak's moment. The reserved peak is no measure of it: the caching allocator's rounding
// and segment reuse let a plan's reserved peak fall by more than the bytes it frees: on the
// traced Mixtral (two layers, a100-pcie4) a plan fits 1.14 GB under the no-offload reserved
// peak at the no-offload step time, the allocated peak (31.66 GB) being under that budget
// already (tests/prop/plan_options_prop.cpp holds every plan at or above the bound, and at or
// above the options bound where it is a plan of options).
Bytes must_free(const RowResult& none, Bytes budget) { return none.peak_allocated - budget; }

}  // namespace

SimTime step_lower_bound(const Model& model, const DeviceProfile& device, const RowResult& none,
                         Bytes budget) {
  return step_lower_bound(planning::find_layers(model), model, device, none, budget);
}

SimTime step_lower_bound(const std::vector<planning::Layer>& layers, const Model& model,
                         const DeviceProfile& device, const RowResult& none, Bytes budget) {
  // Note [The bytes a plan must free]
  const Bytes excess = must_free(none, budget);
  if (excess <= Bytes(0)) return none.step_time;
  // Note [What the link can carry in forward]
  Wide left =
      static_cast<Wide>(excess.count()) - carried_in_forward(model, device, none.forward_time);
  if (left <= 0) return none.step_time;
  // The rest is recomputed, the ops that free the most bytes per ns first (fractionally), or
  // carried by a forward made longer for the link, at its bandwidth's cost per byte, whichever
  // is cheaper.
  std::vector<std::pair<Bytes, SimTime>> items;
  for (const planning::Layer& layer : layers) {
    for (std::uint32_t p = layer.first; p < layer.end; ++p) {
      const Bytes freed = planning::freed_by(model, p, layer.first, layer.end);
      if (freed > Bytes(0)) items.emplace_back(freed, model.ops[p].duration);
    }
  }
  // A forward lengthened by a ns lets the link carry bandwidth / 1e9 bytes more: an item as
  // large as whatever is left, priced per byte as the link is.
  const std::int64_t bandwidth = std::max<std::int64_t>(1, device.d2h.bandwidth.bytes_per_s());
  const Bytes all(static_cast<std::int64_t>(left));
  items.emplace_back(all, SimTime(static_cast<std::int64_t>(left * 1'000'000'000 / bandwidth)));
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
    return static_cast<Wide>(a.first.count()) * std::max<std::int64_t>(1, b.second.ns()) >
           static_cast<Wide>(b.first.count()) * std::max<std::int64_t>(1, a.second.ns());
  });
  std::int64_t extra = 0;
  for (const auto& [freed, time] : items) {
    if (left <= 0) break;
    if (left >= freed.count()) {
      extra += time.ns();
      left -= freed.count();
    } else {
      extra += static_cast<std::int64_t>(left * time.ns() / freed.count());
      left = 0;
    }
  }
  return none.step_time + SimTime(extra);
}

std::vector<std::vector<std::vector<std::uint32_t>>> option_recompute_sets(
    const planning::PlanSpace& space) {
  const std::vector<planning::Layer>& layers = space.layers();
  std::vector<std::vector<std::vector<std::uint32_t>>> out(layers.size());
  // One plan of every layer at its first configuration (as plan_of makes it), each layer's
  // options set in it in turn: a layer's ops and region depend on its own configuration only.
  Plan plan = space.kept();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const planning::Layer& layer = layers[l];
    std::set<std::vector<std::uint32_t>> distinct;
    // Offloaded or not: an offloaded layer's ops after its replay's end are served, not
    // recomputed (Note [What a replay never reaches ranks first] in space.cpp).
    for (std::size_t k = 0; k < layer.levels.size(); ++k) {
      for (std::size_t t = 0; t < layer.tails.size(); ++t) {
        for (const bool offload : {false, true}) {
          if (space.configure_layer(plan, l, planning::LayerConfig{k, offload, t})) {
            recompute_random_prefix(plan, space.model(), plan.regions.back());
            plan.regions.pop_back();
          }
          std::vector<std::uint32_t> ops;
          for (std::uint32_t i = layer.first; i < layer.end; ++i) {
            if (plan.ops[i].saved == SavedDecision::Recompute) ops.push_back(i);
          }
          distinct.insert(std::move(ops));
        }
      }
    }
    for (std::uint32_t i = layer.first; i < layer.end; ++i) {
      plan.ops[i].saved = space.kept().ops[i].saved;
    }
    out[l].assign(distinct.begin(), distinct.end());
  }
  return out;
}

SimTime options_lower_bound(const planning::PlanSpace& space,
                            const std::vector<std::vector<std::vector<std::uint32_t>>>& sets,
                            const DeviceProfile& device, const RowResult& none, Bytes budget) {
  const Model& model = space.model();
  const SimTime fractional = step_lower_bound(space.layers(), model, device, none, budget);
  const Bytes excess = must_free(none, budget);
  if (excess <= Bytes(0)) return fractional;
  const Wide left_wide =
      static_cast<Wide>(excess.count()) - carried_in_forward(model, device, none.forward_time);
  if (left_wide <= 0) return fractional;
  const auto left = static_cast<std::int64_t>(left_wide);
  // Freed bytes in units of at most 1/1024 of what is left, rounded up: optimistic, so the
  // minimum stays a lower bound.
  constexpr std::int64_t kUnits = 1024;
  const std::int64_t unit = std::max<std::int64_t>(1, (left + kUnits - 1) / kUnits);
  const std::int64_t need = (left + unit - 1) / unit;
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> best(static_cast<std::size_t>(need + 1), kNone);
  best[0] = 0;
  const std::vector<planning::Layer>& layers = space.layers();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::vector<std::int64_t> next(best.size(), kNone);
    // Ops the replay never reaches cost nothing (Note [A replay ends before the op it no
    // longer needs]).
    const std::uint32_t reached = layers[l].replayed_end;
    for (const std::vector<std::uint32_t>& ops : sets[l]) {
      std::int64_t time = 0;
      std::int64_t freed = 0;
      for (const std::uint32_t p : ops) {
        if (p < reached) time += model.ops[p].duration.ns();
        freed += planning::freed_by(model, p, layers[l].first, layers[l].end).count();
      }
      const std::int64_t units = (freed + unit - 1) / unit;
      for (std::int64_t m = 0; m <= need; ++m) {
        if (best[static_cast<std::size_t>(m)] == kNone) continue;
        const auto to = static_cast<std::size_t>(std::min(need, m + units));
        next[to] = std::min(next[to], best[static_cast<std::size_t>(m)] + time);
      }
    }
    best = std::move(next);
  }
  // What the options leave, carried by a forward made longer for the link.
  const std::int64_t bandwidth = std::max<std::int64_t>(1, device.d2h.bandwidth.bytes_per_s());
  std::int64_t extra = kNone;
  for (std::int64_t m = 0; m <= need; ++m) {
    if (best[static_cast<std::size_t>(m)] == kNone) continue;
    const std::int64_t rest = std::max<std::int64_t>(0, left - m * unit);
    extra = std::min(
        extra, best[static_cast<std::size_t>(m)] +
                   static_cast<std::int64_t>(static_cast<Wide>(rest) * 1'000'000'000 / bandwidth));
  }
  if (extra == kNone) return fractional;
  return std::max(fractional, none.step_time + SimTime(extra));
}

bool in_option_space(const planning::PlanSpace& space,
                     const std::vector<std::vector<std::vector<std::uint32_t>>>& sets,
                     const Plan& plan) {
  const std::vector<planning::Layer>& layers = space.layers();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::vector<std::uint32_t> ops;
    for (std::uint32_t i = layers[l].first; i < layers[l].end; ++i) {
      if (plan.ops[i].saved == SavedDecision::Recompute) ops.push_back(i);
    }
    if (std::find(sets[l].begin(), sets[l].end(), ops) == sets[l].end()) return false;
  }
  return true;
}

}  // namespace ferry::sim
