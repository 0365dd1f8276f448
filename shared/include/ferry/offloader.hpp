#pragma once
/// The offload scheduler: saved tensors in (pack), tensors back out (unpack), and the stream
/// commands that move them, issued to a Backend. Two policies share it: `trl`, a faithful model
/// of the reference hook-based offloader, and `ferry`.

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "ferry/backend.hpp"
#include "ferry/check.hpp"
#include "ferry/ids.hpp"
#include "ferry/offload_options.hpp"

namespace ferry {

/// What unpack hands back: a storage (the caller owns one reference) and where the tensor
/// starts in it.
template <class Buffer>
struct Unpacked {
  Buffer storage;
  Bytes offset;
};

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

template <Backend B>
class Offloader {
 public:
  using Stream = typename B::Stream;
  using Event = typename B::Event;
  using Buffer = typename B::Buffer;

  Offloader(B& backend, OffloadOptions options)
      : backend_(backend), options_(options), compute_(backend.compute_stream()) {
    check_offload_options(options_);
    if (options_.policy != Policy::None && !options_.use_streams) {
      // Copies in order with the kernels: every wait below is then on the stream's own work.
      offload_stream_ = reload_stream_ = compute_;
    } else if (options_.policy == Policy::Trl) {
      offload_stream_ = reload_stream_ = backend_.make_stream("offload");
    } else if (options_.policy == Policy::Ferry) {
      offload_stream_ = backend_.make_stream("d2h");
      reload_stream_ = backend_.make_stream("h2d");
    }
  }

  Offloader(const Offloader&) = delete;
  Offloader& operator=(const Offloader&) = delete;

  /// Takes a saved tensor whose storage is `storage`; returns the id autograd keeps instead.
  TensorId pack(const TensorFacts& facts, const Buffer& storage) {
    if (options_.policy == Policy::Trl) trl_phase_for_pack();
    ++telemetry_.packed;
    const TensorId id(static_cast<std::uint32_t>(id_base_ + id_to_record_.size()));
    id_offset_.push_back(facts.view_offset);
    ++tracked_;
    const bool small = facts.bytes < options_.min_bytes;
    const bool keep = options_.policy == Policy::None || !facts.on_device || facts.is_param ||
                      small || no_offload_depth_ > 0 ||
                      (facts.no_offload && options_.policy == Policy::Ferry);
    if (keep) {
      id_to_record_.push_back(keep_record(facts, storage));
      return id;
    }
    if (options_.policy == Policy::Trl) {
      id_to_record_.push_back(trl_offload(facts, storage, id));
    } else {
      id_to_record_.push_back(ferry_offload(facts, storage));
    }
    return id;
  }

  /// The tensor behind `id`, for use on the compute stream by backward node `node`.
  Unpacked<Buffer> unpack(TensorId id, NodeId node) {
    if (options_.policy == Policy::Trl && trl_first_backward_call_) {
      trl_first_backward_call_ = false;
      trl_first_forward_call_ = true;
      trl_node_ = NodeId();
    }
    Record* rec = lookup(id);
    if (rec == nullptr) throw OffloadError(fmt::format("untracked tensor with id {}", id.value()));
    Unpacked<Buffer> out{rec->device, id_offset_[slot(id)]};
    if (options_.policy == Policy::Trl) {
      out = trl_unpack(id, *rec, node);
    } else if (rec->kept) {
      backend_.hold(rec->device);
    } else {
      out = Unpacked<Buffer>{ferry_unpack(*rec, node), id_offset_[slot(id)]};
    }
    return out;
  }

  /// Autograd no longer needs `id` (its graph was freed).
  void release(TensorId id) {
    // The reference offloader never hears of a release: an entry never unpacked stays tracked
    // (hence its "tracker not empty" error at the next forward).
    if (options_.policy == Policy::Trl) return;
    Record* rec = lookup(id);
    if (rec == nullptr) return;  // already released
    forget(id);
    if (--rec->ids > 0) return;
    finish_record(*rec);
  }

  /// The post-hook of backward node `node`: it ran, its tensors may be freed.
  void node_done(NodeId node) {
    if (options_.policy == Policy::Trl) {
      trl_node_done(node);
    } else if (options_.policy == Policy::Ferry) {
      ferry_node_done(node);
    }
  }

  /// Backward starts; `order` is the node order the engine will follow (may be empty: then
  /// nodes are expected in decreasing id order, as PyTorch's engine orders by sequence number).
  void backward_begin(std::span<const NodeId> order) {
    if (options_.policy != Policy::Ferry) return;
    for (Record& r : records_) r.unpacks_left = r.ids;
    prefetch_queue_.clear();
    queued_.assign(records_.size(), false);
    auto enqueue = [&](NodeId node) {
      if (!node.valid() || node.value() >= node_records_.size()) return;
      for (const std::uint32_t r : node_records_[node.value()]) {
        if (!queued_[r] && records_[r].live && records_[r].host_valid) {
          queued_[r] = true;
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
    if (options_.policy == Policy::Trl) {
      for (const auto& [id, r] : trl_bwd_stash_) {
        auto ev = trl_bwd_events_.find(id);
        if (ev != trl_bwd_events_.end()) backend_.wait(reload_stream_, ev->second);
        Record& rec = records_[static_cast<std::size_t>(r)];
        backend_.drop(rec.device);
        rec.device_valid = false;
        recycle(rec);
      }
      trl_bwd_stash_.clear();
      trl_bwd_events_.clear();
      reclaim();
      return;
    }
    if (options_.policy != Policy::Ferry) return;
    for (Record& r : records_) {
      if (r.live && r.reloaded) free_reloaded(r);
    }
    for (auto& uses : node_uses_) uses.clear();
    prefetch_queue_.clear();
    prefetch_bytes_ = Bytes(0);
    std::erase_if(window_, [&](std::uint32_t r) { return !records_[r].resident; });
    reclaim();
  }

  /// Saved tensors packed while at least one region is open stay on the device.
  void push_no_offload() { ++no_offload_depth_; }
  void pop_no_offload() {
    FERRY_CHECK(no_offload_depth_ > 0, "pop_no_offload without a matching push");
    --no_offload_depth_;
  }

  [[nodiscard]] const OffloadTelemetry& telemetry() const { return telemetry_; }
  /// Ids packed and neither unpacked for good (trl) nor released (ferry).
  [[nodiscard]] std::size_t tracked() const { return tracked_; }
  [[nodiscard]] const OffloadOptions& options() const { return options_; }
  [[nodiscard]] Stream offload_stream() const { return offload_stream_; }
  [[nodiscard]] Stream reload_stream() const { return reload_stream_; }

 private:
  static constexpr std::int32_t kNoRecord = -1;

  // One storage on its way off the device and back (trl: one tensor).
  struct Record {
    Buffer device{};  // original (kept / in window) or reloaded copy; core's reference
    Buffer host{};
    Event d2h_done{};
    Event h2d_done{};
    Bytes bytes;  // bytes moved
    std::uint64_t storage = 0;
    long snapshot = 0;     // use count right after the reload (escape check)
    std::int32_t ids = 0;  // live packed ids sharing this record
    std::int32_t unpacks_left = 0;
    bool live = true;
    bool kept = false;
    bool device_valid = false;
    bool host_valid = false;
    bool resident = false;  // device holds the original
    bool reloaded = false;  // device holds a reloaded copy
    bool compute_waited = false;
    bool prefetched = false;
    bool ever_reloaded = false;
  };

  struct HostSlot {
    Buffer buffer;
    Event last_read;
    bool has_read;
  };

  // Ids grow monotonically (the reference retires its stash by id distance); the table keeps
  // only the span from the oldest id still tracked.
  [[nodiscard]] std::size_t slot(TensorId id) const { return id.value() - id_base_; }

  Record* lookup(TensorId id) {
    if (!id.valid() || id.value() < id_base_ || slot(id) >= id_to_record_.size()) return nullptr;
    const std::int32_t r = id_to_record_[slot(id)];
    return r == kNoRecord ? nullptr : &records_[static_cast<std::size_t>(r)];
  }

  void forget(TensorId id) {
    id_to_record_[slot(id)] = kNoRecord;
    --tracked_;
    while (!id_to_record_.empty() && id_to_record_.front() == kNoRecord) {
      id_to_record_.pop_front();
      id_offset_.pop_front();
      ++id_base_;
    }
  }

  std::int32_t add_record(Record rec) {
    if (!free_records_.empty()) {
      const std::uint32_t r = free_records_.back();
      free_records_.pop_back();
      records_[r] = rec;
      return static_cast<std::int32_t>(r);
    }
    records_.push_back(rec);
    return static_cast<std::int32_t>(records_.size() - 1);
  }

  static std::vector<std::uint32_t>& at(std::vector<std::vector<std::uint32_t>>& table,
                                        NodeId node) {
    FERRY_CHECK(node.valid(), "a saved tensor needs the node that saves it");
    if (table.size() <= node.value()) table.resize(node.value() + 1);
    return table[node.value()];
  }

  // A record no id refers to any more. Queues may still hold its index, so it is reused only
  // after the end-of-backward callback pruned them (reclaim()).
  void recycle(Record& rec) {
    rec.live = false;
    dead_records_.push_back(static_cast<std::uint32_t>(&rec - records_.data()));
  }

  void reclaim() {
    for (auto& list : node_records_) {
      std::erase_if(list, [&](std::uint32_t r) { return !records_[r].live; });
    }
    std::erase_if(dead_records_, [&](std::uint32_t r) {
      const auto in = [r](const auto& queue, auto index) {
        return std::any_of(queue.begin(), queue.end(),
                           [&](const auto& e) { return index(e) == r; });
      };
      if (in(window_, [](std::uint32_t e) { return e; }) ||
          in(trl_fwd_stash_, [](const auto& e) { return static_cast<std::uint32_t>(e.second); }) ||
          in(trl_bwd_stash_, [](const auto& e) { return static_cast<std::uint32_t>(e.second); })) {
        return false;
      }
      free_records_.push_back(r);
      return true;
    });
  }

  std::int32_t keep_record(const TensorFacts& facts, const Buffer& storage) {
    ++telemetry_.kept;
    backend_.hold(storage);
    Record rec;
    rec.device = storage;
    rec.device_valid = true;
    rec.kept = true;
    rec.ids = 1;
    rec.bytes = facts.bytes;
    return add_record(rec);
  }

  // Copies `bytes` of `storage` (from `offset`) into `host` on the offload stream, records
  // the copy's event and keeps the original alive (resident) until it is known done.
  std::int32_t start_offload(const Buffer& storage, Bytes offset, const Buffer& host, Bytes bytes,
                             std::uint64_t key) {
    backend_.copy(offload_stream_, storage, offset, host, Bytes(0), bytes, "offload");
    Record rec;
    rec.host = host;
    rec.host_valid = true;
    rec.bytes = bytes;
    rec.storage = key;
    rec.ids = 1;
    rec.d2h_done = backend_.make_event();
    backend_.record(rec.d2h_done, offload_stream_);
    backend_.hold(storage);
    rec.device = storage;
    rec.device_valid = true;
    rec.resident = true;
    ++telemetry_.offloaded;
    telemetry_.bytes_d2h += bytes;
    return add_record(rec);
  }

  void wait_for_compute(Stream stream) {
    Event e = backend_.make_event();
    backend_.record(e, compute_);
    backend_.wait(stream, e);
  }

  // --- trl ------------------------------------------------------------------------------------

  void trl_phase_for_pack() {
    if (!trl_first_forward_call_) return;
    if (tracked() != 0) {
      throw OffloadError("Backward pass should have cleared tracker of all tensors");
    }
    trl_first_forward_call_ = false;
    trl_first_backward_call_ = true;
  }

  std::int32_t trl_offload(const TensorFacts& facts, const Buffer& storage, TensorId id) {
    // Retire stash entries that are max_fwd_stash_size ids old.
    while (!trl_fwd_stash_.empty() &&
           trl_fwd_stash_.front().first.value() +
                   static_cast<std::uint32_t>(options_.trl_stash_count) <=
               id.value()) {
      trl_retire(trl_fwd_stash_.front());
      trl_fwd_stash_.pop_front();
    }
    if (!options_.faults.skip_offload_wait) wait_for_compute(offload_stream_);
    auto host = backend_.allocate(Place::PinnedHostCaching, facts.bytes, offload_stream_,
                                  "offloaded activation");
    if (!host) throw OffloadError("out of pinned host memory");
    const std::int32_t r =
        start_offload(storage, facts.view_offset, *host, facts.bytes, facts.storage);
    trl_fwd_stash_.emplace_back(id, r);
    return r;
  }

  void trl_retire(const std::pair<TensorId, std::int32_t>& entry) {
    Record& rec = records_[static_cast<std::size_t>(entry.second)];
    if (!options_.faults.skip_forward_guard) backend_.wait(compute_, rec.d2h_done);
    backend_.drop(rec.device);
    rec.device_valid = false;
    rec.resident = false;
  }

  Unpacked<Buffer> trl_unpack(TensorId id, Record& rec, NodeId node) {
    const std::int32_t r = id_to_record_[slot(id)];
    Unpacked<Buffer> out{rec.device, id_offset_[slot(id)]};
    if (rec.kept) {
      forget(id);  // the tracker's reference moves to the caller
      recycle(rec);
      return out;
    }
    std::vector<TensorId> previous;
    if (node != trl_node_) {
      trl_node_ = node;
      for (const auto& [prev, unused] : trl_bwd_stash_) previous.push_back(prev);
    }
    bool brought_back = false;
    long snapshot = 0;
    auto stashed = std::find_if(trl_fwd_stash_.begin(), trl_fwd_stash_.end(),
                                [&](const auto& e) { return e.first == id; });
    if (stashed != trl_fwd_stash_.end()) {
      ++telemetry_.stash_hits;
      backend_.hold(rec.device);
    } else {
      auto buf = backend_.allocate(Place::Device, rec.bytes, reload_stream_, "reloaded activation");
      if (!buf)
        throw OffloadError(fmt::format("out of device memory reloading tensor {}", id.value()));
      backend_.copy(reload_stream_, rec.host, Bytes(0), *buf, Bytes(0), rec.bytes, "reload");
      if (!options_.faults.skip_reload_wait) {
        Event e = backend_.make_event();
        backend_.record(e, reload_stream_);
        backend_.wait(compute_, e);
      }
      rec.device = *buf;
      rec.device_valid = true;
      trl_bwd_stash_.emplace(id, r);
      snapshot = backend_.use_count(*buf);
      brought_back = true;
      ++telemetry_.on_demand;
      telemetry_.bytes_h2d += rec.bytes;
      backend_.hold(*buf);
      out = Unpacked<Buffer>{*buf, Bytes(0)};
    }
    trl_hooks_[node].push_back(TrlHook{id, brought_back, snapshot, std::move(previous)});
    // The tracker entry goes; its host copy is freed once the copy stream is done with it.
    if (!options_.faults.skip_host_guard) backend_.record_stream(rec.host, offload_stream_);
    backend_.drop(rec.host);
    rec.host_valid = false;
    forget(id);
    if (!brought_back) recycle(rec);  // a reload stays in the stash until its drain
    return out;
  }

  struct TrlHook {
    TensorId id;
    bool brought_back;
    long snapshot;
    std::vector<TensorId> previous;
  };

  void trl_node_done(NodeId node) {
    auto it = trl_hooks_.find(node);
    if (it == trl_hooks_.end()) return;
    for (const TrlHook& hook : it->second) {
      if (hook.brought_back) {
        auto stash = trl_bwd_stash_.find(hook.id);
        Record& rec = records_[static_cast<std::size_t>(stash->second)];
        if (backend_.use_count(rec.device) > hook.snapshot) {
          ++telemetry_.record_stream_fallbacks;
          if (!options_.faults.skip_record_stream) backend_.record_stream(rec.device, compute_);
          backend_.drop(rec.device);
          rec.device_valid = false;
          trl_bwd_stash_.erase(stash);
          recycle(rec);
        } else {
          Event e = backend_.make_event();
          backend_.record(e, compute_);
          trl_bwd_events_[hook.id] = e;
        }
      }
      for (const auto& entry : trl_fwd_stash_) trl_retire(entry);
      trl_fwd_stash_.clear();
      for (const TensorId prev : hook.previous) {
        auto stash = trl_bwd_stash_.find(prev);
        if (stash == trl_bwd_stash_.end()) continue;
        if (!options_.faults.skip_backward_guard) {
          backend_.wait(reload_stream_, trl_bwd_events_.at(prev));
        }
        Record& rec = records_[static_cast<std::size_t>(stash->second)];
        backend_.drop(rec.device);
        rec.device_valid = false;
        trl_bwd_stash_.erase(stash);
        trl_bwd_events_.erase(prev);
        recycle(rec);
      }
    }
    trl_hooks_.erase(it);
  }

  // --- ferry ----------------------------------------------------------------------------------

  std::int32_t ferry_offload(const TensorFacts& facts, const Buffer& storage) {
    if (options_.dedup) {
      auto it = storage_index_.find(facts.storage);
      if (it != storage_index_.end()) {
        Record& rec = records_[it->second];
        ++rec.ids;
        ++telemetry_.deduplicated;
        at(node_records_, facts.node).push_back(it->second);
        return static_cast<std::int32_t>(it->second);
      }
    }
    const Bytes size = facts.storage_bytes;
    std::optional<HostSlot> slot = take_host(size);
    if (!slot) {
      ++telemetry_.host_fallbacks;
      return keep_record(facts, storage);
    }
    while (window_bytes_ + size > options_.window_bytes && !window_.empty()) retire_oldest();
    if (!options_.faults.skip_offload_wait) wait_for_compute(offload_stream_);
    if (slot->has_read && !options_.faults.skip_host_guard) {
      backend_.wait(offload_stream_, slot->last_read);
    }
    const std::int32_t r = start_offload(storage, Bytes(0), slot->buffer, size, facts.storage);
    const auto ur = static_cast<std::uint32_t>(r);
    window_.push_back(ur);
    window_bytes_ += size;
    if (options_.dedup) storage_index_.emplace(facts.storage, ur);
    at(node_records_, facts.node).push_back(ur);
    return r;
  }

  // A host buffer of exactly `size` bytes from the pool, a new one, or none (cap reached).
  std::optional<HostSlot> take_host(Bytes size) {
    auto it = host_pool_.find(size.count());
    if (it != host_pool_.end() && !it->second.empty()) {
      HostSlot slot = it->second.back();
      it->second.pop_back();
      return slot;
    }
    if (telemetry_.pinned_bytes + size > options_.host_cap) {
      // Unpin cached buffers of other sizes before giving up.
      for (auto& [bytes, slots] : host_pool_) {
        while (!slots.empty() && telemetry_.pinned_bytes + size > options_.host_cap) {
          const HostSlot victim = slots.back();
          slots.pop_back();
          if (victim.has_read) backend_.record_stream(victim.buffer, reload_stream_);
          backend_.drop(victim.buffer);
          telemetry_.pinned_bytes -= Bytes(bytes);
        }
      }
      if (telemetry_.pinned_bytes + size > options_.host_cap) return std::nullopt;
    }
    auto buffer = backend_.allocate(Place::PinnedHost, size, offload_stream_, "host pool");
    if (!buffer) return std::nullopt;
    telemetry_.pinned_bytes += size;
    telemetry_.pinned_peak = std::max(telemetry_.pinned_peak, telemetry_.pinned_bytes);
    return HostSlot{*buffer, Event{}, false};
  }

  void retire_oldest() {
    Record& rec = records_[window_.front()];
    window_.pop_front();
    if (!rec.resident) return;  // already let go (consumed or released)
    window_bytes_ -= rec.bytes;
    release_original(rec);
  }

  void release_original(Record& rec) {
    if (!options_.faults.skip_forward_guard) backend_.wait(compute_, rec.d2h_done);
    backend_.drop(rec.device);
    rec.device_valid = false;
    rec.resident = false;
    if (options_.dedup) storage_index_.erase(rec.storage);
  }

  void reload(Record& rec) {
    auto buf = backend_.allocate(Place::Device, rec.bytes, reload_stream_, "reloaded activation");
    if (!buf) throw OffloadError("out of device memory reloading an offloaded activation");
    if (!options_.faults.skip_host_guard) backend_.wait(reload_stream_, rec.d2h_done);
    backend_.copy(reload_stream_, rec.host, Bytes(0), *buf, Bytes(0), rec.bytes, "reload");
    rec.h2d_done = backend_.make_event();
    backend_.record(rec.h2d_done, reload_stream_);
    rec.device = *buf;
    rec.device_valid = true;
    rec.reloaded = true;
    rec.compute_waited = false;
    rec.ever_reloaded = true;
    rec.snapshot = backend_.use_count(*buf);
    telemetry_.bytes_h2d += rec.bytes;
  }

  void prefetch() {
    if (!options_.prefetch) return;
    while (!prefetch_queue_.empty()) {
      Record& rec = records_[prefetch_queue_.front()];
      if (!rec.live || rec.resident || rec.reloaded || !rec.host_valid || rec.unpacks_left == 0) {
        prefetch_queue_.pop_front();
        continue;
      }
      if (prefetch_bytes_ + rec.bytes > options_.prefetch_bytes) break;
      reload(rec);
      rec.prefetched = true;
      prefetch_bytes_ += rec.bytes;
      ++telemetry_.prefetched;
      prefetch_queue_.pop_front();
    }
  }

  Buffer ferry_unpack(Record& rec, NodeId node) {
    const auto r = static_cast<std::uint32_t>(&rec - records_.data());
    if (rec.unpacks_left > 0) --rec.unpacks_left;
    at(node_uses_, node).push_back(r);
    if (rec.resident) {
      ++telemetry_.stash_hits;
    } else {
      if (!rec.reloaded) {
        ++telemetry_.on_demand;
        reload(rec);
      }
      if (rec.prefetched) {
        prefetch_bytes_ -= rec.bytes;
        rec.prefetched = false;
      }
      if (!rec.compute_waited && !options_.faults.skip_reload_wait) {
        backend_.wait(compute_, rec.h2d_done);
      }
      rec.compute_waited = true;
    }
    prefetch();
    backend_.hold(rec.device);
    return rec.device;
  }

  void free_reloaded(Record& rec) {
    if (backend_.use_count(rec.device) > rec.snapshot) {
      ++telemetry_.record_stream_fallbacks;
      if (!options_.faults.skip_record_stream) backend_.record_stream(rec.device, compute_);
    } else {
      Event e = backend_.make_event();
      backend_.record(e, compute_);
      if (!options_.faults.skip_backward_guard) backend_.wait(reload_stream_, e);
    }
    backend_.drop(rec.device);
    rec.device_valid = false;
    rec.reloaded = false;
    rec.compute_waited = false;
    if (rec.prefetched) {
      prefetch_bytes_ -= rec.bytes;
      rec.prefetched = false;
    }
  }

  void ferry_node_done(NodeId node) {
    if (!node.valid() || node.value() >= node_uses_.size()) return;
    std::vector<std::uint32_t>& uses = node_uses_[node.value()];
    for (const std::uint32_t r : uses) {
      Record& rec = records_[r];
      if (!rec.live || rec.unpacks_left > 0) continue;
      if (rec.reloaded) {
        free_reloaded(rec);
      } else if (rec.resident) {
        window_bytes_ -= rec.bytes;
        release_original(rec);
      }
    }
    uses.clear();
  }

  // Every id of the record was released: give back device and host memory.
  void finish_record(Record& rec) {
    recycle(rec);
    if (rec.kept) {
      backend_.drop(rec.device);
      rec.device_valid = false;
      return;
    }
    if (rec.resident) {
      window_bytes_ -= rec.bytes;
      release_original(rec);
    }
    if (rec.reloaded) free_reloaded(rec);
    if (rec.host_valid) {
      host_pool_[rec.bytes.count()].push_back(HostSlot{rec.host, rec.h2d_done, rec.ever_reloaded});
      rec.host_valid = false;
    }
  }

  B& backend_;
  OffloadOptions options_;
  Stream compute_;
  Stream offload_stream_{};
  Stream reload_stream_{};
  OffloadTelemetry telemetry_;
  std::vector<Record> records_;
  std::deque<std::int32_t> id_to_record_;  // from id_base_ on
  std::deque<Bytes> id_offset_;            // where each packed tensor starts in its storage
  std::uint32_t id_base_ = 0;
  std::size_t tracked_ = 0;
  std::vector<std::uint32_t> free_records_;
  std::vector<std::uint32_t> dead_records_;
  int no_offload_depth_ = 0;

  // trl state
  bool trl_first_forward_call_ = true;
  bool trl_first_backward_call_ = false;
  NodeId trl_node_;
  std::deque<std::pair<TensorId, std::int32_t>> trl_fwd_stash_;
  std::map<TensorId, std::int32_t> trl_bwd_stash_;
  std::map<TensorId, Event> trl_bwd_events_;
  std::map<NodeId, std::vector<TrlHook>> trl_hooks_;

  // ferry state
  std::deque<std::uint32_t> window_;
  Bytes window_bytes_;
  std::map<std::uint64_t, std::uint32_t> storage_index_;
  std::map<std::int64_t, std::vector<HostSlot>> host_pool_;  // free buffers by exact size
  // By node id (small dense integers, as autograd sequence numbers are); inner vectors keep
  // their capacity from step to step.
  std::vector<std::vector<std::uint32_t>> node_records_;
  std::vector<std::vector<std::uint32_t>> node_uses_;
  std::deque<std::uint32_t> prefetch_queue_;
  std::vector<bool> queued_;
  Bytes prefetch_bytes_;
};

}  // namespace ferry
