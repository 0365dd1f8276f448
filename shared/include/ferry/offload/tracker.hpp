#pragma once
/// What every offload policy keeps and does alike: the backend and its streams, the options,
/// the records and the ids that name them, the counters, and the two moves every policy makes
/// (keep a tensor on the device; start copying one to the host).

#include <fmt/format.h>

#include <utility>

#include "ferry/backend.hpp"
#include "ferry/offload/faults.hpp"
#include "ferry/offload/options.hpp"
#include "ferry/offload/record.hpp"

namespace ferry {

/// What unpack hands back: a storage (the caller owns one reference) and where the tensor
/// starts in it.
template <class Buffer>
struct Unpacked {
  Buffer storage;
  Bytes offset;
};

template <Backend B>
struct Tracker {
  using Stream = typename B::Stream;
  using Event = typename B::Event;
  using Buffer = typename B::Buffer;
  using Rec = Record<Buffer, Event>;

  /// Copies go on `streams` (offload, reload): the same one, or the compute stream, as the
  /// policy chooses; invalid ones when nothing is ever copied.
  Tracker(B& device, const OffloadOptions& opts, const OffloadFaults& planted,
          std::pair<Stream, Stream> streams)
      : backend(device),
        options(opts),
        faults(planted),
        compute(device.compute_stream()),
        offload_stream(streams.first),
        reload_stream(streams.second) {}

  /// Whether a saved tensor stays on the device by rule: not a device tensor, a parameter or
  /// buffer, under `min_bytes`, packed inside a no-offload region, or (when `opt_out` is
  /// honoured) marked no_offload itself.
  [[nodiscard]] bool stays(const TensorFacts& facts, bool in_region, bool opt_out) const {
    return options.policy == Policy::None || !facts.on_device || facts.is_param ||
           facts.bytes < options.min_bytes || in_region || (opt_out && facts.no_offload);
  }

  /// A Kept record holding a reference to `storage`.
  RecordId keep(const TensorFacts& facts, const Buffer& storage) {
    ++telemetry.kept;
    backend.hold(storage);
    Rec rec;
    rec.state = RecordState::Kept;
    rec.device = storage;
    rec.ids = 1;
    rec.bytes = facts.bytes;
    return records.add(rec);
  }

  /// Copies `bytes` of `storage` (from `offset`) into `host` on the offload stream, records
  /// the copy's event and keeps the original alive: an Offloading record.
  RecordId start_offload(const Buffer& storage, Bytes offset, const Buffer& host, Bytes bytes,
                         std::uint64_t key) {
    backend.copy(offload_stream, storage, offset, host, Bytes(0), bytes, "offload");
    Rec rec;
    rec.state = RecordState::Offloading;
    rec.host = host;
    rec.bytes = bytes;
    rec.storage = key;
    rec.ids = 1;
    rec.d2h_done = backend.make_event();
    backend.record(rec.d2h_done, offload_stream);
    backend.hold(storage);
    rec.device = storage;
    ++telemetry.offloaded;
    telemetry.bytes_d2h += bytes;
    return records.add(rec);
  }

  /// `stream` waits for the work submitted to the compute stream so far.
  void wait_for_compute(Stream stream) {
    Event e = backend.make_event();
    backend.record(e, compute);
    backend.wait(stream, e);
  }

  /// The record behind a tracked `id`, or OffloadError naming the id.
  RecordId find(TensorId id) const {
    const RecordId r = ids.find(id);
    if (!r.valid()) throw OffloadError(fmt::format("untracked tensor with id {}", id.value()));
    return r;
  }

  B& backend;
  const OffloadOptions options;
  const OffloadFaults faults;
  const Stream compute;
  const Stream offload_stream;
  const Stream reload_stream;
  OffloadTelemetry telemetry;
  RecordTable<Buffer, Event> records;
  IdTable ids;
};

}  // namespace ferry
