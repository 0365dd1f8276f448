#pragma once
/// One simulated GPU as a ferry::Backend: streams, events and reference-counted storages over
/// a Simulator (see Note [Backend handles]).

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/backend.hpp"
#include "ferry/result.hpp"
#include "ferry/sim/engine/simulator.hpp"

namespace ferry::sim {

class Device {
 public:
  struct Stream {
    StreamId id;
    friend bool operator==(Stream, Stream) = default;
  };
  struct Event {
    EventId id;
    friend bool operator==(Event, Event) = default;
  };
  struct Buffer {
    BufferId id;
    friend bool operator==(Buffer, Buffer) = default;
  };

  /// Drives device `device` of `sim`; `compute` is the stream current at the start.
  Device(Simulator& sim, DeviceId device, StreamId compute);

  /// The current stream: the one work of the host thread goes to now (torch's
  /// `current_stream()`), `compute` until set_current_stream() names another.
  Stream compute_stream() const { return Stream{current_}; }
  /// Makes `stream` current, as `torch.cuda.set_stream` (or entering `torch.cuda.stream(s)`)
  /// does. Orders nothing: the caller makes the waits a stream switch needs.
  void set_current_stream(Stream stream);
  Stream make_stream(std::string_view name);
  Event make_event();
  std::optional<Buffer> allocate(Place place, Bytes bytes, Stream stream, std::string_view name);
  /// As allocate(), with the allocator's message (what was live, what was asked) on failure.
  Result<Buffer> try_allocate(Place place, Bytes bytes, Stream stream, std::string_view name);
  void copy(Stream stream, Buffer src, Bytes src_offset, Buffer dst, Bytes dst_offset, Bytes bytes,
            std::string_view name);
  void record(Event event, Stream stream);
  void wait(Stream stream, Event event);
  void hold(Buffer buffer);
  void drop(Buffer buffer);
  [[nodiscard]] long use_count(Buffer buffer) const;
  void record_stream(Buffer buffer, Stream stream);
  void synchronize(Stream stream);

  [[nodiscard]] Simulator& sim() { return sim_; }
  [[nodiscard]] DeviceId device() const { return device_; }

 private:
  Simulator& sim_;
  DeviceId device_;
  StreamId current_;
  std::vector<long> refs_;  // by BufferId
};

static_assert(Backend<Device>);

}  // namespace ferry::sim
