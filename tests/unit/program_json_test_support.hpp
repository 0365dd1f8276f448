#pragma once
// What the program format's tests share (program_json_test.cpp, program_json_errors_test.cpp,
// device_profiles_test.cpp): the bundled profiles' directory, an inline profile and a program
// that uses every op kind.

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <string_view>

#include "ferry/sim/io/program_json.hpp"

namespace ferry::sim::program_json_test {

inline const std::filesystem::path kProfileDir = FERRY_SCENARIOS_DIR "/devices";

// A small inline profile with round numbers, so that the program below depends on one bundled
// file only.
inline constexpr std::string_view kInlineProfile = R"({
      "name": "toy",
      "memory_bytes": 1073741824,
      "flops_per_s": 1000000000000,
      "memory_bytes_per_s": 1000000000000,
      "h2d": {"bytes_per_s": 10000000000, "latency_ns": 1000, "bidirectional_permille": 500},
      "d2h": {"bytes_per_s": 10000000000, "latency_ns": 1000},
      "pageable": {"h2d_bytes_per_s": 5000000000, "d2h_bytes_per_s": 5000000000},
      "d2d": {"bytes_per_s": 500000000000, "latency_ns": 500},
      "peer": {"bytes_per_s": 100000000000, "latency_ns": 1500},
      "pinned_host_capacity_bytes": 8589934592,
      "overheads_ns": {"kernel": 3000, "copy": 5000, "event_record": 200, "stream_wait": 150,
                       "event_query": 100, "synchronize": 2000, "malloc": 1000, "free": 500,
                       "host_access": 100}
    })";

/// A program using every op kind, two devices (one bundled profile, one inline) and a link.
inline std::string valid_program() {
  return std::string(R"({
  "format": "ferry.program/1",
  "description": "every op kind once or more",
  "devices": [
    {"name": "gpu0", "profile": "h100-sxm-pcie5"},
    {"name": "gpu1", "profile": )") +
         std::string(kInlineProfile) + R"(}
  ],
  "links": [{"from": "gpu0", "to": "gpu1", "bytes_per_s": 300000000000, "latency_ns": 2500}],
  "streams": [
    {"name": "compute", "device": "gpu0"},
    {"name": "d2h", "device": "gpu0"},
    {"name": "other", "device": "gpu1"}
  ],
  "buffers": [
    {"name": "act0", "kind": "device", "device": "gpu0", "bytes": 1048576},
    {"name": "act1", "kind": "device", "device": "gpu1", "bytes": 16384},
    {"name": "host0", "kind": "pinned", "bytes": 1048576, "pool": "exact"},
    {"name": "host1", "kind": "pinned", "bytes": 4096},
    {"name": "page0", "kind": "pageable", "bytes": 4096}
  ],
  "events": ["e0", "e1"],
  "ops": [
    {"op": "alloc", "buffer": "act0", "stream": "compute"},
    {"op": "alloc", "buffer": "host0"},
    {"op": "kernel", "stream": "compute", "duration_ns": 1000, "writes": [{"buffer": "act0"}]},
    {"op": "record", "event": "e0", "stream": "compute"},
    {"op": "wait", "stream": "d2h", "event": "e0"},
    {"op": "copy", "label": "offload", "stream": "d2h",
     "src": {"buffer": "act0"}, "dst": {"buffer": "host0"}},
    {"op": "record_stream", "buffer": "act0", "stream": "d2h"},
    {"op": "record", "event": "e1", "stream": "d2h"},
    {"op": "query", "event": "e1"},
    {"op": "sync_event", "event": "e1"},
    {"op": "host_read", "reads": [{"buffer": "host0", "offset": 4096}]},
    {"op": "host_write", "writes": [{"buffer": "page0", "offset": 0, "bytes": 100}]},
    {"op": "copy", "stream": "compute",
     "src": {"buffer": "page0"}, "dst": {"buffer": "act0", "offset": 512, "bytes": 4096}},
    {"op": "sync_stream", "stream": "compute"},
    {"op": "alloc", "buffer": "act1", "stream": "other"},
    {"op": "copy", "stream": "other",
     "src": {"buffer": "act0", "bytes": 4096}, "dst": {"buffer": "act1", "offset": 8192,
     "bytes": 4096}},
    {"op": "kernel", "label": "consume", "stream": "other", "duration_ns": 0,
     "reads": [{"buffer": "act1"}, {"buffer": "act1", "offset": 16383}]},
    {"op": "free", "buffer": "act0"},
    {"op": "sync_device", "device": "gpu1"},
    {"op": "empty_cache", "device": "gpu0"},
    {"op": "free", "buffer": "host0"}
  ]
})";
}

/// `text` read as prog.json, its profiles from the bundled ones.
inline Result<Program> parse(std::string_view text) {
  return parse_program(text, "prog.json", kProfileDir);
}

}  // namespace ferry::sim::program_json_test
