#include "ferry/sim/planner/report.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/report/row_fields.hpp"
#include "ferry/sim/report/tables.hpp"
#include "report_format.hpp"

namespace ferry::sim {

namespace {

using Json = nlohmann::ordered_json;
using planning::none_time;

std::string layer_name(std::int32_t layer) {
  return layer < 0 ? std::string("other") : fmt::format("{}", layer);
}

}  // namespace

const RowResult* best_fixed(const PlanOutcome& o) {
  const RowResult* best = nullptr;
  for (const RowResult& r : o.fixed) {
    if (!r.completed_within_memory() || r.peak_reserved > o.planned_budget) continue;
    if (o.plan.host_budget && r.pinned_peak > *o.plan.host_budget) continue;
    if (best == nullptr || r.step_time < best->step_time) best = &r;
  }
  return best;
}

std::string plan_text(const PlanOutcome& o, const Model& model, const DeviceProfile& device) {
  const RowResult& r = o.row;
  const RowResult* none = o.fixed.empty() ? nullptr : &o.fixed.front();
  std::string out = fmt::format("ferry plan: {} on {}, budget {} peak reserved", model.name,
                                device.name, format_bytes(o.plan.budget));
  if (o.plan.host_budget) out += fmt::format(", {} pinned host", format_bytes(*o.plan.host_budget));
  if (o.margin_permille > 0) {
    out += fmt::format(", planned to {} (margin {})", format_bytes(o.planned_budget),
                       margin_text(o.margin_permille));
  }
  out += "\n";
  out += fmt::format("step time: {}", format_time(r.step_time));
  if (none != nullptr) {
    out += fmt::format(" ({} the no-offload step, {})",
                       ratio_text(r.step_time.ns(), none->step_time.ns(), "x"),
                       format_time(none->step_time));
  }
  out += "\n";
  out += fmt::format("lower bound: {} (the plan is at {} of it)\n", format_time(o.lower_bound),
                     ratio_text(r.step_time.ns(), o.lower_bound.ns(), "x"));
  out += fmt::format("lower bound over per-layer options: {} ({})\n", format_time(o.options_bound),
                     o.in_option_space
                         ? fmt::format("the plan is one, at {} of it",
                                       ratio_text(r.step_time.ns(), o.options_bound.ns(), "x"))
                         : std::string("the plan keeps single ops of a region: not one of them"));
  out += row_lines(r, {RowLine::PeakReservedAllocated});
  const auto [low, high] = expected_peak_band(r.peak_reserved);
  out += fmt::format(
      "on a GPU: peak reserved expected in {} .. {} (docs/validation.md's error band)\n",
      format_bytes(low), format_bytes(high));
  out += row_lines(r, {RowLine::PinnedPeak, RowLine::Moved, RowLine::Recompute, RowLine::Stall});
  if (o.plan.paged_stash && r.paged_stash) {
    out += fmt::format(
        "paged stash: on (faster than the plan without it); {} of rows from {} of padded "
        "buffers, pool {}\n",
        format_bytes(r.paged_stash->data), format_bytes(r.paged_stash->padded),
        format_bytes(r.paged_stash->pool));
  }
  if (const RowResult* best = best_fixed(o)) {
    out += fmt::format("best fixed policy that fits: {}, {} ({})\n", best->name,
                       format_time(best->step_time), format_bytes(best->peak_reserved));
  } else {
    out += "best fixed policy that fits: none of them fits\n";
  }
  out += fmt::format(
      "hazards: {} (final run checked: hazard checker and content checks on{}); "
      "{} simulations ({} more reused)\n",
      r.hazards,
      o.node_ranks > 0 ? fmt::format(", and {} ranks of a node side by side", o.node_ranks) : "",
      o.simulations, o.reused);
  out += fmt::format("{:<6} {:>10} {:>10} {:>10}\n", "layer", "kept", "offloaded", "recomputed");
  for (const LayerSummary& s : o.layers) {
    out += fmt::format("{:<6} {:>10} {:>10} {:>10}\n", layer_name(s.layer), format_bytes(s.kept),
                       format_bytes(s.offloaded), format_bytes(s.recomputed));
  }
  out += "bytes are of saved activations, each storage counted once in its producing op's layer\n";
  return out + parallelism_text(o.plan.parallelism, device, model);
}

Json plan_report_json(const PlanOutcome& o, const Model& model, const DeviceProfile& device) {
  const RowResult& r = o.row;
  Json j;
  j["format"] = "ferry.plan-report/1";
  j["model"] = model.name;
  j["device"] = device.name;
  j["budget_bytes"] = o.plan.budget.count();
  j["margin_permille"] = o.margin_permille;
  j["planned_budget_bytes"] = o.planned_budget.count();
  j["host_budget_bytes"] = o.plan.host_budget ? Json(o.plan.host_budget->count()) : Json(nullptr);
  put_row(j, r, {RowField::StepTime});
  j["lower_bound_ns"] = o.lower_bound.ns();
  j["options_lower_bound_ns"] = o.options_bound.ns();
  j["plan_in_option_space"] = o.in_option_space;
  put_row(j, r,
          {RowField::PeakReserved, RowField::PeakAllocated, RowField::PinnedPeak, RowField::D2h,
           RowField::H2d, RowField::Recompute, RowField::ForwardStall, RowField::BackwardStall,
           RowField::Hazards});
  const auto [low, high] = expected_peak_band(r.peak_reserved);
  j["expected_peak_reserved_bytes"] = {{"low", low.count()}, {"high", high.count()}};
  if (o.node_ranks > 0) j["node_check_ranks"] = o.node_ranks;
  j["simulations"] = o.simulations;
  j["reused_simulations"] = o.reused;
  Json layers = Json::array();
  for (const LayerSummary& s : o.layers) {
    layers.push_back({{"layer", s.layer},
                      {"kept_bytes", s.kept.count()},
                      {"offloaded_bytes", s.offloaded.count()},
                      {"recomputed_bytes", s.recomputed.count()}});
  }
  j["layers"] = std::move(layers);
  Json fixed = Json::array();
  for (const RowResult& f : o.fixed) {
    fixed.push_back({{"name", f.name},
                     {"fits", f.completed_within_memory() && f.peak_reserved <= o.planned_budget},
                     {"step_time_ns", f.step_time.ns()},
                     {"peak_reserved_bytes", f.peak_reserved.count()},
                     {"pinned_peak_bytes", f.pinned_peak.count()}});
  }
  j["fixed"] = std::move(fixed);
  j["plan"] = plan_json(o.plan);
  return with_parallelism(std::move(j), o.plan.parallelism, device, model);
}

std::string sweep_text(const std::vector<SweepPoint>& points, const Model& model,
                       const DeviceProfile& device, const Parallelism& parallelism) {
  const SimTime none = none_time(points);
  std::string out = fmt::format(
      "ferry plan --sweep: {} on {}, {} budgets (peak reserved) from the floor to the no-offload "
      "peak; no offload: {}\n",
      model.name, device.name, points.size(), format_time(none));
  out += fmt::format("{:>10} {:>9} {:>7} {:>11} {:>8}  {:<22} {:>9} {:>7}\n", "budget", "plan",
                     "time", "lower bound", "vs bound", "best fixed that fits", "its time", "time");
  for (const SweepPoint& p : points) {
    if (!p.outcome) {
      out += fmt::format("{:>10} no plan: {}\n", format_bytes(p.budget), p.failure);
      continue;
    }
    const PlanOutcome& o = *p.outcome;
    const RowResult* best = best_fixed(o);
    out += fmt::format("{:>10} {:>9} {:>7} {:>11} {:>8}  {:<22} {:>9} {:>7}\n",
                       format_bytes(p.budget), format_time(o.row.step_time),
                       ratio_text(o.row.step_time.ns(), none.ns(), "x"), format_time(o.lower_bound),
                       ratio_text(o.row.step_time.ns(), o.lower_bound.ns(), "x"),
                       best ? best->name : "none fits", best ? format_time(best->step_time) : "-",
                       best ? ratio_text(best->step_time.ns(), none.ns(), "x") : "-");
  }
  out +=
      "time is the ratio to the no-offload step; every plan was checked (hazard checker and "
      "content checks on)\n";
  std::string stashed;
  for (const SweepPoint& p : points) {
    if (p.outcome && p.outcome->plan.paged_stash) {
      stashed += (stashed.empty() ? "" : ", ") + format_bytes(p.budget);
    }
  }
  if (!stashed.empty()) {
    out +=
        fmt::format("paged stash (faster than the plan without it) in the plans at {}\n", stashed);
  }
  return out + parallelism_text(parallelism, device, model);
}

Json sweep_json(const std::vector<SweepPoint>& points, const Model& model,
                const DeviceProfile& device, const Parallelism& parallelism) {
  Json j;
  j["format"] = "ferry.plan-sweep/1";
  j["model"] = model.name;
  j["device"] = device.name;
  j["none_step_time_ns"] = none_time(points).ns();
  Json list = Json::array();
  for (const SweepPoint& p : points) {
    Json row;
    row["budget_bytes"] = p.budget.count();
    if (!p.outcome) {
      row["failure"] = p.failure;
      list.push_back(std::move(row));
      continue;
    }
    const PlanOutcome& o = *p.outcome;
    row["step_time_ns"] = o.row.step_time.ns();
    row["lower_bound_ns"] = o.lower_bound.ns();
    row["peak_reserved_bytes"] = o.row.peak_reserved.count();
    row["pinned_peak_bytes"] = o.row.pinned_peak.count();
    const RowResult* best = best_fixed(o);
    row["best_fixed"] = best ? Json(best->name) : Json(nullptr);
    row["best_fixed_step_time_ns"] = best ? Json(best->step_time.ns()) : Json(nullptr);
    if (o.plan.paged_stash) row["paged_stash"] = true;
    list.push_back(std::move(row));
  }
  j["points"] = std::move(list);
  return with_parallelism(std::move(j), parallelism, device, model);
}

}  // namespace ferry::sim
