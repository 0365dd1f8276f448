// A trainer's space as `ferry plan --for` reports it: the fastest setting that fits beside
// ferry's plan, as text and JSON, and the refusal naming the smallest budget that plans.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/trainers.hpp"
#include "ferry/sim/report/row_fields.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {
namespace {

using Json = nlohmann::ordered_json;

}  // namespace

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
  const Bytes peak = least->row.peak_reserved;
  const Bytes budget = smallest_budget_for(peak, c.margin_permille);
  if (c.device_memory.count() > 0 && budget > c.device_memory) {
    return fmt::format(
        "no setting of {}'s space fits the budget (planned to {}), {} being the "
        "leanest; {}",
        name, format_bytes(c.planned_budget), trainer_label(least->setting),
        no_budget_on_device(peak, c.margin_permille, c.device, c.device_memory,
                            fmt::format(" in {}'s space", name)));
  }
  return fmt::format(
      "no setting of {}'s space fits the budget (planned to {}): the smallest peak reserved in "
      "it is {} ({}), so the smallest budget that plans in {}'s space is {} ({} bytes{})",
      name, format_bytes(c.planned_budget), format_bytes(peak), trainer_label(least->setting), name,
      format_bytes(budget), budget.count(),
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
