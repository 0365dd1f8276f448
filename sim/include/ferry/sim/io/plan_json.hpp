#pragma once
/// The `ferry.plan/1` file: writing a plan and reading it back with errors that name the JSON
/// path (docs/plan-format.md).

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ferry/plan/plan.hpp"
#include "ferry/result.hpp"

namespace ferry::sim {

/// The plan as a `ferry.plan/1` document (fixed key order, integers as integers, every field
/// present but the optional host budget, horizon and parallelism).
[[nodiscard]] nlohmann::ordered_json plan_json(const Plan& plan);
/// plan_json's document as the file's text: indented by 2, each region and op on one line.
[[nodiscard]] std::string plan_to_json(const Plan& plan);
/// A document plan_json made (a plan report's "plan" member, say) as the file's text, as
/// plan_to_json writes it: the plan made a document once is not made one again to be written.
[[nodiscard]] std::string plan_document_text(nlohmann::ordered_json plan_document);

/// Parses a `ferry.plan/1` document; unknown keys, wrong types, out-of-range numbers and
/// inconsistent regions are errors naming `source` and the path ("regions[1].end_op: ...").
Result<Plan> parse_plan(std::string_view text, std::string_view source);

}  // namespace ferry::sim
