#include "ferry/sim/planner/trainers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <limits>
#include <map>
#include <utility>

#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/report/row_fields.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {
namespace {

using Json = nlohmann::ordered_json;

// Note [A trainer's settings as checkpoint plans]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each trainer setting is the checkpoint regions the trainer's own code makes, run by the
// simulated autograd as it runs any plan, with nothing offloaded but where Hugging Face's offload
// flag asks ferry to:
// * Hugging Face (transformers 5.23, `PreTrainedModel._set_gradient_checkpointing`): every
//   decoder layer whose index is a multiple of `every_n_layers` is one non-reentrant region
//   (torch's checkpoint with `use_reentrant=False`, early stop on: the Trainer's default
//   keywords). `activation_checkpointing_kwargs={"offload": True}` is in the space as ferry
//   runs it after `ferry.enable_gradient_checkpointing(model)` (real/python/ferry/compat/hf.py):
//   each checkpointed layer's call runs inside the model's `ferry.offload` session, made with
//   its default options, which offloads what the checkpoint keeps for its recomputation, the
//   layer's inputs, on ferry's copy stream (Note [Checkpoint inputs offloaded] in
//   real/python/ferry/_checkpoint.py). The simulator runs the same regions under ferry's policy
//   with OffloadOptions' defaults, which are the session's (no horizon: the session's
//   horizon_bytes is unset), and an OffloadSelection that offers the offloader the regions'
//   inputs alone: the saved tensors of the layers left unchecked and of the ops outside the
//   layers stay on the device, as the session is entered around checkpointed calls only.
//   transformers' own flag (torch's save_on_cpu around the checkpoint, its copies on the
//   compute stream, without ferry) is no simulated policy and stays out of the space.
// * torchtitan (0.3.0, `torchtitan/distributed/activation_checkpoint.py`): `FullAC` and
//   `SelectiveAC` wrap every block in torch's checkpoint_wrapper with `early_stop=False`;
//   `SelectiveAC` adds its op-level policy (apply_op_sac_policy).
// * Megatron-Core (0.19.2, `megatron/core/recompute.py`, `transformer_layer.py`, `attention.py`,
//   `moe/moe_layer.py`): every recompute goes through `tensor_parallel.checkpoint`, an
//   autograd Function that runs its function under no_grad and re-runs it in backward: the
//   reentrant variant. Full `uniform` makes one region per `recompute_num_layers` consecutive
//   layers, `block` one region for each of the first `recompute_num_layers` layers;
//   selective checkpoints modules of each layer: `core_attn` the attention core
//   (attention_cores), `mlp` a dense layer's MLP from the pre-MLP norm's output on (with
//   Transformer Engine's layer spec the norm is fused into `linear_fc1` and inside the MLP)
//   and `moe` a mixture-of-experts layer from its router on. Where a layer's MLP starts is
//   found by what its ops are: after the residual sum that reads the layer's input (the first
//   `add` whose input was made before the layer), to the layer's last op, the second residual
//   sum; of an MoE layer (one with a grouped matmul or a `topk`), from the first matmul there
//   (the router), the norm before it outside.
// What the simulator does not express is left out of the spaces, not approximated (docs/plan.md
// lists it).

constexpr std::string_view kAddKind = "aten.add.Tensor";
constexpr std::string_view kTopkKind = "aten.topk.default";

// Megatron's recompute_modules choices (TransformerConfig.recompute_modules), in its order.
constexpr std::array<std::string_view, 8> kMegatronModules{
    "core_attn", "moe_act", "layernorm",      "mla_up_proj",
    "mlp",       "moe",     "shared_experts", "gdn_norm_out"};
// Those whose regions the simulator runs as Megatron does (Note [A trainer's settings as
// checkpoint plans]); the others are output-discarding checkpoints (moe_act, layernorm, gdn's),
// or modules of architectures a traced model does not tell apart (MLA, shared experts).
constexpr std::array<std::string_view, 3> kMegatronExpressed{"core_attn", "mlp", "moe"};

// The ops [first, end) of each transformer layer, by layer.
std::map<std::int32_t, OpSpan> layer_spans(const Model& model) {
  std::map<std::int32_t, OpSpan> spans;
  for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
    const std::int32_t layer = model.ops[i].layer;
    if (layer < 0) continue;
    auto [it, added] = spans.try_emplace(layer, OpSpan{i, i + 1});
    if (!added) it->second.end_op = i + 1;
  }
  return spans;
}

std::int32_t layer_count(const Model& model) {
  const auto spans = layer_spans(model);
  return spans.empty() ? 0 : spans.rbegin()->first + 1;
}

// A layer's MLP block and whether it is a mixture of experts (Note [A trainer's settings as
// checkpoint plans]).
struct MlpBlock {
  OpSpan span;
  bool moe = false;
};

class LayerBlocks {
 public:
  explicit LayerBlocks(const Model& model) : model_(model), producer_(model.tensors.size(), -1) {
    for (std::uint32_t i = 0; i < model.ops.size(); ++i) {
      for (const std::uint32_t t : model.ops[i].outputs) {
        if (producer_[t] < 0) producer_[t] = static_cast<std::int64_t>(i);
      }
    }
  }

  // The MLP block of the layer whose ops are `layer`, if its residual sums are found.
  [[nodiscard]] std::optional<MlpBlock> mlp(const OpSpan& layer) const {
    const std::uint32_t last = layer.end_op - 1;
    if (model_.ops[last].kind != kAddKind) return std::nullopt;
    std::optional<std::uint32_t> residual;
    for (std::uint32_t i = layer.first_op; i < last && !residual; ++i) {
      if (model_.ops[i].kind != kAddKind) continue;
      for (const std::uint32_t t : model_.ops[i].inputs) {
        const std::int64_t by = producer_[base(t)];
        if (by >= 0 && by < static_cast<std::int64_t>(layer.first_op)) residual = i;
      }
    }
    if (!residual || *residual + 1 >= last) return std::nullopt;
    MlpBlock block{.span = {*residual + 1, last}};
    for (std::uint32_t i = block.span.first_op; i < last; ++i) {
      const std::string& kind = model_.ops[i].kind;
      if (is_grouped_matmul_kind(kind) || kind == kTopkKind) block.moe = true;
    }
    if (block.moe) {
      std::uint32_t first = block.span.first_op;
      while (first < last && !is_matmul_kind(model_.ops[first].kind)) ++first;
      if (first == last) return std::nullopt;
      block.span.first_op = first;
    }
    return block;
  }

 private:
  [[nodiscard]] std::uint32_t base(std::uint32_t t) const {
    const std::int32_t of = model_.tensors[t].view_of;
    return of >= 0 ? static_cast<std::uint32_t>(of) : t;
  }

  const Model& model_;
  std::vector<std::int64_t> producer_;
};

// Which of Megatron's expressed modules `model` has: core_attn where a layer has an attention
// core, mlp where a layer is dense, moe where one is a mixture of experts.
std::vector<std::string> megatron_modules_of(const Model& model) {
  bool dense = false;
  bool moe = false;
  const LayerBlocks blocks(model);
  for (const auto& [layer, span] : layer_spans(model)) {
    if (const auto block = blocks.mlp(span)) (block->moe ? moe : dense) = true;
  }
  std::vector<std::string> out;
  if (!attention_cores(model).empty()) out.emplace_back("core_attn");
  if (dense) out.emplace_back("mlp");
  if (moe) out.emplace_back("moe");
  return out;
}

// torchtitan's `force_recompute_mm_shapes_by_fqns` (SelectiveAC's default ["moe.router.gate"],
// its MoE router): every mm or linear whose weight has a router's (in, out) shape is recomputed
// and left out of the every-other-mm count. A router is found by what it is, the first matmul of
// a mixture-of-experts block (LayerBlocks), its shape by its product's (k, n); the count of the
// region's other matmuls is then made again, as SelectiveAC's policy counts them.
void recompute_router_matmuls(CheckpointPlan& plan, const Model& model) {
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  const LayerBlocks blocks(model);
  for (const auto& [layer, span] : layer_spans(model)) {
    const auto block = blocks.mlp(span);
    if (!block || !block->moe) continue;
    const GemmShape& g = model.ops[block->span.first_op].gemm;
    if (g.known() && std::ranges::find(shapes, std::pair{g.k, g.n}) == shapes.end()) {
      shapes.emplace_back(g.k, g.n);
    }
  }
  if (shapes.empty()) return;
  const auto counted = [](std::string_view kind) {
    return kind == "aten.mm.default" || kind == "aten.linear.default";
  };
  for (const CheckpointRegion& region : plan.regions) {
    std::int64_t matmuls = 0;
    for (std::uint32_t i = region.first_op; i < region.end_op; ++i) {
      const ModelOp& op = model.ops[i];
      if (!counted(op.kind)) continue;
      const bool router =
          op.gemm.known() &&
          std::ranges::find(shapes, std::pair{op.gemm.k, op.gemm.n}) != shapes.end();
      plan.op_policy[i] =
          !router && ++matmuls % 2 == 1 ? OpPolicy::MustSave : OpPolicy::PreferRecompute;
    }
  }
}

CheckpointPlan regions_of_layers(const Model& model, auto&& checkpointed, bool reentrant,
                                 std::optional<bool> early_stop) {
  CheckpointPlan plan;
  for (const auto& [layer, span] : layer_spans(model)) {
    if (!checkpointed(layer)) continue;
    plan.regions.push_back(CheckpointRegion{span.first_op, span.end_op, reentrant, early_stop});
  }
  return plan;
}

std::string python_string(std::string_view s) { return fmt::format("\"{}\"", s); }

std::string python_list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + python_string(items[i]);
  return out + "]";
}

// The shell's words of `text`: whitespace-separated, single or double quotes around a word's
// parts (no escapes), `#` at a word's start comments the rest of the line out.
Result<std::vector<std::string>> shell_words(std::string_view text, std::string_view source) {
  std::vector<std::string> words;
  std::size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\\') {
      ++i;  // a backslash ends a line that goes on (the flags as a shell script writes them)
      continue;
    }
    if (c == '#') {
      while (i < text.size() && text[i] != '\n') ++i;
      continue;
    }
    std::string word;
    while (i < text.size() && text[i] != ' ' && text[i] != '\t' && text[i] != '\n' &&
           text[i] != '\r') {
      if (text[i] == '\'' || text[i] == '"') {
        const char quote = text[i];
        const std::size_t close = text.find(quote, i + 1);
        if (close == std::string_view::npos) {
          return Error{fmt::format("{}: a quote ({}) is not closed", source, quote)};
        }
        word.append(text.substr(i + 1, close - i - 1));
        i = close + 1;
      } else {
        word.push_back(text[i++]);
      }
    }
    words.push_back(std::move(word));
  }
  return words;
}

Result<std::int32_t> layer_number(std::string_view text, std::string_view flag, std::int32_t layers,
                                  std::string_view source) {
  std::int32_t n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc{} || end != text.data() + text.size() || n < 1 || n > layers) {
    return Error{fmt::format("{}: {} \"{}\": give a number of layers from 1 to {} (the model's)",
                             source, flag, text, layers)};
  }
  return n;
}

Result<TrainerSetting> parse_hf(const std::vector<std::string>& words, const Model& model,
                                std::string_view source) {
  TrainerSetting s{.trainer = Trainer::Hf};
  std::optional<bool> on;
  std::optional<Json> kwargs;
  for (std::size_t i = 0; i < words.size(); ++i) {
    const std::string& flag = words[i];
    const bool checkpointing =
        flag == "--activation_checkpointing" || flag == "--gradient_checkpointing";
    const bool keywords =
        flag == "--activation_checkpointing_kwargs" || flag == "--gradient_checkpointing_kwargs";
    if (!checkpointing && !keywords) {
      return Error{fmt::format(
          "{}: \"{}\" is not a flag of TrainingArguments' activation checkpointing "
          "(--activation_checkpointing true|false, --activation_checkpointing_kwargs JSON)",
          source, flag)};
    }
    if (i + 1 >= words.size()) return Error{fmt::format("{}: {} takes a value", source, flag)};
    const std::string& value = words[++i];
    if (checkpointing) {
      // HfArgumentParser's string_to_bool.
      std::string lower = value;
      std::ranges::transform(lower, lower.begin(),
                             [](char c) { return static_cast<char>(std::tolower(c)); });
      if (lower == "true" || lower == "yes" || lower == "t" || lower == "y" || lower == "1") {
        on = true;
      } else if (lower == "false" || lower == "no" || lower == "f" || lower == "n" ||
                 lower == "0") {
        on = false;
      } else {
        return Error{fmt::format("{}: {} \"{}\": give true or false", source, flag, value)};
      }
      continue;
    }
    Json parsed = Json::parse(value, nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object()) {
      return Error{
          fmt::format("{}: {} \"{}\" is not a JSON object such as "
                      "'{{\"every_n_layers\": 2}}'",
                      source, flag, value)};
    }
    kwargs = std::move(parsed);
  }
  s.mode = on.value_or(false) ? "checkpoint" : "none";
  if (!kwargs || s.mode == "none") {
    if (s.mode == "checkpoint") s.layers = 1;
    return s;
  }
  s.layers = 1;
  for (const auto& [key, value] : kwargs->items()) {
    if (key == "every_n_layers") {
      // Any N from 1 (transformers' own rule: layer index % N == 0); one of the model's
      // layers or more checkpoints layer 0 alone.
      if (!value.is_number_integer() || value.get<std::int64_t>() < 1 ||
          value.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max()) {
        return Error{fmt::format("{}: every_n_layers {}: give a whole number of layers, 1 or more",
                                 source, value.dump())};
      }
      s.layers = std::min(value.get<std::int32_t>(), std::max(1, layer_count(model)));
    } else if (key == "offload") {
      // ferry's offload of the checkpointed layers' inputs (Note [A trainer's settings as
      // checkpoint plans]); transformers' own save_on_cpu without ferry is not simulated.
      if (!value.is_boolean()) {
        return Error{fmt::format(
            "{}: offload {}: give true (ferry offloads the checkpointed layers' inputs, after "
            "ferry.enable_gradient_checkpointing(model)) or false",
            source, value.dump())};
      }
      s.offload = value.get<bool>();
    } else if (key == "use_reentrant") {
      if (value != false) {
        return Error{
            fmt::format("{}: use_reentrant {}: the space is the Trainer's default, "
                        "use_reentrant false",
                        source, value.dump())};
      }
    } else {
      return Error{fmt::format(
          "{}: activation_checkpointing_kwargs \"{}\" is not one ferry reads (every_n_layers, "
          "offload, use_reentrant false)",
          source, key)};
    }
  }
  return s;
}

Result<TrainerSetting> parse_torchtitan(const std::vector<std::string>& words,
                                        std::string_view source) {
  // torchtitan's Trainer.Config defaults to SelectiveAC; tyro takes the subcommand as a word.
  TrainerSetting s{.trainer = Trainer::Torchtitan, .mode = "selective"};
  for (const std::string& word : words) {
    std::string w = word;
    if (w.starts_with("--")) w.erase(0, 2);
    std::ranges::replace(w, '-', '_');
    const std::string_view prefix = "activation_checkpoint:";
    const std::string mode = w.starts_with(prefix) ? w.substr(prefix.size()) : std::string();
    if (mode == "none" || mode == "full" || mode == "selective") {
      s.mode = mode;
    } else if (mode == "memory_budget") {
      return Error{fmt::format(
          "{}: \"{}\" is not in the simulator's space: memory-budget checkpointing is the "
          "compiler's partitioner's choice under torch.compile (docs/plan.md, \"A trainer's own "
          "settings\"); give activation_checkpoint:none, full or selective",
          source, word)};
    } else {
      return Error{
          fmt::format("{}: \"{}\" is not torchtitan's activation checkpointing "
                      "subcommand: give activation_checkpoint:none, "
                      "activation_checkpoint:full or activation_checkpoint:selective",
                      source, word)};
    }
  }
  return s;
}

Result<TrainerSetting> parse_megatron(const std::vector<std::string>& words, const Model& model,
                                      std::string_view source) {
  TrainerSetting s{.trainer = Trainer::Megatron};
  std::optional<std::string> granularity;
  std::optional<std::string> method;
  std::optional<std::string> num_layers;
  std::optional<std::vector<std::string>> modules;
  for (std::size_t i = 0; i < words.size(); ++i) {
    const std::string& flag = words[i];
    const auto value = [&]() -> Result<std::string> {
      if (i + 1 >= words.size() || words[i + 1].starts_with("--")) {
        return Error{fmt::format("{}: {} takes a value", source, flag)};
      }
      return words[++i];
    };
    if (flag == "--recompute-granularity" || flag == "--recompute-method" ||
        flag == "--recompute-num-layers") {
      auto v = value();
      if (!v) return v.error();
      (flag == "--recompute-granularity" ? granularity
       : flag == "--recompute-method"    ? method
                                         : num_layers) = v.value();
    } else if (flag == "--recompute-modules") {
      modules.emplace();
      while (i + 1 < words.size() && !words[i + 1].starts_with("--")) {
        modules->push_back(words[++i]);
      }
    } else if (flag == "--fine-grained-activation-offloading" || flag == "--offload-modules") {
      return Error{fmt::format(
          "{}: {} is not in the simulator's space: Megatron's fine-grained activation "
          "offloading runs its own copy streams and reload order, which no simulated offload "
          "policy does (docs/plan.md, \"A trainer's own settings\")",
          source, flag)};
    } else {
      return Error{fmt::format(
          "{}: \"{}\" is not a recompute flag of Megatron-LM ferry reads (--recompute-granularity "
          "full|selective, --recompute-method uniform|block, --recompute-num-layers N, "
          "--recompute-modules M...)",
          source, flag)};
    }
  }
  if (!granularity) {
    if (method || num_layers || modules) {
      return Error{
          fmt::format("{}: --recompute-method, --recompute-num-layers and "
                      "--recompute-modules need --recompute-granularity",
                      source)};
    }
    return s;
  }
  s.mode = *granularity;
  if (s.mode == "full") {
    // TransformerConfig.__post_init__'s rules.
    if (!method || (*method != "uniform" && *method != "block")) {
      return Error{
          fmt::format("{}: --recompute-granularity full needs --recompute-method "
                      "uniform or block",
                      source)};
    }
    if (!num_layers) {
      return Error{
          fmt::format("{}: --recompute-granularity full needs --recompute-num-layers N", source)};
    }
    auto n = layer_number(*num_layers, "--recompute-num-layers", layer_count(model), source);
    if (!n) return n.error();
    s.method = *method;
    s.layers = n.value();
    return s;
  }
  if (s.mode != "selective") {
    return Error{
        fmt::format("{}: --recompute-granularity \"{}\": give full or selective", source, s.mode)};
  }
  if (num_layers) {
    return Error{
        fmt::format("{}: --recompute-granularity selective takes no "
                    "--recompute-num-layers (Megatron's rule)",
                    source)};
  }
  const std::vector<std::string> asked = modules.value_or(std::vector<std::string>{"core_attn"});
  const std::vector<std::string> present = megatron_modules_of(model);
  for (const std::string_view module : kMegatronModules) {
    if (std::ranges::find(asked, module) == asked.end()) continue;
    if (std::ranges::find(kMegatronExpressed, module) == kMegatronExpressed.end()) {
      return Error{fmt::format(
          "{}: recompute module \"{}\" is not in the simulator's space (docs/plan.md, \"A "
          "trainer's own settings\"); it takes core_attn, mlp and moe",
          source, module)};
    }
    if (std::ranges::find(present, module) == present.end()) {
      return Error{fmt::format("{}: recompute module \"{}\": model \"{}\" has no layer with it",
                               source, module, model.name)};
    }
    s.modules.emplace_back(module);
  }
  for (const std::string& module : asked) {
    if (std::ranges::find(kMegatronModules, module) == kMegatronModules.end()) {
      return Error{
          fmt::format("{}: \"{}\" is not one of Megatron's recompute modules", source, module)};
    }
  }
  return s;
}

}  // namespace

std::string_view trainer_name(Trainer trainer) {
  switch (trainer) {
    case Trainer::Hf:
      return "hf";
    case Trainer::Torchtitan:
      return "torchtitan";
    case Trainer::Megatron:
      return "megatron";
  }
  return "hf";
}

Result<Trainer> parse_trainer(std::string_view name, std::string_view option) {
  for (const Trainer t : {Trainer::Hf, Trainer::Torchtitan, Trainer::Megatron}) {
    if (name == trainer_name(t)) return t;
  }
  return Error{fmt::format("{}: \"{}\" is not a trainer ferry knows: hf, torchtitan or megatron",
                           option, name)};
}

std::vector<TrainerSetting> trainer_space(Trainer trainer, const Model& model) {
  std::vector<TrainerSetting> space{TrainerSetting{.trainer = trainer}};
  const std::int32_t layers = layer_count(model);
  switch (trainer) {
    case Trainer::Hf:
      for (std::int32_t n = 1; n <= layers; ++n) {
        for (const bool offload : {false, true}) {
          space.push_back(
              {.trainer = trainer, .mode = "checkpoint", .layers = n, .offload = offload});
        }
      }
      break;
    case Trainer::Torchtitan:
      if (layers > 0) {
        space.push_back({.trainer = trainer, .mode = "full"});
        space.push_back({.trainer = trainer, .mode = "selective"});
      }
      break;
    case Trainer::Megatron: {
      for (const char* method : {"uniform", "block"}) {
        for (std::int32_t n = 1; n <= layers; ++n) {
          space.push_back({.trainer = trainer, .mode = "full", .method = method, .layers = n});
        }
      }
      // Every non-empty subset of the modules the model has, in Megatron's order.
      const std::vector<std::string> present = megatron_modules_of(model);
      for (std::uint32_t mask = 1; mask < (1U << present.size()); ++mask) {
        TrainerSetting s{.trainer = trainer, .mode = "selective"};
        for (std::size_t i = 0; i < present.size(); ++i) {
          if ((mask >> i) & 1U) s.modules.push_back(present[i]);
        }
        space.push_back(std::move(s));
      }
      break;
    }
  }
  return space;
}

Result<CheckpointPlan> trainer_checkpoint(const TrainerSetting& s, const Model& model) {
  if (s.mode == "none") return CheckpointPlan{};
  switch (s.trainer) {
    case Trainer::Hf: {
      const std::int32_t n = std::max(1, s.layers);
      return regions_of_layers(
          model, [n](std::int32_t layer) { return layer % n == 0; }, false, std::nullopt);
    }
    case Trainer::Torchtitan: {
      CheckpointPlan plan = regions_of_layers(
          model, [](std::int32_t) { return true; }, false, false);
      if (s.mode == "selective") {
        if (auto applied = apply_op_sac_policy(plan, model); !applied) return applied.error();
        recompute_router_matmuls(plan, model);
      }
      return plan;
    }
    case Trainer::Megatron:
      break;
  }
  if (s.mode == "full") {
    const std::int32_t n = std::max(1, s.layers);
    if (s.method == "uniform") {
      CheckpointPlan plan = checkpoint_every(model, n);
      for (CheckpointRegion& r : plan.regions) r.reentrant = true;
      return plan;
    }
    return regions_of_layers(
        model, [n](std::int32_t layer) { return layer < n; }, true, std::nullopt);
  }
  CheckpointPlan plan;
  const auto has = [&](std::string_view m) {
    return std::ranges::find(s.modules, m) != s.modules.end();
  };
  std::vector<OpSpan> spans;
  if (has("core_attn")) spans = attention_cores(model);
  if (has("mlp") || has("moe")) {
    const LayerBlocks blocks(model);
    for (const auto& [layer, span] : layer_spans(model)) {
      const auto block = blocks.mlp(span);
      if (block && has(block->moe ? "moe" : "mlp")) spans.push_back(block->span);
    }
  }
  if (spans.empty()) {
    return Error{fmt::format("recompute modules {}: model \"{}\" has none of them",
                             python_list(s.modules), model.name)};
  }
  std::ranges::sort(spans, {}, &OpSpan::first_op);
  for (const OpSpan& span : spans) {
    plan.regions.push_back(CheckpointRegion{span.first_op, span.end_op, true, std::nullopt});
  }
  return plan;
}

void trainer_offload(TrainingOptions& options, const TrainerSetting& s, const Model& model) {
  if (s.trainer != Trainer::Hf || s.mode == "none" || !s.offload) {
    options.offload.policy = Policy::None;
    return;
  }
  // `ferry.offload()` with its defaults (Note [A trainer's settings as checkpoint plans]).
  options.offload = OffloadOptions{};
  options.offload.policy = Policy::Ferry;
  options.offload.horizon_bytes = Bytes(std::numeric_limits<std::int64_t>::max());
  options.offload_selection.ops.assign(model.ops.size(), false);
  options.offload_selection.region_inputs.assign(options.checkpoint.regions.size(), true);
}

namespace {

// The hf setting's activation_checkpointing_kwargs, as JSON (the keys it differs from the
// defaults in), or null where it has none.
Json hf_kwargs(const TrainerSetting& s) {
  if (s.mode == "none" || (s.layers <= 1 && !s.offload)) return Json();
  Json kwargs = Json::object();
  if (s.layers > 1) kwargs["every_n_layers"] = s.layers;
  if (s.offload) kwargs["offload"] = true;
  return kwargs;
}

// `kwargs` (numbers and booleans) as Python writes its literal (True), or as its json.dumps
// does (true).
std::string dict_text(const Json& kwargs, bool python) {
  std::string out = "{";
  for (const auto& [key, value] : kwargs.items()) {
    std::string v = value.dump();
    if (python && value.is_boolean()) v = value.get<bool>() ? "True" : "False";
    out += fmt::format("{}{}: {}", out.size() > 1 ? ", " : "", python_string(key), v);
  }
  return out + "}";
}

}  // namespace

std::vector<std::string> trainer_flags(const TrainerSetting& s) {
  switch (s.trainer) {
    case Trainer::Hf:
      if (s.mode == "none") return {"--activation_checkpointing", "false"};
      if (hf_kwargs(s).is_null()) return {"--activation_checkpointing", "true"};
      return {"--activation_checkpointing", "true", "--activation_checkpointing_kwargs",
              dict_text(hf_kwargs(s), false)};
    case Trainer::Torchtitan:
      return {"activation_checkpoint:" + s.mode};
    case Trainer::Megatron:
      break;
  }
  if (s.mode == "none") return {};
  std::vector<std::string> flags{"--recompute-granularity", s.mode};
  if (s.mode == "full") {
    flags.insert(flags.end(), {"--recompute-method", s.method, "--recompute-num-layers",
                               fmt::format("{}", s.layers)});
    return flags;
  }
  flags.emplace_back("--recompute-modules");
  flags.insert(flags.end(), s.modules.begin(), s.modules.end());
  return flags;
}

std::string shell_line(const std::vector<std::string>& tokens) {
  std::string out;
  for (const std::string& t : tokens) {
    if (!out.empty()) out += ' ';
    const bool plain = !t.empty() && t.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyz"
                                         "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                         "-_:=.,/") == std::string::npos;
    out += plain ? t : "'" + t + "'";
  }
  return out;
}

std::string trainer_python(const TrainerSetting& s) {
  switch (s.trainer) {
    case Trainer::Hf:
      if (s.mode == "none") return "TrainingArguments(activation_checkpointing=False)";
      if (hf_kwargs(s).is_null()) return "TrainingArguments(activation_checkpointing=True)";
      return fmt::format(
          "TrainingArguments(activation_checkpointing=True, "
          "activation_checkpointing_kwargs={})",
          dict_text(hf_kwargs(s), true));
    case Trainer::Torchtitan:
      if (s.mode == "none") return "Trainer.Config(activation_checkpoint=None)";
      return fmt::format("Trainer.Config(activation_checkpoint={}AC.Config())",
                         s.mode == "full" ? "Full" : "Selective");
    case Trainer::Megatron:
      break;
  }
  if (s.mode == "none") return "TransformerConfig(recompute_granularity=None)";
  if (s.mode == "full") {
    return fmt::format(
        "TransformerConfig(recompute_granularity=\"full\", recompute_method=\"{}\", "
        "recompute_num_layers={})",
        s.method, s.layers);
  }
  return fmt::format("TransformerConfig(recompute_granularity=\"selective\", recompute_modules={})",
                     python_list(s.modules));
}

std::vector<std::string> trainer_left_out(Trainer trainer) {
  switch (trainer) {
    case Trainer::Hf:
      return {
          "activation_checkpointing_kwargs offload=True without "
          "ferry.enable_gradient_checkpointing (torch's save_on_cpu on the compute stream)",
          "use_reentrant=True"};
    case Trainer::Torchtitan:
      return {"MemoryBudgetAC (torch.compile's partitioner)",
              "SelectiveAC's device-to-host copies saved"};
    case Trainer::Megatron:
      break;
  }
  return {"recompute_modules layernorm, moe_act, gdn_norm_out (output-discarding)",
          "recompute_modules mla_up_proj, shared_experts", "distribute_saved_activations",
          "fine_grained_activation_offloading with offload_modules"};
}

std::string trainer_label(const TrainerSetting& s) {
  switch (s.trainer) {
    case Trainer::Hf:
      if (s.mode == "none") return "no checkpointing";
      return fmt::format("checkpointing, every_n_layers={}{}", s.layers,
                         s.offload ? ", inputs offloaded by ferry" : "");
    case Trainer::Torchtitan:
      return s.mode == "none" ? "no checkpointing" : s.mode + " checkpointing";
    case Trainer::Megatron:
      break;
  }
  if (s.mode == "none") return "no recompute";
  if (s.mode == "full") return fmt::format("full recompute, {} {}", s.method, s.layers);
  std::string modules;
  for (const std::string& m : s.modules) modules += (modules.empty() ? "" : " ") + m;
  return "selective recompute, " + modules;
}

Json trainer_fields(const TrainerSetting& s) {
  Json j = Json::object();
  switch (s.trainer) {
    case Trainer::Hf:
      j["activation_checkpointing"] = s.mode != "none";
      if (const Json kwargs = hf_kwargs(s); !kwargs.is_null()) {
        j["activation_checkpointing_kwargs"] = kwargs;
      }
      return j;
    case Trainer::Torchtitan:
      j["activation_checkpoint"] = s.mode;
      return j;
    case Trainer::Megatron:
      break;
  }
  j["recompute_granularity"] = s.mode == "none" ? Json() : Json(s.mode);
  if (s.mode == "full") {
    j["recompute_method"] = s.method;
    j["recompute_num_layers"] = s.layers;
  } else if (s.mode == "selective") {
    j["recompute_modules"] = s.modules;
  }
  return j;
}

Result<TrainerSetting> parse_trainer_flags(Trainer trainer, std::string_view text,
                                           const Model& model, std::string_view source) {
  auto words = shell_words(text, source);
  if (!words) return words.error();
  switch (trainer) {
    case Trainer::Hf:
      return parse_hf(words.value(), model, source);
    case Trainer::Torchtitan:
      return parse_torchtitan(words.value(), source);
    case Trainer::Megatron:
      return parse_megatron(words.value(), model, source);
  }
  return Error{"unknown trainer"};
}

namespace {

// The run of the space with the smallest peak reserved that completed, if any.
const TrainerRun* leanest(const TrainerChoice& c) {
  const TrainerRun* out = nullptr;
  for (const TrainerRun& run : c.runs) {
    if (!run.row.completed_within_memory()) continue;
    if (out == nullptr || run.row.peak_reserved < out->row.peak_reserved) out = &run;
  }
  return out;
}

std::string flags_text(const TrainerSetting& s) {
  const std::vector<std::string> flags = trainer_flags(s);
  return flags.empty() ? std::string("(none: the defaults)") : shell_line(flags);
}

}  // namespace

Bytes trainer_smallest_budget(const TrainerChoice& c) {
  const TrainerRun* least = leanest(c);
  return least != nullptr ? smallest_budget_for(least->row.peak_reserved, c.margin_permille)
                          : Bytes(0);
}

std::string trainer_refusal(const TrainerChoice& c) {
  const std::string_view name = trainer_name(c.trainer);
  const TrainerRun* least = leanest(c);
  if (least == nullptr) {
    return fmt::format("no setting of {}'s space completed a step on the device", name);
  }
  return fmt::format(
      "no setting of {}'s space fits the budget (planned to {}): the smallest peak reserved in "
      "it is {} ({}), so the smallest budget that plans in {}'s space is {} ({} bytes{})",
      name, format_bytes(c.planned_budget), format_bytes(least->row.peak_reserved),
      trainer_label(least->setting), name,
      format_bytes(smallest_budget_for(least->row.peak_reserved, c.margin_permille)),
      smallest_budget_for(least->row.peak_reserved, c.margin_permille).count(),
      c.margin_permille > 0 ? fmt::format(", margin {}", margin_text(c.margin_permille)) : "");
}

std::string trainer_text(const TrainerChoice& c, const RowResult* plan, const RowResult* none) {
  const std::string_view name = trainer_name(c.trainer);
  std::size_t fitting = 0;
  for (const TrainerRun& run : c.runs) fitting += run.fits ? 1 : 0;
  std::string out;
  if (!c.best) return fmt::format("{}: {}\n", name, trainer_refusal(c));
  const TrainerSetting& s = c.runs[*c.best].setting;
  const RowResult& r = c.checked;
  const std::int64_t base = none != nullptr ? none->step_time.ns() : 0;
  out +=
      fmt::format("{}'s best: {}: step time {}", name, trainer_label(s), format_time(r.step_time));
  if (base > 0) {
    out += fmt::format(" ({} the no-offload step; ferry's plan: {})",
                       ratio_text(r.step_time.ns(), base, "x"),
                       plan != nullptr ? ratio_text(plan->step_time.ns(), base, "x") : "-");
  }
  out += fmt::format(", peak reserved {}, allocated {}\n", format_bytes(r.peak_reserved),
                     format_bytes(r.peak_allocated));
  out += fmt::format("  {}\n", trainer_python(s));
  if (s.offload) {
    out +=
        "  offload=True is ferry's offload of the checkpointed layers' inputs: call "
        "ferry.enable_gradient_checkpointing(model) before the Trainer\n";
  }
  out += fmt::format("  command line: {}\n", flags_text(s));
  out += fmt::format(
      "  {} of {} settings of {}'s space fit (docs/plan.md, \"A trainer's own settings\"); "
      "`ferry simulate --for {} --trainer-config FILE` runs it\n",
      fitting, c.runs.size(), name, name);
  std::string left_out;
  for (const std::string& item : trainer_left_out(c.trainer)) {
    left_out += (left_out.empty() ? "" : "; ") + item;
  }
  out += fmt::format("  not in the space (no faithful simulation): {}\n", left_out);
  return out;
}

Json trainer_json(const TrainerChoice& c, const RowResult* plan, const RowResult* none) {
  Json j;
  j["trainer"] = std::string(trainer_name(c.trainer));
  j["planned_budget_bytes"] = c.planned_budget.count();
  const std::int64_t base = none != nullptr ? none->step_time.ns() : 0;
  j["no_offload_step_time_ns"] = base > 0 ? Json(base) : Json(nullptr);
  j["plan_step_time_ns"] = plan != nullptr ? Json(plan->step_time.ns()) : Json(nullptr);
  if (c.best) {
    const TrainerSetting& s = c.runs[*c.best].setting;
    Json best;
    best["label"] = trainer_label(s);
    best["settings"] = trainer_fields(s);
    best["flags"] = trainer_flags(s);
    best["command_line"] = shell_line(trainer_flags(s));
    best["python"] = trainer_python(s);
    put_row(best, c.checked,
            {RowField::StepTime, RowField::PeakReserved, RowField::PeakAllocated,
             RowField::Recompute, RowField::Hazards});
    j["best"] = std::move(best);
    j["refusal"] = nullptr;
  } else {
    j["best"] = nullptr;
    j["refusal"] = trainer_refusal(c);
    const Bytes budget = trainer_smallest_budget(c);
    j["smallest_budget_bytes"] = budget.count() > 0 ? Json(budget.count()) : Json(nullptr);
  }
  Json space = Json::array();
  for (const TrainerRun& run : c.runs) {
    Json row;
    row["label"] = trainer_label(run.setting);
    row["settings"] = trainer_fields(run.setting);
    row["flags"] = trainer_flags(run.setting);
    row["fits_budget"] = run.fits;
    put_row(row, run.row,
            {RowField::Fits, RowField::StepTime, RowField::PeakReserved, RowField::PeakAllocated});
    space.push_back(std::move(row));
  }
  j["space"] = std::move(space);
  j["left_out"] = trainer_left_out(c.trainer);
  return j;
}

}  // namespace ferry::sim
