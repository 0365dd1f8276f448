#pragma once
/// The `ferry` policy: one copy stream per direction, a forward window bounded in bytes,
/// prefetch in the order backward will need, events instead of record_stream except where a
/// view escaped, an exact-size pinned pool under a cap (keep on the device when it is full),
/// one copy per storage shared by views. With every tensor kept by rule it is Policy::None.

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ferry/offload/host_pool.hpp"
#include "ferry/offload/tracker.hpp"

namespace ferry {

template <Backend B>
class FerryPolicy {
 public:
  using Event = typename B::Event;
  using Buffer = typename B::Buffer;

  FerryPolicy(B& backend, const OffloadOptions& options, const OffloadFaults& faults)
      : t_(backend, options, faults, streams(backend, options)),
        pool_(backend, options.host_cap, t_.offload_stream, t_.reload_stream) {}
  FerryPolicy(const FerryPolicy&) = delete;
  FerryPolicy& operator=(const FerryPolicy&) = delete;

  TensorId pack(const TensorFacts& facts, const Buffer& storage, bool in_region) {
    ++t_.telemetry.packed;
    RecordId r;
    if (t_.stays(facts, in_region, /*opt_out=*/true)) {
      r = t_.keep(facts, storage);
    } else if (past_horizon(facts)) {
      ++t_.telemetry.past_horizon;
      r = t_.keep(facts, storage);
    } else {
      r = offload(facts, storage);
    }
    return t_.ids.add(r, facts.view_offset);
  }

  Unpacked<Buffer> unpack(TensorId id, NodeId node) {
    const RecordId r = t_.find(id);
    if (t_.records[r].state == RecordState::Kept) {
      t_.backend.hold(t_.records[r].device);
      return Unpacked<Buffer>{t_.records[r].device, t_.ids.offset(id)};
    }
    return Unpacked<Buffer>{use(r, node), t_.ids.offset(id)};
  }

  void release(TensorId id) {
    const RecordId r = t_.ids.find(id);
    if (!r.valid()) return;  // already released
    t_.ids.forget(id);
    if (--t_.records[r].ids > 0) return;
    finish(r);
  }

  void node_done(NodeId node) {
    if (!node.valid() || node.value() >= node_uses_.size()) return;
    std::vector<RecordId>& uses = node_uses_[node.value()];
    for (const RecordId r : uses) {
      const auto& rec = t_.records[r];
      if (rec.ids == 0 || rec.unpacks_left > 0) continue;
      if (reloaded(rec.state)) {
        free_reloaded(r);
      } else if (rec.state == RecordState::Offloading) {
        leave_window(rec.bytes);
        release_original(r);
      }
    }
    uses.clear();
  }

  /// `order` is the node order the engine will follow (empty: decreasing id order, as
  /// PyTorch's engine orders by sequence number); prefetch follows it.
  void backward_begin(std::span<const NodeId> order) {
    in_backward_ = true;
    for (auto& rec : t_.records.all()) rec.unpacks_left = rec.ids;
    prefetch_queue_.clear();
    queued_.assign(t_.records.size(), false);
    auto enqueue = [&](NodeId node) {
      if (!node.valid() || node.value() >= node_records_.size()) return;
      for (const RecordId r : node_records_[node.value()]) {
        if (!queued_[r.value()] && t_.records[r].ids > 0 && holds_host(t_.records[r].state)) {
          queued_[r.value()] = true;
          prefetch_queue_.push_back(r);
        }
      }
    };
    if (order.empty()) {
      for (std::size_t n = node_records_.size(); n-- > 0;) {
        enqueue(NodeId(static_cast<std::uint32_t>(n)));
      }
    } else {
      for (const NodeId node : order) enqueue(node);
    }
    prefetch();
  }

  /// The end-of-backward callback: everything reloaded for this backward is let go.
  void backward_end() {
    new_forward();
    for (std::uint32_t i = 0; i < t_.records.size(); ++i) {
      const RecordId r(i);
      if (t_.records[r].ids > 0 && reloaded(t_.records[r].state)) free_reloaded(r);
    }
    for (auto& uses : node_uses_) uses.clear();
    prefetch_queue_.clear();
    prefetch_bytes_ = Bytes(0);
    prefetch_count_ = 0;
    std::erase_if(window_,
                  [&](RecordId r) { return t_.records[r].state != RecordState::Offloading; });
    for (auto& list : node_records_) {
      std::erase_if(list, [&](RecordId r) { return t_.records[r].ids == 0; });
    }
    t_.records.reclaim(
        [&](RecordId r) { return std::find(window_.begin(), window_.end(), r) != window_.end(); });
  }

  void enter() { new_forward(); }
  void exit() {}

  [[nodiscard]] const Tracker<B>& tracker() const { return t_; }

 private:
  // One stream per direction; with `use_streams` false, the compute stream; none for
  // Policy::None, which copies nothing.
  static std::pair<typename B::Stream, typename B::Stream> streams(B& backend,
                                                                   const OffloadOptions& options) {
    if (options.policy == Policy::None) return {};
    if (!options.use_streams) return {backend.compute_stream(), backend.compute_stream()};
    const auto d2h = backend.make_stream("d2h");
    const auto h2d = backend.make_stream("h2d");
    return {d2h, h2d};
  }

  // Note [Offload horizon]
  // A copy to the host hides behind compute only if it ends before backward needs the tensor
  // again; a tensor saved near the end of forward (the last layers, the loss's log-softmax)
  // comes back at once, and copying it out stalls compute twice: the forward window waits for
  // the copy, and so does backward before it may use or free the original. TRL's forward stash
  // keeps the last few offloaded originals for that reason, by count. ferry keeps on the device
  // everything saved after a horizon in bytes: a forward copies saved storages in pack order
  // while the bytes copied so far, this one included, stay within `horizon_bytes`; the first
  // pack past it, and every later pack of that forward (views of storages already copied
  // included), stay as in a no-offload region. The core knows no time, so the horizon is an
  // option: the simulator derives it from the link's bandwidth and latency and the forward and
  // backward work left after each saved tensor (sim::offload_horizon), and a real run given
  // the same number makes the same decisions on the same packs. The count starts again at the
  // next forward (after backward_end, or on entering the context); packs during backward
  // (recomputation) neither count nor stop.

  // Whether the pack of `facts` (which does not stay by rule) comes after the horizon.
  bool past_horizon(const TensorFacts& facts) {
    if (!t_.options.horizon_bytes || in_backward_) return false;
    if (beyond_horizon_) return true;
    const bool copies =
        !(t_.options.dedup && storage_index_.contains({facts.storage, version_key(facts)}));
    if (copies && forward_copied_ + facts.storage_bytes > *t_.options.horizon_bytes) {
      beyond_horizon_ = true;
    }
    return beyond_horizon_;
  }

  // A new forward: the horizon counts from zero again.
  void new_forward() {
    in_backward_ = false;
    beyond_horizon_ = false;
    forward_copied_ = Bytes(0);
  }

  static constexpr bool reloaded(RecordState s) {
    return s == RecordState::Reloading || s == RecordState::Reloaded;
  }

  static std::vector<RecordId>& at(std::vector<std::vector<RecordId>>& table, NodeId node) {
    FERRY_CHECK(node.valid(), "a saved tensor needs the node that saves it");
    if (table.size() <= node.value()) table.resize(node.value() + 1);
    return table[node.value()];
  }

  RecordId offload(const TensorFacts& facts, const Buffer& storage) {
    if (t_.options.dedup) {
      auto it = storage_index_.find({facts.storage, version_key(facts)});
      if (it != storage_index_.end()) {
        ++t_.records[it->second].ids;
        ++t_.telemetry.deduplicated;
        at(node_records_, facts.node).push_back(it->second);
        return it->second;
      }
    }
    const Bytes size = facts.storage_bytes;
    auto slot = pool_.take(size, t_.telemetry);
    if (!slot) {
      ++t_.telemetry.host_fallbacks;
      return t_.keep(facts, storage);
    }
    // Note [Tensors in flight]
    while (window_bytes_ + size > t_.options.window_bytes && !window_.empty() &&
           (window_count_ >= t_.options.min_in_flight || t_.options.window_bytes.count() == 0)) {
      retire_oldest();
    }
    if (!t_.faults.skip_offload_wait) t_.wait_for_compute(t_.offload_stream);
    if (slot->read && !t_.faults.skip_host_guard && !t_.faults.reuse_pinned_early) {
      t_.backend.wait(t_.offload_stream, slot->last_read);
    }
    const RecordId r = t_.start_offload(storage, Bytes(0), slot->buffer, size, facts.storage);
    window_.push_back(r);
    window_bytes_ += size;
    ++window_count_;
    if (!in_backward_) forward_copied_ += size;
    if (t_.options.dedup) storage_index_.emplace(std::pair{facts.storage, version_key(facts)}, r);
    at(node_records_, facts.node).push_back(r);
    return r;
  }

  // Note [Tensors in flight]
  // The forward window and the prefetch budget are bounds in bytes, but a bound that holds
  // fewer than three tensors serialises the link with compute: one tensor is on the link, the
  // next must be queued behind it so the link never idles, and a third is the one compute is
  // producing (forward) or about to read (backward). Below that, each copy waits for the one
  // before it to end, and compute waits for both (at sequence 16384 a Llama-3-8B saves tensors
  // of 448 MiB and more, so a 512 MiB window held one). So both always admit
  // `min_in_flight` tensors (three by default), whatever their bytes, and the byte bound
  // applies beyond that; TRL's stash holds five by count alone. A bound of zero bytes still
  // means none: every copy waited for at once, every reload on demand (what tests of the
  // reload path ask for).

  void leave_window(Bytes bytes) {
    window_bytes_ -= bytes;
    --window_count_;
  }

  void leave_prefetch(Bytes bytes) {
    prefetch_bytes_ -= bytes;
    --prefetch_count_;
  }

  void retire_oldest() {
    const RecordId r = window_.front();
    window_.pop_front();
    if (t_.records[r].state != RecordState::Offloading) return;  // consumed or released
    leave_window(t_.records[r].bytes);
    release_original(r);
  }

  // Offloading -> OnHost: the original goes once its copy is done.
  void release_original(RecordId r) {
    auto& rec = t_.records[r];
    // Note [The compute stream is the current one]: every compute stream waits for the copy.
    if (!t_.faults.skip_forward_guard) t_.guard_original(rec.d2h_done);
    t_.backend.drop(rec.device);
    rec.move_to(RecordState::OnHost);
    if (t_.options.dedup) forget_storage(rec.storage, r);
  }

  // The version part of the dedup key (the planted fault ignores versions).
  [[nodiscard]] std::uint32_t version_key(const TensorFacts& facts) const {
    return t_.faults.dedup_across_versions ? 0 : facts.version;
  }

  // Drops `r` from the dedup index (one entry per version of its storage at most).
  void forget_storage(std::uint64_t storage, RecordId r) {
    for (auto it = storage_index_.lower_bound({storage, 0});
         it != storage_index_.end() && it->first.first == storage; ++it) {
      if (it->second == r) {
        storage_index_.erase(it);
        return;
      }
    }
  }

  // OnHost -> Reloading.
  void reload(RecordId r) {
    auto& rec = t_.records[r];
    auto buf =
        t_.backend.allocate(Place::Device, rec.bytes, t_.reload_stream, "reloaded activation");
    if (!buf)
      throw OffloadError("out of device memory reloading an offloaded activation",
                         FailureKind::OutOfMemory);
    if (!t_.faults.skip_host_guard) t_.backend.wait(t_.reload_stream, rec.d2h_done);
    t_.backend.copy(t_.reload_stream, rec.host, Bytes(0), *buf, Bytes(0), rec.bytes, "reload");
    rec.h2d_done = t_.backend.make_event();
    t_.backend.record(rec.h2d_done, t_.reload_stream);
    rec.device = *buf;
    t_.readers_of(r).clear();
    rec.move_to(RecordState::Reloading);
    rec.host_read = true;
    rec.snapshot = t_.backend.use_count(*buf);
    t_.telemetry.bytes_h2d += rec.bytes;
  }

  // Reloads ahead of demand, in queue order, while the prefetch budget allows.
  void prefetch() {
    if (!t_.options.prefetch) return;
    while (!prefetch_queue_.empty()) {
      const RecordId r = prefetch_queue_.front();
      const auto& rec = t_.records[r];
      if (rec.ids == 0 || rec.state != RecordState::OnHost || rec.unpacks_left == 0) {
        prefetch_queue_.pop_front();
        continue;
      }
      if (prefetch_bytes_ + rec.bytes > t_.options.prefetch_bytes &&
          (prefetch_count_ >= t_.options.min_in_flight || t_.options.prefetch_bytes.count() == 0)) {
        break;  // Note [Tensors in flight]
      }
      reload(r);
      prefetch_bytes_ += rec.bytes;
      ++prefetch_count_;
      ++t_.telemetry.prefetched;
      prefetch_queue_.pop_front();
    }
  }

  // An unpack of an offloaded record by `node`: the original if still resident, else the
  // reloaded copy (reloading now if no prefetch did), which compute waits for once.
  Buffer use(RecordId r, NodeId node) {
    auto& rec = t_.records[r];
    if (rec.unpacks_left > 0) --rec.unpacks_left;
    at(node_uses_, node).push_back(r);
    if (rec.state == RecordState::Offloading) {
      ++t_.telemetry.stash_hits;
    } else {
      if (rec.state == RecordState::OnHost) {
        ++t_.telemetry.on_demand;
        reload(r);
      } else if (rec.state == RecordState::Reloading) {
        leave_prefetch(rec.bytes);  // a prefetched reload, now in use
      }
      // Each stream that reads the reloaded copy waits for it once (Note [The compute stream
      // is the current one]).
      const auto reader = t_.compute();
      if (t_.new_reader(r, reader) && !t_.faults.skip_reload_wait) {
        t_.backend.wait(reader, rec.h2d_done);
      }
      if (rec.state == RecordState::Reloading) rec.move_to(RecordState::Reloaded);
    }
    prefetch();
    t_.backend.hold(rec.device);
    return rec.device;
  }

  // Reloading | Reloaded -> OnHost: the reload stream may reuse the block once compute is done
  // with it (an event), or record_stream when a view escaped.
  void free_reloaded(RecordId r) {
    auto& rec = t_.records[r];
    const bool escaped = t_.backend.use_count(rec.device) > rec.snapshot;
    if (escaped) ++t_.telemetry.record_stream_fallbacks;
    // The stream current at the free reads it too when a view escaped there (a checkpoint's
    // recomputation on a side stream hands the reloaded input to backward on this one).
    t_.new_reader(r, t_.compute());
    for (const auto& reader : t_.readers_of(r)) {
      if (escaped) {
        if (!t_.faults.skip_record_stream) t_.backend.record_stream(rec.device, reader);
      } else {
        Event e = t_.backend.make_event();
        t_.backend.record(e, reader);
        if (!t_.faults.skip_backward_guard) t_.backend.wait(t_.reload_stream, e);
      }
    }
    t_.backend.drop(rec.device);
    if (rec.state == RecordState::Reloading) leave_prefetch(rec.bytes);
    rec.move_to(RecordState::OnHost);
  }

  // Every id of the record was released: give back device and host memory.
  void finish(RecordId r) {
    t_.records.retire(r);
    auto& rec = t_.records[r];
    if (rec.state == RecordState::Kept) {
      t_.backend.drop(rec.device);
      rec.move_to(RecordState::Dropped);
      return;
    }
    if (rec.state == RecordState::Offloading) {
      leave_window(rec.bytes);
      release_original(r);
    }
    if (reloaded(rec.state)) free_reloaded(r);
    pool_.give(rec.bytes, {rec.host, rec.h2d_done, rec.host_read});
    rec.move_to(RecordState::Dropped);
  }

  Tracker<B> t_;
  HostPool<B> pool_;
  std::deque<RecordId> window_;  // offloads whose original may still be resident
  Bytes window_bytes_;           // bytes and count of those still Offloading
  std::int32_t window_count_ = 0;
  // Offloads whose original is still resident, by (storage, version): see Note [Saved-tensor
  // contract] in real/src/saved_tensors.hpp.
  std::map<std::pair<std::uint64_t, std::uint32_t>, RecordId> storage_index_;
  // By node id (small dense integers, as autograd sequence numbers are); inner vectors keep
  // their capacity from step to step.
  std::vector<std::vector<RecordId>> node_records_;
  std::vector<std::vector<RecordId>> node_uses_;
  std::deque<RecordId> prefetch_queue_;
  std::vector<bool> queued_;
  Bytes prefetch_bytes_;  // bytes and count of prefetched reloads not yet in use
  std::int32_t prefetch_count_ = 0;
  // Note [Offload horizon]: this forward's copied bytes, and whether it went past the horizon.
  bool in_backward_ = false;
  bool beyond_horizon_ = false;
  Bytes forward_copied_;
};

}  // namespace ferry
