#pragma once
/// ferry's pinned host pool: buffers of exactly the size asked for, reused by size, under a
/// cap on the pinned bytes held.

#include <algorithm>
#include <map>
#include <optional>
#include <vector>

#include "ferry/backend.hpp"
#include "ferry/offload/options.hpp"

namespace ferry {

template <Backend B>
class HostPool {
 public:
  using Stream = typename B::Stream;
  using Event = typename B::Event;
  using Buffer = typename B::Buffer;

  /// A pooled buffer and the last reload that read it (when `read`).
  struct Slot {
    Buffer buffer;
    Event last_read;
    bool read = false;
  };

  /// Buffers are allocated on `offload`; a buffer dropped to meet the cap is given back to the
  /// allocator with record_stream on the stream of its last copy (`reload` once a reload read
  /// it, which waited for the offload; `offload` before).
  HostPool(B& backend, Bytes cap, Stream offload, Stream reload)
      : backend_(backend), cap_(cap), offload_(offload), reload_(reload) {}

  /// A buffer of exactly `size` bytes: a pooled one, a new one, or none (cap reached or no
  /// host memory). The pinned bytes held are counted in `telemetry`.
  std::optional<Slot> take(Bytes size, OffloadTelemetry& telemetry) {
    auto it = free_.find(size.count());
    if (it != free_.end() && !it->second.empty()) {
      Slot slot = it->second.back();
      it->second.pop_back();
      return slot;
    }
    if (!fits(size, telemetry)) {
      // Unpin cached buffers of other sizes before giving up.
      for (auto& [bytes, slots] : free_) {
        while (!slots.empty() && !fits(size, telemetry)) {
          const Slot victim = slots.back();
          slots.pop_back();
          // The allocator may hand the buffer out again at once: it must wait for the last
          // copy that touched it, the reload that read it or else the offload that wrote it.
          backend_.record_stream(victim.buffer, victim.read ? reload_ : offload_);
          backend_.drop(victim.buffer);
          telemetry.pinned_bytes -= Bytes(bytes);
        }
      }
      if (!fits(size, telemetry)) return std::nullopt;
    }
    auto buffer = backend_.allocate(Place::PinnedHost, size, offload_, "host pool");
    if (!buffer) return std::nullopt;
    telemetry.pinned_bytes += size;
    telemetry.pinned_peak = std::max(telemetry.pinned_peak, telemetry.pinned_bytes);
    return Slot{*buffer, Event{}, false};
  }

  /// Gives back a buffer of `size` bytes for reuse.
  void give(Bytes size, const Slot& slot) { free_[size.count()].push_back(slot); }

 private:
  [[nodiscard]] bool fits(Bytes size, const OffloadTelemetry& telemetry) const {
    return telemetry.pinned_bytes + size <= cap_;
  }

  B& backend_;
  Bytes cap_;
  Stream offload_;
  Stream reload_;
  std::map<std::int64_t, std::vector<Slot>> free_;  // by exact size
};

}  // namespace ferry
