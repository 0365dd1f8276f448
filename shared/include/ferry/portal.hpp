#pragma once
/// Skip-connection portals: where a pipeline keeps a tensor that bypasses the partition chain,
/// and the use count (tensor life) that tells the backend when the portal lets go of it.

#include <compare>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include "ferry/ids.hpp"

namespace ferry {

// Note [Portal tensor life]
// A skip connection stashes a tensor in partition p and pops it in a later partition q. The
// tensor does not travel down the partition chain: it waits in a portal, one per (skip,
// micro-batch). torchgpipe (skip/portal.py, skip/tracker.py; see docs/pipeline.md) ties three
// autograd nodes to a portal: PortalBlue, joined into p's lane at the stash; PortalCopy, in the
// fence before q's task, which moves the tensor to q's device; PortalOrange, forked from q's lane
// at the pop. Of the thirteen events its Portal.put_tensor lists around one portal, four take the
// tensor out of the portal (a "use"; torchgpipe's event number in brackets):
//
//   blue               the stash in p's forward hands the tensor to PortalBlue        [1]
//   orange             the pop in q's forward                                          [6]
//   recomputed orange  the pop again in q's recompute, when checkpointed               [8]
//   recomputed blue    the re-stash in p's recompute, when checkpointed                [11]
//
// Backward runs the partitions in reverse, so q recomputes before p does: the recomputed orange
// reads the forward's tensor, still in the portal, and p's recompute then stashes a new tensor
// into a portal that already exists. Each put gives its tensor a life, the uses left before the
// portal drops it:
//
//   2  a first stash without checkpoint: blue, then orange, which drops it.
//   3  a first stash while p runs under checkpoint: blue, orange, then the recomputed orange,
//      which needs the forward's tensor and drops it.
//   1  a stash into an existing portal, in p's recompute (the old tensor went at the recomputed
//      orange): the recomputed blue is its only use.
//
// A use that runs the life out is "released": the portal's reference ends, and the caller frees
// the memory once nothing else (the consumer's saved tensors, a copy in flight) holds it. A use
// after that is the reference's RuntimeError "tensor in portal has been removed". Gradients go
// the other way, used once per put (the orange's backward puts one, PortalCopy's backward takes
// it and puts its copy, the blue's backward takes that); a use with none put is "grad in portal
// has been removed or never set".

/// Misuse that torchgpipe's portal rejects too: a tensor used after its life ran out, a
/// gradient used twice or never put, a portal that was never stashed.
class PortalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One portal: a skip connection (its index in the pipeline's skip list) for one micro-batch.
struct PortalKey {
  std::uint32_t skip = 0;         ///< index of the skip connection
  std::uint32_t micro_batch = 0;  ///< index of the micro-batch

  friend constexpr auto operator<=>(const PortalKey&, const PortalKey&) = default;
};

/// Test-only switches that break the life rules on purpose (planted faults).
struct PortalFaults {
  bool fixed_life = false;  ///< every put gets life 2, whatever Note [Portal tensor life] says
};

/// The life a put gives its tensor: 1 into an existing portal, else 3 while checkpointing, else
/// 2. See Note [Portal tensor life].
[[nodiscard]] std::int32_t portal_tensor_life(bool portal_exists, bool checkpointing);

/// What a use hands back.
struct PortalUse {
  TensorId tensor;        ///< the tensor the portal held
  bool released = false;  ///< the life ran out: the portal dropped its reference to `tensor`
};

/// What a stash did.
struct PortalStash {
  std::int32_t life = 0;            ///< the life given to the tensor
  std::optional<TensorId> dropped;  ///< a tensor still held that the put replaced (unreferenced)
};

/// Counters over a table's lifetime (clear() keeps them).
struct PortalStats {
  std::int64_t puts = 0;       ///< tensors put (stashes, recompute re-stashes included)
  std::int64_t uses = 0;       ///< tensor uses (blue and orange, recomputed ones included)
  std::int64_t copies = 0;     ///< tensors replaced by their copy (PortalCopy)
  std::int64_t releases = 0;   ///< references dropped: a life ran out, a put replaced, a clear
  std::int64_t grad_puts = 0;  ///< gradients put
  std::int64_t grad_uses = 0;  ///< gradients used
  std::int64_t live = 0;       ///< portals holding a tensor now
  std::int64_t max_live = 0;   ///< most portals holding a tensor at once
};

/// The portals of one training step, keyed by (skip, micro-batch). Tensors and gradients are
/// the backend's handles; the table never owns memory, it only says when its reference ends.
class PortalTable {
 public:
  /// An empty table; `faults` is for tests only.
  explicit PortalTable(PortalFaults faults = {});

  /// Stashes `tensor` with the life of portal_tensor_life(exists, checkpointing): the stash of
  /// a forward (`checkpointing`: the source partition runs under checkpoint) or of a recompute.
  PortalStash stash(PortalKey key, TensorId tensor, bool checkpointing);
  /// Puts `tensor` with an explicit life (> 0); returns a tensor it replaced that was still held.
  std::optional<TensorId> put_tensor(PortalKey key, TensorId tensor, std::int32_t life);
  /// Takes the tensor out once (blue or orange). Throws PortalError when its life ran out.
  PortalUse use_tensor(PortalKey key);
  /// PortalCopy: the portal now holds `copy`; returns the tensor it held before (the caller
  /// drops that reference). Throws PortalError when the life ran out.
  TensorId copy_tensor(PortalKey key, TensorId copy);
  /// Puts a gradient (the orange node's backward, or a PortalCopy backward); returns a
  /// gradient it replaced that was never used.
  std::optional<TensorId> put_grad(PortalKey key, TensorId grad);
  /// Takes the gradient out. Throws PortalError when none was put since the last use.
  TensorId use_grad(PortalKey key);

  /// Whether `key` was ever stashed since the last clear().
  [[nodiscard]] bool contains(PortalKey key) const;
  /// Uses left for the tensor under `key` (0 when dropped or never stashed).
  [[nodiscard]] std::int32_t tensor_life(PortalKey key) const;
  /// Portals still holding a tensor, in key order.
  [[nodiscard]] std::vector<PortalKey> holding_tensors() const;
  /// Portals still holding a gradient, in key order.
  [[nodiscard]] std::vector<PortalKey> holding_grads() const;
  /// Forgets every portal (a new step); returns the tensors and gradients still held, in key
  /// order, whose references the caller now drops.
  std::vector<TensorId> clear();

  [[nodiscard]] const PortalStats& stats() const { return stats_; }

 private:
  struct Portal {
    std::optional<TensorId> tensor;
    std::int32_t life = 0;
    std::optional<TensorId> grad;
  };

  Portal& existing(PortalKey key, const char* what);
  void set_live(std::int64_t delta);

  PortalFaults faults_;
  std::map<PortalKey, Portal> portals_;
  PortalStats stats_;
};

}  // namespace ferry
