#include <fmt/format.h>

#include <array>
#include <limits>
#include <optional>

#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/report/row_fields.hpp"
#include "report_format.hpp"
#include "tensors.hpp"

namespace ferry::sim {

namespace {

using planning::none_time;
using planning::Wide;

// Integer coordinates: the file is byte-stable. Plot area [kLeft, kLeft + kWidth] x
// [kTop, kTop + kHeight]; the legend to its right.
constexpr std::int64_t kLeft = 80;
constexpr std::int64_t kTop = 50;
constexpr std::int64_t kWidth = 560;
constexpr std::int64_t kHeight = 360;
constexpr std::array kColours{"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                              "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

// The plot's ranges, bytes on x and step time (ns) on y, and where a point lands.
struct Canvas {
  std::int64_t x_lo = std::numeric_limits<std::int64_t>::max();
  std::int64_t x_hi = 0;
  std::int64_t y_lo = std::numeric_limits<std::int64_t>::max();
  std::int64_t y_hi = 0;

  void widen(Bytes x, SimTime y) {
    x_lo = std::min(x_lo, x.count());
    x_hi = std::max(x_hi, x.count());
    y_lo = std::min(y_lo, y.ns());
    y_hi = std::max(y_hi, y.ns());
  }
  [[nodiscard]] std::int64_t px(std::int64_t bytes) const {
    return kLeft +
           static_cast<std::int64_t>(static_cast<Wide>(bytes - x_lo) * kWidth / (x_hi - x_lo));
  }
  [[nodiscard]] std::int64_t py(std::int64_t ns) const {
    ns = std::min(ns, y_hi);
    return kTop + kHeight -
           static_cast<std::int64_t>(static_cast<Wide>(ns - y_lo) * kHeight / (y_hi - y_lo));
  }
};

// The ranges over the plans and the fixed configurations that complete, or none when there is
// nothing to draw.
std::optional<Canvas> canvas_of(const std::vector<SweepPoint>& points,
                                const std::vector<RowResult>* fixed, SimTime none) {
  Canvas c;
  for (const SweepPoint& p : points) {
    if (p.outcome) c.widen(p.outcome->row.peak_reserved, p.outcome->row.step_time);
  }
  // Fixed configurations far slower than every plan would squash the curve: the time axis
  // stops at twice the slowest plan, and slower squares sit on its top edge.
  const std::int64_t y_cap = 2 * c.y_hi;
  if (fixed != nullptr) {
    for (const RowResult& r : *fixed) {
      if (!r.failure || !r.fits) {
        c.widen(r.peak_reserved, SimTime(std::min(r.step_time.ns(), y_cap)));
      }
    }
  }
  if (c.x_hi <= c.x_lo || c.y_hi <= c.y_lo || none.ns() <= 0) return std::nullopt;
  c.y_lo = std::min(c.y_lo, none.ns());
  return c;
}

// Axes, ticks, grid and axis labels.
std::string axes(const Canvas& c, SimTime none) {
  std::string out = fmt::format("<path d=\"M{} {} V{} H{}\" stroke=\"black\" fill=\"none\"/>\n",
                                kLeft, kTop, kTop + kHeight, kLeft + kWidth);
  for (std::int64_t i = 0; i <= 4; ++i) {
    const std::int64_t xb = c.x_lo + (c.x_hi - c.x_lo) * i / 4;
    const std::int64_t yt = c.y_lo + (c.y_hi - c.y_lo) * i / 4;
    out += fmt::format(
        "<path d=\"M{} {} V{}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" "
        "text-anchor=\"middle\">{}</text>\n",
        c.px(xb), kTop, kTop + kHeight, c.px(xb), kTop + kHeight + 18, format_bytes(Bytes(xb)));
    out += fmt::format(
        "<path d=\"M{} {} H{}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" "
        "text-anchor=\"end\">{}</text>\n",
        kLeft, c.py(yt), kLeft + kWidth, kLeft - 6, c.py(yt) + 4, ratio_text(yt, none.ns(), "x"));
  }
  out += fmt::format(
      "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">peak reserved device memory</text>\n",
      kLeft + kWidth / 2, kTop + kHeight + 42);
  out += fmt::format(
      "<text x=\"18\" y=\"{}\" transform=\"rotate(-90 18 {})\" text-anchor=\"middle\">step "
      "time / no offload ({})</text>\n",
      kTop + kHeight / 2, kTop + kHeight / 2, format_time(none));
  return out;
}

// The plans: a line through their measured (peak, time) points.
std::string plan_line(const Canvas& c, const std::vector<SweepPoint>& points) {
  std::string out;
  std::string line;
  for (const SweepPoint& p : points) {
    if (!p.outcome) continue;
    const RowResult& r = p.outcome->row;
    line += fmt::format("{}{} {}", line.empty() ? "M" : " L", c.px(r.peak_reserved.count()),
                        c.py(r.step_time.ns()));
    out += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"black\"/>\n",
                       c.px(r.peak_reserved.count()), c.py(r.step_time.ns()));
  }
  out += fmt::format("<path d=\"{}\" stroke=\"black\" stroke-width=\"2\" fill=\"none\"/>\n", line);
  return out;
}

// Legend: the plans, then each fixed configuration as a coloured square at its point.
std::string legend(const Canvas& c, const std::vector<RowResult>* fixed, SimTime none) {
  const std::int64_t lx = kLeft + kWidth + 20;
  std::int64_t ly = kTop + 10;
  std::string out = fmt::format(
      "<path d=\"M{} {} H{}\" stroke=\"black\" stroke-width=\"2\"/><text x=\"{}\" "
      "y=\"{}\">ferry plan</text>\n",
      lx, ly, lx + 20, lx + 26, ly + 4);
  if (fixed == nullptr) return out;
  for (std::size_t i = 0; i < fixed->size(); ++i) {
    const RowResult& r = (*fixed)[i];
    if (r.failure && r.fits) continue;
    const char* colour = kColours[i % kColours.size()];
    ly += 20;
    out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"8\" height=\"8\" fill=\"{}\"/>\n",
                       c.px(r.peak_reserved.count()) - 4, c.py(r.step_time.ns()) - 4, colour);
    out += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"8\" height=\"8\" fill=\"{}\"/><text x=\"{}\" "
        "y=\"{}\">{}</text>\n",
        lx + 6, ly - 4, colour, lx + 26, ly + 4,
        fmt::format("{}: {}, {}", r.name, ratio_text(r.step_time.ns(), none.ns(), "x"),
                    format_bytes(r.peak_reserved)));
  }
  return out;
}

}  // namespace

std::string sweep_svg(const std::vector<SweepPoint>& points, const Model& model,
                      const DeviceProfile& device) {
  const SimTime none = none_time(points);
  const std::vector<RowResult>* fixed = nullptr;
  for (const SweepPoint& p : points) {
    if (p.outcome) fixed = &p.outcome->fixed;
  }
  const std::optional<Canvas> canvas = canvas_of(points, fixed, none);
  if (!canvas) {
    return "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"400\" height=\"40\"><text x=\"10\" "
           "y=\"25\">no plan to draw</text></svg>\n";
  }
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n",
      kLeft + kWidth + 330, kTop + kHeight + 60);
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out += fmt::format(
      "<text x=\"{}\" y=\"24\" font-size=\"15\">ferry plan --sweep: {} on {} (step time against "
      "peak reserved memory)</text>\n",
      kLeft, model.name, device.name);
  out += axes(*canvas, none);
  out += plan_line(*canvas, points);
  out += legend(*canvas, fixed, none);
  out += "</svg>\n";
  return out;
}

}  // namespace ferry::sim
