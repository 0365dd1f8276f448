#include "ferry/sim/engine/collective_cost.hpp"

#include "ferry/check.hpp"

namespace ferry::sim {

GroupPlacement place_group(std::int32_t ranks, std::int32_t stride, std::int32_t per_node) {
  FERRY_CHECK(ranks >= 1 && stride >= 1 && per_node >= 1,
              "a group of {} ranks {} apart, {} to a node", ranks, stride, per_node);
  if (stride >= per_node) return GroupPlacement{ranks, ranks};
  // The members span (ranks - 1) x stride + 1 consecutive ranks, on nodes of per_node.
  const std::int64_t span = std::int64_t{ranks - 1} * stride + 1;
  const auto nodes = static_cast<std::int32_t>((span + per_node - 1) / per_node);
  return GroupPlacement{ranks, nodes};
}

SimTime collective_time(CollectiveKind kind, Bytes bytes, GroupPlacement group,
                        const CollectiveLinks& links) {
  const std::int32_t g = group.ranks;
  if (g <= 1) return SimTime(1);
  const CollectiveLink& link = group.nodes > 1 ? links.inter_node : links.intra_node;
  const Bytes moved(bytes.count() / g * (g - 1));
  const SimTime once = transfer_time(moved, link.bandwidth) + SimTime(link.latency.ns() * (g - 1));
  const std::int64_t passes = kind == CollectiveKind::AllReduce ? 2 : 1;
  return SimTime(once.ns() * passes);
}

}  // namespace ferry::sim
