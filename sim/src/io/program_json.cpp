#include "ferry/sim/io/program_json.hpp"

#include "ferry/program/program_json.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <utility>

#include "ferry/sim/io/text_file.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "json_files.hpp"
#include "name_table.hpp"

namespace ferry::sim {
namespace {

using io_detail::NameTable;
using io_detail::read_nanoseconds;
using io_detail::read_profile;
using io_detail::read_rate;

// Programs

struct OpSpec {
  std::string_view name;
  OpKind kind;
  std::array<std::string_view, 6> keys;
  std::size_t key_count;
};

constexpr std::array kOpSpecs{
    OpSpec{"alloc", OpKind::Alloc, {"op", "label", "buffer", "stream"}, 4},
    OpSpec{"free", OpKind::Free, {"op", "label", "buffer"}, 3},
    OpSpec{"record_stream", OpKind::RecordStream, {"op", "label", "buffer", "stream"}, 4},
    OpSpec{
        "kernel", OpKind::Kernel, {"op", "label", "stream", "duration_ns", "reads", "writes"}, 6},
    OpSpec{"copy", OpKind::Copy, {"op", "label", "stream", "src", "dst"}, 5},
    OpSpec{"record", OpKind::Record, {"op", "label", "event", "stream"}, 4},
    OpSpec{"wait", OpKind::Wait, {"op", "label", "stream", "event"}, 4},
    OpSpec{"sync_stream", OpKind::SyncStream, {"op", "label", "stream"}, 3},
    OpSpec{"sync_event", OpKind::SyncEvent, {"op", "label", "event"}, 3},
    OpSpec{"sync_device", OpKind::SyncDevice, {"op", "label", "device"}, 3},
    OpSpec{"query", OpKind::Query, {"op", "label", "event"}, 3},
    OpSpec{"host_read", OpKind::HostRead, {"op", "label", "reads"}, 3},
    OpSpec{"host_write", OpKind::HostWrite, {"op", "label", "writes"}, 3},
    OpSpec{"empty_cache", OpKind::EmptyCache, {"op", "label", "device"}, 3},
};

const OpSpec* find_op(std::string_view name) {
  for (const OpSpec& spec : kOpSpecs) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

std::string known_ops() {
  std::vector<std::string_view> names;
  for (const OpSpec& spec : kOpSpecs) names.push_back(spec.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

bool is_host(MemoryKind kind) { return kind != MemoryKind::Device; }

/// Reads one program document into a Program, resolving names in declaration order.
class ProgramReader {
 public:
  explicit ProgramReader(const std::filesystem::path& profile_dir) : profile_dir_(profile_dir) {}

  Result<Program> read(const JsonValue& root) {
    FERRY_JSON_TRY(const auto first_look, root.object_with_any_keys());
    FERRY_JSON_TRY(const auto format_value, first_look.required("format"));
    FERRY_JSON_TRY(const auto format, format_value.string());
    if (format != kProgramFormat) {
      return format_value.error("expected {}, got {}", json_quote(kProgramFormat),
                                json_quote(format));
    }
    FERRY_JSON_TRY(const auto object, root.object({"format", "description", "devices", "links",
                                                   "streams", "buffers", "events", "ops"}));
    FERRY_JSON_TRY(program_.description, object.optional_string("description", {}));
    FERRY_JSON_RETURN_IF_ERROR(read_devices(object));
    FERRY_JSON_RETURN_IF_ERROR(read_links(object));
    FERRY_JSON_RETURN_IF_ERROR(read_streams(object));
    FERRY_JSON_RETURN_IF_ERROR(read_buffers(object));
    FERRY_JSON_RETURN_IF_ERROR(read_events(object));
    FERRY_JSON_RETURN_IF_ERROR(read_ops(object));
    return std::move(program_);
  }

 private:
  Status read_devices(const JsonObject& root) {
    FERRY_JSON_TRY(const auto devices_value, root.required("devices"));
    FERRY_JSON_TRY(const auto devices, devices_value.array());
    if (devices.empty()) return devices_value.error("a program needs at least one device");
    for (const JsonValue& value : devices) {
      FERRY_JSON_TRY(const auto object, value.object({"name", "profile"}));
      FERRY_JSON_TRY(const auto name_value, object.required("name"));
      FERRY_JSON_RETURN_IF_ERROR(devices_.declare(name_value));
      ProgramDevice device;
      FERRY_JSON_TRY(device.name, name_value.name());
      FERRY_JSON_TRY(const auto profile_value, object.required("profile"));
      FERRY_JSON_TRY(device.profile, read_profile_reference(profile_value));
      if (profile_value.json().is_string()) device.profile_name = device.profile.name;
      program_.devices.push_back(std::move(device));
    }
    return Ok{};
  }

  Result<DeviceProfile> read_profile_reference(const JsonValue& value) {
    if (value.json().is_object()) return read_profile(value);
    if (!value.json().is_string()) {
      return value.error("expected a bundled profile name or a profile object, got {}",
                         describe_json(value.json()));
    }
    FERRY_JSON_TRY(const auto name, value.name());
    if (const auto it = loaded_profiles_.find(name); it != loaded_profiles_.end()) {
      return it->second;
    }
    auto loaded = load_device_profile(profile_dir_, name);
    if (!loaded) return value.error_message(loaded.error().message);
    loaded_profiles_.emplace(name, loaded.value());
    return loaded;
  }

  Status read_links(const JsonObject& root) {
    FERRY_JSON_TRY(const auto links, root.optional_array("links"));
    for (const JsonValue& value : links) {
      FERRY_JSON_TRY(const auto object, value.object({"from", "to", "bytes_per_s", "latency_ns"}));
      ProgramLink link;
      FERRY_JSON_TRY(const auto from_value, object.required("from"));
      FERRY_JSON_TRY(const auto from, devices_.resolve(from_value));
      FERRY_JSON_TRY(const auto to_value, object.required("to"));
      FERRY_JSON_TRY(const auto to, devices_.resolve(to_value));
      if (from == to) return to_value.error("a link joins two different devices");
      link.from = DeviceId(from);
      link.to = DeviceId(to);
      for (const ProgramLink& earlier : program_.links) {
        if (earlier.from == link.from && earlier.to == link.to) {
          return value.error("duplicate link from {} to {}", json_quote(devices_.name(from)),
                             json_quote(devices_.name(to)));
        }
      }
      FERRY_JSON_TRY(const auto rate, read_rate(object, "bytes_per_s"));
      FERRY_JSON_TRY(const auto latency, read_nanoseconds(object, "latency_ns"));
      link.bandwidth = Bandwidth(rate);
      link.latency = SimTime(latency);
      program_.links.push_back(link);
    }
    return Ok{};
  }

  Status read_streams(const JsonObject& root) {
    FERRY_JSON_TRY(const auto streams, root.required_array("streams"));
    for (const JsonValue& value : streams) {
      FERRY_JSON_TRY(const auto object, value.object({"name", "device"}));
      FERRY_JSON_TRY(const auto name_value, object.required("name"));
      FERRY_JSON_RETURN_IF_ERROR(streams_.declare(name_value));
      ProgramStream stream;
      FERRY_JSON_TRY(stream.name, name_value.name());
      FERRY_JSON_TRY(const auto device_value, object.required("device"));
      FERRY_JSON_TRY(const auto device, devices_.resolve(device_value));
      stream.device = DeviceId(device);
      program_.streams.push_back(std::move(stream));
    }
    return Ok{};
  }

  Status read_buffers(const JsonObject& root) {
    FERRY_JSON_TRY(const auto buffers, root.optional_array("buffers"));
    for (const JsonValue& value : buffers) {
      FERRY_JSON_TRY(const auto object, value.object({"name", "kind", "device", "bytes", "pool"}));
      FERRY_JSON_TRY(const auto name_value, object.required("name"));
      FERRY_JSON_RETURN_IF_ERROR(buffers_.declare(name_value));
      ProgramBuffer buffer;
      FERRY_JSON_TRY(buffer.name, name_value.name());
      FERRY_JSON_TRY(const auto kind_value, object.required("kind"));
      FERRY_JSON_TRY(const auto kind, kind_value.string());
      if (kind == "device") {
        buffer.kind = MemoryKind::Device;
      } else if (kind == "pinned") {
        buffer.kind = MemoryKind::Pinned;
      } else if (kind == "pageable") {
        buffer.kind = MemoryKind::Pageable;
      } else {
        return kind_value.error("unknown memory kind {} (allowed: device, pinned, pageable)",
                                json_quote(kind));
      }
      FERRY_JSON_TRY(const auto bytes, object.required_integer("bytes", 1, kMaxJsonBytes));
      buffer.bytes = Bytes(bytes);
      if (buffer.kind == MemoryKind::Device) {
        FERRY_JSON_TRY(const auto device_value, object.required("device"));
        FERRY_JSON_TRY(const auto device, devices_.resolve(device_value));
        buffer.device = DeviceId(device);
      } else if (const auto device_value = object.optional("device")) {
        return device_value->error("a {} buffer lives in host memory: remove \"device\"", kind);
      }
      if (const auto pool_value = object.optional("pool")) {
        if (buffer.kind != MemoryKind::Pinned) {
          return pool_value->error("\"pool\" applies to pinned buffers only");
        }
        FERRY_JSON_TRY(const auto pool, pool_value->string());
        if (pool == "caching") {
          buffer.pool = PinnedPool::Caching;
        } else if (pool == "exact") {
          buffer.pool = PinnedPool::Exact;
        } else {
          return pool_value->error("unknown pinned pool {} (allowed: caching, exact)",
                                   json_quote(pool));
        }
      }
      program_.buffers.push_back(std::move(buffer));
    }
    return Ok{};
  }

  Status read_events(const JsonObject& root) {
    FERRY_JSON_TRY(const auto events, root.optional_array("events"));
    for (const JsonValue& value : events) {
      FERRY_JSON_RETURN_IF_ERROR(events_.declare(value));
      FERRY_JSON_TRY(auto name, value.name());
      program_.events.push_back(ProgramEvent{std::move(name)});
    }
    return Ok{};
  }

  Status read_ops(const JsonObject& root) {
    FERRY_JSON_TRY(const auto ops, root.required_array("ops"));
    program_.ops.reserve(ops.size());
    for (const JsonValue& value : ops) {
      FERRY_JSON_TRY(auto op, read_op(value));
      program_.ops.push_back(std::move(op));
    }
    return Ok{};
  }

  Result<ProgramOp> read_op(const JsonValue& value) {
    FERRY_JSON_TRY(const auto first_look, value.object_with_any_keys());
    FERRY_JSON_TRY(const auto kind_value, first_look.required("op"));
    FERRY_JSON_TRY(const auto kind_name, kind_value.string());
    const OpSpec* spec = find_op(kind_name);
    if (spec == nullptr) {
      return kind_value.error("unknown op {} (known: {})", json_quote(kind_name), known_ops());
    }
    FERRY_JSON_TRY(const auto object, value.object(std::span<const std::string_view>(
                                          spec->keys.data(), spec->key_count)));
    ProgramOp op;
    op.kind = spec->kind;
    FERRY_JSON_TRY(op.label, object.optional_string("label", {}));
    switch (op.kind) {
      case OpKind::Alloc: {
        FERRY_JSON_RETURN_IF_ERROR(read_alloc(object, op));
        break;
      }
      case OpKind::Free: {
        FERRY_JSON_TRY(op.slot, read_slot(object));
        break;
      }
      case OpKind::RecordStream: {
        FERRY_JSON_RETURN_IF_ERROR(read_record_stream(object, op));
        break;
      }
      case OpKind::Kernel: {
        FERRY_JSON_TRY(const auto stream_value, object.required("stream"));
        FERRY_JSON_TRY(op.stream, read_stream(stream_value));
        FERRY_JSON_TRY(const auto duration, read_nanoseconds(object, "duration_ns"));
        op.duration = SimTime(duration);
        FERRY_JSON_TRY(op.reads, read_ranges(object, "reads", false, false));
        FERRY_JSON_TRY(op.writes, read_ranges(object, "writes", false, false));
        break;
      }
      case OpKind::Copy: {
        FERRY_JSON_RETURN_IF_ERROR(read_copy(object, op));
        break;
      }
      case OpKind::Record:
      case OpKind::Wait: {
        FERRY_JSON_TRY(const auto event_value, object.required("event"));
        FERRY_JSON_TRY(op.event, read_event(event_value));
        FERRY_JSON_TRY(const auto stream_value, object.required("stream"));
        FERRY_JSON_TRY(op.stream, read_stream(stream_value));
        break;
      }
      case OpKind::SyncStream: {
        FERRY_JSON_TRY(const auto stream_value, object.required("stream"));
        FERRY_JSON_TRY(op.stream, read_stream(stream_value));
        break;
      }
      case OpKind::SyncEvent:
      case OpKind::Query: {
        FERRY_JSON_TRY(const auto event_value, object.required("event"));
        FERRY_JSON_TRY(op.event, read_event(event_value));
        break;
      }
      case OpKind::SyncDevice:
      case OpKind::EmptyCache: {
        FERRY_JSON_TRY(const auto device_value, object.required("device"));
        FERRY_JSON_TRY(const auto device, devices_.resolve(device_value));
        op.device = DeviceId(device);
        break;
      }
      case OpKind::HostRead: {
        FERRY_JSON_TRY(op.reads, read_ranges(object, "reads", true, true));
        break;
      }
      case OpKind::HostWrite: {
        FERRY_JSON_TRY(op.writes, read_ranges(object, "writes", true, true));
        break;
      }
    }
    return op;
  }

  Status read_alloc(const JsonObject& object, ProgramOp& op) {
    FERRY_JSON_TRY(op.slot, read_slot(object));
    const ProgramBuffer& buffer = program_.buffers[op.slot.value()];
    if (buffer.kind != MemoryKind::Device) {
      if (const auto stream_value = object.optional("stream")) {
        return stream_value->error(
            "buffer {} is {} host memory, allocated by the host: remove \"stream\"",
            json_quote(buffer.name), memory_kind_name(buffer.kind));
      }
      return Ok{};
    }
    FERRY_JSON_TRY(const auto stream_value, object.required("stream"));
    FERRY_JSON_TRY(op.stream, read_stream(stream_value));
    const DeviceId stream_device = program_.streams[op.stream.value()].device;
    if (stream_device != buffer.device) {
      return stream_value.error("stream {} is on device {} but buffer {} lives on device {}",
                                json_quote(streams_.name(op.stream.value())),
                                json_quote(devices_.name(stream_device.value())),
                                json_quote(buffer.name),
                                json_quote(devices_.name(buffer.device.value())));
    }
    return Ok{};
  }

  Status read_record_stream(const JsonObject& object, ProgramOp& op) {
    FERRY_JSON_TRY(op.slot, read_slot(object));
    const ProgramBuffer& buffer = program_.buffers[op.slot.value()];
    if (buffer.kind == MemoryKind::Pageable) {
      FERRY_JSON_TRY(const auto buffer_value, object.required("buffer"));
      return buffer_value.error("record_stream needs a device or pinned buffer; {} is pageable",
                                json_quote(buffer.name));
    }
    FERRY_JSON_TRY(const auto stream_value, object.required("stream"));
    FERRY_JSON_TRY(op.stream, read_stream(stream_value));
    return Ok{};
  }

  Status read_copy(const JsonObject& object, ProgramOp& op) {
    FERRY_JSON_TRY(const auto stream_value, object.required("stream"));
    FERRY_JSON_TRY(op.stream, read_stream(stream_value));
    FERRY_JSON_TRY(const auto src_value, object.required("src"));
    FERRY_JSON_TRY(op.src, read_range(src_value));
    FERRY_JSON_TRY(const auto dst_value, object.required("dst"));
    FERRY_JSON_TRY(op.dst, read_range(dst_value));
    const ProgramBuffer& src = program_.buffers[op.src.slot.value()];
    const ProgramBuffer& dst = program_.buffers[op.dst.slot.value()];
    if (is_host(src.kind) && is_host(dst.kind)) {
      return object.error("a copy needs at least one device buffer (src {} is {}, dst {} is {})",
                          json_quote(src.name), memory_kind_name(src.kind), json_quote(dst.name),
                          memory_kind_name(dst.kind));
    }
    if (op.src.bytes != op.dst.bytes) {
      return object.error("copy sizes differ: src has {} bytes, dst has {} bytes",
                          op.src.bytes.count(), op.dst.bytes.count());
    }
    if (op.src.slot == op.dst.slot && op.src.offset < op.dst.offset + op.dst.bytes &&
        op.dst.offset < op.src.offset + op.src.bytes) {
      return object.error("src and dst overlap in buffer {}", json_quote(src.name));
    }
    return Ok{};
  }

  Result<SlotId> read_slot(const JsonObject& object) {
    FERRY_JSON_TRY(const auto buffer_value, object.required("buffer"));
    FERRY_JSON_TRY(const auto index, buffers_.resolve(buffer_value));
    return SlotId(index);
  }

  Result<StreamId> read_stream(const JsonValue& value) const {
    FERRY_JSON_TRY(const auto index, streams_.resolve(value));
    return StreamId(index);
  }

  Result<EventId> read_event(const JsonValue& value) const {
    FERRY_JSON_TRY(const auto index, events_.resolve(value));
    return EventId(index);
  }

  Result<SlotRange> read_range(const JsonValue& value) const {
    FERRY_JSON_TRY(const auto object, value.object({"buffer", "offset", "bytes"}));
    FERRY_JSON_TRY(const auto buffer_value, object.required("buffer"));
    FERRY_JSON_TRY(const auto index, buffers_.resolve(buffer_value));
    const ProgramBuffer& buffer = program_.buffers[index];
    const std::int64_t size = buffer.bytes.count();
    FERRY_JSON_TRY(const auto offset, object.optional_integer("offset", 0, 0, kMaxJsonBytes));
    if (offset >= size) {
      return object.optional("offset")->error(
          "offset {} is at or past the end of buffer {} ({} bytes)", offset,
          json_quote(buffer.name), size);
    }
    FERRY_JSON_TRY(const auto bytes,
                   object.optional_integer("bytes", size - offset, 1, kMaxJsonBytes));
    if (offset + bytes > size) {
      return object.optional("bytes")->error(
          "range [{}, {}) ends past the end of buffer {} ({} bytes)", offset, offset + bytes,
          json_quote(buffer.name), size);
    }
    return SlotRange{SlotId(index), Bytes(offset), Bytes(bytes)};
  }

  Result<std::vector<SlotRange>> read_ranges(const JsonObject& object, std::string_view key,
                                             bool required, bool host_only) const {
    std::vector<SlotRange> ranges;
    if (!required && !object.has(key)) return ranges;
    FERRY_JSON_TRY(const auto array_value, object.required(key));
    FERRY_JSON_TRY(const auto elements, array_value.array());
    if (required && elements.empty()) {
      return array_value.error("expected at least one range");
    }
    for (const JsonValue& element : elements) {
      FERRY_JSON_TRY(const auto range, read_range(element));
      const ProgramBuffer& buffer = program_.buffers[range.slot.value()];
      if (host_only && !is_host(buffer.kind)) {
        return element.member("buffer")->error(
            "the host can only access host buffers (pinned or pageable); {} is a device buffer",
            json_quote(buffer.name));
      }
      ranges.push_back(range);
    }
    return ranges;
  }

  const std::filesystem::path& profile_dir_;
  Program program_;
  NameTable devices_{"device"};
  NameTable streams_{"stream"};
  NameTable buffers_{"buffer"};
  NameTable events_{"event"};
  std::map<std::string, DeviceProfile, std::less<>> loaded_profiles_;
};

}  // namespace

Result<Program> parse_program(std::string_view text, std::string_view source,
                              const std::filesystem::path& profile_dir) {
  FERRY_JSON_TRY(const auto document, parse_json_text(text, source));
  ProgramReader reader(profile_dir);
  return reader.read(JsonValue(document, source));
}

Result<Program> load_program(const std::filesystem::path& path,
                             const std::filesystem::path& profile_dir) {
  FERRY_JSON_TRY(const auto text, read_text_file(path));
  return parse_program(text, path.string(), profile_dir);
}

}  // namespace ferry::sim
