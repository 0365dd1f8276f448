// Simulator throughput: simulated ops per second on a long random stream program, with the
// hazard checker off and on, measured side by side in one run.
//   bench_sim [--smoke] [google-benchmark flags]
// --smoke uses a short program (a quick check that the benchmark still runs).

#include <benchmark/benchmark.h>

#include <chrono>
#include <random>

#include "bench_main.hpp"
#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/io/program_json.hpp"
#include "ferry/sim/runs/run_program.hpp"
#include "ferry/sim/workload/model.hpp"
#include "prop/random_program.hpp"

namespace {

using ferry::sim::Program;
using ferry::sim::SimOptions;

std::size_t g_choices = 400'000;

const Program& long_program() {
  static const Program program = [] {
    std::mt19937_64 rng(42);  // fixed seed: the same program on every run
    ferry::sim::testing::ProgramShape shape = ferry::sim::testing::random_shape(rng, 48);
    shape.devices = 1;
    shape.streams = 4;
    shape.events = 4;
    for (auto& s : shape.slots) s.device = 0;
    const auto choices = ferry::sim::testing::random_choices(rng, g_choices);
    return ferry::sim::testing::build_random_program(shape, choices, {});
  }();
  return program;
}

SimOptions options(bool checker) {
  SimOptions o;
  o.check_hazards = checker;
  o.track_content = checker;
  return o;
}

double run_seconds(const Program& program, bool checker, std::int64_t& makespan) {
  const auto start = std::chrono::steady_clock::now();
  auto run = ferry::sim::run_program(program, options(checker));
  const auto stop = std::chrono::steady_clock::now();
  benchmark::DoNotOptimize(run);
  makespan = run.value().sim.makespan().ns();
  return std::chrono::duration<double>(stop - start).count();
}

void BM_Simulate(benchmark::State& state) {
  const bool checker = state.range(0) != 0;
  const Program& program = long_program();
  std::int64_t makespan = 0;
  for (auto _ : state) {
    auto run = ferry::sim::run_program(program, options(checker));
    makespan = run.value().sim.makespan().ns();
    benchmark::DoNotOptimize(makespan);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(program.ops.size()));
  state.counters["ops"] = static_cast<double>(program.ops.size());
  state.counters["simulated_ms"] = static_cast<double>(makespan) / 1e6;
}
BENCHMARK(BM_Simulate)->ArgName("checker")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// Both configurations in each iteration, so the ratio compares like with like.
void BM_CheckerOverhead(benchmark::State& state) {
  const Program& program = long_program();
  double off = 0;
  double on = 0;
  std::int64_t makespan_off = 0;
  std::int64_t makespan_on = 0;
  for (auto _ : state) {
    off += run_seconds(program, false, makespan_off);
    on += run_seconds(program, true, makespan_on);
  }
  const double ops =
      static_cast<double>(program.ops.size()) * static_cast<double>(state.iterations());
  state.counters["ops_per_s_checker_off"] = ops / off;
  state.counters["ops_per_s_checker_on"] = ops / on;
  state.counters["on_over_off_time"] = on / off;
  state.counters["same_makespan"] = makespan_off == makespan_on ? 1 : 0;
}
BENCHMARK(BM_CheckerOverhead)->Unit(benchmark::kMillisecond);

// One training step of the 32-layer Llama-3-8B-like preset (seq 8192) on the H100 profile,
// with the hazard checker and content checks on.
void BM_Llama8BStep(benchmark::State& state) {
  const auto policy = static_cast<ferry::Policy>(state.range(0));
  auto device = ferry::sim::load_device_profile(FERRY_BENCH_SCENARIOS "/devices", "h100-sxm-pcie5");
  auto model = ferry::sim::model_preset("llama3-8b-s8192");
  if (!device.ok() || !model.ok()) {
    state.SkipWithError("preset or profile missing");
    return;
  }
  ferry::sim::assign_roofline_durations(model.value(), device.value());
  ferry::sim::TrainingOptions options;
  options.offload.policy = policy;
  options.steps = 1;
  std::size_t ops = 0;
  std::size_t hazards = 0;
  for (auto _ : state) {
    auto run = ferry::sim::simulate_training(model.value(), device.value(), options);
    ops = run.value().sim.ops().size();
    hazards = run.value().sim.hazards().size();
    benchmark::DoNotOptimize(ops);
  }
  state.counters["sim_ops"] = static_cast<double>(ops);
  state.counters["hazards"] = static_cast<double>(hazards);
}
BENCHMARK(BM_Llama8BStep)
    ->ArgName("policy")
    ->Arg(static_cast<int>(ferry::Policy::None))
    ->Arg(static_cast<int>(ferry::Policy::Trl))
    ->Arg(static_cast<int>(ferry::Policy::Ferry))
    ->Unit(benchmark::kMillisecond);

// Building and validating the largest preset (Llama-3-70B-like, 80 layers, seq 8192): a few
// milliseconds in a release build.
void BM_BuildLargestPreset(benchmark::State& state) {
  std::size_t ops = 0;
  for (auto _ : state) {
    auto model = ferry::sim::model_preset("llama-70b-s8192");
    if (!model.ok() || !ferry::sim::validate_model(model.value()).ok()) {
      state.SkipWithError("preset missing or invalid");
      return;
    }
    ops = model.value().ops.size();
    benchmark::DoNotOptimize(ops);
  }
  state.counters["ops"] = static_cast<double>(ops);
}
BENCHMARK(BM_BuildLargestPreset)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  return ferry::bench::run_benchmarks(argc, argv, [] { g_choices = 2'000; });
}
