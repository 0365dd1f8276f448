#pragma once
/// Planted faults of the offload scheduler: test-only switches, each dropping one
/// synchronization, so that tests can show the checker catches its absence. Production code
/// never constructs one; the scheduler takes it as a separate constructor argument.

namespace ferry {

struct OffloadFaults {
  bool skip_offload_wait = false;    ///< the copy stream does not wait for the producer
  bool skip_reload_wait = false;     ///< compute does not wait for the reload copy
  bool skip_forward_guard = false;   ///< the device original is freed without waiting for D2H
  bool skip_backward_guard = false;  ///< a reloaded buffer is freed without waiting for compute
  bool skip_record_stream = false;   ///< an escaped view's storage is freed with no record_stream
  bool skip_host_guard = false;      ///< host memory reused/reloaded before its copy finished
  bool skip_exit_sync = false;  ///< trl: leaving the context lets the stash go without a host sync
  // Breaches of the saved-tensor contract (Note [Saved-tensor contract],
  // real/src/saved_tensors.hpp):
  bool dedup_across_versions = false;  ///< one copy serves a storage at every version
  bool skip_version_check = false;     ///< real backend: an unpack ignores in-place changes
  bool drop_view_bits = false;         ///< real backend: rebuilt views lose conj and neg bits
  /// The compute stream is the one current when the scheduler was made, not the one current at
  /// each pack and unpack (TRL before its PR #7195; Note [The compute stream is the current
  /// one] in tracker.hpp).
  bool stale_compute_stream = false;
  /// ferry: the host pool hands a pinned buffer to the next copy-out without waiting for the
  /// reload that last read it (skip_host_guard drops this wait and the reload's own).
  bool reuse_pinned_early = false;
  /// real backend: a backward announces no node order, so the core prefetches the nodes of
  /// every forward the session holds, latest first, later micro-batches' included (Note [Nodes
  /// and backward passes] in real/src/session.cpp).
  bool prefetch_later_forwards = false;
};

}  // namespace ferry
