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
// and an offload flag (the saved tensors the layer keeps, and the region's inputs, go to pinned
// host memory instead). Level 0 is no region; level k re-runs, in backward, the first ops of
// the layer's recompute ranking inside a checkpoint region over the layer, and serves the
// others' outputs from forward (must-save, which holds every output of theirs, saved or not:
// what PyTorch's selective checkpoint caches). The ranking puts first the ops that free the most
// bytes per nanosecond of recompute; the levels are the points of the ranking where the bytes
// a region would hold fall, once they are below what the layer saves without a region (the
// first ops of a traced layer's ranking free less than the region holds for the others), at
// most 16 of them (a traced layer has dozens of ops: then only points at least a sixteenth of
// the layer's saved bytes apart), and the top level, plain checkpointing.
//
// The search, with the simulator as the cost model: the fixed configurations of `ferry
// compare` that a plan can express are candidates (simulated once per planner, with the rows
// of the report), so the plan is never slower than the best of them that fits. A greedy
// descent from everything kept simulates two moves a round (recompute one level more on the
// layers with the lowest level, the last of them first; offload the earliest layers not
// offloaded, since their copies have the most forward time left to hide behind and are
// reloaded last) and takes the one that costs the least step time per byte of peak reserved
// it frees; a move spans several layers while the budget is far away (how many from the
// saving per layer the last move of its kind measured), one layer near it. Uniform plans
// (every layer at one level, the last layers offloaded) are searched too. A local search over
// classes of layers with the same configuration runs from where the greedy ended, from the
// best uniform plan and from the fastest fixed configuration that fits, each when it is faster
// than the best so far; the knob variants of `ferry compare` are tried on the result. Every
// simulation is kept by its plan, so a configuration two paths reach runs once.
// docs/plan.md has the whole method.

struct Layer {
  std::int32_t layer = -1;
  std::uint32_t first = 0;
  std::uint32_t end = 0;
  std::vector<std::uint32_t> ranking;  // op indices, best bytes freed per ns first
  std::vector<std::size_t> levels;     // ops of the ranking recomputed at each level
};

struct LayerConfig {
  std::size_t level = 0;  // index into Layer::levels; 0: no region
  bool offload = false;
  friend bool operator==(const LayerConfig&, const LayerConfig&) = default;
};

struct Sample {
  bool ok = false;  // completed without failure
  SimTime time;
  Bytes reserved;
  Bytes pinned;
};

// Bytes of op `p`'s outputs that ops of [first, end) save (its share of the layer's saved
// activations).
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

// Bytes a region over [first, end) holds for op `p` when it serves the op from forward: its
// outputs that ops of the region read or save (an output only later layers read, the layer's
// output, is the next region's input and held there anyway).
Bytes held_by(const Model& model, std::uint32_t p, std::uint32_t first, std::uint32_t end) {
  std::set<std::uint32_t> used;
  for (std::uint32_t j = p + 1; j < end; ++j) {
    for (const std::uint32_t t : model.ops[j].inputs) used.insert(base_of(model, t));
  }
  for (std::uint32_t j = first; j < end; ++j) {
    for (const std::uint32_t t : model.ops[j].saved) used.insert(base_of(model, t));
  }
  Bytes bytes;
  for (const std::uint32_t t : model.ops[p].outputs) {
    if (model.tensors[t].view_of < 0 && used.contains(t)) bytes += model.tensors[t].bytes;
  }
  return bytes;
}

// Orders `ops` by bytes per ns of forward time, most first (compared exactly); ties by order.
void rank(const Model& model, std::vector<std::pair<std::uint32_t, Bytes>>& scored) {
  std::stable_sort(scored.begin(), scored.end(), [&](const auto& a, const auto& b) {
    const Wide lhs = static_cast<Wide>(a.second.count()) *
                     std::max<std::int64_t>(1, model.ops[b.first].duration.ns());
    const Wide rhs = static_cast<Wide>(b.second.count()) *
                     std::max<std::int64_t>(1, model.ops[a.first].duration.ns());
    return lhs > rhs;
  });
}

// The most levels a layer has (Note [Planner search]).
constexpr std::size_t kMaxLevels = 16;

// The levels of a layer (Note [Planner search]).
std::vector<std::size_t> levels_of(const Model& model, const Layer& layer) {
  // Without a region: the distinct activation storages its ops save.
  std::set<std::uint32_t> saved;
  std::set<std::uint32_t> produced;
  std::set<std::uint32_t> inputs;
  for (std::uint32_t j = layer.first; j < layer.end; ++j) {
    for (const std::uint32_t t : model.ops[j].saved) {
      if (planning::is_activation(model, t)) saved.insert(base_of(model, t));
    }
    for (const std::uint32_t t : model.ops[j].inputs) {
      const std::uint32_t b = base_of(model, t);
      if (planning::is_activation(model, t) && !produced.contains(b)) inputs.insert(b);
    }
    for (const std::uint32_t t : model.ops[j].outputs) produced.insert(base_of(model, t));
  }
  std::int64_t without = 0;
  for (const std::uint32_t t : saved) without += model.tensors[t].bytes.count();
  // With a region at level k: its inputs, and the outputs of the ops it serves from forward.
  std::int64_t held = 0;
  for (const std::uint32_t t : inputs) held += model.tensors[t].bytes.count();
  for (const std::uint32_t p : layer.ranking)
    held += held_by(model, p, layer.first, layer.end).count();
  // Every point below `without` where the held bytes fall; at most kMaxLevels of them, each
  // at least 1/kMaxLevels of `without` below the last.
  std::vector<std::pair<std::size_t, std::int64_t>> falls;
  for (std::size_t k = 1; k < layer.ranking.size(); ++k) {
    const std::int64_t freed = held_by(model, layer.ranking[k - 1], layer.first, layer.end).count();
    held -= freed;
    if (freed > 0 && held < without) falls.emplace_back(k, held);
  }
  const std::int64_t step =
      falls.size() + 1 < kMaxLevels ? 1 : std::max<std::int64_t>(1, without / kMaxLevels);
  std::vector<std::size_t> levels{0};
  std::int64_t last = without;
  for (const auto& [k, h] : falls) {
    if (last - h < step) continue;
    levels.push_back(k);
    last = h;
  }
  if (!layer.ranking.empty()) levels.push_back(layer.ranking.size());
  return levels;
}

std::vector<Layer> find_layers(const Model& model) {
  std::vector<Layer> layers;
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    const std::int32_t l = model.ops[i].layer;
    if (l < 0 || model.ops[i].no_offload) continue;
    if (layers.empty() || layers.back().layer != l || layers.back().end != i) {
      layers.push_back(Layer{l, i, i + 1, {}, {}});
    } else {
      layers.back().end = i + 1;
    }
  }
  for (Layer& layer : layers) {
    std::vector<std::pair<std::uint32_t, Bytes>> scored;
    for (std::uint32_t p = layer.first; p < layer.end; ++p) {
      scored.emplace_back(p, held_by(model, p, layer.first, layer.end));
    }
    rank(model, scored);
    for (const auto& [p, bytes] : scored) layer.ranking.push_back(p);
    layer.levels = levels_of(model, layer);
  }
  return layers;
}

// The plan's decisions as a string: two plans with the same key simulate alike.
std::string key_of(const Plan& plan) {
  std::string key;
  key.reserve(plan.ops.size() + 16 * plan.regions.size() + 64);
  for (const PlanOp& op : plan.ops)
    key.push_back(static_cast<char>('0' + static_cast<int>(op.saved)));
  for (const PlanRegion& r : plan.regions) {
    key += fmt::format("|{},{},{}", r.first_op, r.end_op, static_cast<int>(r.inputs));
  }
  const PlanKnobs& k = plan.knobs;
  key += fmt::format("|{},{},{},{},{}", k.min_bytes.count(), k.window_bytes.count(),
                     k.prefetch_bytes.count(), k.prefetch ? 1 : 0,
                     k.horizon_bytes ? k.horizon_bytes->count() : -1);
  key += fmt::format("|{}", plan.host_budget ? plan.host_budget->count() : -1);
  return key;
}

// The knobs of a row's offload options.
PlanKnobs knobs_of(const OffloadOptions& o) {
  PlanKnobs k;
  k.min_bytes = o.min_bytes;
  k.window_bytes = o.window_bytes;
  k.prefetch_bytes = o.prefetch_bytes;
  k.prefetch = o.prefetch;
  k.horizon_bytes = o.horizon_bytes;
  return k;
}

}  // namespace

namespace {

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

}  // namespace

SimTime step_lower_bound(const Model& model, const DeviceProfile& device, const RowResult& none,
                         Bytes budget) {
  const Bytes excess = none.peak_reserved - budget;
  if (excess <= Bytes(0)) return none.step_time;
  // Note [What the link can carry in forward]
  Wide left =
      static_cast<Wide>(excess.count()) - carried_in_forward(model, device, none.forward_time);
  if (left <= 0) return none.step_time;
  // The rest is recomputed, the ops that free the most bytes per ns first (fractionally), or
  // carried by a forward made longer for the link, at its bandwidth's cost per byte, whichever
  // is cheaper.
  std::vector<std::pair<Bytes, SimTime>> items;
  for (const Layer& layer : find_layers(model)) {
    for (std::uint32_t p = layer.first; p < layer.end; ++p) {
      const Bytes freed = freed_by(model, p, layer.first, layer.end);
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

// A fixed configuration of `ferry compare` as a plan (when a plan can express it), and as
// per-layer configurations (when every layer is at one of its levels), with its measured row.
struct FixedForm {
  std::size_t row = 0;
  Plan plan;
  std::optional<std::vector<LayerConfig>> configs;
  Sample sample;
};

struct planning::PlannerState {
  PlannerState(const Model& m, const DeviceProfile& d, std::int32_t s)
      : model(m), device(d), steps(s), layers(find_layers(m)) {
    roomy = device;
    roomy.memory = Bytes(device.memory.count() * 8);
    base.steps = steps;
    base.sim.check_hazards = false;
    base.sim.track_content = false;
  }

  const Model& model;
  DeviceProfile device;
  std::int32_t steps;
  std::vector<Layer> layers;
  DeviceProfile roomy;  // plans are measured here: a plan that does not fit still says its peak
  TrainingOptions base;
  std::optional<std::vector<RowResult>> rows;
  std::vector<FixedForm> forms;
  std::map<std::string, Sample> samples;
  std::map<std::string, RowResult> checked_rows;  // key and device memory -> the checked run
  std::int64_t simulations = 0;
  std::int64_t reused = 0;

  /// The plan of per-layer configurations; `offload_outside`: the ops outside the layers
  /// offload too (as the fixed ferry configurations do), else they keep.
  Plan plan_of(const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
               std::optional<Bytes> host_budget, bool offload_outside = false) const {
    Plan plan = keep_everything_plan(model, device);
    plan.host_budget = host_budget;
    plan.knobs = knobs;
    if (offload_outside) {
      for (PlanOp& op : plan.ops) op.saved = SavedDecision::Offload;
    }
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const Layer& layer = layers[l];
      const LayerConfig& c = configs[l];
      const SavedDecision stored = c.offload ? SavedDecision::Offload : SavedDecision::Keep;
      for (std::uint32_t i = layer.first; i < layer.end; ++i) plan.ops[i].saved = stored;
      const std::size_t k = layer.levels[c.level];
      if (k == 0) continue;
      for (std::size_t r = 0; r < k; ++r)
        plan.ops[layer.ranking[r]].saved = SavedDecision::Recompute;
      plan.regions.push_back(PlanRegion{layer.first, layer.end, stored});
    }
    recompute_random_prefix(plan, model);
    return plan;
  }

  /// The unchecked run of `plan` on the roomy device (once per distinct plan).
  Sample evaluate(const Plan& plan) {
    std::string key = key_of(plan);
    if (auto it = samples.find(key); it != samples.end()) {
      ++reused;
      return it->second;
    }
    ++simulations;
    auto options = plan_training_options(plan, model, base);
    FERRY_CHECK(options.ok(), "planner built an invalid plan: {}", options.error().message);
    auto run = simulate_training(model, roomy, options.value());
    Sample s;
    if (run.ok() && !run.value().failure && !run.value().steps.empty()) {
      const TrainingRun& r = run.value();
      s.ok = true;
      s.time = r.steps.back().end - r.steps.back().start;
      s.reserved = r.sim.device_allocator(r.device).stats().reserved_peak;
      s.pinned = r.sim.pinned_allocator().stats().reserved_peak;
    }
    samples.emplace(std::move(key), s);
    return s;
  }

  /// The checked run of `plan` (hazard checker and content tracking on) on a device with
  /// `memory`; the row's failure says why it cannot be the plan (hazards and content
  /// mismatches included).
  const RowResult& checked(const Plan& plan, Bytes memory) {
    std::string key = fmt::format("{}|{}", key_of(plan), memory.count());
    if (auto it = checked_rows.find(key); it != checked_rows.end()) {
      ++reused;
      return it->second;
    }
    ++simulations;
    DeviceProfile capped = device;
    capped.memory = memory;
    TrainingOptions options;
    options.steps = steps;
    auto training = plan_training_options(plan, model, options);
    FERRY_CHECK(training.ok(), "planner built an invalid plan: {}", training.error().message);
    std::optional<TrainingRun> run;
    RowResult row = run_row(model, capped, PolicyRow{"plan", std::move(training).value()}, &run);
    if (!row.failure && run && !run->sim.content_mismatches().empty()) {
      row.failure =
          Failure{FailureKind::Infeasible,
                  fmt::format("{} content mismatches", run->sim.content_mismatches().size())};
    }
    if (!run && !row.failure) row.failure = Failure{FailureKind::Infeasible, "no run"};
    return checked_rows.emplace(std::move(key), std::move(row)).first->second;
  }

  /// The rows of `ferry compare`, and the fixed configurations a plan can express.
  void ensure_fixed() {
    if (rows) return;
    rows.emplace();
    const std::vector<PolicyRow> policy_rows = default_rows(base, model, device);
    for (const PolicyRow& row : policy_rows) rows->push_back(run_row(model, device, row));
    for (std::size_t i = 0; i < policy_rows.size(); ++i) {
      auto form = form_of(policy_rows[i].options);
      if (!form) continue;
      form->row = i;
      const RowResult& r = (*rows)[i];
      if (r.fits) {
        // The row is this plan's run: keep it as the plan's sample.
        form->sample = Sample{!r.failure, r.step_time, r.peak_reserved, r.pinned_peak};
        samples.emplace(key_of(form->plan), form->sample);
      } else {
        form->sample = evaluate(form->plan);
      }
      forms.push_back(std::move(*form));
    }
  }

  /// A row's configuration as a plan (its regions, per-op policies, what it offloads and its
  /// knobs), when a plan can express it: not trl, not reentrant regions.
  std::optional<FixedForm> form_of(const TrainingOptions& o) const {
    if (is_trl(o.offload.policy)) return std::nullopt;
    const bool ferry = o.offload.policy == Policy::Ferry;
    FixedForm form;
    form.plan = keep_everything_plan(model, device);
    form.plan.knobs = knobs_of(o.offload);
    const SavedDecision stored = ferry ? SavedDecision::Offload : SavedDecision::Keep;
    const auto& chosen = o.offload_selection.ops;
    for (std::size_t i = 0; i < form.plan.ops.size(); ++i) {
      const bool selected = i >= chosen.size() || chosen[i];
      form.plan.ops[i].saved = selected ? stored : SavedDecision::Keep;
    }
    const auto& policy = o.checkpoint.op_policy;
    for (std::size_t r = 0; r < o.checkpoint.regions.size(); ++r) {
      const CheckpointRegion& region = o.checkpoint.regions[r];
      if (region.reentrant || region.early_stop == false) return std::nullopt;
      const auto& inputs = o.offload_selection.region_inputs;
      const bool offload_inputs = ferry && (r >= inputs.size() || inputs[r]);
      form.plan.regions.push_back(
          PlanRegion{region.first_op, region.end_op,
                     offload_inputs ? SavedDecision::Offload : SavedDecision::Keep});
      for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
        const OpPolicy p = i < policy.size() ? policy[i] : OpPolicy::PreferRecompute;
        form.plan.ops[i].saved = p == OpPolicy::PreferRecompute ? SavedDecision::Recompute
                                 : p == OpPolicy::MustSave      ? SavedDecision::Keep
                                                                : SavedDecision::Offload;
      }
    }
    if (!plan_training_options(form.plan, model, base).ok()) return std::nullopt;
    // As layer configurations, when it is one: each layer with no region or a full one.
    std::vector<LayerConfig> configs(layers.size());
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const Layer& layer = layers[l];
      const SavedDecision first = form.plan.ops[layer.first].saved;
      const auto region = std::find_if(
          form.plan.regions.begin(), form.plan.regions.end(),
          [&](const PlanRegion& r) { return r.first_op == layer.first && r.end_op == layer.end; });
      LayerConfig c;
      if (region != form.plan.regions.end()) {
        c.level = layer.levels.size() - 1;
        c.offload = region->inputs == SavedDecision::Offload;
      } else {
        c.offload = first == SavedDecision::Offload;
      }
      configs[l] = c;
    }
    if (key_of(plan_of(configs, form.plan.knobs, std::nullopt, false)) == key_of(form.plan) ||
        key_of(plan_of(configs, form.plan.knobs, std::nullopt, true)) == key_of(form.plan)) {
      form.configs = std::move(configs);
    }
    return form;
  }
};

namespace {

struct Candidate {
  Plan plan;
  Sample sample;
};

// One plan call: the budgets, the candidates found, and the search's moves.
class Search {
 public:
  Search(planning::PlannerState& impl, const PlannerOptions& options)
      : p_(impl), options_(options) {}

  const std::vector<Layer>& layers() const { return p_.layers; }

  Plan plan_of(const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
               bool offload_outside = false) const {
    Plan plan = p_.plan_of(configs, knobs, options_.host_budget, offload_outside);
    plan.budget = options_.budget;
    return plan;
  }

  Sample evaluate(const Plan& plan) {
    const Sample s = p_.evaluate(plan);
    note(plan, s);
    return s;
  }

  /// Takes a measured plan: a candidate when it fits; its peak lowers the floor when its
  /// pinned memory is within the host budget (a plan over the host budget reached nothing a
  /// refusal may point to).
  void note(const Plan& plan, const Sample& s) {
    if (s.ok && within_host(s)) floor_ = std::min(floor_, s.reserved);
    if (!fits(s)) return;
    std::string key = key_of(plan);
    if (auto it = candidates_.find(key); it == candidates_.end()) {
      Plan copy = plan;
      copy.budget = options_.budget;
      candidates_.emplace(std::move(key), Candidate{std::move(copy), s});
    }
  }

  bool within_host(const Sample& s) const {
    return !options_.host_budget || s.pinned <= *options_.host_budget;
  }

  bool fits(const Sample& s) const {
    return s.ok && s.reserved <= options_.budget && within_host(s);
  }

  /// The candidates, fastest first (ties by key, for a stable choice).
  std::vector<const Candidate*> ranked() const {
    std::vector<std::pair<const std::string*, const Candidate*>> all;
    for (const auto& [key, c] : candidates_) all.emplace_back(&key, &c);
    std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
      return a.second->sample.time < b.second->sample.time;
    });
    std::vector<const Candidate*> out;
    for (const auto& [key, c] : all) out.push_back(c);
    return out;
  }

  /// The fastest candidate's time, or none.
  std::optional<SimTime> best_time() const {
    std::optional<SimTime> best;
    for (const auto& [key, c] : candidates_) {
      if (!best || c.sample.time < *best) best = c.sample.time;
    }
    return best;
  }

  Bytes floor() const { return floor_; }
  planning::PlannerState& planner() { return p_; }
  const PlannerOptions& options() const { return options_; }

 private:
  planning::PlannerState& p_;
  const PlannerOptions& options_;
  std::map<std::string, Candidate> candidates_;
  Bytes floor_{std::numeric_limits<std::int64_t>::max()};
};

// The knob variants of `ferry compare`'s ferry rows.
std::vector<PlanKnobs> knob_variants() {
  std::vector<PlanKnobs> out;
  PlanKnobs v;
  v.prefetch = false;
  out.push_back(v);
  v = PlanKnobs{};
  v.window_bytes = 128 * kMiB;
  out.push_back(v);
  v = PlanKnobs{};
  v.prefetch_bytes = 2 * kGiB;
  out.push_back(v);
  v = PlanKnobs{};
  v.min_bytes = 16 * kMiB;
  out.push_back(v);
  return out;
}

// Local search from a plan that fits (Note [Planner search]): layers with the same
// configuration form a class; a move takes the whole class, its first or second half, or its
// first or last layer to a neighbouring configuration (one level less or more, offload on or
// off, or one level less traded for offload). The first move that still fits and is faster is
// taken, and the search starts over, until no move helps or `simulations` new runs are spent.
void local_search(Search& search, std::vector<LayerConfig>& state, Sample& current,
                  const PlanKnobs& knobs, std::int64_t simulations) {
  const std::int64_t stop = search.planner().simulations + simulations;
  bool improved = true;
  while (improved && search.planner().simulations < stop) {
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
      const std::size_t top = search.layers()[members.front()].levels.size() - 1;
      std::vector<LayerConfig> neighbours;
      if (from.level > 0) neighbours.push_back(LayerConfig{from.level - 1, from.offload});
      if (from.level < top) neighbours.push_back(LayerConfig{from.level + 1, from.offload});
      neighbours.push_back(LayerConfig{from.level, !from.offload});
      if (from.level > 0 && !from.offload) neighbours.push_back(LayerConfig{from.level - 1, true});
      if (from.level < top && from.offload) {
        neighbours.push_back(LayerConfig{from.level + 1, false});
      }
      for (const auto& [lo, hi] : subsets) {
        for (const LayerConfig& to : neighbours) {
          if (search.planner().simulations >= stop) return;
          std::vector<LayerConfig> next = state;
          for (std::size_t m = lo; m < hi; ++m) {
            const std::size_t l = members[m];
            next[l] =
                LayerConfig{std::min(to.level, search.layers()[l].levels.size() - 1), to.offload};
          }
          const Sample s = search.evaluate(search.plan_of(next, knobs));
          if (!search.fits(s) || s.time >= current.time) continue;
          state = std::move(next);
          current = s;
          improved = true;
          break;
        }
        if (improved) break;
      }
      if (improved) break;
    }
  }
}

// The fastest uniform plan that fits (Note [Planner search]): every layer at level k, the last
// m layers offloaded; for each k from 0 up, the smallest m that fits, found by bisection (the
// peak falls as m grows, and as k does: the bisection for k starts from the m found for the
// last level that fit). Stops at the first k that fits with nothing offloaded (a higher
// level only recomputes more), and at the first k whose plan without offload is already no
// faster than the best plan found so far (offload does not make a step faster, and a higher
// level is slower still).
std::optional<std::pair<std::vector<LayerConfig>, Sample>> best_uniform(Search& search,
                                                                        const PlanKnobs& knobs) {
  const std::size_t n = search.layers().size();
  std::size_t top = 0;
  for (const Layer& layer : search.layers()) top = std::max(top, layer.levels.size() - 1);
  std::optional<std::pair<std::vector<LayerConfig>, Sample>> best;
  std::size_t most = n;  // the fewest offloaded layers that fit at the last level that fit
  for (std::size_t k = 0; k <= top && n > 0; ++k) {
    auto config = [&](std::size_t m) {
      std::vector<LayerConfig> c(n);
      for (std::size_t l = 0; l < n; ++l) {
        c[l] = LayerConfig{std::min(k, search.layers()[l].levels.size() - 1), l + m >= n};
      }
      return c;
    };
    auto try_m = [&](std::size_t m) {
      const Sample s = search.evaluate(search.plan_of(config(m), knobs));
      if (search.fits(s) && (!best || s.time < best->second.time)) best.emplace(config(m), s);
      return search.fits(s);
    };
    const Sample none = search.evaluate(search.plan_of(config(0), knobs));
    const std::optional<SimTime> fastest = search.best_time();
    if (search.fits(none)) {
      if (!best || none.time < best->second.time) best.emplace(config(0), none);
      break;
    }
    if (none.ok && fastest && none.time >= *fastest) break;
    // A higher level holds less: the fewest offloaded layers that fit do not grow with k.
    if (!try_m(most)) continue;
    std::size_t lo = 0;
    std::size_t hi = most;
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (try_m(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    if (hi == 0) break;
    most = hi;
  }
  return best;
}

// The greedy descent from everything kept (Note [Planner search]); returns where it ended.
std::pair<std::vector<LayerConfig>, Sample> greedy_descent(Search& search) {
  const std::size_t n = search.layers().size();
  const PlannerOptions& options = search.options();
  const PlanKnobs knobs;
  std::vector<LayerConfig> state(n);
  Sample current = search.evaluate(search.plan_of(state, knobs));
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
        if (m.state[l].level + 1 >= search.layers()[l].levels.size()) continue;
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
  return {std::move(state), current};
}

}  // namespace

Planner::Planner(const Model& model, const DeviceProfile& device, std::int32_t steps)
    : state_(std::make_unique<planning::PlannerState>(model, device, steps)) {}

Planner::~Planner() = default;

const std::vector<RowResult>& Planner::fixed() {
  state_->ensure_fixed();
  return *state_->rows;
}

std::int64_t Planner::simulations() const { return state_->simulations; }

Result<PlanOutcome> Planner::plan(const PlannerOptions& options, Bytes* floor_out) {
  planning::PlannerState& p = *state_;
  const std::int64_t simulations_before = p.simulations;
  const std::int64_t reused_before = p.reused;
  p.ensure_fixed();
  Search search(p, options);
  const PlanKnobs knobs;

  // The fixed configurations (Note [Planner search]), as measured with the rows.
  for (const FixedForm& form : p.forms) {
    Plan plan = form.plan;
    plan.host_budget = options.host_budget;
    // The forms were measured without a pinned budget; with one, the plan caps the pool.
    search.note(plan, options.host_budget ? search.evaluate(plan) : form.sample);
  }

  // The greedy descent, then the local search from where it ended.
  auto greedy = greedy_descent(search);
  std::vector<LayerConfig> state = std::move(greedy.first);
  Sample current = greedy.second;
  const std::int64_t kLocal = 40;
  if (search.fits(current)) local_search(search, state, current, knobs, kLocal);
  // From the best uniform plan and from the fastest fixed configuration that fits, when
  // faster than the best so far.
  auto improve_from = [&](std::vector<LayerConfig> start, Sample sample, const PlanKnobs& k) {
    const std::optional<SimTime> best = search.best_time();
    if (!search.fits(sample) || (best && sample.time > *best)) return;
    local_search(search, start, sample, k, kLocal);
    if (!search.fits(current) || sample.time < current.time) {
      state = std::move(start);
      current = sample;
    }
  };
  if (auto uniform = best_uniform(search, knobs)) {
    improve_from(std::move(uniform->first), uniform->second, knobs);
  }
  {
    const FixedForm* fastest = nullptr;
    for (const FixedForm& form : p.forms) {
      if (!form.configs || !search.fits(form.sample) || options.host_budget) continue;
      if (fastest == nullptr || form.sample.time < fastest->sample.time) fastest = &form;
    }
    if (fastest != nullptr && fastest->plan.knobs == knobs) {
      improve_from(*fastest->configs, fastest->sample, knobs);
    }
  }
  // The knob variants on the plan found (or, when none fits, on the smallest it reached: a
  // narrower window or no prefetch can lower the peak further).
  for (const PlanKnobs& k : knob_variants()) (void)search.evaluate(search.plan_of(state, k));

  const Bytes capped = std::min(p.device.memory, options.budget);
  std::string refused;  // why the fastest candidate's checked run was refused
  const std::vector<const Candidate*> ranked = search.ranked();
  for (const Candidate* c : ranked) {
    const RowResult& row = p.checked(c->plan, capped);
    std::string why = row.failure       ? row.failure->message
                      : !row.fits       ? std::string("out of device memory")
                      : row.hazards > 0 ? fmt::format("{} hazards", row.hazards)
                      : row.peak_reserved > options.budget
                          ? fmt::format("peak reserved {}", format_bytes(row.peak_reserved))
                      : options.host_budget && row.pinned_peak > *options.host_budget
                          ? fmt::format("pinned peak {}", format_bytes(row.pinned_peak))
                          : std::string();
    if (!why.empty()) {
      if (refused.empty()) refused = std::move(why);
      continue;
    }
    PlanOutcome outcome;
    outcome.plan = c->plan;
    outcome.row = row;
    outcome.row.name = "plan";
    outcome.layers = summarize_layers(c->plan, p.model);
    outcome.fixed = *p.rows;
    outcome.lower_bound =
        step_lower_bound(p.model, p.device, outcome.fixed.front(), options.budget);
    outcome.simulations = p.simulations - simulations_before;
    outcome.reused = p.reused - reused_before;
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
  if (!ranked.empty()) {
    // Plans reached the budget, and every one failed its checked run: the floor would not
    // say why.
    return Error{fmt::format(
        "infeasible budget: no plan fits {} of peak reserved device memory{} on {}: the {} "
        "plans whose unchecked runs fit failed their checked run on a device with {} (the "
        "fastest: {})",
        format_bytes(options.budget), host, p.device.name, ranked.size(), format_bytes(capped),
        refused)};
  }
  const bool known = floor.count() != std::numeric_limits<std::int64_t>::max();
  return Error{fmt::format(
      "infeasible budget: no plan fits {} of peak reserved device memory{} on {}; the floor (the "
      "smallest peak reserved the planner reached) is {} ({} bytes)",
      format_bytes(options.budget), host, p.device.name,
      known ? format_bytes(floor) : std::string("unknown"), known ? floor.count() : 0)};
}

Result<PlanOutcome> make_plan(const Model& model, const DeviceProfile& device,
                              const PlannerOptions& options, Bytes* floor) {
  Planner planner(model, device, options.steps);
  return planner.plan(options, floor);
}

}  // namespace ferry::sim
