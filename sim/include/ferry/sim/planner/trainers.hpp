#pragma once
/// The activation memory settings of three trainers (Hugging Face's `Trainer`, torchtitan and
/// Megatron-Core) as spaces ferry can enumerate: each setting is a checkpoint plan the simulator
/// runs, its configuration text as the trainer reads it, and the parser `ferry simulate --for`
/// reads that text back with. docs/plan.md, "A trainer's own settings", says what each trainer
/// does and which of its settings the simulator leaves out.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/result.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/autograd/checkpoint_plan.hpp"
#include "ferry/sim/runs/measure.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {

/// A trainer whose settings `ferry plan --for` searches.
enum class Trainer : std::uint8_t {
  Hf,          ///< transformers' `Trainer` (TrainingArguments), transformers 5.23
  Torchtitan,  ///< torchtitan 0.3.0's `activation_checkpoint` config
  Megatron,    ///< Megatron-Core 0.19.2's TransformerConfig recompute fields
};

/// "hf", "torchtitan", "megatron".
[[nodiscard]] std::string_view trainer_name(Trainer trainer);
/// The trainer named `name` (as trainer_name spells it), or an error naming `option` and the
/// names accepted.
[[nodiscard]] Result<Trainer> parse_trainer(std::string_view name,
                                            std::string_view option = "--for");

/// One setting of a trainer's activation memory options.
struct TrainerSetting {
  Trainer trainer = Trainer::Hf;
  /// hf: "none" or "checkpoint" (activation_checkpointing); torchtitan: "none", "full" or
  /// "selective"; megatron: "none", "full" or "selective" (recompute_granularity).
  std::string mode = "none";
  /// megatron full: "uniform" or "block" (recompute_method); else empty.
  std::string method{};
  /// hf checkpoint: every_n_layers (1..layers); megatron full: recompute_num_layers; else 0.
  std::int32_t layers = 0;
  /// megatron selective: recompute_modules, in Megatron's order of its choices.
  std::vector<std::string> modules{};
  /// hf checkpoint: activation_checkpointing_kwargs' offload as ferry runs it (after
  /// `ferry.enable_gradient_checkpointing(model)`): the checkpointed layers' inputs offloaded by
  /// a `ferry.offload` session with its defaults. See trainer_offload.
  bool offload = false;

  friend bool operator==(const TrainerSetting&, const TrainerSetting&) = default;
};

/// Every setting of `trainer`'s space on `model` that the simulator expresses, in a fixed
/// order (no checkpointing first).
[[nodiscard]] std::vector<TrainerSetting> trainer_space(Trainer trainer, const Model& model);

/// The checkpoint plan `setting` runs on `model`, or an error where the model lacks what the
/// setting recomputes (a module no layer has).
[[nodiscard]] Result<CheckpointPlan> trainer_checkpoint(const TrainerSetting& setting,
                                                        const Model& model);

/// The offloading `setting` runs with, on `options` whose checkpoint plan is
/// trainer_checkpoint's: none (Policy::None), or for hf's offload flag ferry's policy with
/// `ferry.offload()`'s default options (no horizon) on the checkpoint regions' inputs alone, every
/// other saved tensor kept on the device, as ferry's session offloads what each checkpointed
/// layer's call keeps for its recomputation. Set after anything that derives the horizon.
void trainer_offload(TrainingOptions& options, const TrainerSetting& setting, const Model& model);

/// What the trainer's loop does with the gradients between steps: Megatron-Core's DDP holds them
/// in buffers made at set-up and zeroes them in place (zero_grad_buffer), whatever the request
/// asks; the Hugging Face Trainer (model.zero_grad()) and torchtitan (optimizers.zero_grad())
/// take what `options` hold.
void trainer_grads(TrainingOptions& options, const TrainerSetting& setting);

/// The setting as the trainer's command line spells it, one token an element: TrainingArguments'
/// flags, torchtitan's `activation_checkpoint:MODE` subcommand, Megatron-LM's flags.
[[nodiscard]] std::vector<std::string> trainer_flags(const TrainerSetting& setting);
/// The tokens as one line a POSIX shell reads back into them (single quotes where needed).
[[nodiscard]] std::string shell_line(const std::vector<std::string>& tokens);
/// The setting as the trainer's Python configuration: TrainingArguments keywords, the
/// `activation_checkpoint` field of torchtitan's Trainer.Config, TransformerConfig fields.
[[nodiscard]] std::string trainer_python(const TrainerSetting& setting);
/// The trainer's settings the spaces leave out, as the report lists them (docs/plan.md says
/// why each has no faithful simulation).
[[nodiscard]] std::vector<std::string> trainer_left_out(Trainer trainer);
/// A short name of the setting for tables ("every_n_layers=2", "full block 4").
[[nodiscard]] std::string trainer_label(const TrainerSetting& setting);
/// The setting's fields as the trainer names them, as JSON (the Python configuration's
/// keywords and values; a value Python spells None is null).
[[nodiscard]] nlohmann::ordered_json trainer_fields(const TrainerSetting& setting);

/// The setting that `text` (a trainer's command-line flags as trainer_flags writes them, one
/// shell line or several; `#` starts a comment) asks for on `model`; the errors name `source`
/// and say what would be accepted. A setting of the trainer the simulator does not express is
/// an error that says so.
[[nodiscard]] Result<TrainerSetting> parse_trainer_flags(Trainer trainer, std::string_view text,
                                                         const Model& model,
                                                         std::string_view source);

/// One setting of a trainer's space as simulated: timing only, on the device.
struct TrainerRun {
  TrainerSetting setting;
  RowResult row;
  bool fits = false;  ///< completed within the device's memory, peak reserved within the budget
};

/// What `ferry plan --for T` found in the trainer's space.
struct TrainerChoice {
  Trainer trainer = Trainer::Hf;
  Bytes planned_budget;               ///< the budget less the margin, as the plan's
  std::int32_t margin_permille = 0;   ///< the plan's margin
  std::vector<TrainerRun> runs{};     ///< every setting of the space, in its order
  std::optional<std::size_t> best{};  ///< the fastest that fits (the first of equals); none: none
  /// The best setting's run with the hazard checker and content checks on, as `ferry simulate
  /// --for T` runs it: the figures printed.
  RowResult checked{};
  /// The device the space ran on, and its memory: a smallest budget above it is not named
  /// (Note [The floor is a budget]); 0: not known.
  std::string device{};
  Bytes device_memory{0};
};

/// Why no setting of `c`'s space fits, naming the smallest budget that plans in it.
[[nodiscard]] std::string trainer_refusal(const TrainerChoice& c);
/// The smallest budget at which some setting of the space fits at `c`'s margin: the smallest
/// peak reserved of a completed run with the margin added back (smallest_budget_for); 0 when no
/// setting completed a step (the device's memory is not checked: trainer_refusal says when it
/// is above it).
[[nodiscard]] Bytes trainer_smallest_budget(const TrainerChoice& c);

/// The report's lines on the trainer: its best setting as its configuration text, its figures,
/// and its price beside ferry's plan (`plan`) against the no-offload step (`none`; either may
/// be null).
[[nodiscard]] std::string trainer_text(const TrainerChoice& c, const RowResult* plan,
                                       const RowResult* none);
/// The same as the report's "trainer" member: the best setting's fields, flags and figures,
/// and every setting of the space with its figures.
[[nodiscard]] nlohmann::ordered_json trainer_json(const TrainerChoice& c, const RowResult* plan,
                                                  const RowResult* none);

}  // namespace ferry::sim
