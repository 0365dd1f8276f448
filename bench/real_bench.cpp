// One training step of the GPT-style example model with no offload, the trl policy (ferry's
// model of the reference offloader) and ferry, run side by side in every iteration, on the CPU
// loopback device and, where one is present, on CUDA. Counters: each step time, the ratios to
// no offload, and (CUDA) each peak of allocated device memory.
//
//   bench_real [--small] [google benchmark flags]     (--small: a tiny model, for smoke runs)

#include <benchmark/benchmark.h>
#include <torch/torch.h>
#ifdef FERRY_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cstring>

#include "ferry/real/api.hpp"
#include "gpt.hpp"

namespace {

struct Shape {
  std::int64_t layers, width, seq, batch, vocab;
};

bool small = false;

void synchronize([[maybe_unused]] bool cuda) {
#ifdef FERRY_HAVE_CUDA
  if (cuda) torch::cuda::synchronize();
#endif
}

double peak_mib([[maybe_unused]] bool cuda) {
#ifdef FERRY_HAVE_CUDA
  if (cuda) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20);
  }
#endif
  return 0;
}

void reset_peak([[maybe_unused]] bool cuda) {
#ifdef FERRY_HAVE_CUDA
  if (cuda) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}

void BM_GptStep(benchmark::State& state, bool cuda) {
  ferry::install();
  const Shape shape = small  ? Shape{2, 64, 64, 2, 256}
                      : cuda ? Shape{8, 1024, 2048, 4, 8192}
                             : Shape{4, 256, 256, 4, 1024};
  const torch::Device device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  torch::manual_seed(0);
  ferry::examples::Gpt model(shape.vocab, shape.seq, shape.width, shape.layers, false);
  model->to(device);
  auto tokens = torch::randint(shape.vocab, {shape.batch, shape.seq},
                               torch::TensorOptions().dtype(torch::kLong).device(device));
  auto targets = tokens.roll(-1, 1);
  std::vector<torch::Tensor> excluded = model->parameters();
  for (const auto& b : model->buffers()) excluded.push_back(b);
  auto session = [&](ferry::Policy policy) {
    ferry::real::RealOptions o;
    o.loopback = !cuda;
    o.offload.policy = policy;
    auto offload = std::make_unique<ferry::Offload>(o);
    offload->exclude(excluded);
    return offload;
  };
  auto trl = session(ferry::Policy::Trl);
  auto fer = session(ferry::Policy::Ferry);
  // Seconds and peak MiB of one step.
  auto step = [&](ferry::Offload* offload) {
    model->zero_grad();
    synchronize(cuda);
    reset_peak(cuda);
    const auto start = std::chrono::steady_clock::now();
    auto logits = model->forward(tokens, offload);
    auto loss =
        torch::nn::functional::cross_entropy(logits.view({-1, shape.vocab}), targets.view({-1}));
    loss.backward();
    synchronize(cuda);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::pair{s, peak_mib(cuda)};
  };
  for (ferry::Offload* o : {static_cast<ferry::Offload*>(nullptr), trl.get(), fer.get()}) {
    (void)step(o);  // warm-up: allocator pools, host pool, kernels
  }
  double none_s = 0, trl_s = 0, ferry_s = 0, none_peak = 0, trl_peak = 0, ferry_peak = 0;
  for (auto _ : state) {
    const auto [a, pa] = step(nullptr);
    const auto [b, pb] = step(trl.get());
    const auto [c, pc] = step(fer.get());
    none_s += a;
    trl_s += b;
    ferry_s += c;
    none_peak = std::max(none_peak, pa);
    trl_peak = std::max(trl_peak, pb);
    ferry_peak = std::max(ferry_peak, pc);
    state.SetIterationTime(a + b + c);
  }
  const auto n = static_cast<double>(state.iterations());
  state.counters["none_ms"] = 1e3 * none_s / n;
  state.counters["trl_ms"] = 1e3 * trl_s / n;
  state.counters["ferry_ms"] = 1e3 * ferry_s / n;
  state.counters["trl/none"] = trl_s / none_s;
  state.counters["ferry/none"] = ferry_s / none_s;
  state.counters["ferry/trl"] = ferry_s / trl_s;
  if (cuda) {
    state.counters["none_peak_MiB"] = none_peak;
    state.counters["trl_peak_MiB"] = trl_peak;
    state.counters["ferry_peak_MiB"] = ferry_peak;
  }
  state.counters["ferry_MiB_moved_per_step"] =
      static_cast<double>(fer->telemetry().bytes_d2h.count()) / (1 << 20) / (n + 1);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--small") == 0) small = true;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RegisterBenchmark("BM_GptStep/loopback", BM_GptStep, false)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  if (torch::cuda::is_available()) {
    benchmark::RegisterBenchmark("BM_GptStep/cuda", BM_GptStep, true)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
