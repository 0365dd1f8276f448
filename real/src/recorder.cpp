#include "ferry/real/recorder.hpp"

#include <fmt/format.h>

namespace ferry::real {

namespace {
std::string range(std::uint32_t buffer, Bytes offset, Bytes bytes) {
  return fmt::format(R"({{"buffer": "b{}", "offset": {}, "bytes": {}}})", buffer, offset.count(),
                     bytes.count());
}
}  // namespace

Recorder::Recorder(std::string profile) : profile_(std::move(profile)) {}

std::uint32_t Recorder::add_stream(std::string_view name) {
  const auto index = static_cast<std::uint32_t>(streams_.size());
  stream_names_.push_back(fmt::format("s{}_{}", index, name));
  streams_.push_back(fmt::format(R"({{"name": "{}", "device": "gpu0"}})", stream_names_.back()));
  return index;
}

std::uint32_t Recorder::add_event() { return events_++; }

std::uint32_t Recorder::add_buffer(Place place, Bytes bytes) {
  const auto index = static_cast<std::uint32_t>(buffers_.size());
  const Bytes size = bytes.count() > 0 ? bytes : Bytes(1);
  switch (place) {
    case Place::Device:
      buffers_.push_back(fmt::format(R"({{"name": "b{}", "kind": "device", "device": "gpu0", )"
                                     R"("bytes": {}}})",
                                     index, size.count()));
      break;
    case Place::PinnedHost:
    case Place::PinnedHostCaching:
      buffers_.push_back(fmt::format(R"({{"name": "b{}", "kind": "pinned", "bytes": {}, )"
                                     R"("pool": "{}"}})",
                                     index, size.count(),
                                     place == Place::PinnedHost ? "exact" : "caching"));
      break;
  }
  return index;
}

void Recorder::alloc(std::uint32_t buffer, std::int64_t stream) {
  if (stream < 0) {
    ops_.push_back(fmt::format(R"({{"op": "alloc", "buffer": "b{}"}})", buffer));
  } else {
    ops_.push_back(fmt::format(R"({{"op": "alloc", "buffer": "b{}", "stream": "{}"}})", buffer,
                               stream_name(stream)));
  }
}

void Recorder::free(std::uint32_t buffer) {
  ops_.push_back(fmt::format(R"({{"op": "free", "buffer": "b{}"}})", buffer));
}

void Recorder::produce(std::uint32_t stream, std::uint32_t buffer, Bytes offset, Bytes bytes) {
  if (bytes.count() <= 0) return;
  ops_.push_back(fmt::format(R"({{"op": "kernel", "label": "producer", "stream": "{}", )"
                             R"("duration_ns": 1000, "writes": [{}]}})",
                             stream_name(stream), range(buffer, offset, bytes)));
}

void Recorder::consume(std::uint32_t stream, std::uint32_t buffer, Bytes offset, Bytes bytes) {
  if (bytes.count() <= 0) return;
  ops_.push_back(fmt::format(R"({{"op": "kernel", "label": "consumer", "stream": "{}", )"
                             R"("duration_ns": 1000, "reads": [{}]}})",
                             stream_name(stream), range(buffer, offset, bytes)));
}

void Recorder::copy(std::uint32_t stream, std::uint32_t src, Bytes src_offset, std::uint32_t dst,
                    Bytes dst_offset, Bytes bytes) {
  ops_.push_back(fmt::format(R"({{"op": "copy", "stream": "{}", "src": {}, "dst": {}}})",
                             stream_name(stream), range(src, src_offset, bytes),
                             range(dst, dst_offset, bytes)));
}

void Recorder::record(std::uint32_t event, std::uint32_t stream) {
  ops_.push_back(fmt::format(R"({{"op": "record", "event": "e{}", "stream": "{}"}})", event,
                             stream_name(stream)));
}

void Recorder::wait(std::uint32_t stream, std::uint32_t event) {
  ops_.push_back(fmt::format(R"({{"op": "wait", "stream": "{}", "event": "e{}"}})",
                             stream_name(stream), event));
}

void Recorder::record_stream(std::uint32_t buffer, std::uint32_t stream) {
  ops_.push_back(fmt::format(R"({{"op": "record_stream", "buffer": "b{}", "stream": "{}"}})",
                             buffer, stream_name(stream)));
}

const std::string& Recorder::stream_name(std::int64_t stream) const {
  return stream_names_.at(static_cast<std::size_t>(stream));
}

std::string Recorder::json() const {
  std::string out = "{\n  \"format\": \"ferry.program/1\",\n";
  out += "  \"description\": \"stream operations recorded from a ferry run\",\n";
  out += fmt::format("  \"devices\": [{{\"name\": \"gpu0\", \"profile\": \"{}\"}}],\n", profile_);
  const auto list = [&](const char* key, const std::vector<std::string>& items, bool last) {
    out += fmt::format("  \"{}\": [", key);
    for (std::size_t i = 0; i < items.size(); ++i) {
      out += (i == 0 ? "\n    " : ",\n    ") + items[i];
    }
    out += items.empty() ? "]" : "\n  ]";
    out += last ? "\n" : ",\n";
  };
  list("streams", streams_, false);
  list("buffers", buffers_, false);
  std::vector<std::string> events;
  events.reserve(events_);
  for (std::uint32_t e = 0; e < events_; ++e) events.push_back(fmt::format("\"e{}\"", e));
  list("events", events, false);
  list("ops", ops_, true);
  out += "}\n";
  return out;
}

}  // namespace ferry::real
