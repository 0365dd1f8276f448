// The program format (docs/program-format.md): every op kind read and its names resolved, recorded
// and written programs read back to the same bytes, the documented example, and mutated
// programs that never throw.

#include "ferry/sim/io/program_json.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/program/recorder.hpp"
#include "program_json_test_support.hpp"

namespace ferry::sim {
namespace {

using program_json_test::kProfileDir;
using program_json_test::parse;
using program_json_test::valid_program;

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
