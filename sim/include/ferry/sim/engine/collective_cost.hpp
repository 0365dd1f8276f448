#pragma once
/// How long a collective takes over a process group (docs/fsdp.md, "The link model"): the ring
/// formula over the group's slowest link, which the group's placement on the nodes decides.

#include <cstdint>
#include <string_view>

#include "ferry/program/device_profile.hpp"
#include "ferry/units.hpp"

namespace ferry::sim {

/// The collectives a process group runs, by what they move.
enum class CollectiveKind : std::uint8_t {
  AllGather,      ///< each rank's part to every rank; `bytes` is the output
  ReduceScatter,  ///< the sum of every rank's input, a part to each; `bytes` is the input
  AllReduce,      ///< the sum to every rank: a reduce-scatter, then an all-gather
  AllToAll,       ///< a part of each rank's input to every rank; `bytes` is the larger of what
                  ///< a rank sends and receives (expert parallelism's splits may differ)
};

/// `kind` as files and reports name it: "all_gather", "reduce_scatter", "all_reduce",
/// "all_to_all".
[[nodiscard]] constexpr std::string_view collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::AllReduce:
      return "all_reduce";
    case CollectiveKind::AllToAll:
      break;
  }
  return "all_to_all";
}

/// Where a process group's ranks lie: how many there are, how many nodes they span, and how
/// many groups of its kind cross a node's links at once (Note [Groups sharing a node's links]).
struct GroupPlacement {
  std::int32_t ranks = 1;
  std::int32_t nodes = 1;
  std::int32_t sharing = 1;
  friend bool operator==(const GroupPlacement&, const GroupPlacement&) = default;
};

/// How many groups of one axis, each of members `stride` apart, cross a node's links at once
/// when each spans `nodes` nodes of `per_node` ranks: min(stride, per_node) across nodes, 1
/// inside one (Note [Groups sharing a node's links]).
[[nodiscard]] std::int32_t groups_sharing_a_node(std::int32_t stride, std::int32_t per_node,
                                                 std::int32_t nodes);

/// The placement of rank 0's group of `ranks` ranks whose members are `stride` ranks apart
/// (ranks 0, stride, 2 x stride, ...), in a world laid out `per_node` consecutive ranks to a
/// node: members `per_node` or more apart are each on a node of their own, nearer ones share
/// nodes; a group across nodes shares each node's links with the other min(stride, per_node)
/// - 1 groups of its kind there. All three are at least 1.
[[nodiscard]] GroupPlacement place_group(std::int32_t ranks, std::int32_t stride,
                                         std::int32_t per_node);

/// What collective_time gives for any collective that takes longer: 2^60 ns (36 years).
inline constexpr SimTime kLongestCollective{std::int64_t{1} << 60};

/// The ring formula for `kind` moving `bytes` over `group`: each rank sends (g - 1) / g of
/// `bytes` at the link's bus bandwidth, one latency per ring step, over the profile's
/// intra-node link when the group lies inside one node, else its inter-node link, of which the
/// group has 1 / `group.sharing`; an
/// all-reduce is two passes, an all-to-all one (each rank keeps 1/g of its data). A group of
/// one rank moves nothing: 1 ns. The link must be known (CollectiveLink::known).
[[nodiscard]] SimTime collective_time(CollectiveKind kind, Bytes bytes, GroupPlacement group,
                                      const CollectiveLinks& links);

}  // namespace ferry::sim
