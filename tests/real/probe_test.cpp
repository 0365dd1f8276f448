// ferry probe: the statistics over repeats, the profile's figures from measurements and
// assumptions, the byte layout of the profile and the report, and a short run on the CPU
// loopback device.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "ferry/real/probe.hpp"

namespace {

using ferry::real::Assumption;
using ferry::real::Measurement;
using ferry::real::ProbeResult;
using ferry::real::ProfileFigure;
using ferry::real::spread_of;

// Every profile key measured as `value`, except those listed in `skip`.
std::vector<Measurement> every_key(std::int64_t value, const std::vector<std::string>& skip = {}) {
  std::vector<Measurement> out;
  for (const std::string_view key : ferry::real::profile_keys()) {
    if (std::find(skip.begin(), skip.end(), key) != skip.end()) continue;
    out.push_back({std::string(key), "x", "test", {value}});
  }
  return out;
}

const ProfileFigure& figure(const std::vector<ProfileFigure>& figures, std::string_view key) {
  const auto it = std::find_if(figures.begin(), figures.end(),
                               [&](const ProfileFigure& f) { return f.key == key; });
  EXPECT_NE(it, figures.end()) << key;
  return *it;
}

TEST(ProbeSpread, OddCountTakesTheMiddleSample) {
  const std::vector<std::int64_t> samples = {9, 1, 5, 7, 3};
  const auto s = spread_of(samples);
  EXPECT_EQ(s.min, 1);
  EXPECT_EQ(s.median, 5);
  EXPECT_EQ(s.max, 9);
}

TEST(ProbeSpread, EvenCountTakesTheMeanOfTheMiddleTwoRoundedDown) {
  const std::vector<std::int64_t> samples = {10, 1, 4, 7};
  const auto s = spread_of(samples);
  EXPECT_EQ(s.min, 1);
  EXPECT_EQ(s.median, 5);  // (4 + 7) / 2 = 5.5
  EXPECT_EQ(s.max, 10);
}

TEST(ProbeSpread, OneSampleIsItsOwnSpread) {
  const std::vector<std::int64_t> samples = {42};
  const auto s = spread_of(samples);
  EXPECT_EQ(s.min, 42);
  EXPECT_EQ(s.median, 42);
  EXPECT_EQ(s.max, 42);
}

TEST(ProbeSpread, LargeSamplesDoNotOverflow) {
  const std::int64_t big = INT64_MAX - 1;
  const std::vector<std::int64_t> samples = {big, INT64_MAX};
  EXPECT_EQ(spread_of(samples).median, big);
}

TEST(ProbeFigures, EveryKeyInTheFormatsOrderFromTheMedian) {
  auto measured = every_key(5'000'000);
  measured[0].samples = {3, 1, 2};  // memory_bytes
  const auto figures = ferry::real::profile_figures(measured, {});
  ASSERT_TRUE(figures.ok()) << figures.error().message;
  ASSERT_EQ(figures.value().size(), ferry::real::profile_keys().size());
  for (std::size_t i = 0; i < figures.value().size(); ++i) {
    EXPECT_EQ(figures.value()[i].key, ferry::real::profile_keys()[i]);
    EXPECT_TRUE(figures.value()[i].measured);
  }
  EXPECT_EQ(figure(figures.value(), "memory_bytes").value, 2);
}

TEST(ProbeFigures, FlopsAreTheBetter16BitMatmul) {
  auto measured = every_key(5'000'000, {"flops_per_s"});
  measured.push_back({"matmul.bf16.flops_per_s", "FLOP/s", "", {300'000'000}});
  measured.push_back({"matmul.fp16.flops_per_s", "FLOP/s", "", {400'000'000}});
  measured.push_back({"matmul.fp32.flops_per_s", "FLOP/s", "", {900'000'000}});
  const auto figures = ferry::real::profile_figures(measured, {});
  ASSERT_TRUE(figures.ok());
  const auto& flops = figure(figures.value(), "flops_per_s");
  EXPECT_EQ(flops.value, 400'000'000);
  EXPECT_TRUE(flops.measured);
  EXPECT_NE(flops.source.find("matmul.fp16.flops_per_s"), std::string::npos);
}

TEST(ProbeFigures, BidirectionalPermilleIsTheLoadedOverTheAloneRate) {
  auto measured =
      every_key(5'000'000, {"h2d.bidirectional_permille", "d2h.bidirectional_permille"});
  for (Measurement& m : measured) {
    if (m.key == "h2d.bytes_per_s" || m.key == "d2h.bytes_per_s") m.samples = {2'000'000'000};
  }
  measured.push_back({"h2d.bidirectional_bytes_per_s", "bytes/s", "", {1'500'000'000}});
  measured.push_back({"d2h.bidirectional_bytes_per_s", "bytes/s", "", {2'400'000'000}});
  const auto figures = ferry::real::profile_figures(measured, {});
  ASSERT_TRUE(figures.ok());
  EXPECT_EQ(figure(figures.value(), "h2d.bidirectional_permille").value, 750);
  // Faster under load than alone (noise) is no slowdown: clamped to 1000, and said so.
  const auto& d2h = figure(figures.value(), "d2h.bidirectional_permille");
  EXPECT_EQ(d2h.value, 1000);
  EXPECT_NE(d2h.source.find("clamped"), std::string::npos);
}

TEST(ProbeFigures, AnAssumptionFillsAKeyWithoutAMeasurement) {
  const auto measured = every_key(5'000'000, {"peer.bytes_per_s"});
  const std::vector<Assumption> assumed = {{"peer.bytes_per_s", 7'000'000, "one device"},
                                           {"d2d.bytes_per_s", 1, "never used"}};
  const auto figures = ferry::real::profile_figures(measured, assumed);
  ASSERT_TRUE(figures.ok());
  const auto& peer = figure(figures.value(), "peer.bytes_per_s");
  EXPECT_EQ(peer.value, 7'000'000);
  EXPECT_FALSE(peer.measured);
  EXPECT_EQ(peer.source, "one device");
  EXPECT_EQ(figure(figures.value(), "d2d.bytes_per_s").value, 5'000'000);  // measured wins
}

TEST(ProbeFigures, ARateBelowTheFormatsFloorIsClampedAndSaidSo) {
  auto measured = every_key(5'000'000);
  for (Measurement& m : measured) {
    if (m.key == "memory_bytes_per_s") m.samples = {10};
  }
  const auto figures = ferry::real::profile_figures(measured, {});
  ASSERT_TRUE(figures.ok());
  const auto& rate = figure(figures.value(), "memory_bytes_per_s");
  EXPECT_EQ(rate.value, 1'000'000);
  EXPECT_NE(rate.source.find("clamped to the format's bounds from 10"), std::string::npos);
}

TEST(ProbeFigures, AKeyWithNeitherMeasurementNorAssumptionIsAnError) {
  const auto figures =
      ferry::real::profile_figures(every_key(5'000'000, {"overheads_ns.free"}), {});
  ASSERT_FALSE(figures.ok());
  EXPECT_NE(figures.error().message.find("overheads_ns.free"), std::string::npos);
}

TEST(ProbeNames, FollowTheSimulatorsRule) {
  EXPECT_TRUE(ferry::real::is_profile_name("h100-probed_2026.01"));
  EXPECT_FALSE(ferry::real::is_profile_name(""));
  EXPECT_FALSE(ferry::real::is_profile_name(".hidden"));
  EXPECT_FALSE(ferry::real::is_profile_name("H100"));
  EXPECT_FALSE(ferry::real::is_profile_name("a/b"));
}

ProbeResult fixed_result() {
  ProbeResult r;
  r.device = "cpu";
  r.device_name = "CPU \"loopback\"";
  r.loopback = true;
  r.repeats = 2;
  r.copy_bytes = ferry::Bytes(4096);
  r.matmul = {8, 16, 32};
  r.measurements = every_key(2'000'000);
  r.measurements[0].samples = {3'000'000, 1'000'000};
  auto figures = ferry::real::profile_figures(r.measurements, {});
  r.figures = std::move(figures).value();
  r.notes = {"a note"};
  return r;
}

TEST(ProbeJson, ProfileHasTheBundledLayout) {
  const std::string expected = R"json({
  "name": "probed",
  "description": "measured by ferry probe on CPU \"loopback\" (cpu), median of 2 repeats; 0 of 27 keys assumed (see the probe report)",
  "memory_bytes": 2000000,
  "flops_per_s": 2000000,
  "memory_bytes_per_s": 2000000,
  "h2d": {"bytes_per_s": 2000000, "latency_ns": 2000000, "bidirectional_permille": 1000},
  "d2h": {"bytes_per_s": 2000000, "latency_ns": 2000000, "bidirectional_permille": 1000},
  "pageable": {"h2d_bytes_per_s": 2000000, "d2h_bytes_per_s": 2000000},
  "d2d": {"bytes_per_s": 2000000, "latency_ns": 2000000},
  "peer": {"bytes_per_s": 2000000, "latency_ns": 2000000},
  "pinned_host_capacity_bytes": 2000000,
  "blas_workspace_bytes": 2000000,
  "overheads_ns": {
    "kernel": 2000000,
    "copy": 2000000,
    "event_record": 2000000,
    "stream_wait": 2000000,
    "event_query": 2000000,
    "synchronize": 2000000,
    "malloc": 2000000,
    "free": 2000000,
    "host_access": 2000000,
    "host_alloc": 2000000
  }
}
)json";
  EXPECT_EQ(ferry::real::profile_json(fixed_result(), "probed"), expected);
}

TEST(ProbeJson, TheFloat32MatmulGivesTheProfilesFloat32Rate) {
  ProbeResult r = fixed_result();  // no float32 matmul ran: the key is left out (above)
  r.measurements.push_back(
      {"matmul.fp32.flops_per_s", "FLOP/s", "", {7'000'000, 5'000'000, 6'000'000}});
  const std::string json = ferry::real::profile_json(r, "probed");
  EXPECT_NE(json.find("  \"flops_per_s\": 2000000,\n  \"fp32_flops_per_s\": 6000000,\n"),
            std::string::npos)
      << json;
}

TEST(ProbeJson, ReportCarriesSamplesSpreadsSourcesAndTheProfile) {
  const ProbeResult r = fixed_result();
  const std::string text = ferry::real::report_json(r, "probed");
  const auto report = nlohmann::json::parse(text);
  EXPECT_EQ(report["format"], "ferry.probe/1");
  EXPECT_EQ(report["device_name"], "CPU \"loopback\"");
  EXPECT_EQ(report["matmul"]["k"], 16);
  const auto& first = report["measurements"][0];
  EXPECT_EQ(first["key"], "memory_bytes");
  EXPECT_EQ(first["samples"], nlohmann::json::array({3'000'000, 1'000'000}));
  EXPECT_EQ(first["min"], 1'000'000);
  EXPECT_EQ(first["median"], 2'000'000);
  EXPECT_EQ(first["max"], 3'000'000);
  EXPECT_EQ(report["profile_keys"].size(), ferry::real::profile_keys().size());
  EXPECT_EQ(report["profile_keys"][0]["measured"], true);
  EXPECT_EQ(report["notes"], nlohmann::json::array({"a note"}));
  EXPECT_EQ(report["profile"], nlohmann::json::parse(ferry::real::profile_json(r, "probed")));
  // Byte-stable: the same result prints the same bytes.
  EXPECT_EQ(text, ferry::real::report_json(r, "probed"));
}

TEST(ProbeRun, LoopbackMeasuresEveryFigureWithItsSpread) {
  ferry::real::ProbeOptions options;
  options.device = "cpu";
  options.repeats = 3;
  options.copy_bytes = ferry::Bytes(64 * 1024);
  options.matmul = {16, 32, 32};
  std::vector<std::string> progress;
  options.progress = [&](std::string_view line) { progress.emplace_back(line); };
  const auto result = ferry::real::run_probe(options);
  ASSERT_TRUE(result.ok()) << result.error().message;
  const ProbeResult& r = result.value();
  EXPECT_TRUE(r.loopback);
  EXPECT_EQ(r.device, "cpu");
  EXPECT_EQ(r.copy_bytes.count(), 64 * 1024);
  EXPECT_FALSE(progress.empty());
  for (const Measurement& m : r.measurements) {
    const bool once = m.key == "memory_bytes" || m.key == "pinned_host_capacity_bytes";
    EXPECT_EQ(m.samples.size(), once ? 1U : 3U) << m.key;
    const auto s = spread_of(m.samples);
    EXPECT_LE(s.min, s.median) << m.key;
    EXPECT_LE(s.median, s.max) << m.key;
    if (m.unit != "ns") {
      EXPECT_GT(s.min, 0) << m.key;  // a rate or a size; a call may take 0 ns
    }
  }
  ASSERT_EQ(r.figures.size(), ferry::real::profile_keys().size());
  const auto has = [&](std::string_view key) {
    return std::any_of(r.measurements.begin(), r.measurements.end(),
                       [&](const Measurement& m) { return m.key == key; });
  };
  for (const char* key :
       {"h2d.bytes_per_s", "d2h.bytes_per_s", "h2d.bidirectional_bytes_per_s",
        "pageable.h2d_bytes_per_s", "d2d.bytes_per_s", "memory_bytes_per_s",
        "matmul.fp32.flops_per_s", "overheads_ns.kernel", "overheads_ns.malloc"}) {
    EXPECT_TRUE(has(key)) << key;
  }
  for (const ProfileFigure& f : r.figures) {
    const bool loopback_assumption =
        f.key.starts_with("peer.") || f.key == "overheads_ns.event_query" ||
        f.key == "overheads_ns.host_access" || f.key == "overheads_ns.host_alloc" ||
        f.key == "blas_workspace_bytes";
    EXPECT_EQ(f.measured, !loopback_assumption) << f.key << ": " << f.source;
  }
}

TEST(ProbeRun, RefusesBadOptionsNamingThem) {
  const auto error_of = [](ferry::real::ProbeOptions o) {
    const auto r = ferry::real::run_probe(o);
    return r.ok() ? std::string("no error") : r.error().message;
  };
  ferry::real::ProbeOptions o;
  o.device = "cpu";
  o.repeats = 0;
  EXPECT_NE(error_of(o).find("--repeats"), std::string::npos);
  o.repeats = 1;
  o.copy_bytes = ferry::Bytes(12);
  EXPECT_NE(error_of(o).find("--bytes"), std::string::npos);
  o.copy_bytes = ferry::Bytes(0);
  o.matmul = {8, 0, 8};
  EXPECT_NE(error_of(o).find("--matmul"), std::string::npos);
  o.matmul = {};
  o.device = "tpu";
  EXPECT_NE(error_of(o).find("--device"), std::string::npos);
  o.device = "cuda:x";
  EXPECT_NE(error_of(o).find("--device"), std::string::npos);
}

TEST(ProbeMain, ABadOptionExitsWithTwo) {
  EXPECT_EQ(ferry::real::probe_main(std::vector<std::string>{"ferry-probe", "--bogus"}), 2);
  EXPECT_EQ(ferry::real::probe_main(std::vector<std::string>{"ferry-probe", "--name", "No"}), 2);
  EXPECT_EQ(ferry::real::probe_main(
                std::vector<std::string>{"ferry-probe", "--out", "/nonexistent/dir/p.json"}),
            2);
}

}  // namespace
