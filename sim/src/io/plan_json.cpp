#include "ferry/sim/io/plan_json.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "ferry/sim/io/parallelism_json.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim {

namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kPlanFormat = "ferry.plan/1";

Result<SavedDecision> read_decision(const JsonValue& value) {
  FERRY_JSON_TRY(const auto text, value.string());
  if (auto d = parse_saved_decision(text)) return *d;
  return value.error("unknown decision {} (allowed: keep, offload, recompute)", json_quote(text));
}

Result<Bytes> read_bytes(const JsonObject& object, std::string_view key, Bytes fallback) {
  FERRY_JSON_TRY(const auto count,
                 object.optional_integer(key, fallback.count(), 0, kMaxJsonBytes));
  return Bytes(count);
}

Result<SimTime> read_time(const JsonObject& object, std::string_view key) {
  FERRY_JSON_TRY(const auto ns, object.optional_integer(key, 0, 0, kMaxJsonNanoseconds));
  return SimTime(ns);
}

Status read_predicted(const JsonObject& root, Plan& plan) {
  if (!root.has("predicted")) return Ok{};
  FERRY_JSON_TRY(
      const auto p,
      root.required_object("predicted", {"step_time_ns", "lower_bound_ns", "recompute_ns",
                                         "stall_ns", "peak_reserved_bytes", "peak_allocated_bytes",
                                         "pinned_peak_bytes", "d2h_bytes", "h2d_bytes"}));
  PlanPrediction& out = plan.predicted;
  FERRY_JSON_TRY(out.step_time, read_time(p, "step_time_ns"));
  FERRY_JSON_TRY(out.lower_bound, read_time(p, "lower_bound_ns"));
  FERRY_JSON_TRY(out.recompute_time, read_time(p, "recompute_ns"));
  FERRY_JSON_TRY(out.stall, read_time(p, "stall_ns"));
  FERRY_JSON_TRY(out.peak_reserved, read_bytes(p, "peak_reserved_bytes", Bytes(0)));
  FERRY_JSON_TRY(out.peak_allocated, read_bytes(p, "peak_allocated_bytes", Bytes(0)));
  FERRY_JSON_TRY(out.pinned_peak, read_bytes(p, "pinned_peak_bytes", Bytes(0)));
  FERRY_JSON_TRY(out.d2h, read_bytes(p, "d2h_bytes", Bytes(0)));
  FERRY_JSON_TRY(out.h2d, read_bytes(p, "h2d_bytes", Bytes(0)));
  return Ok{};
}

}  // namespace

Json plan_json(const Plan& plan) {
  Json j;
  j["format"] = kPlanFormat;
  j["model"] = plan.model;
  j["device"] = plan.device;
  j["budget_bytes"] = plan.budget.count();
  if (plan.host_budget) j["host_budget_bytes"] = plan.host_budget->count();
  j["knobs"] = {{"min_bytes", plan.knobs.min_bytes.count()},
                {"window_bytes", plan.knobs.window_bytes.count()},
                {"prefetch_bytes", plan.knobs.prefetch_bytes.count()},
                {"prefetch", plan.knobs.prefetch}};
  if (plan.knobs.horizon_bytes) j["knobs"]["horizon_bytes"] = plan.knobs.horizon_bytes->count();
  if (plan.parallelism.sharded()) j["parallelism"] = parallelism_json(plan.parallelism);
  if (plan.paged_stash) j["paged_stash"] = true;
  Json regions = Json::array();
  for (const PlanRegion& r : plan.regions) {
    regions.push_back({{"first_op", r.first_op},
                       {"end_op", r.end_op},
                       {"inputs", saved_decision_name(r.inputs)}});
  }
  j["regions"] = std::move(regions);
  Json ops = Json::array();
  for (const PlanOp& op : plan.ops) {
    ops.push_back({{"name", op.name}, {"saved", saved_decision_name(op.saved)}});
  }
  j["ops"] = std::move(ops);
  const PlanPrediction& p = plan.predicted;
  j["predicted"] = {{"step_time_ns", p.step_time.ns()},
                    {"lower_bound_ns", p.lower_bound.ns()},
                    {"recompute_ns", p.recompute_time.ns()},
                    {"stall_ns", p.stall.ns()},
                    {"peak_reserved_bytes", p.peak_reserved.count()},
                    {"peak_allocated_bytes", p.peak_allocated.count()},
                    {"pinned_peak_bytes", p.pinned_peak.count()},
                    {"d2h_bytes", p.d2h.count()},
                    {"h2d_bytes", p.h2d.count()}};
  return j;
}

std::string plan_to_json(const Plan& plan) { return plan_document_text(plan_json(plan)); }

std::string plan_document_text(Json j) {
  // The document, with its regions and ops one per line: a plan of a large model stays readable
  // and diffable.
  const auto one_per_line = [](const Json& items) {
    std::string lines;
    for (const Json& item : items) {
      std::string fields;
      for (const auto& [key, value] : item.items()) {
        fields +=
            fmt::format("{}{}: {}", fields.empty() ? "" : ", ", Json(key).dump(), value.dump());
      }
      lines += fmt::format("{}\n    {{{}}}", lines.empty() ? "" : ",", fields);
    }
    return lines.empty() ? std::string("[]") : "[" + lines + "\n  ]";
  };
  const std::string regions = one_per_line(j["regions"]);
  const std::string ops = one_per_line(j["ops"]);
  j["regions"] = "@regions@";
  j["ops"] = "@ops@";
  std::string text = j.dump(2) + "\n";
  // The placeholders are found with their keys, so no name in the plan can be mistaken for one.
  auto splice = [&](std::string_view key, const std::string& items) {
    const std::string placeholder = fmt::format("\"{}\": \"@{}@\"", key, key);
    text.replace(text.find(placeholder), placeholder.size(), fmt::format("\"{}\": {}", key, items));
  };
  splice("regions", regions);
  splice("ops", ops);
  return text;
}

Result<Plan> parse_plan(std::string_view text, std::string_view source) {
  FERRY_JSON_TRY(const auto json, parse_json_text(text, source));
  const JsonValue root(json, source);
  FERRY_JSON_TRY(const auto first_look, root.object_with_any_keys());
  FERRY_JSON_TRY(const auto format_value, first_look.required("format"));
  FERRY_JSON_TRY(const auto format, format_value.string());
  if (format != kPlanFormat) {
    return format_value.error("expected {}, got {}", json_quote(kPlanFormat), json_quote(format));
  }
  FERRY_JSON_TRY(const auto object, root.object({"format", "model", "device", "budget_bytes",
                                                 "host_budget_bytes", "knobs", "parallelism",
                                                 "paged_stash", "regions", "ops", "predicted"}));
  Plan plan;
  FERRY_JSON_TRY(plan.model, object.required_name("model"));
  FERRY_JSON_TRY(plan.device, object.required_name("device"));
  FERRY_JSON_TRY(const auto budget, object.required_integer("budget_bytes", 0, kMaxJsonBytes));
  plan.budget = Bytes(budget);
  if (object.has("host_budget_bytes")) {
    FERRY_JSON_TRY(const auto host, object.required_integer("host_budget_bytes", 0, kMaxJsonBytes));
    plan.host_budget = Bytes(host);
  }
  if (auto parallelism = object.optional("parallelism")) {
    FERRY_JSON_TRY(plan.parallelism, read_parallelism(*parallelism));
  }
  FERRY_JSON_TRY(plan.paged_stash, object.optional_boolean("paged_stash", false));
  if (object.has("knobs")) {
    FERRY_JSON_TRY(const auto knobs,
                   object.required_object("knobs", {"min_bytes", "window_bytes", "prefetch_bytes",
                                                    "prefetch", "horizon_bytes"}));
    const PlanKnobs defaults;
    FERRY_JSON_TRY(plan.knobs.min_bytes, read_bytes(knobs, "min_bytes", defaults.min_bytes));
    FERRY_JSON_TRY(plan.knobs.window_bytes,
                   read_bytes(knobs, "window_bytes", defaults.window_bytes));
    FERRY_JSON_TRY(plan.knobs.prefetch_bytes,
                   read_bytes(knobs, "prefetch_bytes", defaults.prefetch_bytes));
    FERRY_JSON_TRY(plan.knobs.prefetch, knobs.optional_boolean("prefetch", defaults.prefetch));
    if (knobs.has("horizon_bytes")) {
      FERRY_JSON_TRY(const auto horizon, knobs.required_integer("horizon_bytes", 0, kMaxJsonBytes));
      plan.knobs.horizon_bytes = Bytes(horizon);
    }
  }
  FERRY_JSON_TRY(const auto ops, object.required_array("ops"));
  for (const JsonValue& value : ops) {
    FERRY_JSON_TRY(const auto op, value.object({"name", "saved"}));
    PlanOp out;
    FERRY_JSON_TRY(out.name, op.required_name("name"));
    FERRY_JSON_TRY(const auto saved, op.required("saved"));
    FERRY_JSON_TRY(out.saved, read_decision(saved));
    plan.ops.push_back(std::move(out));
  }
  FERRY_JSON_TRY(const auto regions, object.optional_array("regions"));
  for (const JsonValue& value : regions) {
    FERRY_JSON_TRY(const auto region, value.object({"first_op", "end_op", "inputs"}));
    PlanRegion out;
    FERRY_JSON_TRY(const auto first, region.required_integer("first_op", 0, 0xffffffffLL));
    FERRY_JSON_TRY(const auto end, region.required_integer("end_op", 0, 0xffffffffLL));
    out.first_op = static_cast<std::uint32_t>(first);
    out.end_op = static_cast<std::uint32_t>(end);
    if (region.has("inputs")) {
      FERRY_JSON_TRY(const auto inputs, region.required("inputs"));
      FERRY_JSON_TRY(out.inputs, read_decision(inputs));
    }
    plan.regions.push_back(out);
  }
  FERRY_JSON_RETURN_IF_ERROR(read_predicted(object, plan));
  // The checks across fields; their messages start with the path.
  if (auto valid = validate_plan(plan); !valid) {
    return root.error_message(valid.error().message);
  }
  return plan;
}

}  // namespace ferry::sim
