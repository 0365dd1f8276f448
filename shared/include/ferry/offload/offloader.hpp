#pragma once
/// The offload scheduler: saved tensors in (pack), tensors back out (unpack), and the stream
/// commands that move them, issued to a Backend. The policy chosen in the options does the
/// work: `trl` (trl_policy.hpp) or `ferry` (ferry_policy.hpp, which is also `none` when every
/// tensor stays).

#include <span>
#include <variant>

#include "ferry/check.hpp"
#include "ferry/offload/ferry_policy.hpp"
#include "ferry/offload/trl_policy.hpp"

namespace ferry {

// Note [Offload protocol]
// Forward. A saved tensor worth offloading is copied to host memory on a copy stream after
// that stream waits for the compute stream (the producer must have written it). The device
// original stays referenced in a forward window until the copy is known done; leaving the
// window, the compute stream first waits for the copy's event, so the original's memory, which
// returns to the compute stream's pool, is only reused after the copy read it.
//
// Backward. A reload allocates on the reload stream, copies host -> device after waiting for
// the offload's event, and records an event the compute stream waits for before the first use.
// When the last node that uses it is done, the compute stream records an event, the reload
// stream waits for it, and the reference is dropped: the block goes back to the reload
// stream's pool, where the next reload can only reuse it after compute finished reading. If
// something else still references the storage (a view escaped: its use count grew), the
// storage is freed with record_stream on the compute stream instead.
//
// Host memory. trl takes a block per tensor from the caching host allocator and frees it at
// unpack with record_stream on the copy stream. ferry keeps an exact-size pool: a host buffer
// goes back to the pool when every id using it is released, and before the pool reuses it, the
// offload stream waits for the last reload that read it.
//
// Each saved storage is a record whose state follows Note [Record lifecycle].

template <Backend B>
class Offloader {
 public:
  using Stream = typename B::Stream;
  using Buffer = typename B::Buffer;

  /// `faults` plants synchronization faults; tests only.
  Offloader(B& backend, const OffloadOptions& options, const OffloadFaults& faults = {})
      : policy_(make(backend, options, faults)) {}
  Offloader(const Offloader&) = delete;
  Offloader& operator=(const Offloader&) = delete;

  /// Takes a saved tensor whose storage is `storage`; returns the id autograd keeps instead.
  TensorId pack(const TensorFacts& facts, const Buffer& storage) {
    const bool in_region = no_offload_depth_ > 0;
    return std::visit([&](auto& p) { return p.pack(facts, storage, in_region); }, policy_);
  }

  /// The tensor behind `id`, for use on the compute stream by backward node `node`.
  Unpacked<Buffer> unpack(TensorId id, NodeId node) {
    return std::visit([&](auto& p) { return p.unpack(id, node); }, policy_);
  }

  /// Autograd no longer needs `id` (its graph was freed).
  void release(TensorId id) {
    std::visit([&](auto& p) { p.release(id); }, policy_);
  }

  /// The post-hook of backward node `node`: it ran, its tensors may be freed.
  void node_done(NodeId node) {
    std::visit([&](auto& p) { p.node_done(node); }, policy_);
  }

  /// Backward starts; `order` is the node order the engine will follow (may be empty: then
  /// nodes are expected in decreasing id order, as PyTorch's engine orders by sequence number).
  void backward_begin(std::span<const NodeId> order) {
    std::visit([&](auto& p) { p.backward_begin(order); }, policy_);
  }

  /// The end-of-backward callback: everything reloaded for this backward is let go.
  void backward_end() {
    std::visit([](auto& p) { p.backward_end(); }, policy_);
  }

  /// The offload context is entered (a training step begins) / left (it ends). The current
  /// reference clears stale state on entry and, leaving, waits for its streams and lets its
  /// stashes go; the others do nothing.
  void enter() {
    std::visit([](auto& p) { p.enter(); }, policy_);
  }
  void exit() {
    std::visit([](auto& p) { p.exit(); }, policy_);
  }

  /// Saved tensors packed while at least one region is open stay on the device.
  void push_no_offload() { ++no_offload_depth_; }
  void pop_no_offload() {
    FERRY_CHECK(no_offload_depth_ > 0, "pop_no_offload without a matching push");
    --no_offload_depth_;
  }

  [[nodiscard]] const OffloadTelemetry& telemetry() const { return tracker().telemetry; }
  /// Ids packed and neither unpacked for good (trl) nor released (ferry).
  [[nodiscard]] std::size_t tracked() const { return tracker().ids.tracked(); }
  [[nodiscard]] const OffloadOptions& options() const { return tracker().options; }
  [[nodiscard]] Stream offload_stream() const { return tracker().offload_stream; }
  [[nodiscard]] Stream reload_stream() const { return tracker().reload_stream; }

 private:
  using Policies = std::variant<FerryPolicy<B>, TrlPolicy<B>>;

  static Policies make(B& backend, const OffloadOptions& options, const OffloadFaults& faults) {
    check_offload_options(options);
    if (is_trl(options.policy)) {
      return Policies(std::in_place_type<TrlPolicy<B>>, backend, options, faults);
    }
    return Policies(std::in_place_type<FerryPolicy<B>>, backend, options, faults);
  }

  [[nodiscard]] const Tracker<B>& tracker() const {
    return std::visit([](const auto& p) -> const Tracker<B>& { return p.tracker(); }, policy_);
  }

  Policies policy_;
  int no_offload_depth_ = 0;
};

}  // namespace ferry
