#include "ferry/sim/analysis/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "ferry/check.hpp"
#include "planner_model.hpp"

namespace ferry::sim {

namespace {

using planning::base_of;

// 128-bit products of bytes and nanoseconds.
__extension__ using Wide = __int128;

// Note [Planner search]
// A plan is searched for per transformer layer. A layer's configuration is a recompute level
// k (the first k ops of the layer's recompute ranking are re-run in backward inside a
// checkpoint region over the layer; k = 0: no region) and an offload flag (the saved tensors
// the layer keeps, and the region's inputs, go to pinned host memory instead). The ranking
// puts first the ops that free the most saved bytes per nanosecond of recompute, so a low level
// re-runs the cheap elementwise ops (norms, activations) and the top level is plain
// checkpointing. The search is greedy with the simulator as the cost model: from everything
// kept, each round simulates two moves (recompute one level more on the layers with the lowest
// level, the last of them first; offload the earliest layers not offloaded, since their copies
// have the most forward time left to hide behind and are reloaded last) and takes the one that
// costs the least step time per byte of peak reserved memory it frees. A move spans several
// layers while the budget is far away (how many from the saving per layer the last move of its
// kind measured), one layer near it. Uniform plans (every layer at one level, the last layers
// offloaded) are searched too. A local search over classes of layers with the same
// configuration runs from where the greedy ended, and again from the best uniform plan when
// that is faster; the knob variants of `ferry compare` are tried on its result. The fixed
// configurations of `ferry compare` expressible as plans are candidates too, so the plan is
// never slower than the best of them that fits. docs/plan.md has the whole method.

struct Layer {
  std::int32_t layer = -1;
  std::uint32_t first = 0;
  std::uint32_t end = 0;
  std::vector<std::uint32_t> ranking;  // op indices, best bytes freed per ns first
};

struct LayerConfig {
  std::size_t level = 0;  // ops of the ranking recomputed; 0: no region
  bool offload = false;
  friend bool operator==(const LayerConfig&, const LayerConfig&) = default;
};

struct Sample {
  bool ok = false;  // completed without failure
  SimTime time;
  Bytes reserved;
  Bytes pinned;
};

Bytes freed_by(const Model& model, std::uint32_t p, std::uint32_t first, std::uint32_t end) {
  std::set<std::uint32_t> saved;
  for (std::uint32_t j = first; j < end; ++j) {
    for (const std::uint32_t t : model.ops[j].saved) saved.insert(base_of(model, t));
  }
  Bytes bytes;
  for (const std::uint32_t t : model.ops[p].outputs) {
    if (model.tensors[t].view_of < 0 && saved.contains(t)) bytes += model.tensors[t].bytes;
  }
  return bytes;
}

std::vector<Layer> find_layers(const Model& model) {
  std::vector<Layer> layers;
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    const std::int32_t l = model.ops[i].layer;
    if (l < 0 || model.ops[i].no_offload) continue;
    if (layers.empty() || layers.back().layer != l || layers.back().end != i) {
      layers.push_back(Layer{l, i, i + 1, {}});
    } else {
      layers.back().end = i + 1;
    }
  }
  for (Layer& layer : layers) {
    std::vector<std::pair<std::uint32_t, Bytes>> scored;
    for (std::uint32_t p = layer.first; p < layer.end; ++p) {
      scored.emplace_back(p, freed_by(model, p, layer.first, layer.end));
    }
    // Bytes freed per ns, compared exactly (cross-multiplied); ties by op order.
    std::stable_sort(scored.begin(), scored.end(), [&](const auto& a, const auto& b) {
      const Wide lhs = static_cast<Wide>(a.second.count()) *
                       std::max<std::int64_t>(1, model.ops[b.first].duration.ns());
      const Wide rhs = static_cast<Wide>(b.second.count()) *
                       std::max<std::int64_t>(1, model.ops[a.first].duration.ns());
      return lhs > rhs;
    });
    for (const auto& [p, bytes] : scored) layer.ranking.push_back(p);
  }
  return layers;
}

class Search {
 public:
  Search(const Model& model, const DeviceProfile& device, const PlannerOptions& options)
      : model_(model), device_(device), options_(options), layers_(find_layers(model)) {
    roomy_ = device;
    roomy_.memory = Bytes(std::max(device.memory, options.budget).count() * 8);
    base_.steps = options.steps;
    base_.sim.check_hazards = false;
    base_.sim.track_content = false;
  }

  const std::vector<Layer>& layers() const { return layers_; }

  /// The plan of per-layer configurations; `offload_outside`: the ops outside the layers offload
  /// too (as the fixed ferry configurations do), else they keep.
  Plan plan_of(const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
               bool offload_outside = false) const {
    Plan plan = keep_everything_plan(model_, device_);
    plan.budget = options_.budget;
    plan.host_budget = options_.host_budget;
    plan.knobs = knobs;
    if (offload_outside) {
      for (PlanOp& op : plan.ops) op.saved = SavedDecision::Offload;
    }
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      const LayerConfig& c = configs[l];
      const SavedDecision stored = c.offload ? SavedDecision::Offload : SavedDecision::Keep;
      for (std::uint32_t i = layer.first; i < layer.end; ++i) plan.ops[i].saved = stored;
      if (c.level == 0) continue;
      for (std::size_t k = 0; k < c.level && k < layer.ranking.size(); ++k) {
        plan.ops[layer.ranking[k]].saved = SavedDecision::Recompute;
      }
      plan.regions.push_back(PlanRegion{layer.first, layer.end, stored});
    }
    recompute_random_prefix(plan, model_);
    return plan;
  }

  Sample evaluate(const Plan& plan) {
    ++simulations_;
    auto options = plan_training_options(plan, model_, base_);
    FERRY_CHECK(options.ok(), "planner built an invalid plan: {}", options.error().message);
    auto run = simulate_training(model_, roomy_, options.value());
    Sample s;
    if (!run.ok() || run.value().failure || run.value().steps.empty()) return s;
    const TrainingRun& r = run.value();
    s.ok = true;
    s.time = r.steps.back().end - r.steps.back().start;
    s.reserved = r.sim.device_allocator(r.device).stats().reserved_peak;
    s.pinned = r.sim.pinned_allocator().stats().reserved_peak;
    floor_ = std::min(floor_, s.reserved);
    return s;
  }

  bool fits(const Sample& s) const {
    return s.ok && s.reserved <= options_.budget &&
           (!options_.host_budget || s.pinned <= *options_.host_budget);
  }

  std::int64_t simulations() const { return simulations_; }
  /// The smallest peak reserved of every completed simulation so far.
  Bytes floor() const { return floor_; }

 private:
  const Model& model_;
  const DeviceProfile& device_;
  const PlannerOptions& options_;
  std::vector<Layer> layers_;
  DeviceProfile roomy_;
  TrainingOptions base_;
  std::int64_t simulations_ = 0;
  Bytes floor_{std::numeric_limits<std::int64_t>::max()};
};

struct Candidate {
  Plan plan;
  Sample sample;
};

// The fixed configurations of `ferry compare` that a plan can express.
std::vector<std::pair<std::vector<LayerConfig>, PlanKnobs>> fixed_seeds(const Search& search) {
  const std::size_t n = search.layers().size();
  std::vector<std::pair<std::vector<LayerConfig>, PlanKnobs>> seeds;
  const PlanKnobs knobs;
  auto all = [&](LayerConfig c) { return std::vector<LayerConfig>(n, c); };
  std::vector<LayerConfig> full(n);
  std::vector<LayerConfig> full_offload(n);
  for (std::size_t l = 0; l < n; ++l) {
    full[l].level = search.layers()[l].ranking.size();
    full_offload[l] = LayerConfig{full[l].level, true};
  }
  seeds.emplace_back(all(LayerConfig{0, true}), knobs);
  PlanKnobs v = knobs;
  v.prefetch = false;
  seeds.emplace_back(all(LayerConfig{0, true}), v);
  v = knobs;
  v.window_bytes = 128 * kMiB;
  seeds.emplace_back(all(LayerConfig{0, true}), v);
  v = knobs;
  v.prefetch_bytes = 2 * kGiB;
  seeds.emplace_back(all(LayerConfig{0, true}), v);
  v = knobs;
  v.min_bytes = 16 * kMiB;
  seeds.emplace_back(all(LayerConfig{0, true}), v);
  seeds.emplace_back(full, knobs);
  seeds.emplace_back(full_offload, knobs);
  return seeds;
}

}  // namespace

SimTime step_lower_bound(const Model& model, const DeviceProfile& device, const RowResult& none,
                         Bytes budget) {
  const Bytes excess = none.peak_reserved - budget;
  if (excess <= Bytes(0)) return none.step_time;
  // What the link can carry off the device while the forward pass runs.
  const Wide movable = static_cast<Wide>(device.d2h.bandwidth.bytes_per_s()) *
                       none.forward_time.ns() / 1'000'000'000;
  Wide left = static_cast<Wide>(excess.count()) - movable;
  if (left <= 0) return none.step_time;
  // The rest is recomputed, the ops that free the most bytes per ns first (fractionally).
  std::vector<std::pair<Bytes, SimTime>> items;
  for (const Layer& layer : find_layers(model)) {
    for (std::uint32_t p = layer.first; p < layer.end; ++p) {
      const Bytes freed = freed_by(model, p, layer.first, layer.end);
      if (freed > Bytes(0)) items.emplace_back(freed, model.ops[p].duration);
    }
  }
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

namespace {

// The checked run of a candidate on a device with exactly the budget's memory (or less).
std::optional<RowResult> checked(const Plan& plan, const Model& model, const DeviceProfile& device,
                                 const PlannerOptions& options) {
  DeviceProfile capped = device;
  capped.memory = std::min(device.memory, options.budget);
  TrainingOptions base;
  base.steps = options.steps;
  auto training = plan_training_options(plan, model, base);
  if (!training) return std::nullopt;
  std::optional<TrainingRun> run;
  RowResult row = run_row(model, capped, PolicyRow{"plan", std::move(training).value()}, &run);
  if (!run || !row.fits || row.failure || row.hazards > 0) return std::nullopt;
  if (!run->sim.content_mismatches().empty()) return std::nullopt;
  if (row.peak_reserved > options.budget) return std::nullopt;
  if (options.host_budget && row.pinned_peak > *options.host_budget) return std::nullopt;
  return row;
}

}  // namespace

namespace {

// Local search from a plan that fits (Note [Planner search]): layers with the same
// configuration form a class; a move takes the whole class, its first or second half, or its
// first or last layer to a neighbouring configuration (one recompute level less or more,
// offload on or off, or one level less traded for offload). The first move that still fits
// and is faster is taken, and the search starts over, until no move helps or the simulations
// (`simulations`) are spent.
void local_search(Search& search, std::vector<LayerConfig>& state, Sample& current,
                  const PlanKnobs& knobs, std::vector<Candidate>& candidates,
                  std::int64_t simulations) {
  const std::int64_t stop = search.simulations() + simulations;
  bool improved = true;
  while (improved && search.simulations() < stop) {
    improved = false;
    std::vector<std::vector<std::size_t>> classes;
    for (std::size_t l = 0; l < state.size(); ++l) {
      auto it = std::find_if(classes.begin(), classes.end(),
                             [&](const auto& c) { return state[c.front()] == state[l]; });
      if (it == classes.end()) {
        classes.push_back({l});
      } else {
        it->push_back(l);
      }
    }
    for (const auto& members : classes) {
      const std::size_t size = members.size();
      const std::size_t half = size / 2;
      std::vector<std::pair<std::size_t, std::size_t>> subsets;
      for (const auto& s :
           {std::pair{std::size_t{0}, size}, {0, half}, {half, size}, {0, 1}, {size - 1, size}}) {
        if (s.first < s.second && std::find(subsets.begin(), subsets.end(), s) == subsets.end()) {
          subsets.push_back(s);
        }
      }
      const LayerConfig from = state[members.front()];
      const std::size_t top = search.layers()[members.front()].ranking.size();
      std::vector<LayerConfig> neighbours;
      if (from.level > 0) neighbours.push_back(LayerConfig{from.level - 1, from.offload});
      if (from.level < top) neighbours.push_back(LayerConfig{from.level + 1, from.offload});
      neighbours.push_back(LayerConfig{from.level, !from.offload});
      if (from.level > 0 && !from.offload) neighbours.push_back(LayerConfig{from.level - 1, true});
      if (from.level < top && from.offload)
        neighbours.push_back(LayerConfig{from.level + 1, false});
      for (const auto& [lo, hi] : subsets) {
        for (const LayerConfig& to : neighbours) {
          if (search.simulations() >= stop) return;
          std::vector<LayerConfig> next = state;
          for (std::size_t m = lo; m < hi; ++m) next[members[m]] = to;
          Plan plan = search.plan_of(next, knobs);
          const Sample s = search.evaluate(plan);
          if (!search.fits(s) || s.time >= current.time) continue;
          state = std::move(next);
          current = s;
          candidates.push_back(Candidate{std::move(plan), s});
          improved = true;
          break;
        }
        if (improved) break;
      }
      if (improved) break;
    }
  }
}

}  // namespace

namespace {

// The fastest uniform plan that fits (Note [Planner search]): every layer at recompute level
// k, the last m layers offloaded; for each k from 0 up, the smallest m that fits, found by
// bisection (the peak falls as m grows). Stops at the first k that fits with nothing offloaded:
// a higher level only recomputes more.
std::optional<std::pair<std::vector<LayerConfig>, Sample>> best_uniform(
    Search& search, const PlanKnobs& knobs, std::vector<Candidate>& candidates) {
  const std::size_t n = search.layers().size();
  std::size_t top = 0;
  for (const Layer& layer : search.layers()) top = std::max(top, layer.ranking.size());
  std::optional<std::pair<std::vector<LayerConfig>, Sample>> best;
  for (std::size_t k = 0; k <= top && n > 0; ++k) {
    auto config = [&](std::size_t m) {
      std::vector<LayerConfig> c(n);
      for (std::size_t l = 0; l < n; ++l) {
        c[l] = LayerConfig{std::min(k, search.layers()[l].ranking.size()), l + m >= n};
      }
      return c;
    };
    auto try_m = [&](std::size_t m) {
      Plan plan = search.plan_of(config(m), knobs);
      const Sample s = search.evaluate(plan);
      if (search.fits(s)) {
        candidates.push_back(Candidate{std::move(plan), s});
        if (!best || s.time < best->second.time) best.emplace(config(m), s);
      }
      return search.fits(s);
    };
    if (!try_m(n)) continue;
    std::size_t lo = 0;
    std::size_t hi = n;
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (try_m(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    if (hi == 0) break;
  }
  return best;
}

}  // namespace

Result<PlanOutcome> make_plan(const Model& model, const DeviceProfile& device,
                              const PlannerOptions& options, Bytes* floor_out) {
  Search search(model, device, options);
  const std::size_t n = search.layers().size();
  std::vector<Candidate> candidates;
  auto consider = [&](const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
                      bool offload_outside = false) {
    Plan plan = search.plan_of(configs, knobs, offload_outside);
    const Sample s = search.evaluate(plan);
    if (search.fits(s)) candidates.push_back(Candidate{std::move(plan), s});
    return s;
  };
  const PlanKnobs knobs;
  std::vector<LayerConfig> state(n);
  Sample current = consider(state, knobs);
  for (const auto& [configs, k] : fixed_seeds(search)) {
    // The fixed configurations that offload, offload outside the layers too.
    const bool all =
        std::all_of(configs.begin(), configs.end(), [](const LayerConfig& c) { return c.offload; });
    (void)consider(configs, k, all && !configs.empty());
  }
  {
    // Selective checkpointing (the attention core recomputed in every layer) as a plan.
    Plan selective = search.plan_of(std::vector<LayerConfig>(n), knobs);
    CheckpointPlan ref = checkpoint_every(model, 1);
    apply_selective_policy(ref, model);
    for (const Layer& layer : search.layers()) {
      bool any = false;
      for (std::uint32_t i = layer.first; i < layer.end; ++i) {
        if (ref.op_policy[i] != OpPolicy::PreferRecompute) continue;
        selective.ops[i].saved = SavedDecision::Recompute;
        any = true;
      }
      if (any) selective.regions.push_back(PlanRegion{layer.first, layer.end, SavedDecision::Keep});
    }
    recompute_random_prefix(selective, model);
    const Sample s = search.evaluate(selective);
    if (search.fits(s)) candidates.push_back(Candidate{std::move(selective), s});
  }

  // Greedy descent (Note [Planner search]).
  // Bytes freed per layer by the last move of each kind, and that move's size in layers.
  std::int64_t per_layer_recompute = 0;
  std::int64_t per_layer_offload = 0;
  std::size_t last_recompute = 0;
  std::size_t last_offload = 0;
  while (current.ok && !search.fits(current)) {
    const std::int64_t gap = (current.reserved - options.budget).count();
    const std::int64_t host_gap =
        options.host_budget ? (current.pinned - *options.host_budget).count() : 0;
    auto batch = [&](std::int64_t per_layer, std::size_t last) -> std::size_t {
      if (last == 0 || host_gap > 0) return 1;
      // A move that freed nothing at the peak (the peak lies elsewhere): twice as many layers.
      if (per_layer <= 0) return std::min(n, 2 * last);
      return static_cast<std::size_t>(
          std::clamp<std::int64_t>(gap / per_layer / 2, 1, static_cast<std::int64_t>(n)));
    };
    struct Move {
      std::vector<LayerConfig> state;
      Sample sample;
      std::size_t layers = 0;
      bool recompute = false;
    };
    std::vector<Move> moves;
    // Recompute one level more on the layers with the lowest level, the last layers first.
    {
      std::vector<std::size_t> order(n);
      for (std::size_t l = 0; l < n; ++l) order[l] = n - 1 - l;
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
        return state[a].level < state[b].level;
      });
      Move m{state, {}, 0, true};
      for (const std::size_t l : order) {
        if (m.layers == batch(per_layer_recompute, last_recompute)) break;
        if (m.state[l].level >= search.layers()[l].ranking.size()) continue;
        ++m.state[l].level;
        ++m.layers;
      }
      if (m.layers > 0) moves.push_back(std::move(m));
    }
    // Offload the earliest layers not offloaded (only while no pinned budget is exceeded).
    if (host_gap <= 0) {
      Move m{state, {}, 0, false};
      for (std::size_t l = 0; l < n && m.layers < batch(per_layer_offload, last_offload); ++l) {
        if (m.state[l].offload) continue;
        m.state[l].offload = true;
        ++m.layers;
      }
      if (m.layers > 0) moves.push_back(std::move(m));
    }
    if (moves.empty()) break;
    for (Move& m : moves) m.sample = search.evaluate(search.plan_of(m.state, knobs));
    const Move* best = nullptr;
    auto cost = [&](const Move& m) {
      // Step time added per byte freed (memory and pinned host above its budget count alike).
      const std::int64_t freed =
          (current.reserved - m.sample.reserved).count() +
          (options.host_budget ? (current.pinned - m.sample.pinned).count() : 0);
      const std::int64_t added = (m.sample.time - current.time).ns();
      return std::pair<std::int64_t, std::int64_t>(added, std::max<std::int64_t>(freed, 1));
    };
    for (const Move& m : moves) {
      if (!m.sample.ok) continue;
      if (best == nullptr) {
        best = &m;
        continue;
      }
      const auto [a1, f1] = cost(m);
      const auto [a0, f0] = cost(*best);
      if (static_cast<Wide>(a1) * f0 < static_cast<Wide>(a0) * f1) best = &m;
    }
    if (best == nullptr) break;
    for (const Move& m : moves) {
      // Every move simulated tells how much its kind frees per layer now.
      const std::int64_t f = m.sample.ok ? (current.reserved - m.sample.reserved).count() : 0;
      (m.recompute ? per_layer_recompute : per_layer_offload) =
          f / static_cast<std::int64_t>(m.layers);
      (m.recompute ? last_recompute : last_offload) = m.layers;
    }
    state = best->state;
    current = best->sample;
  }
  if (search.fits(current)) {
    candidates.push_back(Candidate{search.plan_of(state, knobs), current});
  }
  // The local search from where the greedy ended, then from the best uniform plan when that
  // is faster still; the faster result is the plan's layers.
  if (search.fits(current)) local_search(search, state, current, knobs, candidates, 120);
  if (auto uniform = best_uniform(search, knobs, candidates)) {
    if (!search.fits(current) || uniform->second.time < current.time) {
      state = std::move(uniform->first);
      current = uniform->second;
      local_search(search, state, current, knobs, candidates, 80);
    }
  }
  // The knob variants on the plan found (or, when none fits, on the smallest it reached: a
  // narrower window or no prefetch can lower the peak further).
  for (const auto& [configs, k] : fixed_seeds(search)) {
    if (k == knobs) continue;
    (void)consider(state, k);
  }
  std::stable_sort(
      candidates.begin(), candidates.end(),
      [](const Candidate& a, const Candidate& b) { return a.sample.time < b.sample.time; });
  for (const Candidate& c : candidates) {
    auto row = checked(c.plan, model, device, options);
    if (!row) continue;
    PlanOutcome outcome;
    outcome.plan = c.plan;
    outcome.row = std::move(*row);
    outcome.simulations = search.simulations();
    outcome.layers = summarize_layers(c.plan, model);
    TrainingOptions unchecked;
    unchecked.steps = options.steps;
    unchecked.sim.check_hazards = false;
    unchecked.sim.track_content = false;
    for (const PolicyRow& fixed : default_rows(unchecked, model)) {
      outcome.fixed.push_back(run_row(model, device, fixed));
    }
    outcome.lower_bound = step_lower_bound(model, device, outcome.fixed.front(), options.budget);
    const RowResult& r = outcome.row;
    outcome.plan.predicted = PlanPrediction{r.step_time,
                                            outcome.lower_bound,
                                            r.recompute_time,
                                            r.forward_stall + r.backward_stall,
                                            r.peak_reserved,
                                            r.peak_allocated,
                                            r.pinned_peak,
                                            r.d2h,
                                            r.h2d};
    return outcome;
  }
  const Bytes floor = search.floor();
  if (floor_out != nullptr) *floor_out = floor;
  const std::string host = options.host_budget ? fmt::format(" and {} of pinned host memory",
                                                             format_bytes(*options.host_budget))
                                               : std::string();
  return Error{fmt::format(
      "infeasible budget: no plan fits {} of peak reserved device memory{} on {}; the floor (the "
      "smallest peak reserved the planner reached) is {} ({} bytes)",
      format_bytes(options.budget), host, device.name,
      floor.count() == std::numeric_limits<std::int64_t>::max() ? std::string("unknown")
                                                                : format_bytes(floor),
      floor.count() == std::numeric_limits<std::int64_t>::max() ? 0 : floor.count())};
}

}  // namespace ferry::sim
