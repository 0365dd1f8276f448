// Planning time: `ferry plan` on the Llama-3-8B-like (32 layers) and Llama-3-70B-like
// (80 layers) presets at sequence 8192 on the H100 profile, at the budget of checkpointing every
// layer (its peak reserved). Counters: the plan's step time and the checkpointed one's as
// ratios to no offload, the gap to the lower bound, and the simulations the search ran (and the
// runs it reused). The 70B model is planned on the H100 profile with enough memory for its
// no-offload peak.
//   bench_plan [--smoke] [--jobs=N] [google-benchmark flags]
// --smoke plans gpt2-small-s1024 instead (a quick check that the benchmark still runs).
// BM_PlanPipeline: `ferry plan --pp 8 --schedule 1f1b --micro-batches 16 --margin 0` on the
// 70B-like preset and H100 profile (plan_pipeline; counter per_stage: 1 when the plan is a
// per-stage one), and BM_ComparePipeline the pipeline rows
// `ferry compare --pp 8` runs for the same counts (smoke: gpt2-small-s1024 over 2 stages);
// BM_ComparePipelineMesh and BM_PlanPipelineMesh the same at `--fsdp 8 --tp 4`.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bench_main.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/planner/pipeline_plan.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/runs/compare_runs.hpp"
#include "ferry/sim/runs/configurations.hpp"
#include "ferry/sim/workload/rank_workload.hpp"

namespace {

bool g_smoke = false;
// --jobs N: simulations at once (PlannerOptions::jobs); 0, the default, one per hardware thread.
std::int32_t g_jobs = 0;

// Plans `model` in each iteration of `state`; the last outcome, or null (the state then says
// why the benchmark was skipped). Sets the counters every case reports: the plan's gap to the
// lower bound and the simulations the search ran.
std::optional<ferry::sim::PlanOutcome> timed_plan(benchmark::State& state,
                                                  const ferry::sim::Model& model,
                                                  const ferry::DeviceProfile& device,
                                                  const ferry::sim::PlannerOptions& options) {
  ferry::Result<ferry::sim::PlanOutcome> outcome = ferry::Error{"not run"};
  ferry::sim::PlannerOptions with_jobs = options;
  with_jobs.jobs = g_jobs;
  for (auto _ : state) {
    outcome = ferry::sim::make_plan(model, device, with_jobs);
    benchmark::DoNotOptimize(outcome);
  }
  if (!outcome.ok()) {
    state.SkipWithError(outcome.error().message.c_str());
    return std::nullopt;
  }
  const auto& o = outcome.value();
  state.counters["plan_vs_bound"] =
      static_cast<double>(o.row.step_time.ns()) / static_cast<double>(o.lower_bound.ns());
  state.counters["simulations"] = static_cast<double>(o.simulations);
  state.counters["reused"] = static_cast<double>(o.reused);
  return o;
}

void BM_Plan(benchmark::State& state, const char* preset) {
  const std::string name = g_smoke ? "gpt2-small-s1024" : preset;
  auto device = ferry::sim::load_device_profile(FERRY_BENCH_SCENARIOS "/devices", "h100-sxm-pcie5");
  auto model = ferry::sim::model_preset(name);
  if (!device.ok() || !model.ok()) {
    state.SkipWithError("preset or profile missing");
    return;
  }
  ferry::sim::assign_roofline_durations(model.value(), device.value());
  const auto rows =
      ferry::sim::default_rows(ferry::sim::timing_only(2), model.value(), device.value());
  const auto none = ferry::sim::run_row(model.value(), device.value(), rows.front());
  // The 70B model's weights, gradients and activations outgrow one H100: it is planned on the
  // same profile with the memory of its no-offload peak (a device that does not exist; what
  // is measured here is the search).
  device.value().memory = std::max(device.value().memory, none.peak_reserved);
  ferry::sim::RowResult every;
  for (const auto& row : rows) {
    if (row.name == "checkpoint every layer") {
      every = ferry::sim::run_row(model.value(), device.value(), row);
    }
  }
  const ferry::sim::PlannerOptions options{every.peak_reserved, std::nullopt, 2};
  const auto planned = timed_plan(state, model.value(), device.value(), options);
  if (!planned) return;
  const auto& o = *planned;
  const double base_ns = static_cast<double>(none.step_time.ns());
  state.counters["plan_vs_none"] = static_cast<double>(o.row.step_time.ns()) / base_ns;
  state.counters["checkpoint_vs_none"] = static_cast<double>(every.step_time.ns()) / base_ns;
}
// `ferry plan --budget 41GiB --device a100-pcie4` on a Llama-3.2-3B at sequence 4096, batch 2,
// as `python -m ferry trace` lists a Hugging Face one (2,104 ops; the generator's preset of
// that shape, Note [A Llama as a trace lists it]). Counters as above, with the fastest fixed
// configuration that fits.
void BM_PlanTraced(benchmark::State& state) {
  const std::string name = g_smoke ? "gpt2-small-s1024" : "llama3.2-3b-traced-s4096-b2";
  auto device = ferry::sim::load_device_profile(FERRY_BENCH_SCENARIOS "/devices", "a100-pcie4");
  auto model = ferry::sim::model_preset(name);
  if (!device.ok() || !model.ok()) {
    state.SkipWithError("preset or profile missing");
    return;
  }
  ferry::sim::assign_roofline_durations(model.value(), device.value());
  const ferry::Bytes budget = g_smoke ? ferry::Bytes(1LL << 30) : ferry::Bytes(41LL << 30);
  const ferry::sim::PlannerOptions options{budget, std::nullopt, 2};
  const auto planned = timed_plan(state, model.value(), device.value(), options);
  if (!planned) return;
  const auto& o = *planned;
  const double base_ns = static_cast<double>(o.fixed.front().step_time.ns());
  state.counters["plan_vs_none"] = static_cast<double>(o.row.step_time.ns()) / base_ns;
  if (const ferry::sim::RowResult* best = ferry::sim::best_fixed(o)) {
    state.counters["best_fixed_vs_none"] = static_cast<double>(best->step_time.ns()) / base_ns;
  }
}

// The 70B-like preset over 8 pipeline stages of 1F1B with 16 micro-batches (2 and 4 under
// --smoke), durations assigned for the H100 profile; false (the state says why) if missing.
struct PipelineCase {
  ferry::sim::CheckedModel model;
  ferry::DeviceProfile device;
  std::int32_t devices;
  std::int32_t micro_batches;
};

std::optional<PipelineCase> pipeline_case(benchmark::State& state) {
  const std::string name = g_smoke ? "gpt2-small-s1024" : "llama-70b-s8192";
  auto device = ferry::sim::load_device_profile(FERRY_BENCH_SCENARIOS "/devices", "h100-sxm-pcie5");
  auto model = ferry::sim::model_preset(name);
  if (!device.ok() || !model.ok()) {
    state.SkipWithError("preset or profile missing");
    return std::nullopt;
  }
  ferry::sim::assign_roofline_durations(model.value(), device.value());
  auto checked = ferry::sim::check_model(std::move(model).value());
  if (!checked.ok()) {
    state.SkipWithError(checked.error().message.c_str());
    return std::nullopt;
  }
  return PipelineCase{std::move(checked).value(), device.value(), g_smoke ? 2 : 8,
                      g_smoke ? 4 : 16};
}

// The options of `ferry plan --pp N` on a pipeline case: 1F1B at the device's memory.
ferry::sim::PipelinePlanOptions pipeline_plan_options(const PipelineCase& c) {
  ferry::sim::PipelinePlanOptions options;
  options.devices = c.devices;
  options.micro_batches = c.micro_batches;
  options.schedules = {ferry::sim::Schedule::OneFOneB};
  options.budget = c.device.memory;
  options.jobs = g_jobs;
  return options;
}

// Plans the pipeline each iteration and reports the plan's and the best fixed row's step.
void time_pipeline_plan(benchmark::State& state, const ferry::sim::CheckedModel& model,
                        const ferry::DeviceProfile& device,
                        const ferry::sim::PipelinePlanOptions& options) {
  ferry::Result<ferry::sim::PipelinePlan> plan = ferry::Error{"not run"};
  for (auto _ : state) {
    plan = ferry::sim::plan_pipeline(model, device, options);
    benchmark::DoNotOptimize(plan);
  }
  if (!plan.ok()) {
    state.SkipWithError(plan.error().message.c_str());
    return;
  }
  const auto& p = plan.value();
  const auto& chosen = p.candidates[p.chosen];
  state.counters["plan_step_s"] = static_cast<double>(chosen.step_time.ns()) / 1e9;
  if (p.best_fixed) {
    state.counters["best_fixed_step_s"] =
        static_cast<double>(p.candidates[*p.best_fixed].step_time.ns()) / 1e9;
  }
  state.counters["simulations"] = static_cast<double>(p.simulations);
  state.counters["per_stage"] = chosen.stage_configs.empty() ? 0.0 : 1.0;
}

void BM_PlanPipeline(benchmark::State& state) {
  const auto c = pipeline_case(state);
  if (!c) return;
  time_pipeline_plan(state, c->model, c->device, pipeline_plan_options(*c));
}

void BM_ComparePipeline(benchmark::State& state) {
  const auto c = pipeline_case(state);
  if (!c) return;
  std::size_t hazards = 0;
  for (auto _ : state) {
    const auto rows = ferry::sim::pipeline_rows(c->model, c->device, c->devices, c->micro_batches,
                                                ferry::sim::Schedule::OneFOneB);
    hazards = 0;
    for (const auto& row : rows) hazards += row.hazards;
    benchmark::DoNotOptimize(rows);
  }
  state.counters["hazards"] = static_cast<double>(hazards);
}

// The same pipeline with each stage a GPU of FSDP over 8 ranks times tensor parallelism over 4
// (`--fsdp 8 --tp 4 --pp 8`, 256 GPUs; smoke: tiny-llama at --fsdp 2 --tp 2 over 2
// stages): the rank's model, cut once, and its device.
struct MeshCase {
  ferry::sim::Mesh mesh;
  ferry::sim::Workload rank;
};

std::optional<MeshCase> mesh_case(benchmark::State& state, const PipelineCase& c) {
  auto mesh = ferry::sim::Mesh::make(
      ferry::Parallelism{.ranks = g_smoke ? 2 : 8, .tp = g_smoke ? 2 : 4}, c.device);
  auto whole = ferry::sim::model_preset(g_smoke ? "tiny-llama" : "llama-70b-s8192");
  if (!mesh.ok() || !whole.ok()) {
    state.SkipWithError("mesh or preset");
    return std::nullopt;
  }
  const ferry::sim::Workload w{ferry::sim::check_model(std::move(whole).value()).value(), c.device};
  auto rank = ferry::sim::rank_workload(w, mesh.value());
  if (!rank.ok()) {
    state.SkipWithError(rank.error().message.c_str());
    return std::nullopt;
  }
  rank.value().device = mesh.value().rank_profile(c.device);
  return MeshCase{mesh.value(), std::move(rank).value()};
}

// `ferry compare --fsdp 8 --tp 4 --pp 8`'s pipeline rows.
void BM_ComparePipelineMesh(benchmark::State& state) {
  const auto c = pipeline_case(state);
  if (!c) return;
  const auto m = mesh_case(state, *c);
  if (!m) return;
  std::size_t hazards = 0;
  for (auto _ : state) {
    const auto rows =
        ferry::sim::pipeline_rows(m->rank.model, m->rank.device, c->devices, c->micro_batches,
                                  ferry::sim::Schedule::OneFOneB, 1, m->mesh);
    hazards = 0;
    for (const auto& row : rows) hazards += row.hazards;
    benchmark::DoNotOptimize(rows);
  }
  state.counters["hazards"] = static_cast<double>(hazards);
}

// `ferry plan --fsdp 8 --tp 4 --pp 8`.
void BM_PlanPipelineMesh(benchmark::State& state) {
  const auto c = pipeline_case(state);
  if (!c) return;
  const auto m = mesh_case(state, *c);
  if (!m) return;
  ferry::sim::PipelinePlanOptions options = pipeline_plan_options(*c);
  options.mesh = m->mesh;
  time_pipeline_plan(state, m->rank.model, m->rank.device, options);
}

BENCHMARK_CAPTURE(BM_Plan, llama3_8b, "llama3-8b-s8192")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_PlanTraced)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK_CAPTURE(BM_Plan, llama_70b, "llama-70b-s8192")->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_PlanPipeline)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_ComparePipeline)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_ComparePipelineMesh)->Iterations(1)->Unit(benchmark::kSecond);
BENCHMARK(BM_PlanPipelineMesh)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--jobs=", 7) == 0) {
      g_jobs = static_cast<std::int32_t>(std::strtol(argv[i] + 7, nullptr, 10));
    } else {
      args.push_back(argv[i]);
    }
  }
  return ferry::bench::run_benchmarks(static_cast<int>(args.size()), args.data(),
                                      [] { g_smoke = true; });
}
