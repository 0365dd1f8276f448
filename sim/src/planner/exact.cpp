#include "ferry/sim/planner/exact.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <utility>

#include "tensors.hpp"

namespace ferry::sim::planning {

// Note [Layer options]
// The exact stage states a space and solves it. A layer's options are its configurations
// (LayerConfig): every recompute level of its ranking, and every tail without a level (a
// region that serves its first ops from forward and recomputes the ops from a point to its
// end: "keep the head, recompute the tail", which no level of a ranking by bytes per ns
// expresses), each with what the layer keeps left on the device or offloaded. The tails start
// at the latest op where the region's held bytes fall below what the layer saves without one,
// and at earlier ops each at least a sixth of that lower (space.cpp).
//
// The options are measured around a reference: where the search's earlier stages ended (the
// fastest per-layer plan they found). Layers that are alike (the same ops, durations, bytes,
// levels and tails) form a class; a class is measured once, on its middle layer, and the
// stack's last layer apart (it is recomputed first in backward, at the peak, so what it keeps
// costs the peak otherwise). Each option is one run of the cost model with that layer changed
// and every other as in the reference: the step time it adds, the peak reserved bytes it
// frees, the bytes it copies to the host. Of those, the options no other one beats on all
// three are kept (pareto), and each member counts them from its own configuration in the
// reference (as the measured layer saw it).
//
// The choice of one option per layer is then solved exactly under an additive model (Note
// [The option model]), placed (within a class, the offloaded options on the earliest layers,
// whose copies have the most forward left to hide behind, and the more recompute the later
// the layer; the model's cost does not depend on the order), and run. The model is not the
// simulator: a recomputed layer's transient in backward, the allocator's rounding and the
// link's queue are not additive. So the cost model judges the choice, and where its peak is
// over the budget the model is asked to free that much more, and solved again (at most kRounds
// runs); a choice that fits with room to spare is solved once more with half that room given
// back. Where layers are coupled, the options are measured again around two other points
// (Note [Layers are coupled]). The fastest choice that fits goes to the local search
// (search.cpp), which refines it.

// Note [Layers are coupled]
// An option's freed bytes are measured with every other layer as in the reference, and the
// peak is not a sum: it falls in the backward of whichever layer holds the most at that time
// (the stack's last layer, recomputed first, while the others still hold what they saved; or
// an earlier one when the last keeps more and has freed it). So two options can free together
// what neither frees alone (a traced Mixtral cut to two layers: the first layer checkpointed
// whole, the last recomputing all but its expert matmuls), and the model, counting each alone,
// never picks them. Two more kinds of measurement repair that. When the model's first choice
// moved away from the reference and did not fit, the options are measured again around that
// choice (as the linearization of a non-linear cost is redone at the new point), and solved.
// And on stacks of at most kShallowStack layers, the stack's last layer is pinned at each of
// its kPins fastest options on the Pareto set (its own in the reference aside); the other
// layers' options that were on that set, and plain checkpointing, are measured again against
// it, and solved with one repair. Only there: in a shallow stack one layer is a quarter or
// more of what the layers save and moves the peak; in a deep one each layer is a small part of
// it, the additive model is close, and the passes would cost the most (a run of the cost
// model grows with depth). The fastest of what fits is the stage's answer.

// Note [The option model]
// One option per layer, each counted from the reference (Note [Layer options]); the options'
// freed bytes add up and must reach what the reference is over the budget (`need`, negative
// when it has room); their moved bytes add up and must keep the reference's pinned memory
// within the host budget; their added times add up, and the link is priced once for all: the
// bytes copied beyond what it carries in a step without a stall cost their time at its
// bandwidth. What it carries is calibrated on the reference: its bytes copied less its stall
// times the bandwidth when it stalled, else at least its bytes copied and the bandwidth times
// the forward's roofline time. Each option's measured time has the link's part (by this
// model) taken out, so that the link is not counted once per layer.
//
// Every layer's freed and moved bytes are counted from its option that frees and moves the
// least, so that none is negative (the totals shift by a constant: one option per layer).
// Freed bytes are counted in whole memory units, rounded down, and need rounded up: the
// largest unit that divides every option's freed bytes when need is at most 4096 of it (then
// the count is exact), else need in 512 units; moved bytes in whole moved units, rounded up
// (the most any choice moves in at most 32 units): a choice the model admits frees at least
// `need` and moves at most the host budget. The dynamic program runs over the layers with the
// state (units freed, capped at need; units moved) and keeps the least time for each state:
// it is exact for this model, which PlanExact.TheDynamicProgramMatchesBruteForce checks
// against every choice of a 4-layer model's options.

// Note [Options another beats]
// An option that another option of its layer beats in units (strictly faster, freeing as many
// units and moving as few) is set aside before the program runs: in a choice, swapping it for
// the other frees as much, moves as little (the link's time does not grow with fewer bytes) and
// takes less time, so no choice of least cost holds it. Setting it aside leaves the choice the
// program picks unchanged: along the picked choice's states, the option taken at each was the
// first of least time, other candidates only get slower without it, and the end state of least
// cost is still the first. An option only as fast as one that beats it stays (the first of
// equal times is the one picked). PlanExact.TheProgramPicksWhatTheProgramOverEveryOptionPicks
// compares the picks with a program over every option. On the traced Llama-3.2-3B at 41 GiB
// (bench_plan), 6 to 11 of a layer's 17 to 22 options are beaten so.

namespace {

// Runs of the cost model the repair may make (Note [Layer options]).
constexpr int kRounds = 6;
// Options of the stack's last layer the others are measured against (Note [Layers are coupled]).
constexpr std::size_t kPins = 4;
constexpr std::int64_t kMemoryUnits = 512;
constexpr std::int64_t kExactMemoryUnits = 4096;
constexpr std::int64_t kMovedUnits = 32;
constexpr std::int64_t kInfinity = std::numeric_limits<std::int64_t>::max() / 4;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The link's time for `moved` bytes beyond `link` (Note [The option model]).
std::int64_t link_ns(const OptionProblem& problem, std::int64_t moved) {
  const std::int64_t over = moved - problem.link;
  if (over <= 0) return 0;
  return static_cast<std::int64_t>(static_cast<Wide>(over) * 1'000'000'000 /
                                   std::max<std::int64_t>(1, problem.bandwidth));
}

std::int64_t freed_units(const LayerOption& o, const OptionUnits& u) {
  return std::max<std::int64_t>(0, o.freed) / u.memory;
}

std::int64_t moved_units(const LayerOption& o, const OptionUnits& u) {
  return ceil_div(std::max<std::int64_t>(0, o.moved), u.moved);
}

std::int64_t need_units(const OptionProblem& p, const OptionUnits& u) {
  return ceil_div(std::max<std::int64_t>(0, p.need), u.memory);
}

// `problem` with every layer's freed and moved bytes counted from its option that frees the
// least and moves the least, so that none is negative, and need, link and host less what
// those options free and move: one option per layer is chosen, so a choice costs the same and
// fits alike in both (Note [The option model]).
OptionProblem normalized(const OptionProblem& problem) {
  OptionProblem p = problem;
  for (auto& options : p.options) {
    std::int64_t least_freed = std::numeric_limits<std::int64_t>::max();
    std::int64_t least_moved = std::numeric_limits<std::int64_t>::max();
    for (const LayerOption& o : options) {
      least_freed = std::min(least_freed, o.freed);
      least_moved = std::min(least_moved, o.moved);
    }
    for (LayerOption& o : options) {
      o.freed -= least_freed;
      o.moved -= least_moved;
    }
    p.need -= least_freed;
    p.link -= least_moved;
    if (p.host) *p.host -= least_moved;
  }
  return p;
}

OptionUnits units_in(const OptionProblem& problem) {
  OptionUnits u;
  // Whole bytes in common to every option's freed bytes when need is few of them (then the
  // model counts bytes exactly), else need in kMemoryUnits units.
  const std::int64_t need = std::max<std::int64_t>(0, problem.need);
  std::int64_t common = 0;
  for (const auto& options : problem.options) {
    for (const LayerOption& o : options)
      common = std::gcd(common, std::max<std::int64_t>(0, o.freed));
  }
  u.memory = common > 0 && ceil_div(need, common) <= kExactMemoryUnits
                 ? common
                 : std::max<std::int64_t>(1, ceil_div(need, kMemoryUnits));
  std::int64_t most = 0;
  for (const auto& options : problem.options) {
    std::int64_t m = 0;
    for (const LayerOption& o : options) m = std::max(m, o.moved);
    most += m;
  }
  u.moved = std::max<std::int64_t>(1, ceil_div(most, kMovedUnits));
  return u;
}

}  // namespace

OptionUnits units_of(const OptionProblem& problem) { return units_in(normalized(problem)); }

std::optional<std::int64_t> option_cost(const OptionProblem& raw, const OptionUnits& units,
                                        const std::vector<std::size_t>& picked) {
  const OptionProblem problem = normalized(raw);
  std::int64_t freed = 0;
  std::int64_t moved = 0;
  std::int64_t time = 0;
  for (std::size_t l = 0; l < picked.size(); ++l) {
    const LayerOption& o = problem.options[l][picked[l]];
    freed += freed_units(o, units);
    moved += moved_units(o, units);
    time += o.time_ns;
  }
  if (freed < need_units(problem, units)) return std::nullopt;
  if (problem.host && moved * units.moved > *problem.host) return std::nullopt;
  return time + link_ns(problem, moved * units.moved);
}

std::optional<OptionChoice> solve_options(const OptionProblem& raw) {
  const OptionProblem problem = normalized(raw);
  const OptionUnits units = units_in(problem);
  const std::size_t n = problem.options.size();
  const std::int64_t m_size = need_units(problem, units) + 1;
  // Each layer's options in units, less those another option beats: strictly faster, freeing
  // as many units and moving as few (Note [Options another beats]). And the states the first l
  // layers reach: units freed up to m_reach[l] (capped at need) and moved up to k_reach[l];
  // every other state's time is infinite, so the loops below skip it.
  struct Unit {
    std::int64_t freed;
    std::int64_t moved;
    std::int64_t time_ns;
    std::uint32_t option;  // its index in the layer's options
  };
  std::vector<std::vector<Unit>> layers(n);
  std::vector<std::int64_t> m_reach(n + 1, 0);
  std::vector<std::int64_t> k_reach(n + 1, 0);
  for (std::size_t l = 0; l < n; ++l) {
    std::vector<Unit> all;
    for (std::size_t o = 0; o < problem.options[l].size(); ++o) {
      const LayerOption& option = problem.options[l][o];
      all.push_back(Unit{freed_units(option, units), moved_units(option, units), option.time_ns,
                         static_cast<std::uint32_t>(o)});
    }
    std::int64_t freed = 0;
    std::int64_t moved = 0;
    for (const Unit& u : all) {
      const bool beaten = std::any_of(all.begin(), all.end(), [&](const Unit& v) {
        return v.time_ns < u.time_ns && v.freed >= u.freed && v.moved <= u.moved;
      });
      if (beaten) continue;
      layers[l].push_back(u);
      freed = std::max(freed, u.freed);
      moved = std::max(moved, u.moved);
    }
    m_reach[l + 1] = std::min(m_size - 1, m_reach[l] + freed);
    k_reach[l + 1] = k_reach[l] + moved;
  }
  const std::int64_t k_size = k_reach[n] + 1;
  const auto index = [&](std::int64_t m, std::int64_t k) {
    return static_cast<std::size_t>(m * k_size + k);
  };
  const std::size_t states = static_cast<std::size_t>(m_size * k_size);
  std::vector<std::int64_t> best(states, kInfinity);
  std::vector<std::int64_t> next(states, kInfinity);
  best[index(0, 0)] = 0;
  // Per layer and reached state: the option taken there and the units freed before it. Only
  // states a layer reaches are written, and only those are read back.
  struct Step {
    std::uint32_t option;
    std::int32_t from_m;
  };
  std::vector<std::unique_ptr<Step[]>> steps(n);
  for (std::size_t l = 0; l < n; ++l) {
    const std::vector<Unit>& options = layers[l];
    steps[l] = std::make_unique_for_overwrite<Step[]>(index(m_reach[l + 1], k_size - 1) + 1);
    for (std::int64_t m = 0; m <= m_reach[l + 1]; ++m) {
      std::fill_n(next.begin() + static_cast<std::ptrdiff_t>(index(m, 0)), k_reach[l + 1] + 1,
                  kInfinity);
    }
    for (std::int64_t m = 0; m <= m_reach[l]; ++m) {
      for (std::int64_t k = 0; k <= k_reach[l]; ++k) {
        const std::int64_t t = best[index(m, k)];
        if (t >= kInfinity) continue;
        for (const Unit& u : options) {
          const std::size_t at = index(std::min(m_size - 1, m + u.freed), k + u.moved);
          const std::int64_t t2 = t + u.time_ns;
          if (t2 < next[at]) {
            next[at] = t2;
            steps[l][at] = Step{u.option, static_cast<std::int32_t>(m)};
          }
        }
      }
    }
    std::swap(best, next);
  }
  std::optional<OptionChoice> choice;
  std::int64_t end_k = -1;
  for (std::int64_t k = 0; k < k_size; ++k) {
    const std::int64_t t = best[index(m_size - 1, k)];
    if (t >= kInfinity) continue;
    if (problem.host && k * units.moved > *problem.host) continue;  // also when host < 0
    const std::int64_t cost = t + link_ns(problem, k * units.moved);
    if (!choice || cost < choice->cost_ns) {
      choice = OptionChoice{{}, cost};
      end_k = k;
    }
  }
  if (!choice) return std::nullopt;
  choice->picked.assign(problem.options.size(), 0);
  std::int64_t m = m_size - 1;
  std::int64_t k = end_k;
  for (std::size_t l = problem.options.size(); l-- > 0;) {
    const Step s = steps[l][index(m, k)];
    choice->picked[l] = s.option;
    k -= moved_units(problem.options[l][s.option], units);
    m = s.from_m;
  }
  return choice;
}

std::vector<std::vector<std::size_t>> layer_classes(const PlanSpace& space) {
  const Model& model = space.model();
  std::map<std::string, std::size_t> index;
  std::vector<std::vector<std::size_t>> classes;
  for (std::size_t l = 0; l < space.layers().size(); ++l) {
    const Layer& layer = space.layers()[l];
    std::string key = fmt::format("{}|{}|", layer.end - layer.first, fmt::join(layer.levels, ","));
    for (const std::uint32_t t : layer.tails) key += fmt::format("{},", t - layer.first);
    for (const std::uint32_t p : layer.ranking) key += fmt::format("{},", p - layer.first);
    for (std::uint32_t i = layer.first; i < layer.end; ++i) {
      const ModelOp& op = model.ops[i];
      key += fmt::format("|{}:{}:{}:{}:{}", op.kind.name(), op.duration.ns(),
                         op.backward_duration.ns(), op.inputs.size(), op.saved.size());
      for (const std::uint32_t t : op.outputs)
        key += fmt::format(":{}", model.tensors[t].bytes.count());
    }
    const auto [it, added] = index.emplace(std::move(key), classes.size());
    if (added) classes.emplace_back();
    classes[it->second].push_back(l);
  }
  return classes;
}

std::vector<LayerConfig> options_of(const Layer& layer, bool offload) {
  std::vector<LayerConfig> out;
  for (const bool off : {false, true}) {
    if (off && !offload) continue;
    for (std::size_t k = 0; k < layer.levels.size(); ++k) out.push_back(LayerConfig{k, off, 0});
    for (std::size_t t = 1; t < layer.tails.size(); ++t) out.push_back(LayerConfig{0, off, t});
  }
  return out;
}

std::vector<LayerOption> pareto(std::vector<LayerOption> options) {
  const auto beats = [](const LayerOption& a, const LayerOption& b) {
    const bool no_worse = a.time_ns <= b.time_ns && a.freed >= b.freed && a.moved <= b.moved;
    return no_worse && (a.time_ns < b.time_ns || a.freed > b.freed || a.moved < b.moved);
  };
  std::vector<LayerOption> out;
  for (std::size_t i = 0; i < options.size(); ++i) {
    const LayerOption& o = options[i];
    const bool zero = o.config == LayerConfig{};
    bool beaten = false;
    for (std::size_t j = 0; j < options.size() && !zero && !beaten; ++j) {
      // Equal options: the first stays.
      beaten = beats(options[j], o) || (j < i && options[j].time_ns == o.time_ns &&
                                        options[j].freed == o.freed && options[j].moved == o.moved);
    }
    if (!beaten) out.push_back(o);
  }
  return out;
}

namespace {

// The configurations of `choice` (Note [Layer options]): within a class, the offloaded options
// on its earliest layers, then the others, the least added time first.
std::vector<LayerConfig> place(const OptionProblem& problem, const OptionChoice& choice,
                               const std::vector<std::vector<std::size_t>>& classes) {
  std::vector<LayerConfig> configs(problem.options.size());
  for (const auto& members : classes) {
    std::vector<LayerOption> picked;
    for (const std::size_t l : members) picked.push_back(problem.options[l][choice.picked[l]]);
    std::stable_sort(picked.begin(), picked.end(), [](const LayerOption& a, const LayerOption& b) {
      if (a.config.offload != b.config.offload) return a.config.offload;
      return a.time_ns < b.time_ns;
    });
    for (std::size_t m = 0; m < members.size(); ++m) configs[members[m]] = picked[m].config;
  }
  return configs;
}

// The option model around a reference, with the groups it measured (each class, its last
// layer apart) and every option measured on the stack's last layer, when it is a group of its
// own (the Pareto set's and the others), counted from the reference.
struct Measured {
  OptionProblem problem;
  std::vector<std::vector<std::size_t>> classes;
  std::vector<LayerOption> last;
};

// The link's capacity in a step (Note [The option model]): what it carries without a stall,
// from the reference's run `base` when it stalled, else at least what it carried and the
// bandwidth times the forward's roofline time.
std::int64_t link_capacity(Search& search, const Evaluation& base) {
  const std::int64_t bandwidth = search.space().d2h_bandwidth();
  if (base.stall > SimTime(0)) {
    return base.d2h.count() - static_cast<std::int64_t>(static_cast<Wide>(base.stall.ns()) *
                                                        bandwidth / 1'000'000'000);
  }
  std::int64_t forward_ns = 0;
  for (const ModelOp& op : search.space().model().ops) forward_ns += op.duration.ns();
  return std::max(base.d2h.count(), static_cast<std::int64_t>(static_cast<Wide>(bandwidth) *
                                                              forward_ns / 1'000'000'000));
}

// The groups measured: each class of layers, its last layer apart (its recompute runs first in
// backward, at the peak, so what it keeps costs the peak differently).
std::vector<std::vector<std::size_t>> measured_groups(Search& search) {
  std::vector<std::vector<std::size_t>> groups;
  for (std::vector<std::size_t> members : layer_classes(search.space())) {
    if (members.size() >= 2) {
      groups.push_back({members.back()});
      members.pop_back();
    }
    groups.push_back(std::move(members));
  }
  return groups;
}

// `options` counted from `own`, a layer's own configuration among them.
std::vector<LayerOption> relative_to(std::vector<LayerOption> options, const LayerOption& own) {
  for (LayerOption& o : options) {
    o.time_ns -= own.time_ns;
    o.freed -= own.freed;
    o.moved -= own.moved;
  }
  return options;
}

// The option model around `reference` (Note [Layer options]): each group's options measured on
// its middle layer; the layer `pinned`, when a group of its own, has its reference
// configuration as its one option. None when the reference's own run failed.
std::optional<Measured> measure_around(Search& search, const Position& reference,
                                       std::optional<std::size_t> pinned = std::nullopt) {
  const std::size_t n = search.layers().size();
  const PlanKnobs knobs;
  const Evaluation& base = reference.evaluation;
  const Budgets& budgets = search.budgets();
  const bool offload = !budgets.host || *budgets.host > Bytes(0);
  Measured out;
  OptionProblem& problem = out.problem;
  problem.bandwidth = search.space().d2h_bandwidth();
  problem.link = link_capacity(search, base) - base.d2h.count();
  problem.need = (base.reserved - budgets.device).count();
  if (budgets.host) problem.host = (*budgets.host - base.pinned).count();
  out.classes = measured_groups(search);
  problem.options.resize(n);
  // Every option of every group, run side by side ahead of the loop that reads them.
  std::vector<Plan> upcoming;
  for (const auto& members : out.classes) {
    if (pinned && members == std::vector<std::size_t>{*pinned}) continue;
    const std::size_t middle = members[members.size() / 2];
    for (const LayerConfig& config : options_of(search.layers()[middle], offload)) {
      std::vector<LayerConfig> configs = reference.configs;
      configs[middle] = config;
      upcoming.push_back(search.plan_of(configs, knobs));
    }
  }
  search.stage("exact: layer options", static_cast<std::int64_t>(upcoming.size()));
  search.ahead(upcoming, true);
  std::size_t next_plan = 0;  // upcoming[next_plan] is the plan of the next option measured
  for (const auto& members : out.classes) {
    if (pinned && members == std::vector<std::size_t>{*pinned}) {
      problem.options[*pinned] = {LayerOption{reference.configs[*pinned], 0, 0, 0}};
      continue;
    }
    const std::size_t middle = members[members.size() / 2];
    std::vector<LayerOption> measured;
    const std::vector<LayerConfig> configs_measured = options_of(search.layers()[middle], offload);
    for (const LayerConfig& config : configs_measured) {
      const Evaluation e = search.evaluate(upcoming[next_plan++]);
      if (!e.ok) continue;
      // The time an option adds besides the link's (what the link model prices).
      const std::int64_t moved = (e.d2h - base.d2h).count();
      const std::int64_t link = link_ns(problem, moved) - link_ns(problem, 0);
      measured.push_back(LayerOption{config, (e.time - base.time).ns() - link,
                                     (base.reserved - e.reserved).count(), moved});
    }
    if (members == std::vector<std::size_t>{n - 1}) out.last = measured;
    // Each member's options are counted from its own configuration in the reference, as the
    // middle layer measured it (a class's members can differ there).
    const std::vector<LayerOption> kept = pareto(measured);
    for (const std::size_t l : members) {
      const auto own = std::find_if(measured.begin(), measured.end(), [&](const LayerOption& o) {
        return o.config == reference.configs[l];
      });
      if (own == measured.end()) return std::nullopt;  // the reference's own run failed
      problem.options[l] = relative_to(kept, *own);
    }
  }
  return out;
}

// What solving the option model around one reference found: the fastest choice that fits,
// and the model's first choice as the cost model ran it (fitting or not).
struct Solved {
  std::optional<Position> best;
  std::optional<Position> first;
};

// Solves `measured`, has the cost model judge each choice and repairs (Note [Layer options]).
Solved solve_and_repair(Search& search, Measured measured, int rounds = kRounds) {
  search.stage("exact: choices");
  const PlanKnobs knobs;
  const Budgets& budgets = search.budgets();
  OptionProblem& problem = measured.problem;
  Solved out;
  bool gave_back = false;
  for (int round = 0; round < rounds; ++round) {
    const std::optional<OptionChoice> choice = solve_options(problem);
    if (!choice) break;
    std::vector<LayerConfig> configs = place(problem, *choice, measured.classes);
    const Evaluation e = search.evaluate(search.plan_of(configs, knobs));
    if (!e.ok) break;
    if (round == 0) out.first = Position{configs, e};
    if (search.fits(e)) {
      if (!out.best || e.time < out.best->evaluation.time)
        out.best = Position{std::move(configs), e};
      const std::int64_t room = (budgets.device - e.reserved).count();
      if (gave_back || room < units_of(problem).memory) break;
      problem.need -= room / 2;
      gave_back = true;
      continue;
    }
    if (gave_back && out.best) break;
    if (e.reserved > budgets.device) problem.need += (e.reserved - budgets.device).count();
    if (budgets.host && e.pinned > *budgets.host) {
      *problem.host -= (e.pinned - *budgets.host).count();
    }
  }
  return out;
}

}  // namespace

std::optional<Position> exact_stage(Search& search, const Position& from) {
  const std::size_t n = search.layers().size();
  if (n == 0) return std::nullopt;
  // The reference: where the search ended, or everything kept when that did not complete.
  Position reference = from;
  if (!reference.evaluation.ok || reference.configs.size() != n) {
    reference.configs.assign(n, LayerConfig{});
    reference.evaluation = search.evaluate(search.plan_of(reference.configs, PlanKnobs{}));
    if (!reference.evaluation.ok) return std::nullopt;
  }
  std::optional<Measured> measured = measure_around(search, reference);
  if (!measured) return std::nullopt;
  const std::vector<LayerOption> last_options = std::move(measured->last);
  Solved solved = solve_and_repair(search, std::move(*measured));
  const auto take = [&](const Solved& other) {
    if (other.best &&
        (!solved.best || other.best->evaluation.time < solved.best->evaluation.time)) {
      solved.best = other.best;
    }
  };
  // Layers are coupled (Note [Layers are coupled]): when the model's first choice moved away
  // from the reference and did not fit, the options are measured once more around it.
  if (solved.first && !search.fits(solved.first->evaluation) &&
      solved.first->configs != reference.configs) {
    if (std::optional<Measured> again = measure_around(search, *solved.first)) {
      take(solve_and_repair(search, std::move(*again)));
    }
  }
  // And on a shallow stack, with its last layer pinned at each of its kPins options that are
  // faster than its own in the reference and free the most: every other layer's options
  // measured against it, and solved.
  if (n > kShallowStack) return solved.best;
  const std::size_t last = n - 1;
  std::vector<LayerOption> pins;
  for (const LayerOption& o : last_options) {
    if (o.time_ns < 0) pins.push_back(o);
  }
  std::stable_sort(pins.begin(), pins.end(), [](const LayerOption& a, const LayerOption& b) {
    return a.freed != b.freed ? a.freed > b.freed : a.time_ns < b.time_ns;
  });
  if (pins.size() > kPins) pins.resize(kPins);
  const Position around = solved.best ? *solved.best : reference;
  std::vector<Plan> centers;
  for (const LayerOption& pin : pins) {
    std::vector<LayerConfig> configs = around.configs;
    configs[last] = pin.config;
    centers.push_back(search.plan_of(configs, PlanKnobs{}));
  }
  search.ahead(centers, true);
  for (const LayerOption& pin : pins) {
    Position center = around;
    center.configs[last] = pin.config;
    center.evaluation = search.evaluate(search.plan_of(center.configs, PlanKnobs{}));
    if (!center.evaluation.ok) continue;
    if (std::optional<Measured> again = measure_around(search, center, last)) {
      take(solve_and_repair(search, std::move(*again), 2));
    }
  }
  return solved.best;
}

}  // namespace ferry::sim::planning
