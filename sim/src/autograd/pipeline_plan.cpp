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

// Note [Pipeline splits]
// What people run cuts a transformer by its layers, not by measured time: torchtitan's default
// (generate_llm_fqn_per_model_part, no split points given) counts the input embedding and the
// output (norm and head) as one layer each and spreads the layers + 2 equivalents evenly over the
// stages, the first `(layers + 2) % stages` stages taking one more; Megatron-Core splits the
// layers evenly too. PipelineSplit::Layers does the same with ModelOp::layer: stage s starts at
// the first op of its first layer, so the ops before the first layer (the embedding) go with the
// first stage and those after the last (norm, head, loss) with the last. A model whose ops carry
// no layer (a hand-made graph), or whose layers are not contiguous in op order (an
// encoder-decoder numbering each stack from 0), has nothing to count and is balanced by forward
// time instead, the report saying why; a model whose layers cannot give every stage an op
// (torchtitan refuses more stages than layers + 2) is refused, naming `--split balanced`. Points
// are torchtitan's pipeline_parallel_split_points: the layer each stage after the first starts at.

Result<PipelineSplit> parse_split(std::string_view text) {
  if (text == "layers") return PipelineSplit{};
  if (text == "balanced") return PipelineSplit{.rule = PipelineSplit::Rule::Balanced, .points = {}};
  const auto bad = [&](std::string_view why) {
    return Error{fmt::format(
        "--split \"{}\": {}; give layers, balanced, or the layer each stage after the first "
        "starts at, increasing (e.g. 8,16,24 for four stages)",
        text, why)};
  };
  PipelineSplit split{.rule = PipelineSplit::Rule::Points, .points = {}};
  std::size_t at = 0;
  while (true) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view item = text.substr(at, comma - at);
    if (item.empty() || item.size() > 6 ||
        !std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return bad(fmt::format("\"{}\" is not a layer index", item));
    }
    std::int32_t layer = 0;
    for (const char c : item) layer = layer * 10 + (c - '0');
    if (!split.points.empty() && layer <= split.points.back()) {
      return bad(fmt::format("{} does not follow {}", layer, split.points.back()));
    }
    split.points.push_back(layer);
    if (comma == text.size()) break;
    at = comma + 1;
  }
  return split;
}

std::string split_name(const PipelineSplit& split) {
  switch (split.rule) {
    case PipelineSplit::Rule::Layers:
      return "layers";
    case PipelineSplit::Rule::Balanced:
      return "balanced";
    case PipelineSplit::Rule::Points:
      break;
  }
  std::string out;
  for (const std::int32_t p : split.points) out += fmt::format("{}{}", out.empty() ? "" : ",", p);
  return out;
}

std::vector<StageSpan> stage_spans(const Model& model, const std::vector<std::uint32_t>& starts) {
  std::vector<StageSpan> spans;
  for (std::size_t j = 0; j + 1 < starts.size(); ++j) {
    StageSpan span{.begin = starts[j], .end = starts[j + 1]};
    for (std::uint32_t i = span.begin; i < span.end && i < model.ops.size(); ++i) {
      const std::int32_t l = model.ops[i].layer;
      if (l < 0) continue;
      span.first_layer = span.first_layer < 0 ? l : std::min(span.first_layer, l);
      span.last_layer = std::max(span.last_layer, l);
    }
    spans.push_back(span);
  }
  return spans;
}

std::string stage_spans_text(const std::vector<StageSpan>& spans, Schedule schedule,
                             std::int32_t devices) {
  std::string out;
  for (std::size_t s = 0; s < spans.size(); ++s) {
    const StageSpan& span = spans[s];
    out += fmt::format("{}s{} gpu{} ops {}-{}", s == 0 ? "" : ", ", s,
                       pipeline::rank_of_stage(schedule, static_cast<std::uint32_t>(s),
                                               static_cast<std::uint32_t>(std::max(1, devices))),
                       span.begin, span.end == 0 ? 0 : span.end - 1);
    if (span.first_layer >= 0) {
      out += span.first_layer == span.last_layer
                 ? fmt::format(" layer {}", span.first_layer)
                 : fmt::format(" layers {}-{}", span.first_layer, span.last_layer);
    }
  }
  return out;
}

Result<std::vector<std::int32_t>> layers_per_stage(std::int32_t layers, std::int32_t stages) {
  const std::int32_t equivalents = layers + 2;  // the input and the output, one layer each
  if (stages < 1 || stages > equivalents) {
    return Error{fmt::format(
        "{} layers (and the input and output, one layer each) make {} layer equivalents; "
        "they split into 1 to {} stages, not {}",
        layers, equivalents, equivalents, stages)};
  }
  std::vector<std::int32_t> counts(static_cast<std::size_t>(stages), equivalents / stages);
  for (std::int32_t s = 0; s < equivalents % stages; ++s) ++counts[static_cast<std::size_t>(s)];
  --counts.front();  // the input's share
  --counts.back();   // the output's share
  return counts;
}

namespace {

// The layer each of `partitions` stages starts at under `split` (Layers or Points, named
// `name`), for a model of `layers` layers (Note [Pipeline splits]).
Result<std::vector<std::int32_t>> first_layers(const PipelineSplit& split, const std::string& name,
                                               std::int32_t layers, std::int32_t partitions) {
  std::vector<std::int32_t> first(static_cast<std::size_t>(partitions), 0);
  if (split.rule == PipelineSplit::Rule::Layers) {
    auto counts = layers_per_stage(layers, partitions);
    if (!counts) {
      return Error{fmt::format("--split layers: {}; use --split balanced, or fewer stages",
                               counts.error().message)};
    }
    for (std::size_t s = 1; s < first.size(); ++s) first[s] = first[s - 1] + counts.value()[s - 1];
  } else {
    if (split.points.size() + 1 != static_cast<std::size_t>(partitions)) {
      return Error{fmt::format(
          "--split {} gives {} split points for {} stages; give {} (the layer each stage after "
          "the first starts at), or --split layers or balanced",
          name, split.points.size(), partitions, partitions - 1)};
    }
    for (std::size_t s = 1; s < first.size(); ++s) {
      const std::int32_t p = split.points[s - 1];
      if (p < 0 || p > layers || (s > 1 && p <= first[s - 1])) {
        return Error{fmt::format(
            "--split {}: split point {} is not an increasing layer index from 0 to {} (the "
            "model has layers 0-{})",
            name, p, layers, layers - 1)};
      }
      first[s] = p;
    }
  }
  return first;
}

}  // namespace

Result<Partitions> partition_model(const Model& model, std::int32_t partitions,
                                   const PipelineSplit& split) {
  const std::string name = split_name(split);
  std::int32_t layers = 0;
  std::string why;  // why the layers cannot be counted
  for (const ModelOp& op : model.ops) {
    if (op.layer < 0) continue;
    if (op.layer < layers - 1 && why.empty()) {
      why = fmt::format("op '{}' of layer {} follows layer {}: its layers are not contiguous",
                        op.name, op.layer, layers - 1);
    }
    layers = std::max(layers, op.layer + 1);
  }
  if (layers == 0) why = "the model's ops carry no layers";
  if (split.rule == PipelineSplit::Rule::Balanced ||
      (split.rule == PipelineSplit::Rule::Layers && !why.empty())) {
    auto starts = balance_by_duration(model, partitions);
    if (!starts) return starts.error();
    return Partitions{.starts = std::move(starts).value(),
                      .split = split.rule == PipelineSplit::Rule::Balanced
                                   ? name
                                   : fmt::format("balanced ({})", why)};
  }
  if (!why.empty()) {
    return Error{
        fmt::format("--split {}: {}, so there are no layers to split at; use --split "
                    "balanced",
                    name, why)};
  }
  if (partitions < 1 || static_cast<std::size_t>(partitions) > model.ops.size()) {
    return Error{fmt::format("cannot split {} ops into {} partitions (use between 1 and {})",
                             model.ops.size(), partitions, model.ops.size())};
  }
  auto firsts = first_layers(split, name, layers, partitions);
  if (!firsts) return firsts.error();
  const std::vector<std::int32_t>& first = firsts.value();
  const auto n = static_cast<std::uint32_t>(model.ops.size());
  std::uint32_t after_last = 0;  // the op after the last one in a layer
  for (std::uint32_t i = 0; i < n; ++i) {
    if (model.ops[i].layer >= 0) after_last = i + 1;
  }
  std::vector<std::uint32_t> starts(first.size() + 1, n);
  starts[0] = 0;
  for (std::size_t s = 1; s < first.size(); ++s) {
    starts[s] = after_last;
    for (std::uint32_t i = 0; i < n; ++i) {
      if (model.ops[i].layer >= first[s]) {
        starts[s] = i;
        break;
      }
    }
  }
  for (std::size_t s = 0; s + 1 < starts.size(); ++s) {
    if (starts[s] >= starts[s + 1]) {
      return Error{fmt::format(
          "--split {}: stage {} of {} would hold no op (it starts at layer {}, and the model "
          "has {} layers); use --split balanced, or fewer stages",
          name, s, partitions, first[s], layers)};
    }
  }
  return Partitions{.starts = std::move(starts), .split = name};
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
