#include "ferry/sim/planner/search.hpp"

#include <algorithm>
#include <iterator>
#include <limits>
#include <span>
#include <utility>

#include "ferry/sim/planner/exact.hpp"
#include "ferry/sim/planner/lower.hpp"
#include "tensors.hpp"

namespace ferry::sim::planning {

// Note [Planner search]
// A plan is searched for per transformer layer. A layer's configuration is a recompute level
// and an offload flag (the saved tensors the layer keeps, and the region's inputs, go to pinned
// host memory instead). Level 0 is no region; level k re-runs, in backward, the first ops of
// the layer's recompute ranking inside a checkpoint region over the layer, and serves the
// others' outputs from forward (must-save, which holds every output of theirs, saved or not:
// what PyTorch's selective checkpoint caches). The ranking puts first the ops that free the most
// bytes per nanosecond of recompute; the levels are the points of the ranking where the bytes
// a region would hold fall, once they are below what the layer saves without a region (the
// first ops of a traced layer's ranking free less than the region holds for the others), and
// the top level, plain checkpointing; when there are more than 16 such points (a traced layer
// has dozens of ops), only those at least a sixteenth of the layer's saved bytes apart, and
// those just before an op that takes a sixteenth of the layer's forward time or more (a mixture
// of experts' expert matmul: "all but the expert matmuls" is then a level). (space.cpp)
//
// The search, against a cost model (Note [The cost model]; the planner's is the simulator), in
// stages. Seed: the fixed configurations of `ferry compare` that a plan can express are
// candidates (simulated once per planner, with the rows of the report), so the plan is never
// slower than the best of them that fits. Descend: a greedy descent from everything kept
// evaluates two moves a round (recompute one level more on the layers with the lowest level,
// the last of them first; offload the earliest layers not offloaded, since their copies have
// the most forward time left to hide behind and are reloaded last) and takes the one that
// costs the least step time per byte of peak reserved it frees; a move spans several layers
// while the budget is far away (how many from the saving per layer the last move of its kind
// measured), one layer near it. Refine: a local search over classes of layers with the same
// configuration runs from where the greedy ended; uniform plans (every layer at one level, the
// last layers offloaded) are searched too, and the local search runs again from the best
// uniform plan and from the fastest fixed configuration that fits, each when it is faster than
// the best so far. Knobs: the knob variants of `ferry compare` are tried on the result.
// Exact: around the result, layer options are measured and one per layer chosen by a dynamic
// program (Note [Layer options] in exact.cpp), and the local search refines that choice.
// Single ops: from the fastest candidate, ops a region recomputes are kept one at a time
// (Note [Single ops kept]). A
// cost model that keeps its runs by plan (the simulator's does) runs a configuration two paths
// reach once. docs/plan.md has the whole method.

namespace {

// Note [Search effort]
// A local search may ask about kLocalRuns plans it has not asked about before, whether the cost
// model has them cached or runs them: so its path, and the plan, do not depend on what earlier
// searches left in the cache (a budget planned twice by one Planner gets the same plan, and a
// sweep's plans do not depend on the order of its budgets).
constexpr std::int64_t kLocalRuns = 40;

// Layers with the same configuration, in the order of their first layer.
std::vector<std::vector<std::size_t>> classes_of(const std::vector<LayerConfig>& configs) {
  std::vector<std::vector<std::size_t>> classes;
  for (std::size_t l = 0; l < configs.size(); ++l) {
    auto it = std::find_if(classes.begin(), classes.end(),
                           [&](const auto& c) { return configs[c.front()] == configs[l]; });
    if (it == classes.end()) {
      classes.push_back({l});
    } else {
      it->push_back(l);
    }
  }
  return classes;
}

// The parts of a class of `size` layers a move takes, as [lo, hi) of its members: the whole
// class, its first or second half, its first or last layer (each once).
std::vector<std::pair<std::size_t, std::size_t>> parts_of(std::size_t size) {
  const std::size_t half = size / 2;
  std::vector<std::pair<std::size_t, std::size_t>> parts;
  for (const auto& s :
       {std::pair{std::size_t{0}, size}, {0, half}, {half, size}, {0, 1}, {size - 1, size}}) {
    if (s.first < s.second && std::find(parts.begin(), parts.end(), s) == parts.end()) {
      parts.push_back(s);
    }
  }
  return parts;
}

// The configurations next to `from` (`top`: the layer's highest level): one level less or more,
// offload on or off, or one level less traded for offload.
std::vector<LayerConfig> neighbours_of(const LayerConfig& from, std::size_t top) {
  std::vector<LayerConfig> neighbours;
  const std::size_t tail = from.tail;  // a layer's tail is the exact stage's, kept as it is
  if (from.level > 0) neighbours.push_back(LayerConfig{from.level - 1, from.offload, tail});
  if (from.level < top) neighbours.push_back(LayerConfig{from.level + 1, from.offload, tail});
  neighbours.push_back(LayerConfig{from.level, !from.offload, tail});
  if (from.level > 0 && !from.offload) {
    neighbours.push_back(LayerConfig{from.level - 1, true, tail});
  }
  if (from.level < top && from.offload) {
    neighbours.push_back(LayerConfig{from.level + 1, false, tail});
  }
  return neighbours;
}

enum class Step { Improved, Nothing, Spent };

// Tries the moves of one class of layers in order and takes the first that still fits and is
// faster; Spent when the runs up to `stop` ran out first.
Step move_class(Search& search, Position& position, const std::vector<std::size_t>& members,
                const PlanKnobs& knobs, std::int64_t stop) {
  const LayerConfig from = position.configs[members.front()];
  const std::size_t top = search.layers()[members.front()].levels.size() - 1;
  const std::vector<LayerConfig> neighbours = neighbours_of(from, top);
  // The moves in the order they are tried; the plans of the next ones the cost model runs at
  // once are made ahead of them.
  std::vector<std::vector<LayerConfig>> moves;
  for (const auto& [lo, hi] : parts_of(members.size())) {
    for (const LayerConfig& to : neighbours) {
      std::vector<LayerConfig> next = position.configs;
      for (std::size_t m = lo; m < hi; ++m) {
        const std::size_t l = members[m];
        next[l] = LayerConfig{std::min(to.level, search.layers()[l].levels.size() - 1), to.offload,
                              std::min(to.tail, search.layers()[l].tails.size() - 1)};
      }
      moves.push_back(std::move(next));
    }
  }
  std::vector<Plan> plans;  // plans[j] is the plan of moves[j], made up to where needed
  const std::size_t width = search.cost().width();
  for (std::size_t i = 0; i < moves.size(); ++i) {
    if (search.asked() >= stop) return Step::Spent;
    const std::size_t end = std::min(moves.size(), i + width);
    while (plans.size() < end) plans.push_back(search.plan_of(moves[plans.size()], knobs));
    if (width > 1) search.ahead(std::span<const Plan>(plans).subspan(i), false);
    const Evaluation e = search.evaluate(plans[i]);
    if (!search.fits(e) || e.time >= position.evaluation.time) continue;
    position = Position{std::move(moves[i]), e};
    return Step::Improved;
  }
  return Step::Nothing;
}

// Local search from a position that fits (Note [Planner search]): layers with the same
// configuration form a class; a move takes a part of a class (parts_of) to a neighbouring
// configuration (neighbours_of). The first move that still fits and is faster is taken, and
// the search starts over, until no move helps or `runs` plans new to this search are asked
// (Note [Search effort]).
void local_search(Search& search, Position& position, const PlanKnobs& knobs, std::int64_t runs) {
  const std::int64_t stop = search.asked() + runs;
  bool improved = true;
  while (improved && search.asked() < stop) {
    improved = false;
    for (const auto& members : classes_of(position.configs)) {
      const Step step = move_class(search, position, members, knobs, stop);
      if (step == Step::Spent) return;
      if (step == Step::Improved) {
        improved = true;
        break;
      }
    }
  }
}

// Runs the bisection's probe `mid` of [lo, hi) ahead, beside the probes that may follow it: the
// middle of [lo, mid) (when mid fits) and of [mid + 1, hi) (when it does not), as many as the
// cost model runs at once. The bisection then asks for the same plans in the same order as
// without workers; a probe it does not reach is run for nothing.
template <typename PlanOf>
void run_probes_ahead(Search& search, std::size_t lo, std::size_t mid, std::size_t hi,
                      const PlanOf& plan_of) {
  std::vector<Plan> probes = {plan_of(mid)};
  if (lo < mid) probes.push_back(plan_of(lo + (mid - lo) / 2));
  if (mid + 1 < hi) probes.push_back(plan_of(mid + 1 + (hi - mid - 1) / 2));
  search.ahead(probes, false);
}

// The fastest uniform plan that fits (Note [Planner search]): every layer at level k, the last
// m layers offloaded; for each k from 0 up, the smallest m that fits, found by bisection (the
// peak falls as m grows, and as k does: the bisection for k starts from the m found for the
// last level that fit); a bisection stops at a probe that does not fit and is already slower
// than the fastest plan found so far (each m left offloads more). Stops at the first k that
// fits with nothing offloaded (a higher level only recomputes more), and at the first k whose
// plan without offload is already no faster than the best plan found so far (offload does not
// make a step faster, and a higher level is slower still).
std::optional<Position> best_uniform(Search& search, const PlanKnobs& knobs) {
  const std::size_t n = search.layers().size();
  std::size_t top = 0;
  for (const Layer& layer : search.layers()) top = std::max(top, layer.levels.size() - 1);
  std::optional<Position> best;
  std::size_t most = n;  // the fewest offloaded layers known to fit at the last level that fit
  for (std::size_t k = 0; k <= top && n > 0; ++k) {
    auto config = [&](std::size_t m) {
      std::vector<LayerConfig> c(n);
      for (std::size_t l = 0; l < n; ++l) {
        c[l] = LayerConfig{std::min(k, search.layers()[l].levels.size() - 1), l + m >= n, 0};
      }
      return c;
    };
    auto try_m = [&](std::size_t m) {
      const Evaluation e = search.evaluate(search.plan_of(config(m), knobs));
      if (search.fits(e) && (!best || e.time < best->evaluation.time))
        best = Position{config(m), e};
      return e;
    };
    std::vector<Plan> first = {search.plan_of(config(0), knobs)};
    if (search.cost().width() > 1) {
      // Run ahead with the plan of the most layers offloaded, which comes next unless this one
      // fits or is too slow.
      first.push_back(search.plan_of(config(most), knobs));
      search.ahead(first, false);
    }
    const Evaluation none = search.evaluate(first.front());
    const std::optional<SimTime> fastest = search.best_time();
    if (search.fits(none)) {
      if (!best || none.time < best->evaluation.time) best = Position{config(0), none};
      break;
    }
    if (none.ok && fastest && none.time >= *fastest) break;
    // A higher level holds less: the fewest offloaded layers that fit do not grow with k.
    if (!search.fits(try_m(most))) continue;
    std::size_t lo = 0;
    std::size_t hi = most;
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (search.cost().width() > 1) {
        run_probes_ahead(search, lo, mid, hi,
                         [&](std::size_t m) { return search.plan_of(config(m), knobs); });
      }
      const Evaluation probe = try_m(mid);
      if (search.fits(probe)) {
        hi = mid;
        continue;
      }
      // Every m that may still fit offloads more than mid and is no faster: when mid is
      // already slower than the fastest plan, none of them can be the plan.
      const std::optional<SimTime> best_so_far = search.best_time();
      if (probe.ok && best_so_far && probe.time > *best_so_far) break;
      lo = mid + 1;
    }
    if (hi == 0) break;
    most = hi;
  }
  return best;
}

// A move of the greedy descent: its layers' new configurations and what they cost.
struct Move {
  std::vector<LayerConfig> configs;
  Evaluation evaluation;
  std::size_t layers = 0;  // how many layers it changed
  bool recompute = false;  // recompute one level more, else offload
};

// What the last move of each kind freed per layer, and its size in layers.
struct MoveHistory {
  std::int64_t per_layer_recompute = 0;
  std::int64_t per_layer_offload = 0;
  std::size_t last_recompute = 0;
  std::size_t last_offload = 0;
};

// How many layers the next move of a kind spans, of `n` (Note [Planner search]): one at first
// and while over the host budget; twice as many as last time when the last move freed nothing
// at the peak (the peak lies elsewhere); else half the gap to the budget at what the last
// move of the kind freed per layer.
std::size_t batch_size(std::int64_t gap, bool over_host, std::size_t n, std::int64_t per_layer,
                       std::size_t last) {
  if (last == 0 || over_host) return 1;
  if (per_layer <= 0) return std::min(n, 2 * last);
  return static_cast<std::size_t>(
      std::clamp<std::int64_t>(gap / per_layer / 2, 1, static_cast<std::int64_t>(n)));
}

// The greedy descent's moves from `current` (not yet evaluated).
std::vector<Move> propose_moves(const Search& search, const Position& current,
                                const MoveHistory& h) {
  const std::size_t n = search.layers().size();
  const Budgets& budgets = search.budgets();
  const std::int64_t gap = (current.evaluation.reserved - budgets.device).count();
  const bool over_host = budgets.host && current.evaluation.pinned > *budgets.host;
  std::vector<Move> moves;
  // Recompute one level more on the layers with the lowest level, the last layers first.
  {
    std::vector<std::size_t> order(n);
    for (std::size_t l = 0; l < n; ++l) order[l] = n - 1 - l;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return current.configs[a].level < current.configs[b].level;
    });
    const std::size_t batch =
        batch_size(gap, over_host, n, h.per_layer_recompute, h.last_recompute);
    Move m{current.configs, {}, 0, true};
    for (const std::size_t l : order) {
      if (m.layers == batch) break;
      if (m.configs[l].level + 1 >= search.layers()[l].levels.size()) continue;
      ++m.configs[l].level;
      ++m.layers;
    }
    if (m.layers > 0) moves.push_back(std::move(m));
  }
  // Offload the earliest layers not offloaded (only while no pinned budget is exceeded).
  if (!over_host) {
    const std::size_t batch = batch_size(gap, over_host, n, h.per_layer_offload, h.last_offload);
    Move m{current.configs, {}, 0, false};
    for (std::size_t l = 0; l < n && m.layers < batch; ++l) {
      if (m.configs[l].offload) continue;
      m.configs[l].offload = true;
      ++m.layers;
    }
    if (m.layers > 0) moves.push_back(std::move(m));
  }
  return moves;
}

// The move that adds the least step time per byte freed (memory and pinned host above its
// budget count alike), or null when none completed.
const Move* cheapest_move(const Search& search, const Position& current,
                          const std::vector<Move>& moves) {
  auto cost = [&](const Move& m) {
    const std::int64_t freed =
        (current.evaluation.reserved - m.evaluation.reserved).count() +
        (search.budgets().host ? (current.evaluation.pinned - m.evaluation.pinned).count() : 0);
    const std::int64_t added = (m.evaluation.time - current.evaluation.time).ns();
    return std::pair<std::int64_t, std::int64_t>(added, std::max<std::int64_t>(freed, 1));
  };
  const Move* best = nullptr;
  for (const Move& m : moves) {
    if (!m.evaluation.ok) continue;
    if (best == nullptr) {
      best = &m;
      continue;
    }
    const auto [a1, f1] = cost(m);
    const auto [a0, f0] = cost(*best);
    if (static_cast<Wide>(a1) * f0 < static_cast<Wide>(a0) * f1) best = &m;
  }
  return best;
}

// The greedy descent from everything kept (Note [Planner search]); returns where it ended.
Position greedy_descent(Search& search) {
  const PlanKnobs knobs;
  Position current;
  current.configs.assign(search.layers().size(), LayerConfig{});
  current.evaluation = search.evaluate(search.plan_of(current.configs, knobs));
  MoveHistory history;
  while (current.evaluation.ok && !search.fits(current.evaluation)) {
    std::vector<Move> moves = propose_moves(search, current, history);
    if (moves.empty()) break;
    std::vector<Plan> plans;
    for (const Move& m : moves) plans.push_back(search.plan_of(m.configs, knobs));
    search.ahead(plans, true);
    for (std::size_t i = 0; i < moves.size(); ++i) moves[i].evaluation = search.evaluate(plans[i]);
    const Move* best = cheapest_move(search, current, moves);
    if (best == nullptr) break;
    for (const Move& m : moves) {
      // Every move evaluated tells how much its kind frees per layer now.
      const std::int64_t f =
          m.evaluation.ok ? (current.evaluation.reserved - m.evaluation.reserved).count() : 0;
      (m.recompute ? history.per_layer_recompute : history.per_layer_offload) =
          f / static_cast<std::int64_t>(m.layers);
      (m.recompute ? history.last_recompute : history.last_offload) = m.layers;
    }
    current = Position{best->configs, best->evaluation};
  }
  return current;
}

// Runs the local search from `start` when it fits and is no slower than the best candidate so
// far; what it reaches replaces `best` when `best` does not fit or is slower.
void improve_from(Search& search, Position start, Position& best) {
  const std::optional<SimTime> fastest = search.best_time();
  if (!search.fits(start.evaluation) || (fastest && start.evaluation.time > *fastest)) return;
  local_search(search, start, PlanKnobs{}, kLocalRuns);
  if (!search.fits(best.evaluation) || start.evaluation.time < best.evaluation.time) {
    best = std::move(start);
  }
}

// The fastest seed that fits and is a set of layer configurations (none under a host budget:
// the seeds were measured without one).
const Seed* fastest_seed(const Search& search, const std::vector<Seed>& seeds) {
  const Seed* fastest = nullptr;
  for (const Seed& seed : seeds) {
    if (!seed.configs || !search.fits(seed.evaluation) || search.budgets().host) continue;
    if (fastest == nullptr || seed.evaluation.time < fastest->evaluation.time) fastest = &seed;
  }
  return fastest;
}

// Note [Single ops kept]
// The last stage leaves the layers' configurations: from the fastest candidate, each op a
// region recomputes is kept instead, one at a time, the last layer's first and the longest
// ops first within a layer (their recompute costs the most), taking each change that still
// fits and is faster, until kOpRuns plans new to the search are asked. The last layer is
// recomputed first in backward, at the peak, where what it keeps can cost no peak at all;
// which of its ops those are, no level of a ranking says (keep the softmax of the last layer,
// ranked first for its bytes, where the budget is the peak of checkpointing every layer).
// On a shallow stack (kShallowStack) an earlier layer's ops weigh as much, so a second pass of
// kShallowOpRuns tries every layer's, the longest first (a keep the first pass took can stand
// in the way of a larger one); and an op whose keep is faster but over the budget is tried
// again with each of the next kPairs ops kept too: keeping an op can lower the peak, where its
// recompute's transient was larger than its outputs (a traced Mixtral's first layer at the
// peak of checkpointing: keeping its second expert matmul is 0.15 GB over, keeping its
// attention as well fits, 3.3 % faster). That pass runs from each of the kShallowStarts
// fastest candidates that save differently, not only the fastest: what a layer holds decides
// which keeps of the other layer fit (the same Mixtral on h100-sxm-pcie5: the fastest
// candidate's second layer offloads the level before its expert matmuls and keeps three small
// ops, and there the two keeps are 40 MB over; from the next, 0.36 % slower, which offloads
// that level and keeps nothing, they fit, 2.3 % faster than the first start's best).
constexpr std::int64_t kOpRuns = 24;
// On a shallow stack: the runs of the second pass from each start, how many ops after one that
// is over the budget are tried with it, and how many starts.
constexpr std::int64_t kShallowOpRuns = 16;
constexpr std::size_t kPairs = 3;
constexpr std::size_t kShallowStarts = 3;

// One pass of Note [Single ops kept] at a time over a plan: each recomputed op kept in turn,
// the change taken where it fits and is faster.
class SingleOps {
 public:
  SingleOps(Search& search, const Candidate& from)
      : search_(search),
        model_(search.space().model()),
        plan_(from.plan),
        time_(from.evaluation.time) {}

  // The first pass: the last layer's ops first, the longest first within a layer, until
  // kOpRuns plans new to the search are asked.
  void last_layer_first() {
    std::vector<std::uint32_t> order;
    for (auto r = plan_.regions.rbegin(); r != plan_.regions.rend(); ++r) {
      const std::vector<std::uint32_t> ops = recomputed_longest_first(r, std::next(r));
      order.insert(order.end(), ops.begin(), ops.end());
    }
    const std::int64_t stop = search_.asked() + kOpRuns;
    for (std::size_t k = 0; k < order.size(); ++k) {
      if (search_.asked() >= stop) break;
      if (search_.cost().width() > 1) run_ahead(order, k);
      Plan next;
      if (const std::optional<Evaluation> e = keep({order[k]}, next)) (void)take(next, *e);
    }
  }

  // The shallow stack's pass from `from`: every layer's ops, the longest first, and an op
  // whose keep is faster but over the budget together with each of the next kPairs.
  void every_layer_from(const Candidate& from) {
    plan_ = from.plan;
    time_ = from.evaluation.time;
    const std::vector<std::uint32_t> all =
        recomputed_longest_first(plan_.regions.begin(), plan_.regions.end());
    const std::int64_t stop = search_.asked() + kShallowOpRuns;
    for (std::size_t k = 0; k < all.size() && search_.asked() < stop; ++k) {
      if (search_.cost().width() > 1) run_ahead(all, k);
      Plan next;
      const std::optional<Evaluation> e = keep({all[k]}, next);
      if (!e || take(next, *e) || search_.fits(*e) || e->time >= time_) continue;
      for (std::size_t j = k + 1, tried = 0;
           j < all.size() && tried < kPairs && search_.asked() < stop; ++j) {
        const std::optional<Evaluation> both = keep({all[k], all[j]}, next);
        if (!both) continue;
        ++tried;
        if (take(next, *both)) break;
      }
    }
  }

 private:
  // The ops the regions [first, end) recompute in the plan and their replays run, the longest
  // first: keeping an op the replay never reaches saves no time.
  template <typename It>
  std::vector<std::uint32_t> recomputed_longest_first(It first, It end) const {
    std::vector<std::uint32_t> ops;
    for (auto r = first; r != end; ++r) {
      const std::uint32_t stop = replay_end(model_, r->first_op, r->end_op);
      for (std::uint32_t i = r->first_op; i < stop; ++i) {
        if (plan_.ops[i].saved == SavedDecision::Recompute) ops.push_back(i);
      }
    }
    std::stable_sort(ops.begin(), ops.end(), [&](std::uint32_t a, std::uint32_t b) {
      return model_.ops[a].duration > model_.ops[b].duration;
    });
    return ops;
  }

  // The plan with `ops` kept (those still recomputed), when that is admitted.
  std::optional<Plan> kept(std::initializer_list<std::uint32_t> ops) const {
    Plan next = plan_;
    for (const std::uint32_t i : ops) {
      if (plan_.ops[i].saved != SavedDecision::Recompute) return std::nullopt;
      next.ops[i].saved = SavedDecision::Keep;
    }
    recompute_random_prefix(next, model_);
    for (const std::uint32_t i : ops) {
      if (next.ops[i].saved != SavedDecision::Keep) return std::nullopt;
    }
    // A region that recomputes nothing only holds its inputs: the plan without it is no slower,
    // holds no more, and is the simpler of the two.
    std::erase_if(next.regions, [&](const PlanRegion& r) {
      return std::none_of(next.ops.begin() + r.first_op, next.ops.begin() + r.end_op,
                          [](const PlanOp& op) { return op.saved == SavedDecision::Recompute; });
    });
    if (!search_.cost().admits(next, model_)) return std::nullopt;
    return next;
  }

  // `ops` kept, when that is admitted: its evaluation (the plan in `next`), or none.
  std::optional<Evaluation> keep(std::initializer_list<std::uint32_t> ops, Plan& next) {
    std::optional<Plan> made = kept(ops);
    if (!made) return std::nullopt;
    next = std::move(*made);
    return search_.evaluate(next);
  }

  // The keeps of the ops of `ops` from `from` on that the cost model can run at once, each
  // alone, told to it as the next plans (the search may take one and stop using the rest).
  void run_ahead(const std::vector<std::uint32_t>& ops, std::size_t from) {
    std::vector<Plan> upcoming;
    for (std::size_t k = from; k < ops.size() && upcoming.size() < search_.cost().width(); ++k) {
      if (std::optional<Plan> made = kept({ops[k]})) upcoming.push_back(std::move(*made));
    }
    search_.ahead(upcoming, false);
  }

  // Takes `next` where `e` fits and is faster than the plan.
  bool take(Plan& next, const Evaluation& e) {
    if (!search_.fits(e) || e.time >= time_) return false;
    plan_ = std::move(next);
    time_ = e.time;
    return true;
  }

  Search& search_;
  const Model& model_;
  Plan plan_;
  SimTime time_;
};

// Up to kShallowStarts of `ranked`, the fastest first, that differ in what they save.
std::vector<const Candidate*> distinct_starts(const std::vector<const Candidate*>& ranked) {
  std::vector<const Candidate*> starts;
  for (const Candidate* c : ranked) {
    if (starts.size() >= kShallowStarts) break;
    const bool seen = std::any_of(starts.begin(), starts.end(), [&](const Candidate* s) {
      return s->plan.ops == c->plan.ops && s->plan.regions == c->plan.regions;
    });
    if (!seen) starts.push_back(c);
  }
  return starts;
}

// Note [Single ops kept]'s two passes; what either found that fits is a candidate of the search.
void keep_single_ops(Search& search) {
  const std::vector<const Candidate*> ranked = search.ranked();
  if (ranked.empty()) return;
  SingleOps ops(search, *ranked.front());
  ops.last_layer_first();
  if (search.layers().size() > kShallowStack) return;
  for (const Candidate* from : distinct_starts(ranked)) ops.every_layer_from(*from);
}

// `configs` under each of `knobs`, evaluated.
void evaluate_all(Search& search, const std::vector<LayerConfig>& configs,
                  const std::vector<PlanKnobs>& knobs) {
  std::vector<Plan> plans;
  for (const PlanKnobs& k : knobs) plans.push_back(search.plan_of(configs, k));
  search.ahead(plans, true);
  for (const Plan& plan : plans) (void)search.evaluate(plan);
}

}  // namespace

Search::Search(CostModel& cost, const PlanSpace& space, const Budgets& budgets)
    : cost_(&cost),
      space_(&space),
      budgets_(budgets),
      floor_(std::numeric_limits<std::int64_t>::max()) {}

Plan Search::plan_of(const std::vector<LayerConfig>& configs, const PlanKnobs& knobs,
                     bool offload_outside) const {
  Plan plan = space_->plan_of(configs, knobs, budgets_.host, offload_outside);
  plan.budget = budgets_.device;
  return plan;
}

bool CostModel::admits(const Plan& plan, const Model& model) {
  return plan_training_options(plan, model, TrainingOptions{}).ok();
}

Evaluation Search::evaluate(const Plan& plan) {
  std::string key = key_of(plan);
  asked_.insert(key);
  const Evaluation e = cost_->evaluate(plan);
  note(plan, e, std::move(key));
  ++stage_evaluated_;
  report();
  return e;
}

void Search::stage(std::string_view name, std::int64_t total) {
  stage_ = name;
  stage_total_ = total;
  stage_evaluated_ = 0;
  report();
}

void Search::report() const {
  if (progress_) progress_(PlanProgress{stage_, stage_evaluated_, stage_total_, best_time()});
}

void Search::note(const Plan& plan, const Evaluation& e) {
  if (fits(e)) {
    note(plan, e, key_of(plan));
  } else if (e.ok && within_host(e)) {
    floor_ = std::min(floor_, e.reserved);
  }
}

void Search::note(const Plan& plan, const Evaluation& e, std::string key) {
  if (e.ok && within_host(e)) floor_ = std::min(floor_, e.reserved);
  if (!fits(e)) return;
  if (auto it = candidates_.find(key); it == candidates_.end()) {
    Plan copy = plan;
    copy.budget = budgets_.device;
    candidates_.emplace(std::move(key), Candidate{std::move(copy), e});
  }
}

bool Search::within_host(const Evaluation& e) const {
  return !budgets_.host || e.pinned <= *budgets_.host;
}

bool Search::fits(const Evaluation& e) const {
  return e.ok && e.reserved <= budgets_.device && within_host(e);
}

std::vector<const Candidate*> Search::ranked() const {
  std::vector<const Candidate*> out;
  for (const auto& [key, c] : candidates_) out.push_back(&c);
  std::stable_sort(out.begin(), out.end(), [](const Candidate* a, const Candidate* b) {
    return a->evaluation.time < b->evaluation.time;
  });
  return out;
}

std::optional<SimTime> Search::best_time() const {
  std::optional<SimTime> best;
  for (const auto& [key, c] : candidates_) {
    if (!best || c.evaluation.time < *best) best = c.evaluation.time;
  }
  return best;
}

void run_search(Search& search, const std::vector<Seed>& seeds,
                const std::vector<PlanKnobs>& knobs) {
  // Seed.
  search.stage("seeds");
  for (const Seed& seed : seeds) {
    Plan plan = seed.plan;
    plan.host_budget = search.budgets().host;
    // The seeds were measured without a pinned budget; with one, the plan caps the pool.
    search.note(plan, search.budgets().host ? search.evaluate(plan) : seed.evaluation);
  }
  // Descend, then refine.
  const PlanKnobs defaults;
  search.stage("descent");
  Position position = greedy_descent(search);
  search.stage("local search");
  if (search.fits(position.evaluation)) local_search(search, position, defaults, kLocalRuns);
  search.stage("uniform plans");
  if (auto uniform = best_uniform(search, defaults)) {
    search.stage("local search");
    improve_from(search, std::move(*uniform), position);
  }
  const Seed* fastest = fastest_seed(search, seeds);
  if (fastest != nullptr && fastest->plan.knobs == defaults) {
    search.stage("local search");
    improve_from(search, Position{*fastest->configs, fastest->evaluation}, position);
  }
  // The knob variants on the plan found (or, when none fits, on the smallest it reached: a
  // narrower window or no prefetch can lower the peak further).
  search.stage("knob variants", static_cast<std::int64_t>(knobs.size()));
  evaluate_all(search, position.configs, knobs);
  // Exact: the choice of layer options solved under the option model (Note [Layer options] in
  // exact.cpp), refined by the local search; its knob variants when it became the fastest.
  // Everything above stays a candidate, so this only adds faster plans.
  search.stage("exact");
  if (std::optional<Position> exact = exact_stage(search, position)) {
    Position refined = position;
    search.stage("local search");
    improve_from(search, std::move(*exact), refined);
    if (refined.configs != position.configs && search.fits(refined.evaluation) &&
        search.best_time() == refined.evaluation.time) {
      search.stage("knob variants", static_cast<std::int64_t>(knobs.size()));
      evaluate_all(search, refined.configs, knobs);
    }
  }
  search.stage("single ops");
  keep_single_ops(search);
}

}  // namespace ferry::sim::planning
