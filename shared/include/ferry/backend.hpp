#pragma once
/// The Backend concept: what the scheduler core needs from a device, simulated or real.

#include <concepts>
#include <cstdint>
#include <optional>
#include <string_view>

#include "ferry/units.hpp"

namespace ferry {

/// Where a buffer lives.
enum class Place : std::uint8_t {
  Device,             ///< device memory, from the caching allocator of the allocation stream
  PinnedHost,         ///< page-locked host memory sized exactly (ferry's pool)
  PinnedHostCaching,  ///< page-locked host memory from the caching host allocator (power of 2)
};

// Note [Backend handles]
// Streams, events and buffers are cheap copyable handles. A buffer handle refers to a
// reference-counted storage: hold() adds a reference, drop() removes one, and the storage is
// freed (returned to its allocator, stream-ordered like PyTorch's caching allocator) when the
// count reaches zero. use_count() lets the core notice that something else still refers to a
// storage (a view escaped), the one case where it falls back to record_stream.

/// A device the core can drive. Every call is made by the host in program order.
template <class B>
concept Backend = requires(B& b, const B& cb, typename B::Stream s, typename B::Event e,
                           typename B::Buffer buf, Bytes n, Place place, std::string_view name) {
  requires std::semiregular<typename B::Stream>;
  requires std::equality_comparable<typename B::Stream>;
  requires std::semiregular<typename B::Event>;
  requires std::semiregular<typename B::Buffer>;
  /// The stream current now, on which the host's next compute runs (torch's current_stream();
  /// Note [The compute stream is the current one] in offload/tracker.hpp).
  { b.compute_stream() } -> std::same_as<typename B::Stream>;
  { b.make_stream(name) } -> std::same_as<typename B::Stream>;
  { b.make_event() } -> std::same_as<typename B::Event>;
  /// A new buffer of `n` bytes holding one reference; nullopt when there is no memory.
  { b.allocate(place, n, s, name) } -> std::same_as<std::optional<typename B::Buffer>>;
  /// Copies `n` bytes from src (at an offset) into dst (at an offset) on stream s.
  { b.copy(s, buf, n, buf, n, n, name) } -> std::same_as<void>;
  { b.record(e, s) } -> std::same_as<void>;
  { b.wait(s, e) } -> std::same_as<void>;
  { b.hold(buf) } -> std::same_as<void>;
  { b.drop(buf) } -> std::same_as<void>;
  { cb.use_count(buf) } -> std::same_as<long>;
  { b.record_stream(buf, s) } -> std::same_as<void>;
  /// The host waits until the work submitted to s so far is done.
  { b.synchronize(s) } -> std::same_as<void>;
};

}  // namespace ferry
