#include "ferry/sim/workload/rank_workload.hpp"

#include <fmt/format.h>

#include <optional>
#include <string_view>
#include <utility>

#include "rank_cut.hpp"

namespace ferry::sim {

Result<Workload> rank_workload(const Workload& whole, const Mesh& mesh, CutAxes axes) {
  const Parallelism& p = mesh;
  const std::int32_t tp = axes.tp ? p.tp : 1;
  const std::int32_t cp = axes.cp ? p.cp : 1;
  const std::int32_t ep = axes.ep ? p.ep : 1;
  if (tp <= 1 && cp <= 1 && ep <= 1) {
    auto timed = with_roofline_durations(whole.model, whole.device);
    if (!timed) return timed.error();
    return Workload{std::move(timed).value(), whole.device};
  }
  // Each cut reads the one before; the last is validated once (Mesh::make checked the degrees).
  std::optional<Model> cut;
  std::string_view last;
  std::int32_t degree = 1;
  const auto apply = [&](Result<Model> next, std::string_view flag, std::int32_t ranks) -> Status {
    if (!next) return next.error();
    cut = std::move(next).value();
    last = flag;
    degree = ranks;
    return Ok{};
  };
  const auto at = [&]() -> const Model& { return cut ? *cut : *whole.model; };
  if (tp > 1) {
    // A refusal offers the degrees the rest of this mesh takes too (--ep a multiple of --tp, the
    // nodes holding the ranks evenly).
    const auto fits = [&p, &whole](std::int32_t other_tp) {
      Parallelism other = p;
      other.tp = other_tp;
      return Mesh::make(other, whole.device).ok();
    };
    if (auto done = apply(rank_cut_detail::tensor_parallel_cut(
                              at(), tp, whole.device.collectives.gpus_per_node, fits, false),
                          mesh_field(MeshField::Tp).flag, tp);
        !done) {
      return done.error();
    }
  }
  if (cp > 1) {
    const MeshGroup group = mesh.group(Mesh::Axis::Context);
    if (auto done = apply(rank_cut_detail::context_parallel_cut(at(), cp, group.placement(), false),
                          mesh_field(MeshField::Cp).flag, cp);
        !done) {
      return done.error();
    }
  }
  if (ep > 1) {
    const MeshGroup group = mesh.group(Mesh::Axis::Expert);
    if (auto done = apply(
            rank_cut_detail::expert_parallel_cut(at(), ep, group.nodes, p.expert_capacity, false),
            mesh_field(MeshField::Ep).flag, ep);
        !done) {
      return done.error();
    }
  }
  auto checked = check_model(std::move(*cut));
  if (!checked) {
    return Error{fmt::format("{} {}: the cut model is not valid ({})", last, degree,
                             checked.error().message)};
  }
  auto timed = with_roofline_durations(std::move(checked).value(), whole.device);
  if (!timed) return timed.error();
  return Workload{std::move(timed).value(), whole.device};
}

}  // namespace ferry::sim
