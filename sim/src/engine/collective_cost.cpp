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
  FERRY_CHECK(link.known() && bytes.count() >= 0, "a collective over an unknown link");
  // 128-bit: a model's op may move 2^50 bytes over a slow link (check_roofline bounds the
  // result, which saturates at kLongestCollective).
  __extension__ using Wide = unsigned __int128;
  const Wide moved = static_cast<Wide>(bytes.count() / g) * static_cast<Wide>(g - 1);
  const Wide rate = static_cast<Wide>(link.bandwidth.bytes_per_s());
  const Wide once = (moved * 1'000'000'000U + rate - 1) / rate +
                    static_cast<Wide>(link.latency.ns()) * static_cast<Wide>(g - 1);
  const Wide passes = kind == CollectiveKind::AllReduce ? 2 : 1;
  const Wide ns = once * passes;
  return SimTime(ns > static_cast<Wide>(kLongestCollective.ns()) ? kLongestCollective.ns()
                                                                 : static_cast<std::int64_t>(ns));
}

}  // namespace ferry::sim
