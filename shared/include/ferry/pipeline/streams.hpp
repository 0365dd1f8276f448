#pragma once
/// The stream choreography of a pipeline, issued to one Backend per device: compute and copy
/// streams, the events that order a task's copies after the task that produced their data and
/// before the task that reads them, and the holders that free a buffer used on several
/// streams. See Note [Pipeline streams] and Note [Receive buffers and record_stream].

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "ferry/backend.hpp"
#include "ferry/check.hpp"
#include "ferry/pipeline/schedule.hpp"

namespace ferry::pipeline {

// Note [Pipeline streams]
// Each ordered device pair (a, b) has one copy stream, created on b. Whatever crosses from a to
// b (chain activations, a portal's tensor, gradients going back) is copied on that stream after
// it waits for the event a's compute stream recorded when the task that produced the data
// finished; b's compute stream waits for an event the copy stream recorded after the copies,
// before the task that reads them (torchgpipe's Copy and Wait). A copy stream waits for a given
// event at most once per fence. Backward mirrors forward with the streams of the reverse pair.
//
// Note [Receive buffers and record_stream]
// Whatever crosses into b is allocated on the copy stream, so that the caching allocator hands
// the block back to that stream's pool. A received buffer is then used on b's compute stream,
// not on the stream it was allocated on, and a sent buffer is read by a copy stream other than
// its own. When the last holder lets go, the buffer is freed with record_stream on every other
// stream that touched it, as torchgpipe's Copy does (record_stream on both sides). The
// alternative, an event-guarded free (record an event on the user's stream, make the allocating
// stream wait for it, then free), would make the copy stream wait for b's compute at every
// free: the next micro-batch's copy into b would queue behind b's current task and the pipeline
// would lose its copy/compute overlap. record_stream costs nothing on any stream; the block
// only counts as allocated until the next allocation on that device finds the recorded marker
// passed.
//
// Holders are counted when a buffer appears: the ops of the partition that will read it, the
// saved-tensor slots that will keep it, the copy that sends it on, a portal. Each lets go right
// after its kernel or copy is issued, so the free follows the last use with nothing in between.
// The holders together keep one backend reference; anything else that keeps the storage (an
// offloader that packed it) keeps its own, and the storage is freed when the last goes.
//
// Note [Point-to-point receives]
// torch.distributed.pipelining's schedules (1F1B, interleaved 1F1B, zero bubble) move data
// between stages with NCCL send and receive operations rather than torchgpipe's copies. The stage
// allocates the receive buffer on its compute stream, and NCCL, when an operation is posted, makes
// its stream wait for the current (compute) stream of its rank. So under those schedules what
// crosses into b is allocated on b's compute stream, and b's copy stream from a waits twice before
// the transfer: for the event a's compute stream recorded after the task that produced the data
// (the send, posted after that task), and for b's compute stream as it stands when the receive
// is posted (receive_after_compute). Without the second wait the transfer could write a block
// that b's compute stream freed and reused in stream order while an earlier kernel still reads
// it. b's compute stream then waits for the transfer (the receive's work.wait()) as above. The
// sender's compute stream does not wait for its sends: the sent buffer is kept by
// record_stream, as NCCL keeps its inputs.

/// A stream of the pipeline: a compute stream or the copy stream of an ordered device pair.
using StreamRef = std::uint32_t;

template <Backend B>
class Choreography {
 public:
  using Stream = typename B::Stream;
  using Event = typename B::Event;

  /// `devices` are distinct backends, one per device; partition j runs on device
  /// `device_of_partition[j]` (partition j on device j when empty). Makes the copy streams,
  /// "copy gpu{a}->gpu{b}" on device b, in the order (a, b).
  explicit Choreography(std::vector<B*> devices,
                        std::vector<std::uint32_t> device_of_partition = {})
      : devices_(std::move(devices)), partition_device_(std::move(device_of_partition)) {
    const auto n = static_cast<std::uint32_t>(devices_.size());
    if (partition_device_.empty()) {
      for (std::uint32_t j = 0; j < n; ++j) partition_device_.push_back(j);
    }
    for (const std::uint32_t d : partition_device_) {
      FERRY_CHECK(d < n, "partition placed on gpu{}, beyond the {} devices", d, n);
    }
    for (std::uint32_t j = 0; j < n; ++j) streams_.push_back(devices_[j]->compute_stream());
    for (std::uint32_t a = 0; a < n; ++a) {
      for (std::uint32_t b = 0; b < n; ++b) {
        streams_.push_back(
            a == b ? Stream{} : devices_[b]->make_stream(fmt::format("copy gpu{}->gpu{}", a, b)));
      }
    }
  }

  [[nodiscard]] std::uint32_t devices() const {
    return static_cast<std::uint32_t>(devices_.size());
  }
  [[nodiscard]] B& device(std::uint32_t j) const { return *devices_[j]; }
  /// The device partition j runs on.
  [[nodiscard]] std::uint32_t device_of_partition(std::uint32_t j) const {
    return partition_device_[j];
  }
  /// Device d's compute stream.
  [[nodiscard]] StreamRef compute(std::uint32_t d) const { return d; }
  /// The copy stream from device `from` into device `to` (they differ).
  [[nodiscard]] StreamRef copy(std::uint32_t from, std::uint32_t to) const {
    FERRY_CHECK(from != to, "no copy stream from gpu{} to itself", from);
    return devices() + from * devices() + to;
  }
  [[nodiscard]] Stream stream(StreamRef s) const { return streams_[s]; }
  /// The device a stream belongs to.
  [[nodiscard]] std::uint32_t device_of(StreamRef s) const {
    return s < devices() ? s : (s - devices()) % devices();
  }

  /// A fence begins: from here, each copy stream waits for a given event at most once.
  void begin_fence() { waited_.clear(); }

  /// The copy stream from `source`'s device into device `to` waits until task `source`
  /// finished `phase` (once per fence); returns that stream, for the copies.
  StreamRef copy_after(Phase phase, Cell source, std::uint32_t to) {
    const StreamRef s = copy(partition_device_[source.partition], to);
    wait_for(s, phase, source);
    return s;
  }

  /// As copy_after(), on a copy stream chosen by the caller (it must be one into `to`).
  void wait_for(StreamRef s, Phase phase, Cell source) {
    const std::array<std::uint32_t, 4> key{s, static_cast<std::uint32_t>(phase), source.micro_batch,
                                           source.partition};
    if (!waited_.insert(key).second) return;
    const auto it = done_.find(key_of(phase, source));
    FERRY_CHECK(it != done_.end(), "mb{} on gpu{} has not finished the phase it waits for",
                source.micro_batch, source.partition);
    device_of_stream(s).wait(streams_[s], it->second);
  }

  /// A receive is posted on copy stream `s` into a buffer allocated on its device's compute
  /// stream: `s` waits for what that compute stream has been given so far (NCCL orders its
  /// stream after the current stream when an operation is posted). See Note [Point-to-point
  /// receives].
  void receive_after_compute(StreamRef s) {
    const std::uint32_t d = device_of(s);
    B& dev = *devices_[d];
    const Event e = dev.make_event();
    dev.record(e, streams_[compute(d)]);
    dev.wait(streams_[s], e);
  }

  /// The copies into task `into` on copy stream `s` were issued: the task's compute stream
  /// waits for them before its next compute.
  void arrived(Cell into, StreamRef s) {
    B& dev = device_of_stream(s);
    const Event e = dev.make_event();
    dev.record(e, streams_[s]);
    arrivals_[cell_key(into)].push_back(e);
  }

  /// Task `task` starts its compute: its stream waits for every copy that arrived for it.
  void start(Cell task) {
    auto& list = arrivals_[cell_key(task)];
    const std::uint32_t d = partition_device_[task.partition];
    for (const Event& e : list) devices_[d]->wait(streams_[compute(d)], e);
    list.clear();
  }

  /// Task `task` finished `phase` on its compute stream: the event later copies wait for.
  void finish(Phase phase, Cell task) {
    const std::uint32_t d = partition_device_[task.partition];
    B& dev = *devices_[d];
    const Event e = dev.make_event();
    dev.record(e, streams_[compute(d)]);
    done_[key_of(phase, task)] = e;
  }

 private:
  static std::array<std::uint32_t, 3> key_of(Phase phase, Cell c) {
    return {static_cast<std::uint32_t>(phase), c.micro_batch, c.partition};
  }
  static std::array<std::uint32_t, 2> cell_key(Cell c) { return {c.micro_batch, c.partition}; }
  B& device_of_stream(StreamRef s) const { return *devices_[device_of(s)]; }

  std::vector<B*> devices_;
  std::vector<std::uint32_t> partition_device_;
  std::vector<Stream> streams_;                         // by StreamRef
  std::map<std::array<std::uint32_t, 3>, Event> done_;  // (phase, cell): the task finished
  std::map<std::array<std::uint32_t, 2>, std::vector<Event>> arrivals_;  // cell: copies in
  std::set<std::array<std::uint32_t, 4>> waited_;  // (copy stream, phase, cell) this fence
};

/// The pipeline's holders of device buffers (Note [Receive buffers and record_stream]).
template <Backend B>
class SharedBuffers {
 public:
  using Buffer = typename B::Buffer;
  /// A buffer the pipeline holds.
  using Handle = std::uint32_t;

  explicit SharedBuffers(const Choreography<B>& streams) : streams_(streams) {}

  /// Takes over `buffer` (one backend reference), allocated on stream `home`, with `holds`
  /// holders.
  Handle adopt(Buffer buffer, StreamRef home, std::int32_t holds) {
    slots_.push_back(Slot{buffer, home, holds, {}, true});
    return static_cast<Handle>(slots_.size() - 1);
  }

  void hold(Handle h, std::int32_t n = 1) {
    Slot& s = slots_[h];
    FERRY_CHECK(s.live, "holding a buffer the pipeline let go");
    s.holds += n;
  }

  /// One holder lets go; the last one frees the buffer. Returns whether it was the last.
  bool release(Handle h) {
    Slot& s = slots_[h];
    FERRY_CHECK(s.live && s.holds > 0, "releasing a buffer with no holder");
    if (--s.holds > 0) return false;
    let_go(h);
    return true;
  }

  /// Every holder lets go at once (the step ended with the buffer still held).
  void let_go(Handle h) {
    Slot& s = slots_[h];
    FERRY_CHECK(s.live, "letting go of a buffer twice");
    B& dev = streams_.device(streams_.device_of(s.home));
    for (const StreamRef u : s.users) dev.record_stream(s.buffer, streams_.stream(u));
    dev.drop(s.buffer);
    s.live = false;
    s.holds = 0;
  }

  /// Stream `s` used the buffer: it gets record_stream at the free unless it is the home.
  void used_on(Handle h, StreamRef s) {
    Slot& slot = slots_[h];
    if (s == slot.home) return;
    const auto at = std::lower_bound(slot.users.begin(), slot.users.end(), s);
    if (at == slot.users.end() || *at != s) slot.users.insert(at, s);
  }

  [[nodiscard]] const Buffer& buffer(Handle h) const { return slots_[h].buffer; }
  [[nodiscard]] bool live(Handle h) const { return slots_[h].live; }
  [[nodiscard]] std::size_t size() const { return slots_.size(); }

 private:
  struct Slot {
    Buffer buffer;
    StreamRef home = 0;
    std::int32_t holds = 0;
    std::vector<StreamRef> users;  // sorted
    bool live = true;
  };

  const Choreography<B>& streams_;
  std::vector<Slot> slots_;
};

}  // namespace ferry::pipeline
