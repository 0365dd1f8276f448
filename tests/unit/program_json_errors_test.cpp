// Bad programs refused with the path in the message, syntax errors placed by line and byte, and
// the JSON reader's checks that name what they accept.

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "program_json_test_support.hpp"

namespace ferry::sim {
namespace {

using program_json_test::kInlineProfile;
using program_json_test::parse;

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

}  // namespace
}  // namespace ferry::sim
