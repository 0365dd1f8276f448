// The trainers' activation checkpointing settings as ferry's spaces (planner/trainers.hpp): the
// regions each setting makes, by what the ops are, on a preset and on traced Hugging Face
// models (tests/data/traced); every setting's flags read back into it; the settings the
// simulator leaves out refused by name.
#include "ferry/sim/planner/trainers.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/runs/measure.hpp"
#include "sim_fixtures.hpp"

namespace ferry::sim {
namespace {

Model traced(const std::string& family) {
  const std::filesystem::path path =
      std::filesystem::path(FERRY_TESTS_DIR) / "data" / "traced" / (family + ".json");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto model = parse_model(text.str(), path.string());
  EXPECT_TRUE(model.ok()) << (model.ok() ? "" : model.error().message);
  return std::move(model).value();
}

Model preset(const std::string& name) {
  auto model = model_preset(name);
  EXPECT_TRUE(model.ok());
  return std::move(model).value();
}

std::int32_t layers_of(const Model& model) {
  std::int32_t n = 0;
  for (const ModelOp& op : model.ops) n = std::max(n, op.layer + 1);
  return n;
}

CheckpointPlan plan_of(const TrainerSetting& s, const Model& model) {
  auto plan = trainer_checkpoint(s, model);
  EXPECT_TRUE(plan.ok()) << (plan.ok() ? "" : plan.error().message);
  return plan.ok() ? std::move(plan).value() : CheckpointPlan{};
}

std::string joined(const std::vector<std::string>& flags) { return shell_line(flags); }

TEST(TrainerSpace, EverySettingsFlagsReadBackIntoIt) {
  for (const Model& model : {preset("llama3-8b-s8192"), traced("mixtral-4layer"), traced("qwen2"),
                             traced("llama"), traced("gpt2")}) {
    for (const Trainer t : {Trainer::Hf, Trainer::Torchtitan, Trainer::Megatron}) {
      for (const TrainerSetting& s : trainer_space(t, model)) {
        auto read = parse_trainer_flags(t, joined(trainer_flags(s)), model, "flags");
        ASSERT_TRUE(read.ok()) << model.name << " " << trainer_label(s) << ": "
                               << read.error().message;
        EXPECT_EQ(read.value(), s) << model.name << " " << trainer_label(s);
      }
    }
  }
}

TEST(TrainerSpace, HuggingFaceCheckpointsEveryNthLayerFromTheFirst) {
  const Model model = preset("llama3-8b-s8192");
  const std::int32_t layers = layers_of(model);
  const auto space = trainer_space(Trainer::Hf, model);
  ASSERT_EQ(space.size(), 2 * static_cast<std::size_t>(layers) + 1);
  EXPECT_EQ(space.front().mode, "none");
  EXPECT_TRUE(plan_of(space.front(), model).regions.empty());
  for (std::int32_t n = 1; n <= layers; ++n) {
    // Each every_n_layers without and with ferry's offload of the regions' inputs.
    const auto at = 2 * static_cast<std::size_t>(n) - 1;
    EXPECT_EQ(space[at].layers, n);
    EXPECT_FALSE(space[at].offload);
    EXPECT_EQ(space[at + 1].layers, n);
    EXPECT_TRUE(space[at + 1].offload);
    const CheckpointPlan plan = plan_of(space[at], model);
    EXPECT_EQ(plan_of(space[at + 1], model).regions.size(), plan.regions.size());
    ASSERT_EQ(plan.regions.size(), static_cast<std::size_t>((layers + n - 1) / n)) << n;
    for (const CheckpointRegion& r : plan.regions) {
      const std::int32_t layer = model.ops[r.first_op].layer;
      EXPECT_EQ(layer % n, 0);
      EXPECT_FALSE(r.reentrant);
      EXPECT_FALSE(r.early_stop.has_value());  // torch's default: on
      // The whole layer, no more.
      EXPECT_EQ(model.ops[r.end_op - 1].layer, layer);
      EXPECT_TRUE(r.first_op == 0 || model.ops[r.first_op - 1].layer != layer);
      EXPECT_TRUE(r.end_op == model.ops.size() || model.ops[r.end_op].layer != layer);
    }
  }
}

// The offload flag as ferry runs it: ferry's policy with `ferry.offload()`'s defaults, offered
// the checkpoint regions' inputs alone (Note [A trainer's settings as checkpoint plans]).
TEST(TrainerSpace, HuggingFaceOffloadIsFerrysSessionOnTheRegionsInputsAlone) {
  const Model model = traced("llama");
  TrainerSetting s{.trainer = Trainer::Hf, .mode = "checkpoint", .layers = 1};
  const auto options = [&](const TrainerSetting& setting) {
    TrainingOptions o;
    o.offload.window_bytes = Bytes(1);  // a request's knobs, which the session does not take
    o.checkpoint = plan_of(setting, model);
    trainer_offload(o, setting, model);
    return o;
  };
  EXPECT_EQ(options(s).offload.policy, Policy::None);
  s.offload = true;
  const TrainingOptions on = options(s);
  EXPECT_EQ(on.offload.policy, Policy::Ferry);
  const OffloadOptions defaults;
  EXPECT_EQ(on.offload.window_bytes, defaults.window_bytes);
  EXPECT_EQ(on.offload.prefetch_bytes, defaults.prefetch_bytes);
  EXPECT_EQ(on.offload.min_bytes, defaults.min_bytes);
  EXPECT_EQ(on.offload.horizon_bytes, Bytes(std::numeric_limits<std::int64_t>::max()));
  EXPECT_EQ(on.offload_selection.ops, std::vector<bool>(model.ops.size(), false));
  EXPECT_EQ(on.offload_selection.region_inputs,
            std::vector<bool>(on.checkpoint.regions.size(), true));

  const DeviceProfile device = testing::simple_profile();
  const auto run = [&](const TrainingOptions& o) {
    return run_row(model, device, PolicyRow{"hf", o});
  };
  const RowResult offloaded = run(on);
  EXPECT_EQ(offloaded.hazards, 0);
  EXPECT_GT(offloaded.telemetry.offloaded, 0);
  s.offload = false;
  EXPECT_EQ(run(options(s)).telemetry.offloaded, 0);
  // Offering the offloader every saved tensor outside the regions, as `ferry simulate --policy
  // ferry --checkpoint every:1` does, offloads more than the session's inputs alone.
  TrainingOptions everything = on;
  everything.offload_selection = {};
  EXPECT_GT(run(everything).telemetry.offloaded, offloaded.telemetry.offloaded);
  // One region of the two layers (every_n_layers=2): fewer inputs offloaded.
  s = {.trainer = Trainer::Hf, .mode = "checkpoint", .layers = 2, .offload = true};
  const RowResult half = run(options(s));
  EXPECT_GT(half.telemetry.offloaded, 0);
  EXPECT_LT(half.telemetry.offloaded, offloaded.telemetry.offloaded);
}

TEST(TrainerSpace, TorchtitanWrapsEveryBlockWithoutEarlyStop) {
  const Model model = traced("llama");
  const auto space = trainer_space(Trainer::Torchtitan, model);
  ASSERT_EQ(space.size(), 3U);
  const CheckpointPlan full = plan_of(space[1], model);
  const CheckpointPlan selective = plan_of(space[2], model);
  ASSERT_EQ(full.regions.size(), static_cast<std::size_t>(layers_of(model)));
  ASSERT_EQ(selective.regions.size(), full.regions.size());
  for (const CheckpointPlan* plan : {&full, &selective}) {
    for (const CheckpointRegion& r : plan->regions) {
      EXPECT_EQ(r.early_stop, std::optional<bool>(false));
      EXPECT_FALSE(r.reentrant);
    }
  }
  EXPECT_TRUE(full.op_policy.empty());
  // The op-level policy saves the attention kernel of each layer.
  std::size_t saved_attention = 0;
  for (std::uint32_t i = 0; i < selective.op_policy.size(); ++i) {
    if (selective.op_policy[i] == OpPolicy::MustSave &&
        is_fused_attention_kind(model.ops[i].kind)) {
      ++saved_attention;
    }
  }
  EXPECT_EQ(saved_attention, full.regions.size());
}

TEST(TrainerSpace, TorchtitanRecomputesTheRouterAndCountsTheOtherMatmuls) {
  // SelectiveAC's force_recompute_mm_shapes_by_fqns: the router's mm (the first matmul of a
  // mixture-of-experts block) is recomputed and not counted; of the other mm's of a block the
  // first, third, ... are saved.
  const Model model = traced("mixtral-4layer");
  const CheckpointPlan plan = plan_of({.trainer = Trainer::Torchtitan, .mode = "selective"}, model);
  CheckpointPlan plain = checkpoint_every(model, 1);
  ASSERT_TRUE(apply_op_sac_policy(plain, model).ok());
  std::size_t routers = 0;
  for (const CheckpointRegion& r : plan.regions) {
    std::int64_t counted = 0;
    for (std::uint32_t i = r.first_op; i < r.end_op; ++i) {
      const ModelOp& op = model.ops[i];
      if (op.kind != "aten.mm.default") {
        EXPECT_EQ(plan.op_policy[i], plain.op_policy[i]) << op.name;
        continue;
      }
      const bool router = op.gemm.n == 4;  // the traced model's four experts
      routers += router ? 1 : 0;
      const OpPolicy expected =
          !router && ++counted % 2 == 1 ? OpPolicy::MustSave : OpPolicy::PreferRecompute;
      EXPECT_EQ(plan.op_policy[i], expected) << op.name;
    }
  }
  EXPECT_EQ(routers, plan.regions.size());
  // Without a mixture of experts the policy is op-sac's as it is.
  const Model dense = traced("llama");
  CheckpointPlan dense_plain = checkpoint_every(dense, 1);
  ASSERT_TRUE(apply_op_sac_policy(dense_plain, dense).ok());
  EXPECT_EQ(plan_of({.trainer = Trainer::Torchtitan, .mode = "selective"}, dense).op_policy,
            dense_plain.op_policy);
}

TEST(TrainerSpace, MegatronFullRecomputeIsReentrantChunksOrTheFirstLayers) {
  const Model model = preset("llama3-8b-s8192");
  const std::int32_t layers = layers_of(model);
  TrainerSetting uniform{
      .trainer = Trainer::Megatron, .mode = "full", .method = "uniform", .layers = 3};
  const CheckpointPlan chunks = plan_of(uniform, model);
  ASSERT_EQ(chunks.regions.size(), static_cast<std::size_t>((layers + 2) / 3));
  for (std::size_t i = 0; i < chunks.regions.size(); ++i) {
    const CheckpointRegion& r = chunks.regions[i];
    EXPECT_TRUE(r.reentrant);
    EXPECT_EQ(model.ops[r.first_op].layer, static_cast<std::int32_t>(3 * i));
    EXPECT_EQ(model.ops[r.end_op - 1].layer,
              std::min(layers - 1, static_cast<std::int32_t>(3 * i + 2)));
  }
  TrainerSetting block{
      .trainer = Trainer::Megatron, .mode = "full", .method = "block", .layers = 5};
  const CheckpointPlan first = plan_of(block, model);
  ASSERT_EQ(first.regions.size(), 5U);
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_TRUE(first.regions[i].reentrant);
    EXPECT_EQ(model.ops[first.regions[i].first_op].layer, static_cast<std::int32_t>(i));
  }
}

TEST(TrainerSpace, MegatronSelectiveModulesAreFoundByWhatTheOpsAre) {
  // A dense traced layer: core_attn and mlp; the MLP starts right after the residual sum that
  // reads the layer's input and ends before the layer's last op, the second residual sum.
  const Model dense = traced("llama");
  const auto dense_space = trainer_space(Trainer::Megatron, dense);
  const std::int32_t layers = layers_of(dense);
  ASSERT_EQ(dense_space.size(), 1U + 2U * static_cast<std::size_t>(layers) + 3U);
  TrainerSetting mlp{.trainer = Trainer::Megatron, .mode = "selective", .modules = {"mlp"}};
  const CheckpointPlan mlps = plan_of(mlp, dense);
  ASSERT_EQ(mlps.regions.size(), static_cast<std::size_t>(layers));
  for (const CheckpointRegion& r : mlps.regions) {
    EXPECT_TRUE(r.reentrant);
    const std::int32_t layer = dense.ops[r.first_op].layer;
    EXPECT_EQ(dense.ops[r.first_op - 1].kind, "aten.add.Tensor");
    EXPECT_EQ(dense.ops[r.end_op].kind, "aten.add.Tensor");
    EXPECT_EQ(dense.ops[r.end_op].layer, layer);
    EXPECT_TRUE(r.end_op + 1 == dense.ops.size() || dense.ops[r.end_op + 1].layer != layer);
    std::size_t matmuls = 0;
    for (std::uint32_t i = r.first_op; i < r.end_op; ++i) {
      matmuls += is_matmul_kind(dense.ops[i].kind) ? 1 : 0;
    }
    EXPECT_EQ(matmuls, 3U);  // gate, up, down
  }
  // A mixture of experts: moe instead of mlp, from the router's matmul on.
  const Model moe = traced("mixtral-4layer");
  std::vector<std::vector<std::string>> selective;
  for (const TrainerSetting& s : trainer_space(Trainer::Megatron, moe)) {
    if (s.mode == "selective") selective.push_back(s.modules);
  }
  const std::vector<std::vector<std::string>> expected{
      {"core_attn"}, {"moe"}, {"core_attn", "moe"}};
  EXPECT_EQ(selective, expected);
  TrainerSetting experts{.trainer = Trainer::Megatron, .mode = "selective", .modules = {"moe"}};
  const CheckpointPlan moes = plan_of(experts, moe);
  ASSERT_EQ(moes.regions.size(), static_cast<std::size_t>(layers_of(moe)));
  for (const CheckpointRegion& r : moes.regions) {
    EXPECT_TRUE(is_matmul_kind(moe.ops[r.first_op].kind));
    EXPECT_FALSE(is_matmul_kind(moe.ops[r.first_op - 1].kind));
    EXPECT_EQ(moe.ops[r.end_op].kind, "aten.add.Tensor");
    bool grouped = false;
    for (std::uint32_t i = r.first_op; i < r.end_op; ++i) {
      grouped = grouped || is_grouped_matmul_kind(moe.ops[i].kind);
    }
    EXPECT_TRUE(grouped);
  }
  // Asked for by name on a model without it: refused, naming the module.
  auto refused = parse_trainer_flags(Trainer::Megatron,
                                     "--recompute-granularity selective --recompute-modules mlp",
                                     moe, "megatron.flags");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("\"mlp\": model"), std::string::npos)
      << refused.error().message;
}

TEST(TrainerSpace, SettingsOutsideTheSimulatorsSpaceAreRefusedByName) {
  const Model model = traced("llama");
  const auto refused = [&](Trainer t, std::string_view text, std::string_view says) {
    auto read = parse_trainer_flags(t, text, model, "cfg");
    ASSERT_FALSE(read.ok()) << text;
    EXPECT_NE(read.error().message.find(says), std::string::npos) << read.error().message;
    EXPECT_EQ(read.error().message.rfind("cfg: ", 0), 0U) << read.error().message;
  };
  refused(Trainer::Hf,
          "--activation_checkpointing true --activation_checkpointing_kwargs '{\"offload\": 1}'",
          "give true (ferry offloads the checkpointed layers' inputs");
  refused(Trainer::Hf, "--activation_checkpointing maybe", "give true or false");
  refused(Trainer::Hf,
          "--activation_checkpointing true --activation_checkpointing_kwargs "
          "'{\"every_n_layers\": 0}'",
          "1 or more");
  refused(Trainer::Hf, "--learning_rate 1e-4", "not a flag of TrainingArguments");
  refused(Trainer::Megatron,
          "--recompute-granularity full --recompute-method uniform --recompute-num-layers 3",
          "from 1 to 2");
  refused(Trainer::Torchtitan, "activation_checkpoint:memory_budget", "torch.compile");
  refused(Trainer::Torchtitan, "activation_checkpoint:sometimes", "activation_checkpoint:none");
  refused(Trainer::Megatron, "--recompute-granularity selective --recompute-modules layernorm",
          "\"layernorm\" is not in the simulator's space");
  refused(Trainer::Megatron, "--recompute-granularity full --recompute-num-layers 1",
          "needs --recompute-method");
  refused(Trainer::Megatron, "--recompute-granularity full --recompute-method block",
          "needs --recompute-num-layers");
  refused(Trainer::Megatron, "--recompute-granularity selective --recompute-num-layers 1",
          "takes no");
  refused(Trainer::Megatron, "--fine-grained-activation-offloading --offload-modules core_attn",
          "fine-grained");
  refused(Trainer::Megatron, "--recompute-granularity selective --recompute-modules qkv",
          "not one of Megatron's");
  // every_n_layers past the model's layers checkpoints layer 0 alone, as every_n_layers = layers.
  auto past = parse_trainer_flags(Trainer::Hf,
                                  "--activation_checkpointing true "
                                  "--activation_checkpointing_kwargs '{\"every_n_layers\": 7}'",
                                  model, "cfg");
  ASSERT_TRUE(past.ok()) << past.error().message;
  EXPECT_EQ(past.value().layers, 2);
  // The offload flag with checkpointing off is ignored, as transformers ignores the kwargs.
  auto off = parse_trainer_flags(Trainer::Hf,
                                 "--activation_checkpointing false "
                                 "--activation_checkpointing_kwargs '{\"offload\": true}'",
                                 model, "cfg");
  ASSERT_TRUE(off.ok()) << off.error().message;
  EXPECT_EQ(off.value(), TrainerSetting{});
  // Megatron's default module list, and a comment and line breaks as a script writes them.
  auto read = parse_trainer_flags(Trainer::Megatron,
                                  "# best\n--recompute-granularity selective \\\n", model, "cfg");
  ASSERT_TRUE(read.ok()) << read.error().message;
  EXPECT_EQ(read.value().modules, std::vector<std::string>{"core_attn"});
}

TEST(TrainerSpace, TheSmallestBudgetThatPlansHoldsThePeakAfterTheMargin) {
  for (const std::int32_t margin : {0, 1, 55, 160, 500}) {
    for (const std::int64_t peak : {1LL, 999LL, 1000LL, 39787167744LL, 12345678901LL}) {
      const Bytes b = smallest_budget_for(Bytes(peak), margin);
      EXPECT_GE(budget_less_margin(b, margin), Bytes(peak)) << margin << " " << peak;
      EXPECT_LT(budget_less_margin(Bytes(b.count() - 1), margin), Bytes(peak))
          << margin << " " << peak;
    }
  }
}

}  // namespace
}  // namespace ferry::sim
