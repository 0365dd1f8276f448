#pragma once
// Private to the planner's trainer spaces: what a trainer's setting reads of a model, shared by
// the spaces (trainers.cpp) and the parser of the trainer's flags (trainer_flags.cpp).

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/sim/workload/model.hpp"

namespace ferry::sim::trainer_model {

// Megatron's recompute_modules choices (TransformerConfig.recompute_modules), in its order.
inline constexpr std::array<std::string_view, 8> kMegatronModules{
    "core_attn", "moe_act", "layernorm",      "mla_up_proj",
    "mlp",       "moe",     "shared_experts", "gdn_norm_out"};
// Those whose regions the simulator runs as Megatron does (Note [A trainer's settings as
// checkpoint plans]); the others are output-discarding checkpoints (moe_act, layernorm, gdn's),
// or modules of architectures a traced model does not tell apart (MLA, shared experts).
inline constexpr std::array<std::string_view, 3> kMegatronExpressed{"core_attn", "mlp", "moe"};

/// The model's transformer layers: one past the highest layer an op names; 0 with none.
[[nodiscard]] std::int32_t layer_count(const Model& model);

/// Which of Megatron's expressed modules `model` has: core_attn where a layer has an attention
/// core, mlp where a layer is dense, moe where one is a mixture of experts.
[[nodiscard]] std::vector<std::string> megatron_modules_of(const Model& model);

/// `s` as a Python string literal, and `items` as a Python list of them.
[[nodiscard]] std::string python_string(std::string_view s);
[[nodiscard]] std::string python_list(const std::vector<std::string>& items);

}  // namespace ferry::sim::trainer_model
