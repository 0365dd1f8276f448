// Golden tests: every bundled example program -> summary text, summary JSON and trace bytes,
// compared with tests/golden/expected/. Racy examples must report exactly their planted hazard.
// To accept new output after an intended change: scripts/update-golden.sh (it sets
// FERRY_UPDATE_GOLDEN=1 for this test, which then rewrites the expected files).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#include "ferry/sim/export/trace.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/report/check_report.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/runs/run_program.hpp"

namespace ferry::sim {
namespace {

namespace fs = std::filesystem;

const fs::path kScenarios = FERRY_SCENARIOS_DIR;
const fs::path kExpected = fs::path(FERRY_TESTS_DIR) / "golden" / "expected";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

bool updating() {
  const char* v = std::getenv("FERRY_UPDATE_GOLDEN");
  return v != nullptr && std::string(v) == "1";
}

void expect_golden(const fs::path& file, const std::string& actual) {
  if (updating()) {
    std::ofstream(file, std::ios::binary) << actual;
    return;
  }
  ASSERT_TRUE(fs::exists(file)) << file << " is missing; run scripts/update-golden.sh";
  const std::string expected = read_file(file);
  if (expected != actual) {
    const fs::path got = fs::path(file.string() + ".actual");
    std::ofstream(got, std::ios::binary) << actual;
    FAIL() << file << " differs from the output, written to " << got
           << " (diff them; if the change is intended, run scripts/update-golden.sh)";
  }
}

struct Expected {
  const char* program;
  std::vector<std::tuple<HazardKind, Conflict, std::uint32_t, std::uint32_t>> hazards;
};

// The hazard each racy example plants (kind, conflict, earlier op, later op); safe ones none.
const std::vector<Expected>& expectations() {
  static const std::vector<Expected> all = {
      {"offload_step", {}},
      {"free_with_record_stream", {}},
      {"pageable_copy", {}},
      {"two_gpu_pipeline", {}},
      {"bidirectional_copies", {}},
      {"reload_without_wait", {{HazardKind::Race, Conflict::ReadAfterWrite, 4, 6}}},
      // Reported at the free (op 6); the simulated reuse by op 8 is the report's reused_by.
      {"free_during_offload", {{HazardKind::LatentReuse, Conflict::WriteAfterRead, 5, 6}}},
      // The two scenarios of Note [Latent reuse]: whatever the durations, no reuse needed.
      {"free_while_side_stream_reads", {{HazardKind::LatentReuse, Conflict::WriteAfterRead, 4, 5}}},
      {"record_stream_on_one_of_two_readers",
       {{HazardKind::LatentReuse, Conflict::WriteAfterRead, 9, 11}}},
      {"host_reads_pinned_early", {{HazardKind::HostBeforeCopy, Conflict::ReadAfterWrite, 5, 7}}},
      {"wait_before_record", {{HazardKind::Race, Conflict::ReadAfterWrite, 2, 4}}},
      {"use_after_free",
       {{HazardKind::UseAfterFree, Conflict::None, 3, 4},
        {HazardKind::DoubleFree, Conflict::None, 3, 5}}},
  };
  return all;
}

class Golden : public ::testing::TestWithParam<Expected> {};

TEST_P(Golden, ProgramMatchesExpectedHazardsSummaryAndTrace) {
  const Expected& e = GetParam();
  const std::string name = e.program;
  const fs::path rel = fs::path("scenarios") / "programs" / (name + ".json");
  auto program = load_program(kScenarios / "programs" / (name + ".json"), kScenarios / "devices");
  ASSERT_TRUE(program.ok()) << program.error().message;
  ChromeTrace trace;
  auto run = run_program(program.value(), {}, {}, &trace);
  ASSERT_TRUE(run.ok()) << run.error().message;
  const auto& hazards = run.value().sim.hazards();
  ASSERT_EQ(hazards.size(), e.hazards.size()) << summary_text(run.value(), rel.string());
  for (std::size_t i = 0; i < hazards.size(); ++i) {
    const auto& [kind, conflict, first, second] = e.hazards[i];
    EXPECT_EQ(hazards[i].kind, kind) << i;
    EXPECT_EQ(hazards[i].conflict, conflict) << i;
    EXPECT_EQ(hazards[i].first.value(), first) << i;
    EXPECT_EQ(hazards[i].second.value(), second) << i;
  }
  expect_golden(kExpected / (name + ".txt"), summary_text(run.value(), rel.string()));
  expect_golden(kExpected / (name + ".json"), summary_json(run.value(), rel.string()));
  // The trace an observer writes during the run, and the one replayed from the finished run.
  expect_golden(kExpected / (name + ".trace.json"), trace.json(run.value().sim));
  EXPECT_EQ(trace.json(run.value().sim), chrome_trace(run.value().sim));
}

INSTANTIATE_TEST_SUITE_P(Examples, Golden, ::testing::ValuesIn(expectations()),
                         [](const auto& test) { return std::string(test.param.program); });

TEST(Golden, EveryBundledProgramHasAnExpectation) {
  for (const auto& entry : fs::directory_iterator(kScenarios / "programs")) {
    // Subfolders (field/: pairs from upstream bugs) are checked by the CLI tests instead.
    if (!entry.is_regular_file()) continue;
    const std::string stem = entry.path().stem().string();
    bool found = false;
    for (const Expected& e : expectations()) found = found || stem == e.program;
    EXPECT_TRUE(found) << stem << " has no entry in expectations()";
  }
}

// `ferry compare` on two presets: the whole table, as text and JSON, is pinned.
class GoldenCompare : public ::testing::TestWithParam<const char*> {};

TEST_P(GoldenCompare, TableMatchesExpectedBytes) {
  const std::string preset = GetParam();
  auto model = model_preset(preset);
  auto device = load_device_profile(kScenarios / "devices", "h100-sxm-pcie5");
  ASSERT_TRUE(model.ok() && device.ok());
  assign_roofline_durations(model.value(), device.value());
  TrainingOptions base;
  base.steps = 2;
  // As `ferry compare` runs them: gradients freed between steps, as torch's zero_grad() does.
  base.grads_set_to_none = true;
  std::vector<RowResult> rows;
  for (const PolicyRow& row : default_rows(base, model.value(), device.value())) {
    rows.push_back(run_row(model.value(), device.value(), row));
    EXPECT_EQ(rows.back().hazards, 0U) << row.name;
    EXPECT_FALSE(rows.back().failure) << row.name << ": " << rows.back().failure->message;
  }
  expect_golden(kExpected / ("compare_" + preset + ".txt"),
                compare_text(rows, model.value(), device.value()));
  expect_golden(kExpected / ("compare_" + preset + ".json"),
                document_text(compare_json(rows, model.value(), device.value())));
}

INSTANTIATE_TEST_SUITE_P(Presets, GoldenCompare, ::testing::Values("tiny-gpt", "gpt2-small-s1024"),
                         [](const auto& test) {
                           std::string name = test.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// `ferry compare --pp 4 --schedule gpipe` on gpt2-small: the pipeline rows, with and without
// offload in every stage, are pinned too; every row runs hazard-free.
TEST(GoldenComparePipeline, Gpt2SmallOnFourDevicesMatchesExpectedBytes) {
  auto model = model_preset("gpt2-small-s1024");
  auto device = load_device_profile(kScenarios / "devices", "h100-sxm-pcie5");
  ASSERT_TRUE(model.ok() && device.ok());
  assign_roofline_durations(model.value(), device.value());
  const std::vector<PipelineRow> rows =
      pipeline_rows(check_model(model.value()).value(), device.value(), 4, 4);
  std::size_t offloading = 0;
  for (const PipelineRow& row : rows) {
    EXPECT_EQ(row.hazards, 0U) << row.name;
    EXPECT_FALSE(row.failure) << row.name << ": " << row.failure->message;
    if (row.options.offload.policy != Policy::None) {
      ++offloading;
      EXPECT_GT(row.d2h.count(), 0) << row.name;
    }
  }
  EXPECT_EQ(offloading, 4U);
  expect_golden(kExpected / "compare_pipeline_gpt2-small-s1024.txt", pipeline_text(rows));
  expect_golden(kExpected / "compare_pipeline_gpt2-small-s1024.json", pipeline_json(rows) + "\n");
}

// The same rows under torch's 1F1B (4 devices, 8 micro-batches) and interleaved 1F1B (2 stages
// a device), with each device's peak, bubble and micro-batches in flight: pinned, hazard-free.
TEST(GoldenComparePipeline, Gpt2SmallUnderOneFOneBAndInterleavedMatchesExpectedBytes) {
  auto model = model_preset("gpt2-small-s1024");
  auto device = load_device_profile(kScenarios / "devices", "h100-sxm-pcie5");
  ASSERT_TRUE(model.ok() && device.ok());
  assign_roofline_durations(model.value(), device.value());
  const CheckedModel checked = check_model(model.value()).value();
  for (const auto& [schedule, v, file] :
       {std::tuple{Schedule::OneFOneB, 1, "compare_pipeline_1f1b_gpt2-small-s1024"},
        std::tuple{Schedule::Interleaved1F1B, 2,
                   "compare_pipeline_interleaved_gpt2-small-s1024"}}) {
    const std::vector<PipelineRow> rows = pipeline_rows(checked, device.value(), 4, 8, schedule, v);
    for (const PipelineRow& row : rows) {
      EXPECT_EQ(row.hazards, 0U) << row.name;
      EXPECT_FALSE(row.failure) << row.name << ": " << row.failure->message;
    }
    expect_golden(kExpected / (std::string(file) + ".txt"), pipeline_text(rows));
    expect_golden(kExpected / (std::string(file) + ".json"), pipeline_json(rows) + "\n");
  }
}

}  // namespace
}  // namespace ferry::sim
