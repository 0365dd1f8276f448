#include "pipeline_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "ferry/check.hpp"
#include "graph.hpp"

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

namespace pipelining {

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

Status check_views(const Model& model) {
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

namespace {

// Which cross-partition skips each op pops and stashes, and which each partition copies in
// and sends gradients back from.
void plan_skips(Plan& plan, const std::vector<SkipConnection>& skips) {
  const std::size_t ops = plan.partition_of.size();
  const std::uint32_t parts = plan.partitions();
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
}

// Bases a partition needs, by route (sorted sets while the accesses are walked).
struct RoutesIn {
  std::vector<std::set<std::uint32_t>> chain_in, inputs_of, params_of, grads_of;
};

// How op k reaches tensor t: resident, a batch input, or its producer's partition (local, the
// chain, or a portal when t is a cross skip that k consumes).
Access access_of(const Plan& plan, const Model& model, std::uint32_t k, std::uint32_t t) {
  Access a;
  a.tensor = t;
  a.base = plan.base[t];
  const ModelTensor& storage = model.tensors[a.base];
  if (is_resident(storage.role)) {
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
}

// Notes what op k's partition needs for access `a`: a batch input, a resident tensor, or a
// chain tensor copied into every partition from its producer's to k's.
void route_in(const Plan& plan, RoutesIn& routes, std::uint32_t k, const Access& a) {
  const std::uint32_t j = plan.partition_of[k];
  if (a.route == Route::Input) routes.inputs_of[j].insert(a.base);
  if (a.route == Route::Resident) routes.params_of[j].insert(a.base);
  if (a.route == Route::Chain) {
    const std::uint32_t from = plan.partition_of[static_cast<std::uint32_t>(plan.producer[a.base])];
    for (std::uint32_t p = from + 1; p <= j; ++p) routes.chain_in[p].insert(a.base);
  }
}

// Op k's reads, and its uses: the distinct held sources, each counted once as a read.
void plan_reads(Plan& plan, const Model& model, RoutesIn& routes, std::uint32_t k) {
  const std::uint32_t j = plan.partition_of[k];
  for (const std::uint32_t t : model.ops[k].inputs) {
    const Access a = access_of(plan, model, k, t);
    plan.reads[k].push_back(a);
    route_in(plan, routes, k, a);
    if (a.route == Route::Resident && model.tensors[a.base].role == TensorRole::Param) {
      routes.grads_of[j].insert(a.base);
    }
    if (!a.held()) continue;
    const bool seen = std::any_of(plan.uses[k].begin(), plan.uses[k].end(),
                                  [&](const Access& u) { return u.same_source(a); });
    if (seen) continue;
    plan.uses[k].push_back(a);
    if (a.route == Route::Local) ++plan.local_counts[a.base].reads;
    if (a.route == Route::Chain) ++plan.chain_counts[j][a.base].reads;
  }
}

// Op k's saved tensors, each counted as a save of its source.
void plan_saves(Plan& plan, const Model& model, RoutesIn& routes, std::uint32_t k) {
  const std::uint32_t j = plan.partition_of[k];
  for (const std::uint32_t t : model.ops[k].saved) {
    // A saved tensor is the one the op read, if it read it; else its own output or a tensor
    // reachable like a read.
    Access a = access_of(plan, model, k, t);
    for (const Access& r : plan.reads[k]) {
      if (r.tensor == t) a = r;
    }
    plan.saves[k].push_back(a);
    route_in(plan, routes, k, a);
    if (a.route == Route::Local) ++plan.local_counts[a.base].saves;
    if (a.route == Route::Chain) ++plan.chain_counts[j][a.base].saves;
    if (a.route == Route::Portal) ++plan.portal_saves[a.skip];
  }
}

// How each op reaches what it reads and saves, and who holds each local and chain tensor.
RoutesIn plan_accesses(Plan& plan, const Model& model, std::size_t skip_count) {
  const std::size_t ops = model.ops.size();
  const std::uint32_t parts = plan.partitions();
  plan.reads.resize(ops);
  plan.saves.resize(ops);
  plan.uses.resize(ops);
  plan.chain_counts.resize(parts);
  plan.local_counts.resize(model.tensors.size());
  plan.portal_saves.assign(skip_count, 0);
  plan.chain_in.resize(parts);
  RoutesIn routes{.chain_in = std::vector<std::set<std::uint32_t>>(parts),
                  .inputs_of = std::vector<std::set<std::uint32_t>>(parts),
                  .params_of = std::vector<std::set<std::uint32_t>>(parts),
                  .grads_of = std::vector<std::set<std::uint32_t>>(parts)};
  for (std::uint32_t k = 0; k < ops; ++k) {
    plan_reads(plan, model, routes, k);
    plan_saves(plan, model, routes, k);
  }
  return routes;
}

// Which chain gradients each partition sends back, and the sorted route lists.
void plan_gradients(Plan& plan, const RoutesIn& routes) {
  const std::uint32_t parts = plan.partitions();
  const auto& chain_in = routes.chain_in;
  const auto& inputs_of = routes.inputs_of;
  const auto& params_of = routes.params_of;
  const auto& grads_of = routes.grads_of;
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
}

// Note [A stage's optimizer state]
// An optimizer's state tensor is named `optimizer.<parameter>.<key>` (AdamW's exp_avg and
// exp_avg_sq, as the tracer writes them) and belongs to that parameter: the partition holding
// the parameter's gradient holds it from set-up, as the single-device run holds it, and its
// optimizer step updates it. A parameter two partitions read (tied weights) has its state on
// each. State naming no parameter a partition updates is held by the first.
void plan_optimizer_state(Plan& plan, const Model& model) {
  constexpr std::string_view kPrefix = "optimizer.";
  std::map<std::string, std::uint32_t, std::less<>> param_named;
  for (std::uint32_t t = 0; t < model.tensors.size(); ++t) {
    const ModelTensor& tensor = model.tensors[t];
    if (tensor.role == TensorRole::Param && tensor.view_of < 0) param_named[tensor.name] = t;
  }
  plan.state_of.assign(plan.partitions(), {});
  for (std::uint32_t t = 0; t < model.tensors.size(); ++t) {
    const ModelTensor& tensor = model.tensors[t];
    if (tensor.role != TensorRole::OptimizerState || tensor.view_of >= 0) continue;
    const std::string_view name = tensor.name;
    const std::size_t dot = name.rfind('.');
    const auto param =
        name.starts_with(kPrefix) && dot != std::string_view::npos && dot > kPrefix.size()
            ? param_named.find(name.substr(kPrefix.size(), dot - kPrefix.size()))
            : param_named.end();
    bool held = false;
    for (std::uint32_t j = 0; j < plan.partitions() && param != param_named.end(); ++j) {
      if (!std::ranges::binary_search(plan.grads_of[j], param->second)) continue;
      plan.state_of[j].push_back(t);
      held = true;
    }
    if (!held) plan.state_of.front().push_back(t);
  }
}

}  // namespace

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
  plan_skips(plan, skips);
  plan_gradients(plan, plan_accesses(plan, model, skips.size()));
  plan_optimizer_state(plan, model);
  return plan;
}

}  // namespace pipelining
}  // namespace ferry::sim
