// A small GPT-style model trained for a few steps in pure C++ LibTorch, with ferry offloading
// the activations of every block and checkpointing the MLP of each block. Prints loss, peak
// memory and step time. Runs on CUDA when present, on the CPU loopback device otherwise.
//
//   train_gpt [--steps N] [--policy ferry|trl|none] [--layers L] [--seq S] [--width D]
//             [--window-bytes B] [--loopback] [--no-checkpoint] [--record FILE]
//             [--plant-missing-wait]

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#ifdef FERRY_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include "ferry/real/api.hpp"
#include "gpt.hpp"

using ferry::examples::Gpt;

int main(int argc, char** argv) {
  ferry::install();  // before any autograd use

  CLI::App app{"Train a small GPT-style model with ferry offload + checkpoint"};
  int steps = 5;
  std::string policy = "ferry";
  std::int64_t layers = 4, seq = 128, width = 128, batch = 4, vocab = 512;
  bool loopback = false, no_checkpoint = false, plant = false;
  std::string record;
  std::int64_t window = -1;
  app.add_option("--steps", steps, "training steps")->check(CLI::PositiveNumber);
  app.add_option("--policy", policy, "ferry, trl or none")
      ->check(CLI::IsMember({"ferry", "trl", "none"}));
  app.add_option("--layers", layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "sequence length")->check(CLI::PositiveNumber);
  app.add_option("--width", width, "model width (a multiple of 4)")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--window-bytes", window,
                 "ferry: device bytes of offloads in flight (0: each original goes as soon as "
                 "its copy is issued, so backward reloads everything)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--loopback", loopback, "run on the CPU loopback device even with a GPU");
  app.add_flag("--no-checkpoint", no_checkpoint, "keep the MLP activations (offload only)");
  app.add_option("--record", record, "write the stream operations of the last step here");
  app.add_flag("--plant-missing-wait", plant,
               "drop the compute stream's wait for each reload (a planted fault)");
  CLI11_PARSE(app, argc, argv);
  if (width % 4 != 0) {
    fmt::print(stderr, "train_gpt: --width must be a multiple of 4\n");
    return 2;
  }

#ifdef FERRY_HAVE_CUDA
  const bool cuda = !loopback && torch::cuda::is_available();
#else
  const bool cuda = false;
#endif
  const torch::Device device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  torch::manual_seed(0);
  Gpt model(vocab, seq, width, layers, !no_checkpoint);
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-4));

  ferry::real::RealOptions options;
  options.loopback = !cuda;
  // FERRY_LOOPBACK=async[:SEED[:MAX_DELAY_US]] runs the loopback device's streams on worker
  // threads (docs/real.md).
  if (const char* streams = std::getenv("FERRY_LOOPBACK"); streams != nullptr && !cuda) {
    try {
      options.loopback_streams = ferry::real::parse_loopback_streams(streams, "FERRY_LOOPBACK");
    } catch (const std::invalid_argument& e) {
      fmt::print(stderr, "train_gpt: {}\n", e.what());
      return 2;
    }
  }
  options.offload.policy = ferry::parse_policy(policy).value_or(ferry::Policy::Ferry);
  if (window >= 0) options.offload.window_bytes = ferry::Bytes(window);
  options.record = !record.empty();
  ferry::OffloadFaults faults;
  faults.skip_reload_wait = plant;
  ferry::Offload offload(options, faults);
  std::vector<torch::Tensor> excluded = model->parameters();
  for (const auto& b : model->buffers()) excluded.push_back(b);
  offload.exclude(excluded);

  fmt::print("model: {} blocks, width {}, seq {}, batch {}; policy {}; device {}{}\n", layers,
             width, seq, batch, policy, cuda ? "cuda" : "cpu (loopback)",
             no_checkpoint ? "" : "; MLPs checkpointed");
  for (int step = 1; step <= steps; ++step) {
    auto tokens = torch::randint(vocab, {batch, seq},
                                 torch::TensorOptions().dtype(torch::kLong).device(device));
    auto targets = tokens.roll(-1, 1);
#ifdef FERRY_HAVE_CUDA
    if (cuda) {
      torch::cuda::synchronize();
      c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    }
#endif
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    auto logits = model->forward(tokens, &offload);
    auto loss = torch::nn::functional::cross_entropy(logits.view({-1, vocab}), targets.view({-1}));
    loss.backward();
    optimizer.step();
#ifdef FERRY_HAVE_CUDA
    if (cuda) torch::cuda::synchronize();
#endif
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::string peak = "n/a on the CPU";
#ifdef FERRY_HAVE_CUDA
    if (cuda) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
      peak =
          fmt::format("{:.1f} MiB", static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20));
    }
#endif
    const ferry::OffloadTelemetry t = offload.telemetry();
    fmt::print(
        "step {}: loss {:.4f}  peak memory {}  step time {:.1f} ms  offloaded {:.1f} MiB "
        "total, host pool peak {:.1f} MiB, tracked after step {}\n",
        step, loss.item<double>(), peak, ms, static_cast<double>(t.bytes_d2h.count()) / (1 << 20),
        static_cast<double>(t.pinned_peak.count()) / (1 << 20), offload.tracked());
  }
  if (!record.empty()) {
    std::ofstream out(record);
    out << offload.program_json();
    if (!out) {
      fmt::print(stderr, "train_gpt: cannot write {}\n", record);
      return 2;
    }
    fmt::print("stream operations written to {}\n", record);
  }
  return 0;
}
