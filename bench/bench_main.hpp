#pragma once
// The main() of ferry's benchmark programs: Google Benchmark's flags, plus --smoke, a short run
// that only checks the benchmarks still work (`on_smoke` shrinks the workload before the run).

#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

namespace ferry::bench {

template <class OnSmoke>
int run_benchmarks(int argc, char** argv, OnSmoke on_smoke) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) {
      on_smoke();
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace ferry::bench
