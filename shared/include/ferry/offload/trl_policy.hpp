#pragma once
/// The `trl` policy: a faithful model of the reference hook-based offloader: one side stream for
/// both directions, a forward stash of the last N offloaded tensors, reload on demand at unpack,
/// the previous node's reloads freed after an event, record_stream when a view escaped, and a
/// drain at the end of backward. `trl` is TRL as it ships today (see Note [TRL today]);
/// `trl-seed` is the version first released (seed files 000 and 001); `trl-1.7` is TRL 1.0 to
/// 1.7.1 (Note [TRL 1.7's dedup key]).

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <iterator>
#include <map>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/offload/tracker.hpp"

namespace ferry {

// Note [TRL today]
// Three changes to the reference since its first release (docs/offload.md cites them):
// * Dedup, with streams only: a pack whose (storage, view offset) is keyed keeps the tensor on
//   the device (a new reference, no copy) and takes the key over. An offload keys its storage
//   until its stash entry retires; a pack kept so keeps the key until it is unpacked, so every
//   later pack of that storage in the forward stays too. Each forward starts without keys.
// * The phase flag: the next pack starts a new forward only once the tracker is empty again,
//   so recompute packs during backward (checkpointing) are not taken for a new forward.
// * Entering the context clears what a previous step left (tracker, stashes, dedup keys,
//   flags); leaving it, with streams, the host waits for the compute and side streams and the
//   stashes let go of what they hold. The tracker itself survives leaving, so backward may run
//   after the context closed.

// Note [TRL 1.7's dedup key]
// TRL 1.0 to 1.7.1 (before TRL PR #6241, first released in 1.8.0) key dedup by where the storage
// lies in device memory and its dtype, with or without streams, and let go of no key until the
// next forward starts: every offload's key outlives its stash entry. Once the caching allocator
// hands a freed original's address to a later tensor of that dtype, a save of it counts as a
// view of the offloaded storage and stays on the device; so does every later save at that
// address in the forward, and in backward's recomputation. The rest is today's.

template <Backend B>
class TrlPolicy {
 public:
  using Event = typename B::Event;
  using Buffer = typename B::Buffer;

  /// One side stream carries both directions; with `use_streams` false, the compute stream.
  TrlPolicy(B& backend, const OffloadOptions& options, const OffloadFaults& faults)
      : t_(backend, options, faults, streams(backend, options)) {}
  TrlPolicy(const TrlPolicy&) = delete;
  TrlPolicy& operator=(const TrlPolicy&) = delete;

  TensorId pack(const TensorFacts& facts, const Buffer& storage, bool in_region) {
    begin_forward_if_first();
    ++t_.telemetry.packed;
    const Key key = address_keys() ? Key{facts.address, facts.view_offset.count(), facts.dtype}
                                   : Key{facts.storage, facts.view_offset.count(),
                                         t_.faults.dedup_across_versions ? 0 : facts.version};
    if (dedup() && keys_.contains(key)) {
      ++t_.telemetry.deduplicated;
      const RecordId kept = t_.keep(facts, storage);
      take_key(key, kept);
      return t_.ids.add(kept, facts.view_offset);
    }
    // The reference knows no per-tensor opt-out.
    const bool stays = t_.stays(facts, in_region, /*opt_out=*/false);
    const RecordId r = stays ? t_.keep(facts, storage) : offload(facts, storage, t_.ids.next());
    if (!stays && dedup()) take_key(key, r);
    return t_.ids.add(r, facts.view_offset);
  }

  Unpacked<Buffer> unpack(TensorId id, NodeId node) {
    if (first_backward_call_) {
      first_backward_call_ = false;
      if (!today()) first_forward_call_ = true;
      node_ = NodeId();
    }
    if (!t_.ids.find(id).valid() && cleared(id)) {
      throw OffloadError(fmt::format(
          "untracked tensor with id {}: the offload context was entered again before the "
          "backward of the forward that saved it, and policy \"trl\" forgets on each entry what "
          "earlier forwards saved, as the reference does. A schedule that runs several "
          "forwards before their backwards (a pipeline's GPipe or 1F1B, several forwards "
          "accumulated into one backward) needs policy=\"ferry\", which keeps each forward's "
          "saved tensors until its backward, or one offload context per forward",
          id.value()));
    }
    const RecordId r = t_.find(id);
    auto& rec = t_.records[r];
    Unpacked<Buffer> out{rec.device, t_.ids.offset(id)};
    release_key(r);
    if (rec.state == RecordState::Kept) {
      forget(id, r);  // the tracker's reference moves to the caller
      rec.move_to(RecordState::Dropped);
      t_.records.retire(r);
      return out;
    }
    std::vector<TensorId> previous;
    if (node != node_) {
      node_ = node;
      for (const auto& [prev, unused] : bwd_stash_) previous.push_back(prev);
    }
    const bool stashed = std::any_of(fwd_stash_.begin(), fwd_stash_.end(),
                                     [&](const auto& e) { return e.first == id; });
    long snapshot = 0;
    if (stashed) {
      ++t_.telemetry.stash_hits;
    } else {
      out = Unpacked<Buffer>{reload(id, r), Bytes(0)};
      snapshot = t_.backend.use_count(rec.device);
    }
    t_.backend.hold(rec.device);  // the caller's reference
    hooks_[node].push_back(Hook{id, !stashed, snapshot, std::move(previous)});
    // The tracker entry goes; its host copy is freed once the copy stream is done with it.
    if (!t_.faults.skip_host_guard) t_.backend.record_stream(rec.host, t_.offload_stream);
    t_.backend.drop(rec.host);
    forget(id, r);
    if (stashed) {
      rec.move_to(RecordState::Original);
      t_.records.retire(r);  // the original stays in the stash until it retires
    } else {
      rec.move_to(RecordState::Returned);  // the reload stays until its drain
    }
    return out;
  }

  /// The reference never hears of a release: an entry never unpacked stays tracked (until the
  /// next entry clears it; the seed refuses the next forward instead).
  void release(TensorId /*id*/) {}

  void node_done(NodeId node) {
    auto it = hooks_.find(node);
    if (it == hooks_.end()) return;
    for (const Hook& hook : it->second) {
      if (hook.brought_back) after_reloaded_use(hook);
      for (const auto& entry : fwd_stash_) retire_stashed(entry.second);
      fwd_stash_.clear();
      for (const TensorId prev : hook.previous) {
        auto stash = bwd_stash_.find(prev);
        if (stash == bwd_stash_.end()) continue;
        auto event = bwd_events_.find(prev);
        // No event yet: the node that used `prev` has not finished. Within one backward pass a
        // node's post-hook runs before the next node starts, so that node encloses this one:
        // a reentrant checkpoint whose replay runs a backward of its own, where the reference
        // does no previous-node bookkeeping (it compares graph tasks). The entry stays for
        // the enclosing node's post-hook or the end-of-backward drain.
        if (event == bwd_events_.end()) continue;
        if (!t_.faults.skip_backward_guard) t_.backend.wait(t_.reload_stream, event->second);
        drop_returned(stash->second);
        bwd_stash_.erase(stash);
        bwd_events_.erase(event);
      }
    }
    hooks_.erase(it);
  }

  void backward_begin(std::span<const NodeId> /*order*/) {}

  /// Today's reference clears what a previous step left; the seed does nothing.
  void enter() {
    if (!today()) return;
    for (std::uint32_t v = t_.ids.oldest().value(); v < t_.ids.next().value(); ++v) {
      if (!t_.ids.find(TensorId(v)).valid()) continue;
      if (!cleared_.empty() && cleared_.back().second == v) {
        ++cleared_.back().second;
      } else {
        cleared_.emplace_back(v, v + 1);
      }
    }
    for (std::uint32_t i = 0; i < t_.records.size(); ++i) {
      auto& rec = t_.records[RecordId(i)];
      if (rec.state == RecordState::Free || rec.state == RecordState::Dropped) continue;
      if (holds_device(rec.state)) t_.backend.drop(rec.device);
      if (holds_host(rec.state)) {
        // As the copy into it recorded its stream on the block (without streams, leaving the
        // context did not wait for it).
        if (!t_.faults.skip_host_guard) t_.backend.record_stream(rec.host, t_.offload_stream);
        t_.backend.drop(rec.host);
      }
      rec.move_to(RecordState::Dropped);
      t_.records.retire(RecordId(i));
    }
    t_.ids.clear();
    fwd_stash_.clear();
    bwd_stash_.clear();
    bwd_events_.clear();
    hooks_.clear();
    keys_.clear();
    key_of_.clear();
    t_.records.reclaim([](RecordId) { return false; });
    first_forward_call_ = true;
    first_backward_call_ = false;
  }

  /// Today's reference, with streams, waits for both streams, then its stashes let go.
  void exit() {
    if (!today() || !t_.options.use_streams) return;
    if (!t_.faults.skip_exit_sync) {
      t_.backend.synchronize(t_.compute());
      t_.backend.synchronize(t_.offload_stream);
    }
    for (const auto& entry : fwd_stash_) let_go_stashed(entry.second);
    fwd_stash_.clear();
    keys_.clear();
    key_of_.clear();
    for (const auto& [id, r] : bwd_stash_) drop_returned(r);
    bwd_stash_.clear();
    bwd_events_.clear();
  }

  /// The end-of-backward callback: every reload still held is let go.
  void backward_end() {
    for (const auto& [id, r] : bwd_stash_) {
      auto ev = bwd_events_.find(id);
      if (ev != bwd_events_.end()) t_.backend.wait(t_.reload_stream, ev->second);
      drop_returned(r);
    }
    bwd_stash_.clear();
    bwd_events_.clear();
    t_.records.reclaim([&](RecordId r) {
      const auto named = [r](const auto& queue) {
        return std::any_of(queue.begin(), queue.end(),
                           [&](const auto& e) { return e.second == r; });
      };
      return named(fwd_stash_) || named(bwd_stash_);
    });
  }

  [[nodiscard]] const Tracker<B>& tracker() const { return t_; }

 private:
  // A view's place: storage identity and offset in it (the reference adds the dtype, which
  // views at one offset of one storage share in practice), and its version: unlike the
  // reference, a storage changed in place between two saves is not deduplicated (the second
  // save would get the first's bytes; see Note [Saved-tensor contract] in
  // real/src/saved_tensors.hpp).
  using Key = std::tuple<std::uint64_t, std::int64_t, std::uint32_t>;

  // What the reference's per-node post-hook remembers of one unpack.
  struct Hook {
    TensorId id;
    bool brought_back;
    long snapshot;
    std::vector<TensorId> previous;
  };

  static std::pair<typename B::Stream, typename B::Stream> streams(B& backend,
                                                                   const OffloadOptions& options) {
    const auto side =
        options.use_streams ? backend.make_stream("offload") : backend.compute_stream();
    return {side, side};
  }

  // The first pack after a backward: the tracker must be empty.
  void begin_forward_if_first() {
    if (!first_forward_call_) return;
    if (t_.ids.tracked() != 0) {
      throw OffloadError("Backward pass should have cleared tracker of all tensors");
    }
    first_forward_call_ = false;
    first_backward_call_ = true;
    keys_.clear();
    key_of_.clear();
  }

  RecordId offload(const TensorFacts& facts, const Buffer& storage, TensorId id) {
    // Retire stash entries that are max_fwd_stash_size ids old.
    while (!fwd_stash_.empty() && fwd_stash_.front().first.value() +
                                          static_cast<std::uint32_t>(t_.options.trl_stash_count) <=
                                      id.value()) {
      retire_stashed(fwd_stash_.front().second);
      fwd_stash_.pop_front();
    }
    if (!t_.faults.skip_offload_wait) t_.wait_for_compute(t_.offload_stream);
    auto host = t_.backend.allocate(Place::PinnedHostCaching, facts.bytes, t_.offload_stream,
                                    "offloaded activation");
    if (!host) {
      throw OffloadError(fmt::format("out of pinned host memory: could not pin {} bytes for "
                                     "tensor {} (the host has too little memory left)",
                                     facts.bytes.count(), id.value()),
                         FailureKind::OutOfMemory);
    }
    const RecordId r =
        t_.start_offload(storage, facts.view_offset, *host, facts.bytes, facts.storage);
    fwd_stash_.emplace_back(id, r);
    return r;
  }

  // The stash lets an original go once its copy is done.
  void retire_stashed(RecordId r) {
    // Note [The compute stream is the current one]: every compute stream waits for the copy.
    if (!t_.faults.skip_forward_guard) {
      t_.guard_original(t_.records[r].d2h_done);
    }
    let_go_stashed(r);
  }

  // The stash drops its reference to an original (its copy is known done) and its dedup key,
  // unless a later pack took the key over.
  void let_go_stashed(RecordId r) {
    auto& rec = t_.records[r];
    t_.backend.drop(rec.device);
    rec.move_to(rec.state == RecordState::Offloading ? RecordState::OnHost : RecordState::Dropped);
    release_key(r);
  }

  // `r` holds `key` now: a later pack of it stays on the device.
  void take_key(const Key& key, RecordId r) {
    keys_.insert_or_assign(key, r);
    key_of_.insert_or_assign(r, key);
  }

  // `r` lets go of its key, which goes unless another record took it over; TRL 1.7 lets go
  // of none.
  void release_key(RecordId r) {
    if (address_keys()) return;
    auto it = key_of_.find(r);
    if (it == key_of_.end()) return;
    auto held = keys_.find(it->second);
    if (held != keys_.end() && held->second == r) keys_.erase(held);
    key_of_.erase(it);
  }

  // Copies the host copy back into a new buffer on the side stream; compute waits for it.
  Buffer reload(TensorId id, RecordId r) {
    auto& rec = t_.records[r];
    auto buf =
        t_.backend.allocate(Place::Device, rec.bytes, t_.reload_stream, "reloaded activation");
    if (!buf) {
      throw OffloadError(fmt::format("out of device memory reloading tensor {}", id.value()),
                         FailureKind::OutOfMemory);
    }
    t_.backend.copy(t_.reload_stream, rec.host, Bytes(0), *buf, Bytes(0), rec.bytes, "reload");
    // The stream current at the unpack reads it (Note [The compute stream is the current one]).
    const auto reader = t_.compute();
    t_.readers_of(r) = {reader};
    if (!t_.faults.skip_reload_wait) {
      Event e = t_.backend.make_event();
      t_.backend.record(e, t_.reload_stream);
      t_.backend.wait(reader, e);
    }
    rec.device = *buf;
    bwd_stash_.emplace(id, r);
    ++t_.telemetry.on_demand;
    t_.telemetry.bytes_h2d += rec.bytes;
    return *buf;
  }

  // The node that used a reload ran: if a view of it escaped, free it with record_stream now;
  // else record when compute is done with it, for the next node's hook.
  void after_reloaded_use(const Hook& hook) {
    auto stash = bwd_stash_.find(hook.id);
    if (stash == bwd_stash_.end()) return;  // the end-of-backward drain let it go already
    const RecordId r = stash->second;
    // The node read it on the stream current at its unpack, which may not be current now.
    const auto reader = t_.readers_of(r).front();
    if (t_.backend.use_count(t_.records[r].device) > hook.snapshot) {
      ++t_.telemetry.record_stream_fallbacks;
      if (!t_.faults.skip_record_stream) {
        t_.backend.record_stream(t_.records[r].device, reader);
        if (!(t_.compute() == reader)) t_.backend.record_stream(t_.records[r].device, t_.compute());
      }
      drop_returned(r);
      bwd_stash_.erase(stash);
    } else {
      Event e = t_.backend.make_event();
      t_.backend.record(e, reader);
      bwd_events_[hook.id] = e;
    }
  }

  void drop_returned(RecordId r) {
    t_.backend.drop(t_.records[r].device);
    t_.records[r].move_to(RecordState::Dropped);
    t_.records.retire(r);
  }

  void forget(TensorId id, RecordId r) {
    t_.ids.forget(id);
    --t_.records[r].ids;
    // Today's reference starts a new forward only once the tracker is empty again.
    if (today() && t_.ids.tracked() == 0) first_forward_call_ = true;
  }

  // TRL as it ships today, not its first release (Note [TRL today]).
  [[nodiscard]] bool today() const { return t_.options.policy == Policy::Trl || address_keys(); }
  [[nodiscard]] bool dedup() const { return address_keys() || (today() && t_.options.use_streams); }
  // TRL 1.0 to 1.7.1 (Note [TRL 1.7's dedup key]).
  [[nodiscard]] bool address_keys() const { return t_.options.policy == Policy::Trl17; }

  // Whether an entry forgot `id` while it was tracked.
  [[nodiscard]] bool cleared(TensorId id) const {
    auto it = std::upper_bound(cleared_.begin(), cleared_.end(), id.value(),
                               [](std::uint32_t v, const auto& run) { return v < run.first; });
    return it != cleared_.begin() && id.value() < std::prev(it)->second;
  }

  Tracker<B> t_;
  // The keyed storages, each with the record that holds its key (Note [TRL today]), and the
  // key each such record holds.
  std::map<Key, RecordId> keys_;
  std::map<RecordId, Key> key_of_;
  bool first_forward_call_ = true;
  bool first_backward_call_ = false;
  // The ids entries forgot while they were tracked, as increasing runs [first, end): an unpack
  // of one names the cause.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> cleared_;
  NodeId node_;
  std::deque<std::pair<TensorId, RecordId>> fwd_stash_;
  std::map<TensorId, RecordId> bwd_stash_;
  std::map<TensorId, Event> bwd_events_;
  std::map<NodeId, std::vector<Hook>> hooks_;
};

}  // namespace ferry
