#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <array>
#include <limits>

#include "ferry/sim/analysis/planner.hpp"

namespace ferry::sim {

namespace {

using Json = nlohmann::ordered_json;

// 128-bit products of bytes and pixels.
__extension__ using Wide = __int128;

std::string times(std::int64_t value, std::int64_t base) {
  if (base <= 0) return "-";
  const std::int64_t t = (value * 1000 + base / 2) / base;
  return fmt::format("{}.{:03}x", t / 1000, t % 1000);
}

// The no-offload step time of the sweep (from any point's fixed rows), or 0.
SimTime none_time(const std::vector<SweepPoint>& points) {
  for (const SweepPoint& p : points) {
    if (p.outcome && !p.outcome->fixed.empty()) return p.outcome->fixed.front().step_time;
  }
  return SimTime(0);
}

}  // namespace

std::vector<SweepPoint> plan_sweep(
    const Model& model, const DeviceProfile& device, const PlannerOptions& options,
    std::int32_t points, const std::function<void(std::size_t, std::size_t, Bytes)>& progress) {
  points = std::max(points, 2);
  // One planner for every budget: the fixed configurations run once, and a simulation one
  // budget made serves the others.
  Planner planner(model, device, options.steps);
  PlannerOptions tiny = options;
  tiny.budget = Bytes(1);
  Bytes floor;
  (void)planner.plan(tiny, &floor);
  const RowResult& none = planner.fixed().front();
  const Bytes peak = std::max(none.peak_reserved, floor);
  std::vector<SweepPoint> out;
  const auto count = static_cast<std::size_t>(points);
  for (std::size_t i = 0; i < count; ++i) {
    SweepPoint point;
    point.budget = floor + Bytes((peak - floor).count() * static_cast<std::int64_t>(i) /
                                 static_cast<std::int64_t>(count - 1));
    if (progress) progress(i, count, point.budget);
    PlannerOptions o = options;
    o.budget = point.budget;
    auto outcome = planner.plan(o);
    if (outcome) {
      point.outcome = std::move(outcome).value();
    } else {
      point.failure = outcome.error().message;
    }
    out.push_back(std::move(point));
  }
  return out;
}

std::string sweep_text(const std::vector<SweepPoint>& points, const Model& model,
                       const DeviceProfile& device) {
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
    out +=
        fmt::format("{:>10} {:>9} {:>7} {:>11} {:>8}  {:<22} {:>9} {:>7}\n", format_bytes(p.budget),
                    format_time(o.row.step_time), times(o.row.step_time.ns(), none.ns()),
                    format_time(o.lower_bound), times(o.row.step_time.ns(), o.lower_bound.ns()),
                    best ? best->name : "none fits", best ? format_time(best->step_time) : "-",
                    best ? times(best->step_time.ns(), none.ns()) : "-");
  }
  out +=
      "time is the ratio to the no-offload step; every plan was checked (hazard checker and "
      "content checks on)\n";
  return out;
}

std::string sweep_json(const std::vector<SweepPoint>& points, const Model& model,
                       const DeviceProfile& device) {
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
    list.push_back(std::move(row));
  }
  j["points"] = std::move(list);
  return j.dump(2) + "\n";
}

std::string sweep_svg(const std::vector<SweepPoint>& points, const Model& model,
                      const DeviceProfile& device) {
  // Integer coordinates: the file is byte-stable. Plot area [kLeft, kLeft + kWidth] x
  // [kTop, kTop + kHeight]; the legend to its right.
  constexpr std::int64_t kLeft = 80;
  constexpr std::int64_t kTop = 50;
  constexpr std::int64_t kWidth = 560;
  constexpr std::int64_t kHeight = 360;
  constexpr std::array kColours{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  const SimTime none = none_time(points);
  const std::vector<RowResult>* fixed = nullptr;
  for (const SweepPoint& p : points) {
    if (p.outcome) fixed = &p.outcome->fixed;
  }
  // Ranges: bytes on x, step time (ns) on y, over the plans and the fixed configurations that
  // complete.
  std::int64_t x_lo = std::numeric_limits<std::int64_t>::max();
  std::int64_t x_hi = 0;
  std::int64_t y_lo = std::numeric_limits<std::int64_t>::max();
  std::int64_t y_hi = 0;
  auto widen = [&](Bytes x, SimTime y) {
    x_lo = std::min(x_lo, x.count());
    x_hi = std::max(x_hi, x.count());
    y_lo = std::min(y_lo, y.ns());
    y_hi = std::max(y_hi, y.ns());
  };
  for (const SweepPoint& p : points) {
    if (p.outcome) widen(p.outcome->row.peak_reserved, p.outcome->row.step_time);
  }
  // Fixed configurations far slower than every plan would squash the curve: the time axis
  // stops at twice the slowest plan, and slower squares sit on its top edge.
  const std::int64_t y_cap = 2 * y_hi;
  if (fixed != nullptr) {
    for (const RowResult& r : *fixed) {
      if (!r.failure || !r.fits) widen(r.peak_reserved, SimTime(std::min(r.step_time.ns(), y_cap)));
    }
  }
  if (x_hi <= x_lo || y_hi <= y_lo || none.ns() <= 0) {
    return "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"400\" height=\"40\"><text x=\"10\" "
           "y=\"25\">no plan to draw</text></svg>\n";
  }
  y_lo = std::min(y_lo, none.ns());
  auto px = [&](std::int64_t bytes) {
    return kLeft +
           static_cast<std::int64_t>(static_cast<Wide>(bytes - x_lo) * kWidth / (x_hi - x_lo));
  };
  auto py = [&](std::int64_t ns) {
    ns = std::min(ns, y_hi);
    return kTop + kHeight -
           static_cast<std::int64_t>(static_cast<Wide>(ns - y_lo) * kHeight / (y_hi - y_lo));
  };
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n",
      kLeft + kWidth + 330, kTop + kHeight + 60);
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out += fmt::format(
      "<text x=\"{}\" y=\"24\" font-size=\"15\">ferry plan --sweep: {} on {} (step time against "
      "peak reserved memory)</text>\n",
      kLeft, model.name, device.name);
  // Axes, ticks and grid.
  out += fmt::format("<path d=\"M{} {} V{} H{}\" stroke=\"black\" fill=\"none\"/>\n", kLeft, kTop,
                     kTop + kHeight, kLeft + kWidth);
  for (std::int64_t i = 0; i <= 4; ++i) {
    const std::int64_t xb = x_lo + (x_hi - x_lo) * i / 4;
    const std::int64_t yt = y_lo + (y_hi - y_lo) * i / 4;
    out += fmt::format(
        "<path d=\"M{} {} V{}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" "
        "text-anchor=\"middle\">{}</text>\n",
        px(xb), kTop, kTop + kHeight, px(xb), kTop + kHeight + 18, format_bytes(Bytes(xb)));
    out += fmt::format(
        "<path d=\"M{} {} H{}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" "
        "text-anchor=\"end\">{}</text>\n",
        kLeft, py(yt), kLeft + kWidth, kLeft - 6, py(yt) + 4, times(yt, none.ns()));
  }
  out += fmt::format(
      "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">peak reserved device memory</text>\n",
      kLeft + kWidth / 2, kTop + kHeight + 42);
  out += fmt::format(
      "<text x=\"18\" y=\"{}\" transform=\"rotate(-90 18 {})\" text-anchor=\"middle\">step "
      "time / no offload ({})</text>\n",
      kTop + kHeight / 2, kTop + kHeight / 2, format_time(none));
  // The plans: a line through their measured (peak, time) points.
  std::string line;
  for (const SweepPoint& p : points) {
    if (!p.outcome) continue;
    const RowResult& r = p.outcome->row;
    line += fmt::format("{}{} {}", line.empty() ? "M" : " L", px(r.peak_reserved.count()),
                        py(r.step_time.ns()));
    out += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"black\"/>\n",
                       px(r.peak_reserved.count()), py(r.step_time.ns()));
  }
  out += fmt::format("<path d=\"{}\" stroke=\"black\" stroke-width=\"2\" fill=\"none\"/>\n", line);
  // Legend: the plans, then each fixed configuration as a coloured square at its point.
  const std::int64_t lx = kLeft + kWidth + 20;
  std::int64_t ly = kTop + 10;
  out += fmt::format(
      "<path d=\"M{} {} H{}\" stroke=\"black\" stroke-width=\"2\"/><text x=\"{}\" "
      "y=\"{}\">ferry plan</text>\n",
      lx, ly, lx + 20, lx + 26, ly + 4);
  if (fixed != nullptr) {
    for (std::size_t i = 0; i < fixed->size(); ++i) {
      const RowResult& r = (*fixed)[i];
      if (r.failure && r.fits) continue;
      const char* colour = kColours[i % kColours.size()];
      ly += 20;
      out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"8\" height=\"8\" fill=\"{}\"/>\n",
                         px(r.peak_reserved.count()) - 4, py(r.step_time.ns()) - 4, colour);
      out += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"8\" height=\"8\" fill=\"{}\"/><text x=\"{}\" "
          "y=\"{}\">{}</text>\n",
          lx + 6, ly - 4, colour, lx + 26, ly + 4,
          fmt::format("{}: {}, {}", r.name, times(r.step_time.ns(), none.ns()),
                      format_bytes(r.peak_reserved)));
    }
  }
  out += "</svg>\n";
  return out;
}

}  // namespace ferry::sim
