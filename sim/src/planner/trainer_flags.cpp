// A trainer setting and the trainer's own flags, both ways: the flags a setting is run with
// (TrainingArguments, torchtitan's config, Megatron-LM's command line, and their Python forms),
// and the setting a file of those flags asks for, checked as the trainer checks them.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "ferry/sim/planner/trainers.hpp"
#include "trainer_model.hpp"

namespace ferry::sim {

using trainer_model::kMegatronExpressed;
using trainer_model::kMegatronModules;
using trainer_model::layer_count;
using trainer_model::megatron_modules_of;
using trainer_model::python_list;
using trainer_model::python_string;

namespace trainer_model {

std::string python_string(std::string_view s) { return fmt::format("\"{}\"", s); }

std::string python_list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + python_string(items[i]);
  return out + "]";
}

}  // namespace trainer_model

namespace {

using Json = nlohmann::ordered_json;

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

// HfArgumentParser's string_to_bool; none where `value` is neither.
std::optional<bool> string_to_bool(std::string value) {
  std::ranges::transform(value, value.begin(),
                         [](char c) { return static_cast<char>(std::tolower(c)); });
  if (value == "true" || value == "yes" || value == "t" || value == "y" || value == "1") {
    return true;
  }
  if (value == "false" || value == "no" || value == "f" || value == "n" || value == "0") {
    return false;
  }
  return std::nullopt;
}

// The keys of activation_checkpointing_kwargs into `s` (a checkpointing setting).
Status read_hf_kwargs(TrainerSetting& s, const Json& kwargs, const Model& model,
                      std::string_view source) {
  for (const auto& [key, value] : kwargs.items()) {
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
  return Ok{};
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
      on = string_to_bool(value);
      if (!on) return Error{fmt::format("{}: {} \"{}\": give true or false", source, flag, value)};
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
  if (auto read = read_hf_kwargs(s, *kwargs, model, source); !read) return read.error();
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

// --recompute-granularity full's setting, by TransformerConfig.__post_init__'s rules.
Result<TrainerSetting> megatron_full(TrainerSetting s, const std::optional<std::string>& method,
                                     const std::optional<std::string>& num_layers,
                                     const Model& model, std::string_view source) {
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

// --recompute-granularity selective's setting: the modules `asked`, each one Megatron has, the
// simulator expresses and the model holds.
Result<TrainerSetting> megatron_selective(TrainerSetting s, const std::vector<std::string>& asked,
                                          const Model& model, std::string_view source) {
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
  if (s.mode == "full") return megatron_full(std::move(s), method, num_layers, model, source);
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
  return megatron_selective(std::move(s), modules.value_or(std::vector<std::string>{"core_attn"}),
                            model, source);
}

}  // namespace

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

}  // namespace ferry::sim
