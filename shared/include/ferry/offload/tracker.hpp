#pragma once
/// What every offload policy keeps and does alike: the backend and its streams, the options,
/// the records and the ids that name them, the counters, and the two moves every policy makes
/// (keep a tensor on the device; start copying one to the host).

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

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

// Note [The compute stream is the current one]
// The compute stream is not a fixed stream: it is the stream current when the work happens
// (torch's current_stream()), which a checkpoint's recomputation, FSDP2, a custom autograd
// Function or a user's `with torch.cuda.stream(s)` change. So the core asks the backend at each
// step instead of remembering one: a pack orders its copy after the stream current at the pack
// (the producer); the original is freed once every compute stream seen so far has waited for
// the copy (the block returns to the pool of the stream it was allocated on, which the core
// does not know: a checkpoint's inputs are packed on the stream current when the region
// starts, not on the one that computed them); an unpack makes the stream current at the unpack (a
// reader) wait for the reload, and every further reader on another stream waits too; the
// reloaded block is freed after each reader and after the stream current at the free (an
// event each, or record_stream on each when a view escaped: a recomputation on a side stream
// hands the reloaded input to the backward on the stream current when the block is let go).
// A recomputation packs and unpacks like any other compute, on the stream current then. The
// planted fault stale_compute_stream uses the stream current when the scheduler was made
// instead (what TRL did before its PR #7195), which races as soon as work runs on another
// stream.

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
        first_compute(device.compute_stream()),
        offload_stream(streams.first),
        reload_stream(streams.second) {}

  /// Whether a saved tensor stays on the device by rule: not a device tensor, a parameter or
  /// buffer, under `min_bytes`, packed inside a no-offload region, or (when `opt_out` is
  /// honoured) marked no_offload itself.
  [[nodiscard]] bool stays(const TensorFacts& facts, bool in_region, bool opt_out) const {
    return options.policy == Policy::None || !facts.on_device || facts.is_param ||
           facts.bytes < options.min_bytes || in_region || (opt_out && facts.no_offload);
  }

  /// The stream current now (Note [The compute stream is the current one]).
  [[nodiscard]] Stream compute() const {
    if (faults.stale_compute_stream) return first_compute;
    const Stream now = backend.compute_stream();
    if (std::find(computes.begin(), computes.end(), now) == computes.end()) computes.push_back(now);
    return now;
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
    const RecordId r = records.add(rec);
    readers_of(r).clear();
    (void)compute();  // the stream current at the pack is among those guard_original waits on
    return r;
  }

  /// The streams that read record `r`'s reloaded copy since its last reload.
  std::vector<Stream>& readers_of(RecordId r) {
    if (record_readers.size() <= r.value()) record_readers.resize(r.value() + 1);
    return record_readers[r.value()];
  }

  /// An original may be freed once its copy (`copied`) is done: every compute stream seen so
  /// far waits for it. A storage belongs to the pool of the stream it was allocated
  /// on, which the core does not know: the stream current at its pack (a checkpoint's inputs
  /// are packed on the stream current when the region starts) need not be the one it was
  /// computed on.
  void guard_original(Event copied) {
    if (computes.empty()) computes.push_back(first_compute);
    for (const Stream& s : computes) backend.wait(s, copied);
  }

  /// Whether `stream` has not read record `r` yet since its reload; notes it as a reader.
  bool new_reader(RecordId r, Stream stream) {
    std::vector<Stream>& readers = readers_of(r);
    if (std::find(readers.begin(), readers.end(), stream) != readers.end()) return false;
    readers.push_back(stream);
    return true;
  }

  /// `stream` waits for the work submitted to the current stream so far.
  void wait_for_compute(Stream stream) {
    Event e = backend.make_event();
    backend.record(e, compute());
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
  const Stream first_compute;  ///< current when the scheduler was made (the planted fault's)
  mutable std::vector<Stream> computes;  ///< every stream compute() returned, first seen first
  const Stream offload_stream;
  const Stream reload_stream;
  OffloadTelemetry telemetry;
  RecordTable<Buffer, Event> records;
  std::vector<std::vector<Stream>> record_readers;  ///< by record id
  IdTable ids;
};

}  // namespace ferry
