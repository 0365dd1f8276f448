#include "ferry/sim/io/program_json.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/program/recorder.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim {
namespace {

const std::filesystem::path kProfileDir = FERRY_SCENARIOS_DIR "/devices";

// A small inline profile with round numbers, so that the program below depends on one bundled
// file only.
constexpr std::string_view kInlineProfile = R"({
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
std::string valid_program() {
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

Result<Program> parse(std::string_view text) {
  return parse_program(text, "prog.json", kProfileDir);
}

TEST(ProgramJson, ParsesEveryOpKindAndResolvesNamesInDeclarationOrder) {
  const auto result = parse(valid_program());
  ASSERT_TRUE(result.ok()) << result.error().message;
  const Program& program = result.value();

  ASSERT_EQ(program.devices.size(), 2U);
  EXPECT_EQ(program.devices[0].name, "gpu0");
  EXPECT_EQ(program.devices[0].profile.name, "h100-sxm-pcie5");
  EXPECT_EQ(program.devices[1].profile.name, "toy");
  EXPECT_EQ(program.devices[1].profile.h2d.bidirectional_permille, 500);
  EXPECT_EQ(program.devices[1].profile.d2h.bidirectional_permille, 1000);  // default
  EXPECT_EQ(program.devices[1].profile.d2d.bidirectional_permille, 1000);  // fixed
  EXPECT_EQ(program.devices[1].profile.peer.latency, SimTime(1500));

  ASSERT_EQ(program.links.size(), 1U);
  EXPECT_EQ(program.links[0].from, DeviceId(0));
  EXPECT_EQ(program.links[0].to, DeviceId(1));
  EXPECT_EQ(program.links[0].bandwidth, Bandwidth(300'000'000'000));
  EXPECT_EQ(program.links[0].latency, SimTime(2500));

  ASSERT_EQ(program.streams.size(), 3U);
  EXPECT_EQ(program.streams[2].device, DeviceId(1));

  ASSERT_EQ(program.buffers.size(), 5U);
  EXPECT_EQ(program.buffers[1].kind, MemoryKind::Device);
  EXPECT_EQ(program.buffers[1].device, DeviceId(1));
  EXPECT_EQ(program.buffers[2].kind, MemoryKind::Pinned);
  EXPECT_EQ(program.buffers[2].pool, PinnedPool::Exact);
  EXPECT_EQ(program.buffers[3].pool, PinnedPool::Caching);  // default
  EXPECT_FALSE(program.buffers[3].device.valid());
  EXPECT_EQ(program.buffers[4].kind, MemoryKind::Pageable);
  EXPECT_EQ(program.buffers[4].bytes, Bytes(4096));
  ASSERT_EQ(program.events.size(), 2U);
  EXPECT_EQ(program.events[1].name, "e1");

  const auto& ops = program.ops;
  ASSERT_EQ(ops.size(), 21U);
  const std::vector<OpKind> kinds = {OpKind::Alloc,        OpKind::Alloc,      OpKind::Kernel,
                                     OpKind::Record,       OpKind::Wait,       OpKind::Copy,
                                     OpKind::RecordStream, OpKind::Record,     OpKind::Query,
                                     OpKind::SyncEvent,    OpKind::HostRead,   OpKind::HostWrite,
                                     OpKind::Copy,         OpKind::SyncStream, OpKind::Alloc,
                                     OpKind::Copy,         OpKind::Kernel,     OpKind::Free,
                                     OpKind::SyncDevice,   OpKind::EmptyCache, OpKind::Free};
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    EXPECT_EQ(ops[i].kind, kinds[i]) << "ops[" << i << "]";
  }

  EXPECT_EQ(ops[0].slot, SlotId(0));
  EXPECT_EQ(ops[0].stream, StreamId(0));
  EXPECT_EQ(ops[1].slot, SlotId(2));
  EXPECT_FALSE(ops[1].stream.valid());  // host buffers are allocated by the host

  EXPECT_EQ(ops[2].duration, SimTime(1000));
  ASSERT_EQ(ops[2].writes.size(), 1U);
  EXPECT_EQ(ops[2].writes[0].slot, SlotId(0));
  EXPECT_EQ(ops[2].writes[0].offset, Bytes(0));
  EXPECT_EQ(ops[2].writes[0].bytes, Bytes(1048576));  // whole buffer by default
  EXPECT_TRUE(ops[2].reads.empty());

  EXPECT_EQ(ops[3].event, EventId(0));
  EXPECT_EQ(ops[3].stream, StreamId(0));
  EXPECT_EQ(ops[4].stream, StreamId(1));
  EXPECT_EQ(ops[4].event, EventId(0));

  EXPECT_EQ(ops[5].label, "offload");
  EXPECT_EQ(ops[5].stream, StreamId(1));
  EXPECT_EQ(ops[5].src.slot, SlotId(0));
  EXPECT_EQ(ops[5].dst.slot, SlotId(2));
  EXPECT_EQ(ops[5].dst.bytes, Bytes(1048576));

  EXPECT_EQ(ops[6].slot, SlotId(0));
  EXPECT_EQ(ops[6].stream, StreamId(1));
  EXPECT_EQ(ops[8].event, EventId(1));
  EXPECT_EQ(ops[9].event, EventId(1));

  ASSERT_EQ(ops[10].reads.size(), 1U);
  EXPECT_EQ(ops[10].reads[0].offset, Bytes(4096));
  EXPECT_EQ(ops[10].reads[0].bytes, Bytes(1048576 - 4096));  // rest of the buffer
  ASSERT_EQ(ops[11].writes.size(), 1U);
  EXPECT_EQ(ops[11].writes[0].slot, SlotId(4));
  EXPECT_EQ(ops[11].writes[0].bytes, Bytes(100));

  EXPECT_EQ(ops[12].src.slot, SlotId(4));
  EXPECT_EQ(ops[12].src.bytes, Bytes(4096));
  EXPECT_EQ(ops[12].dst.offset, Bytes(512));
  EXPECT_EQ(ops[13].stream, StreamId(0));

  EXPECT_EQ(ops[14].slot, SlotId(1));
  EXPECT_EQ(ops[14].stream, StreamId(2));
  EXPECT_EQ(ops[15].src.slot, SlotId(0));
  EXPECT_EQ(ops[15].src.bytes, Bytes(4096));
  EXPECT_EQ(ops[15].dst.slot, SlotId(1));
  EXPECT_EQ(ops[15].dst.offset, Bytes(8192));

  EXPECT_EQ(ops[16].label, "consume");
  EXPECT_EQ(ops[16].duration, SimTime(0));
  ASSERT_EQ(ops[16].reads.size(), 2U);
  EXPECT_EQ(ops[16].reads[1].offset, Bytes(16383));
  EXPECT_EQ(ops[16].reads[1].bytes, Bytes(1));

  EXPECT_EQ(ops[17].slot, SlotId(0));
  EXPECT_EQ(ops[18].device, DeviceId(1));
  EXPECT_EQ(ops[19].device, DeviceId(0));
  EXPECT_EQ(ops[20].slot, SlotId(2));
}

// What a real run records, the simulator's reader reads, and the core's writer writes back to
// the same bytes; the program it reads is the one the recorder built, and it runs.
TEST(ProgramJson, RecordedProgramsReadBackAndWriteBackToTheSameBytes) {
  Recorder recorder("h100-sxm-pcie5");
  const auto compute = recorder.add_stream("compute");
  const auto d2h = recorder.add_stream("d2h");
  const auto h2d = recorder.add_stream("h2d");
  const auto original = recorder.add_buffer(Place::Device, Bytes(4096));
  const auto host = recorder.add_buffer(Place::PinnedHost, Bytes(4096));
  const auto cached = recorder.add_buffer(Place::PinnedHostCaching, Bytes(0));
  const auto reload = recorder.add_buffer(Place::Device, Bytes(4096));
  recorder.alloc(original, compute);
  recorder.produce(compute, original, Bytes(0), Bytes(4096));
  recorder.alloc(host, -1);
  recorder.alloc(cached, -1);
  const auto written = recorder.add_event();
  recorder.record(written, compute);
  recorder.wait(d2h, written);
  recorder.copy(d2h, original, Bytes(1024), host, Bytes(0), Bytes(3072));
  const auto copied = recorder.add_event();
  recorder.record(copied, d2h);
  recorder.wait(compute, copied);
  recorder.free(original);
  recorder.alloc(reload, h2d);
  recorder.wait(h2d, copied);
  recorder.copy(h2d, host, Bytes(0), reload, Bytes(0), Bytes(3072));
  recorder.record_stream(reload, compute);
  recorder.consume(compute, reload, Bytes(16), Bytes(100));
  recorder.free(reload);
  recorder.free(host);
  recorder.free(cached);

  const std::string json = recorder.json();
  const auto read = parse_program(json, "recorded.json", kProfileDir);
  ASSERT_TRUE(read.ok()) << read.error().message << "\n" << json;
  EXPECT_EQ(program_to_json(read.value()), json);
  const Program& p = read.value();
  EXPECT_EQ(p.devices.at(0).profile.name, "h100-sxm-pcie5");
  EXPECT_GT(p.devices.at(0).profile.memory, Bytes(0));  // loaded from the bundled file
  ASSERT_EQ(p.ops.size(), recorder.program().ops.size());
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    EXPECT_EQ(p.ops[i].kind, recorder.program().ops[i].kind) << "ops[" << i << "]";
  }
  EXPECT_EQ(p.buffers.at(cached).bytes, Bytes(1));  // an empty buffer is recorded as one byte
  EXPECT_EQ(p.buffers.at(host).pool, PinnedPool::Exact);
}

TEST(ProgramJson, WritesProgramsThatReadBackToTheSameBytes) {
  const auto first = parse(valid_program());
  ASSERT_TRUE(first.ok()) << first.error().message;
  const std::string written = program_to_json(first.value());
  const auto second = parse_program(written, "written.json", kProfileDir);
  ASSERT_TRUE(second.ok()) << second.error().message;
  EXPECT_EQ(program_to_json(second.value()), written);

  const Program& a = first.value();
  const Program& b = second.value();
  ASSERT_EQ(a.ops.size(), b.ops.size());
  for (std::size_t i = 0; i < a.ops.size(); ++i) {
    EXPECT_EQ(a.ops[i].kind, b.ops[i].kind);
    EXPECT_EQ(a.ops[i].label, b.ops[i].label);
    EXPECT_EQ(a.ops[i].reads.size(), b.ops[i].reads.size());
    EXPECT_EQ(a.ops[i].src.offset, b.ops[i].src.offset);
    EXPECT_EQ(a.ops[i].dst.bytes, b.ops[i].dst.bytes);
  }
  EXPECT_EQ(b.devices[0].profile.h2d.bandwidth, a.devices[0].profile.h2d.bandwidth);
}

TEST(DeviceProfiles, EveryBundledProfileLoadsAndNamesItsFile) {
  const std::vector<std::string> expected = {
      "a100-pcie4",    "a100-sxm4-40gb", "b200", "gh200", "gh200-quad", "h100-pcie-80gb",
      "h100-sxm-96gb", "h100-sxm-pcie5", "h200", "l4",    "l40s",       "rtx-4090"};
  const auto names = list_device_profiles(kProfileDir);
  for (const auto& name : expected) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  for (const auto& name : names) {
    const auto profile = load_device_profile(kProfileDir, name);
    ASSERT_TRUE(profile.ok()) << profile.error().message;
    EXPECT_EQ(profile.value().name, name);
    EXPECT_FALSE(profile.value().description.empty()) << name;
    EXPECT_GT(profile.value().h2d.bandwidth.bytes_per_s(), 0);
    // Writing and reading back gives the same profile.
    const std::string written = device_profile_to_json(profile.value());
    const auto again = parse_device_profile(written, name);
    ASSERT_TRUE(again.ok()) << again.error().message;
    EXPECT_EQ(device_profile_to_json(again.value()), written);
  }
}

TEST(DeviceProfiles, BundledFiguresMatchTheDocumentedSources) {
  const auto h100 = load_device_profile(kProfileDir, "h100-sxm-pcie5");
  ASSERT_TRUE(h100.ok()) << h100.error().message;
  EXPECT_EQ(h100.value().h2d.bandwidth, Bandwidth(55'370'000'000));
  EXPECT_EQ(h100.value().d2h.bandwidth, Bandwidth(55'200'000'000));
  EXPECT_EQ(h100.value().flops_per_s, 989'000'000'000'000);
  // torch's cuBLAS workspace on compute capability 9.0 (:4096:8), and elsewhere (:4096:2:16:8).
  EXPECT_EQ(h100.value().blas_workspace, Bytes(32 * kMiB));

  const auto a100 = load_device_profile(kProfileDir, "a100-pcie4");
  ASSERT_TRUE(a100.ok()) << a100.error().message;
  // Gen4: H2D loses about half its rate under bidirectional load, D2H hardly any.
  EXPECT_LT(a100.value().h2d.bidirectional_permille, 500);
  EXPECT_GT(a100.value().d2h.bidirectional_permille, 900);
  EXPECT_EQ(a100.value().blas_workspace, 8 * kMiB + Bytes(128 * 1024));

  const auto gh200 = load_device_profile(kProfileDir, "gh200");
  ASSERT_TRUE(gh200.ok()) << gh200.error().message;
  EXPECT_GT(gh200.value().h2d.bandwidth, gh200.value().d2h.bandwidth);
  EXPECT_GT(gh200.value().pageable_h2d.bytes_per_s() * 10,
            gh200.value().h2d.bandwidth.bytes_per_s() * 9);
}

TEST(DeviceProfiles, TrainingGpuFiguresMatchTheDocumentedSources) {
  const auto figures = [](const char* name) {
    auto profile = load_device_profile(kProfileDir, name);
    EXPECT_TRUE(profile.ok()) << profile.error().message;
    return profile.value();
  };
  // Dense BF16 tensor peaks of the datasheets (half of the printed sparse figures).
  EXPECT_EQ(figures("h100-pcie-80gb").flops_per_s, 756'000'000'000'000);
  EXPECT_EQ(figures("h200").flops_per_s, 989'000'000'000'000);
  EXPECT_EQ(figures("b200").flops_per_s, 2'250'000'000'000'000);
  EXPECT_EQ(figures("l4").flops_per_s, 121'000'000'000'000);
  EXPECT_EQ(figures("l40s").flops_per_s, 362'050'000'000'000);
  EXPECT_EQ(figures("rtx-4090").flops_per_s, 165'200'000'000'000);
  EXPECT_EQ(figures("h200").memory_bandwidth, Bandwidth(4'800'000'000'000));
  EXPECT_EQ(figures("a100-sxm4-40gb").memory_bandwidth, Bandwidth(1'555'000'000'000));
  // torchtitan's hosts: 95.0396 GiB as torch reports it, HBM2e at 2.4 TB/s.
  EXPECT_EQ(figures("h100-sxm-96gb").memory, Bytes(102'047'993'456));
  EXPECT_EQ(figures("h100-sxm-96gb").memory_bandwidth, Bandwidth(2'400'000'000'000));
  // Megatron-LM #6491, four GH200s: CE CPU->GPU 411.57-421.14 GB/s, GPU->CPU 169.90-170.09 GB/s.
  EXPECT_EQ(figures("gh200-quad").h2d.bandwidth, Bandwidth(416'000'000'000));
  EXPECT_EQ(figures("gh200-quad").d2h.bandwidth, Bandwidth(170'000'000'000));
  // nvbandwidth #15, eight RTX 4090s: medians of the CE rates.
  EXPECT_EQ(figures("rtx-4090").h2d.bandwidth, Bandwidth(26'200'000'000));
  EXPECT_EQ(figures("rtx-4090").d2h.bandwidth, Bandwidth(26'800'000'000));
  // No NVLink on the Ada cards: no collectives, and FSDP over ranks is refused.
  EXPECT_FALSE(figures("l40s").collectives.intra_node.known());
  // torch's cuBLAS workspace: 32 MiB on Hopper and Blackwell, :4096:2:16:8 on Ampere and Ada.
  EXPECT_EQ(figures("b200").blas_workspace, Bytes(32 * kMiB));
  EXPECT_EQ(figures("l4").blas_workspace, 8 * kMiB + Bytes(128 * 1024));
}

TEST(DeviceProfiles, TheBlasWorkspaceIsOptionalAndBounded) {
  const auto h100 = load_device_profile(kProfileDir, "h100-sxm-pcie5");
  ASSERT_TRUE(h100.ok());
  DeviceProfile none = h100.value();
  none.blas_workspace = Bytes(0);
  const std::string written = device_profile_to_json(none);
  EXPECT_EQ(written.find("blas_workspace_bytes"), std::string::npos);  // left out when 0
  const auto again = parse_device_profile(written, "p.json");
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value().blas_workspace, Bytes(0));
  for (const std::string bad : {"-1", "1073741825", "\"32MiB\"", "1.5"}) {
    std::string text = device_profile_to_json(h100.value());
    const std::string key = "\"blas_workspace_bytes\": 33554432";
    ASSERT_NE(text.find(key), std::string::npos) << text;
    text.replace(text.find(key), key.size(), "\"blas_workspace_bytes\": " + bad);
    const auto refused = parse_device_profile(text, "p.json");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.error().message.find("blas_workspace_bytes"), std::string::npos)
        << refused.error().message;
  }
}

TEST(DeviceProfiles, UnknownNameListsTheBundledProfiles) {
  const auto profile = load_device_profile(kProfileDir, "h100");
  ASSERT_FALSE(profile.ok());
  EXPECT_NE(profile.error().message.find("unknown device profile \"h100\""), std::string::npos)
      << profile.error().message;
  EXPECT_NE(
      profile.error().message.find(
          "a100-pcie4, a100-sxm4-40gb, b200, gh200, gh200-quad, h100-pcie-80gb, h100-sxm-96gb, "
          "h100-sxm-pcie5, h200, l4, l40s, rtx-4090"),
      std::string::npos)
      << profile.error().message;
}

TEST(DeviceProfiles, NamesThatCouldEscapeTheDirectoryAreRefused) {
  for (const char* name : {"../devices/gh200", "/etc/passwd", ".hidden", "GH200", ""}) {
    const auto profile = load_device_profile(kProfileDir, name);
    ASSERT_FALSE(profile.ok()) << name;
    EXPECT_NE(profile.error().message.find("invalid device profile name"), std::string::npos)
        << profile.error().message;
  }
}

// ---------------------------------------------------------------------------------------------
// Bad inputs

/// A small valid program whose parts a test case replaces.
struct ProgramText {
  std::string format = R"("ferry.program/1")";
  std::string devices = R"([{"name": "gpu0", "profile": "h100-sxm-pcie5"},
              {"name": "gpu1", "profile": "h100-sxm-pcie5"}])";
  std::string streams = R"([{"name": "compute", "device": "gpu0"},
              {"name": "copy", "device": "gpu0"},
              {"name": "other", "device": "gpu1"}])";
  std::string buffers = R"([{"name": "act0", "kind": "device", "device": "gpu0", "bytes": 4096},
              {"name": "host0", "kind": "pinned", "bytes": 4096},
              {"name": "page0", "kind": "pageable", "bytes": 2048},
              {"name": "act1", "kind": "device", "device": "gpu1", "bytes": 4096}])";
  std::string events = R"(["e0", "e1"])";
  std::string ops = "[]";
  std::string extra;

  [[nodiscard]] std::string str() const {
    return "{\n  \"format\": " + format + ",\n  \"devices\": " + devices +
           ",\n  \"streams\": " + streams + ",\n  \"buffers\": " + buffers +
           ",\n  \"events\": " + events + ",\n  \"ops\": " + ops + extra + "\n}\n";
  }
};

std::string with_ops(std::string ops) {
  ProgramText text;
  text.ops = "[" + std::move(ops) + "]";
  return text.str();
}

std::string with_buffers(std::string buffers) {
  ProgramText text;
  text.buffers = "[" + std::move(buffers) + "]";
  return text.str();
}

std::string with_devices(std::string devices) {
  ProgramText text;
  text.devices = "[" + std::move(devices) + "]";
  text.streams = "[]";
  text.buffers = "[]";
  return text.str();
}

std::string inline_profile_with(std::string_view from, std::string_view to) {
  std::string profile(kInlineProfile);
  const auto at = profile.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) profile.replace(at, from.size(), to);
  return with_devices(R"({"name": "gpu0", "profile": )" + profile + "}");
}

struct BadCase {
  std::string name;
  std::string text;
  std::vector<std::string> expected;  // each must appear in the message
};

std::vector<BadCase> bad_cases() {
  ProgramText unknown_top_key;
  unknown_top_key.extra = R"(, "opz": [])";
  ProgramText wrong_format;
  wrong_format.format = R"("ferry.program/2")";
  ProgramText dup_events;
  dup_events.events = R"(["e0", "e1", "e0"])";
  ProgramText dangling_stream_device;
  dangling_stream_device.streams = R"([{"name": "s", "device": "gpu7"}])";
  ProgramText empty_stream_name;
  empty_stream_name.streams = R"([{"name": "", "device": "gpu0"}])";
  ProgramText dup_streams;
  dup_streams.streams = R"([{"name": "s", "device": "gpu0"}, {"name": "s", "device": "gpu1"}])";
  ProgramText self_link;
  self_link.extra = R"(, "links": [{"from": "gpu0", "to": "gpu0", "bytes_per_s": 1000000000,
                                     "latency_ns": 0}])";
  ProgramText ops_object;
  ops_object.ops = "{}";
  ProgramText events_not_strings;
  events_not_strings.events = R"(["e0", 7])";
  const std::string deep = R"({"format": "ferry.program/1", "ops": )" + std::string(100000, '[');

  return {
      {"syntax error",
       "{\"format\": \"ferry.program/1\",\n  \"devices\": [}\n",
       {"prog.json:2:15: syntax error"}},
      {"trailing garbage", with_ops("") + "x", {"prog.json:", ": syntax error"}},
      {"invalid utf-8",
       with_ops(R"({"op": "sync_stream", "label": "a)" + std::string("\xff") +
                R"(", "stream": "compute"})"),
       {"prog.json:13:44: syntax error", "ill-formed UTF-8 byte", "\\xff"}},
      {"empty file", "  \n", {"prog.json: empty document"}},
      {"top-level array", "[1, 2]", {"prog.json: expected an object, got an array"}},
      {"deeply nested arrays", deep, {"prog.json: nesting deeper than 128 levels"}},
      {"duplicate json key",
       with_ops(R"({"op": "sync_stream", "stream": "a", "stream": "b"})"),
       {"prog.json: ops[0]: duplicate key \"stream\""}},
      {"wrong format string",
       wrong_format.str(),
       {"prog.json: format: expected \"ferry.program/1\", got \"ferry.program/2\""}},
      {"no devices",
       R"({"format": "ferry.program/1", "devices": [], "streams": [], "ops": []})",
       {"prog.json: devices: a program needs at least one device"}},
      {"missing ops",
       R"({"format": "ferry.program/1", "devices": [{"name": "g", "profile": "gh200"}],
           "streams": []})",
       {"prog.json: missing required key \"ops\""}},
      {"unknown top-level key",
       unknown_top_key.str(),
       {"prog.json: unknown key \"opz\" (allowed: format, description, devices"}},
      {"unknown key in op",
       with_ops(R"({"op": "sync_stream", "strem": "compute"})"),
       {"prog.json: ops[0]: unknown key \"strem\" (allowed: op, label, stream)"}},
      {"unknown op",
       with_ops(R"({"op": "launch"})"),
       {"prog.json: ops[0].op: unknown op \"launch\" (known: alloc, free"}},
      {"op without kind",
       with_ops(R"({"stream": "compute"})"),
       {"prog.json: ops[0]: missing required key \"op\""}},
      {"op not an object", with_ops("5"), {"prog.json: ops[0]: expected an object, got 5"}},
      {"ops not an array", ops_object.str(), {"prog.json: ops: expected an array, got an object"}},
      {"wrong type",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": "5"})"),
       {"prog.json: ops[0].duration_ns: expected a non-negative integer, got a string \"5\""}},
      {"negative duration",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": -5})"),
       {"prog.json: ops[0].duration_ns: expected a non-negative integer, got -5"}},
      {"huge duration",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": 1000000000000001})"),
       {"prog.json: ops[0].duration_ns: 1000000000000001 is above the limit of 1000000000000000"}},
      {"integer beyond 64 bits",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": 99999999999999999999})"),
       {"prog.json: ops[0].duration_ns: 1e+20 is above the limit of 1000000000000000"}},
      {"negative size",
       with_buffers(R"({"name": "b", "kind": "pageable", "bytes": -1})"),
       {"prog.json: buffers[0].bytes: expected a positive integer, got -1"}},
      {"zero size",
       with_buffers(R"({"name": "b", "kind": "pageable", "bytes": 0})"),
       {"prog.json: buffers[0].bytes: expected a positive integer, got 0"}},
      {"float size",
       with_buffers(R"({"name": "b", "kind": "pageable", "bytes": 4096.0})"),
       {"prog.json: buffers[0].bytes: expected a positive integer, got 4096.0"}},
      {"exponent size",
       with_buffers(R"({"name": "b", "kind": "pageable", "bytes": 1e3})"),
       {"prog.json: buffers[0].bytes: expected a positive integer, got 1000.0"}},
      {"huge size",
       with_buffers(R"({"name": "b", "kind": "pageable", "bytes": 1125899906842625})"),
       {"prog.json: buffers[0].bytes: 1125899906842625 is above the limit of 1125899906842624"}},
      {"unknown memory kind",
       with_buffers(R"({"name": "b", "kind": "managed", "bytes": 1})"),
       {"prog.json: buffers[0].kind: unknown memory kind \"managed\""}},
      {"device buffer without device",
       with_buffers(R"({"name": "b", "kind": "device", "bytes": 1})"),
       {"prog.json: buffers[0]: missing required key \"device\""}},
      {"host buffer with device",
       with_buffers(R"({"name": "b", "kind": "pinned", "device": "gpu0", "bytes": 1})"),
       {"prog.json: buffers[0].device: a pinned buffer lives in host memory"}},
      {"pool on a device buffer",
       with_buffers(R"({"name": "b", "kind": "device", "device": "gpu0", "bytes": 1,
                        "pool": "exact"})"),
       {"prog.json: buffers[0].pool: \"pool\" applies to pinned buffers only"}},
      {"unknown pool",
       with_buffers(R"({"name": "b", "kind": "pinned", "bytes": 1, "pool": "x"})"),
       {"prog.json: buffers[0].pool: unknown pinned pool \"x\""}},
      {"duplicate buffer names",
       with_buffers(R"({"name": "b", "kind": "pinned", "bytes": 1},
                       {"name": "b", "kind": "pageable", "bytes": 1})"),
       {"prog.json: buffers[1].name: duplicate buffer name \"b\" (first declared at "
        "buffers[0].name)"}},
      {"duplicate event names",
       dup_events.str(),
       {"prog.json: events[2]: duplicate event name \"e0\" (first declared at events[0])"}},
      {"duplicate stream names",
       dup_streams.str(),
       {"prog.json: streams[1].name: duplicate stream name \"s\""}},
      {"empty name",
       empty_stream_name.str(),
       {"prog.json: streams[0].name: expected a non-empty name"}},
      {"event that is not a string",
       events_not_strings.str(),
       {"prog.json: events[1]: expected a name (a string), got 7"}},
      {"dangling stream",
       with_ops(R"({"op": "sync_stream", "stream": "nope"})"),
       {"prog.json: ops[0].stream: unknown stream \"nope\" (declared: \"compute\", \"copy\", "
        "\"other\")"}},
      {"dangling event",
       with_ops(R"({"op": "wait", "stream": "copy", "event": "e9"})"),
       {"prog.json: ops[0].event: unknown event \"e9\""}},
      {"dangling buffer",
       with_ops(R"({"op": "free", "buffer": "ghost"})"),
       {"prog.json: ops[0].buffer: unknown buffer \"ghost\""}},
      {"dangling device in op",
       with_ops(R"({"op": "sync_device", "device": "gpu7"})"),
       {"prog.json: ops[0].device: unknown device \"gpu7\""}},
      {"dangling device in stream",
       dangling_stream_device.str(),
       {"prog.json: streams[0].device: unknown device \"gpu7\""}},
      {"dangling buffer in a range",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": 1,
                    "writes": [{"buffer": "act0"}, {"buffer": "act9"}]})"),
       {"prog.json: ops[0].writes[1].buffer: unknown buffer \"act9\""}},
      {"unequal copy sizes",
       with_ops(R"({"op": "copy", "stream": "copy", "src": {"buffer": "act0"},
                    "dst": {"buffer": "page0"}})"),
       {"prog.json: ops[0]: copy sizes differ: src has 4096 bytes, dst has 2048 bytes"}},
      {"range past the end",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": 1,
                    "reads": [{"buffer": "act0", "offset": 4000, "bytes": 200}]})"),
       {"prog.json: ops[0].reads[0].bytes: range [4000, 4200) ends past the end of buffer "
        "\"act0\" (4096 bytes)"}},
      {"offset past the end",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": 1,
                    "reads": [{"buffer": "act0", "offset": 4096}]})"),
       {"prog.json: ops[0].reads[0].offset: offset 4096 is at or past the end of buffer"}},
      {"empty range",
       with_ops(R"({"op": "kernel", "stream": "compute", "duration_ns": 1,
                    "reads": [{"buffer": "act0", "bytes": 0}]})"),
       {"prog.json: ops[0].reads[0].bytes: expected a positive integer, got 0"}},
      {"unknown key in a range",
       with_ops(R"({"op": "host_read", "reads": [{"buffer": "host0", "size": 4}]})"),
       {"prog.json: ops[0].reads[0]: unknown key \"size\" (allowed: buffer, offset, bytes)"}},
      {"host to host copy",
       with_ops(R"({"op": "copy", "stream": "copy", "src": {"buffer": "host0", "bytes": 2048},
                    "dst": {"buffer": "page0"}})"),
       {"prog.json: ops[0]: a copy needs at least one device buffer"}},
      {"overlapping copy",
       with_ops(R"({"op": "copy", "stream": "copy", "src": {"buffer": "act0", "bytes": 100},
                    "dst": {"buffer": "act0", "offset": 50, "bytes": 100}})"),
       {"prog.json: ops[0]: src and dst overlap in buffer \"act0\""}},
      {"device buffer in host_read",
       with_ops(R"({"op": "host_read", "reads": [{"buffer": "host0"}, {"buffer": "act0"}]})"),
       {"prog.json: ops[0].reads[1].buffer: the host can only access host buffers"}},
      {"host_read without ranges",
       with_ops(R"({"op": "host_read", "reads": []})"),
       {"prog.json: ops[0].reads: expected at least one range"}},
      {"alloc without stream for a device buffer",
       with_ops(R"({"op": "alloc", "buffer": "act0"})"),
       {"prog.json: ops[0]: missing required key \"stream\""}},
      {"alloc with stream for a host buffer",
       with_ops(R"({"op": "alloc", "buffer": "host0", "stream": "compute"})"),
       {"prog.json: ops[0].stream: buffer \"host0\" is pinned host memory"}},
      {"alloc on another device's stream",
       with_ops(R"({"op": "alloc", "buffer": "act1", "stream": "compute"})"),
       {"prog.json: ops[0].stream: stream \"compute\" is on device \"gpu0\" but buffer \"act1\" "
        "lives on device \"gpu1\""}},
      {"record_stream on pageable memory",
       with_ops(R"({"op": "record_stream", "buffer": "page0", "stream": "copy"})"),
       {"prog.json: ops[0].buffer: record_stream needs a device or pinned buffer"}},
      {"label not a string",
       with_ops(R"({"op": "sync_stream", "stream": "copy", "label": 3})"),
       {"prog.json: ops[0].label: expected a string, got 3"}},
      {"link to itself",
       self_link.str(),
       {"prog.json: links[0].to: a link joins two different devices"}},
      {"unknown profile name",
       with_devices(R"({"name": "gpu0", "profile": "h100"})"),
       {"prog.json: devices[0].profile: unknown device profile \"h100\" (bundled: a100-pcie4, "
        "a100-sxm4-40gb, b200, gh200, gh200-quad, h100-pcie-80gb, h100-sxm-96gb, h100-sxm-pcie5, "
        "h200, l4, "
        "l40s, rtx-4090)"}},
      {"profile neither name nor object",
       with_devices(R"({"name": "gpu0", "profile": 1})"),
       {"prog.json: devices[0].profile: expected a bundled profile name or a profile object"}},
      {"inline profile with zero bandwidth",
       inline_profile_with(R"("bytes_per_s": 500000000000)", R"("bytes_per_s": 0)"),
       {"prog.json: devices[0].profile.d2d.bytes_per_s: expected an integer in [1000000, "}},
      {"inline profile with permille 0",
       inline_profile_with(R"("bidirectional_permille": 500)", R"("bidirectional_permille": 0)"),
       {"prog.json: devices[0].profile.h2d.bidirectional_permille: expected an integer in "
        "[1, 1000], got 0"}},
      {"inline profile with permille on d2d",
       inline_profile_with(R"("latency_ns": 500)",
                           R"("latency_ns": 500, "bidirectional_permille": 900)"),
       {"prog.json: devices[0].profile.d2d: unknown key \"bidirectional_permille\" (allowed: "
        "bytes_per_s, latency_ns)"}},
      {"inline profile missing an overhead",
       inline_profile_with(R"("host_access": 100)", R"("host_acess": 100)"),
       {"prog.json: devices[0].profile.overheads_ns: unknown key \"host_acess\""}},
      {"inline profile with a bad name",
       inline_profile_with(R"("toy")", R"("My GPU")"),
       {"prog.json: devices[0].profile.name: profile names use lower-case letters"}},
  };
}

TEST(ProgramJson, RejectsBadInputsWithThePathInTheMessage) {
  const auto cases = bad_cases();
  EXPECT_GE(cases.size(), 25U);
  for (const BadCase& bad : cases) {
    SCOPED_TRACE(bad.name);
    Result<Program> result = Error{"not run"};
    ASSERT_NO_THROW(result = parse(bad.text));
    ASSERT_FALSE(result.ok());
    const std::string& message = result.error().message;
    for (const std::string& expected : bad.expected) {
      EXPECT_NE(message.find(expected), std::string::npos)
          << "expected: " << expected << "\n     got: " << message;
    }
  }
}

TEST(ProgramJson, SyntaxErrorPositionsCountLinesAndBytes) {
  const auto missing_value = parse_json_text("{\n  \"a\": 1,\n  \"b\": }", "x.json");
  ASSERT_FALSE(missing_value.ok());
  EXPECT_EQ(missing_value.error().message.rfind("x.json:3:8: syntax error", 0), 0U)
      << missing_value.error().message;

  const auto unterminated = parse_json_text("[1, 2", "x.json");
  ASSERT_FALSE(unterminated.ok());
  EXPECT_EQ(unterminated.error().message.rfind("x.json:1:", 0), 0U) << unterminated.error().message;
}

TEST(ProgramJson, TheDocumentedExampleParses) {
  const std::filesystem::path doc = FERRY_TESTS_DIR "/../docs/program-format.md";
  std::ifstream in(doc);
  ASSERT_TRUE(in) << doc;
  std::stringstream contents;
  contents << in.rdbuf();
  const std::string text = contents.str();
  const std::string fence = "```json\n";
  const auto begin = text.find(fence);
  ASSERT_NE(begin, std::string::npos);
  const auto end = text.find("```", begin + fence.size());
  ASSERT_NE(end, std::string::npos);
  const auto example = text.substr(begin + fence.size(), end - begin - fence.size());
  const auto program = parse_program(example, "program-format.md", kProfileDir);
  ASSERT_TRUE(program.ok()) << program.error().message;
  EXPECT_EQ(program.value().streams.size(), 3U);
  EXPECT_EQ(program.value().ops.size(), 24U);
}

TEST(ProgramJson, LoadProgramNamesAMissingFile) {
  const auto result = load_program(kProfileDir / "no-such-program.json", kProfileDir);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error().message.find("no-such-program.json: cannot read"), std::string::npos)
      << result.error().message;
}

TEST(JsonReader, IntegersAreCheckedAgainstBothBounds) {
  const nlohmann::json document = nlohmann::json::parse(R"({"a": 5, "b": -3, "c": 2.5,
                                                           "d": true, "e": "x"})");
  const JsonValue root(document, "doc");
  const auto object = root.object({"a", "b", "c", "d", "e"});
  ASSERT_TRUE(object.ok());
  EXPECT_EQ(object.value().required_integer("a", 0, 10).value(), 5);
  EXPECT_EQ(object.value().required_integer("b", -5, 10).value(), -3);
  EXPECT_EQ(object.value().required_integer("a", 0, 4).error().message,
            "doc: a: 5 is above the limit of 4");
  EXPECT_EQ(object.value().required_integer("b", 0, 4).error().message,
            "doc: b: expected an integer in [0, 4], got -3");
  EXPECT_EQ(object.value().required_integer("b", 0, kMaxJsonBytes).error().message,
            "doc: b: expected a non-negative integer, got -3");
  EXPECT_EQ(object.value().required_integer("c", 0, kMaxJsonBytes).error().message,
            "doc: c: expected a non-negative integer, got 2.5 (write integers without a "
            "fraction or exponent)");
  EXPECT_EQ(object.value().required_integer("c", 0, 2).error().message,
            "doc: c: 2.5 is above the limit of 2");
  EXPECT_EQ(object.value().required_integer("d", 1, kMaxJsonBytes).error().message,
            "doc: d: expected a positive integer, got true");
  EXPECT_EQ(object.value().optional_integer("z", 7, 0, 10).value(), 7);
  EXPECT_TRUE(object.value().optional_boolean("d", false).value());
  EXPECT_EQ(object.value().required("z").error().message, "doc: missing required key \"z\"");
}

TEST(JsonReader, UnknownKeysAreListedWithTheAllowedOnes) {
  const nlohmann::json document = nlohmann::json::parse(R"({"outer": [{"good": 1, "bad": 2}]})");
  const JsonValue root(document, "doc");
  const auto outer = root.object({"outer"});
  ASSERT_TRUE(outer.ok());
  const auto elements = outer.value().required_array("outer");
  ASSERT_TRUE(elements.ok());
  ASSERT_EQ(elements.value().size(), 1U);
  EXPECT_EQ(elements.value()[0].path(), "outer[0]");
  const auto inner = elements.value()[0].object({"good", "fine"});
  ASSERT_FALSE(inner.ok());
  EXPECT_EQ(inner.error().message, "doc: outer[0]: unknown key \"bad\" (allowed: good, fine)");
}

TEST(JsonReader, PathsQuoteKeysThatAreNotIdentifiers) {
  EXPECT_EQ(json_member_path("", "ops"), "ops");
  EXPECT_EQ(json_member_path("ops[3]", "reads"), "ops[3].reads");
  EXPECT_EQ(json_member_path("a", "two words"), "a[\"two words\"]");
  EXPECT_EQ(json_element_path("ops", 3), "ops[3]");
}

TEST(JsonReader, DescriptionsOfLongStringsAreCut) {
  const std::string text = describe_json(nlohmann::json(std::string(1000, 'x')));
  EXPECT_LT(text.size(), 60U);
  EXPECT_EQ(text.substr(text.size() - 3), "...");
  EXPECT_EQ(describe_json(nlohmann::json::array()), "an array");
  EXPECT_EQ(describe_json(nlohmann::json(nullptr)), "null");
}

// ---------------------------------------------------------------------------------------------
// Mutated input never crashes

TEST(ProgramJson, MutatedProgramsNeverThrowAndAlwaysExplainFailures) {
  constexpr std::uint32_t kSeed = 20240611;
  constexpr int kIterations = 5000;
  std::cout << "[ seed     ] " << kSeed << "\n";
  SCOPED_TRACE(testing::Message() << "seed " << kSeed);
  std::mt19937 random(kSeed);
  const std::string base = valid_program();
  constexpr std::string_view kAlphabet = "{}[],:\"\\ 0123456789-+.eEabcnrtul\n\xff";
  int accepted = 0;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    std::string text = base;
    const int mutations = 1 + static_cast<int>(random() % 4);
    for (int m = 0; m < mutations && !text.empty(); ++m) {
      const std::size_t at = random() % text.size();
      const char replacement = kAlphabet[random() % kAlphabet.size()];
      switch (random() % 4) {
        case 0:
          text.erase(at, 1);
          break;
        case 1:
          text[at] = replacement;
          break;
        case 2:
          text.insert(at, 1, replacement);
          break;
        default:
          text.erase(at, std::min<std::size_t>(text.size() - at, 1 + random() % 40));
          break;
      }
    }
    Result<Program> result = Error{"not run"};
    ASSERT_NO_THROW(result = parse_program(text, "fuzz.json", kProfileDir))
        << "iteration " << iteration << ":\n"
        << text;
    if (result.ok()) {
      ++accepted;
    } else {
      const std::string& message = result.error().message;
      ASSERT_GT(message.size(), std::string("fuzz.json: ").size()) << message;
      ASSERT_EQ(message.rfind("fuzz.json", 0), 0U) << message;
    }
  }
  std::cout << "[ accepted ] " << accepted << " of " << kIterations << " mutated programs\n";
}

}  // namespace
}  // namespace ferry::sim
