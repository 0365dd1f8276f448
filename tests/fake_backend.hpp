#pragma once
// A Backend that only writes down what it is asked to do, for testing the core on its own.

#include <fmt/format.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend_handles.hpp"
#include "ferry/backend.hpp"

namespace ferry::testing {

class FakeBackend {
 public:
  using Stream = StreamHandle;
  using Event = EventHandle;
  using Buffer = BufferHandle;

  Stream compute_stream() const { return Stream{0}; }
  Stream make_stream(std::string_view name) {
    log.push_back(fmt::format("stream s{} {}", ++streams, name));
    return Stream{streams};
  }
  Event make_event() { return Event{events++}; }
  std::optional<Buffer> allocate(Place place, Bytes bytes, Stream stream, std::string_view) {
    if (place != Place::Device && host_fails) return std::nullopt;
    const int id = static_cast<int>(refs.size());
    refs.push_back(1);
    log.push_back(fmt::format("alloc {} {} s{} -> b{}", place == Place::Device ? "device" : "host",
                              bytes.count(), stream.id, id));
    return Buffer{id};
  }
  void copy(Stream s, Buffer src, Bytes so, Buffer dst, Bytes dso, Bytes n, std::string_view) {
    log.push_back(fmt::format("copy s{} b{}+{} -> b{}+{} {}", s.id, src.id, so.count(), dst.id,
                              dso.count(), n.count()));
  }
  void record(Event e, Stream s) { log.push_back(fmt::format("record e{} s{}", e.id, s.id)); }
  void wait(Stream s, Event e) { log.push_back(fmt::format("wait s{} e{}", s.id, e.id)); }
  void hold(Buffer b) { ++refs.at(static_cast<std::size_t>(b.id)); }
  void drop(Buffer b) {
    if (--refs.at(static_cast<std::size_t>(b.id)) == 0)
      log.push_back(fmt::format("free b{}", b.id));
  }
  long use_count(Buffer b) const { return refs.at(static_cast<std::size_t>(b.id)); }
  void synchronize(Stream s) { log.push_back(fmt::format("sync s{}", s.id)); }
  void record_stream(Buffer b, Stream s) {
    log.push_back(fmt::format("record_stream b{} s{}", b.id, s.id));
  }

  /// A storage the autograd owns (one reference), as a forward op would produce it.
  Buffer tensor() {
    refs.push_back(1);
    return Buffer{static_cast<int>(refs.size() - 1)};
  }
  /// Index of the first log line at or after `from` that equals `line`, or -1.
  int find(std::string_view line, int from = 0) const {
    for (std::size_t i = static_cast<std::size_t>(from); i < log.size(); ++i) {
      if (log[i] == line) return static_cast<int>(i);
    }
    return -1;
  }
  std::string dump() const {
    std::string out;
    for (const auto& l : log) out += l + "\n";
    return out;
  }

  std::vector<std::string> log;
  std::vector<long> refs;
  int streams = 0;
  int events = 0;
  bool host_fails = false;
};

static_assert(Backend<FakeBackend>);

}  // namespace ferry::testing
