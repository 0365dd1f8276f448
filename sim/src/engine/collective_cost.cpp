#include "ferry/sim/engine/collective_cost.hpp"

#include <algorithm>

#include "ferry/check.hpp"

namespace ferry::sim {

// Note [Groups sharing a node's links]
// A ring across nodes has the node's NICs together (docs/fsdp.md, "The link model") only when
// it is the one group of its kind crossing them. Groups of one kind run their collectives at
// the same time (every rank runs the same step), and a node's per_node consecutive ranks belong
// to min(stride, per_node) groups whose members are stride ranks apart: HSDP's replica groups
// (one rank of each shard group), eight to a node of eight; the shard groups under tensor
// parallelism, tp to a node. They move their bytes through the same NICs at once, so each has
// 1 / min(stride, per_node) of the node's inter-node link (the profile's figure is the node's
// NICs together). A group inside a node has NVLink's per-GPU rate, shared by none. The IBM and
// Meta FSDP blog's H100 HSDP runs see the network "peeking out" about 10 % of the step
// (docs/validation.md, row 43): an HSDP replica group with the whole node's link hides it.
std::int32_t groups_sharing_a_node(std::int32_t stride, std::int32_t per_node, std::int32_t nodes) {
  return nodes > 1 ? std::min(stride, per_node) : 1;
}

GroupPlacement place_group(std::int32_t ranks, std::int32_t stride, std::int32_t per_node) {
  FERRY_CHECK(ranks >= 1 && stride >= 1 && per_node >= 1,
              "a group of {} ranks {} apart, {} to a node", ranks, stride, per_node);
  if (ranks == 1) return GroupPlacement{};
  // Members per_node or more apart are on a node each; nearer ones span (ranks - 1) x stride +
  // 1 consecutive ranks, on nodes of per_node.
  const std::int64_t span = std::int64_t{ranks - 1} * stride + 1;
  const auto nodes =
      stride >= per_node ? ranks : static_cast<std::int32_t>((span + per_node - 1) / per_node);
  return GroupPlacement{ranks, nodes, groups_sharing_a_node(stride, per_node, nodes)};
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
  const std::int32_t sharing = group.nodes > 1 ? std::max(group.sharing, 1) : 1;
  const Wide rate = std::max<Wide>(
      static_cast<Wide>(link.bandwidth.bytes_per_s()) / static_cast<Wide>(sharing), 1);
  const Wide once = (moved * 1'000'000'000U + rate - 1) / rate +
                    static_cast<Wide>(link.latency.ns()) * static_cast<Wide>(g - 1);
  const Wide passes = kind == CollectiveKind::AllReduce ? 2 : 1;
  const Wide ns = once * passes;
  return SimTime(ns > static_cast<Wide>(kLongestCollective.ns()) ? kLongestCollective.ns()
                                                                 : static_cast<std::int64_t>(ns));
}

}  // namespace ferry::sim
