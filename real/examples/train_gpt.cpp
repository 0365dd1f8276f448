// A small GPT-style model trained for a few steps in pure C++ LibTorch, with ferry offloading
// the activations of every block and checkpointing the MLP of each block. Prints loss, peak
// memory and step time. Runs on CUDA when present, on the CPU loopback device otherwise.
//
//   train_gpt [--steps N] [--policy ferry|trl|none] [--layers L] [--seq S] [--width D]
//             [--window-bytes B] [--loopback] [--no-checkpoint] [--record FILE]
//             [--plant-missing-wait]

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>
#ifdef FERRY_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <fstream>

#include "ferry/real/api.hpp"

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t width, std::int64_t heads, bool checkpointed)
      : heads_(heads), checkpointed_(checkpointed) {
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    qkv_ = register_module("qkv", torch::nn::Linear(width, 3 * width));
    proj_ = register_module("proj", torch::nn::Linear(width, width));
    up_ = register_module("up", torch::nn::Linear(width, 4 * width));
    down_ = register_module("down", torch::nn::Linear(4 * width, width));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), s = x.size(1), d = x.size(2), hd = d / heads_;
    auto qkv = qkv_->forward(ln1_->forward(x)).view({b, s, 3, heads_, hd}).permute({2, 0, 3, 1, 4});
    auto att = qkv[0].matmul(qkv[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    auto mask = torch::ones({s, s}, x.options().dtype(torch::kBool)).triu(1);
    att = torch::dropout(att.masked_fill(mask, -1e9).softmax(-1), 0.1, is_training());
    auto y = att.matmul(qkv[2]).transpose(1, 2).reshape({b, s, d});
    auto h = x + proj_->forward(y);
    auto mlp = [this](const torch::Tensor& in) {
      return down_->forward(torch::gelu(up_->forward(ln2_->forward(in))));
    };
    return h + (checkpointed_ ? ferry::checkpoint(mlp, h) : mlp(h));
  }

  std::int64_t heads_;
  bool checkpointed_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(std::int64_t vocab, std::int64_t seq, std::int64_t width, std::int64_t layers,
          bool checkpointed) {
    tok_ = register_module("tok", torch::nn::Embedding(vocab, width));
    pos_ = register_module("pos", torch::nn::Embedding(seq, width));
    for (std::int64_t i = 0; i < layers; ++i) {
      blocks_.push_back(register_module(fmt::format("block{}", i), Block(width, 4, checkpointed)));
    }
    ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    head_ = register_module("head", torch::nn::Linear(width, vocab));
  }

  // The blocks run under the offload session; the head does not (offloading the head's input
  // only to reload it at once costs time and saves nothing).
  torch::Tensor forward(const torch::Tensor& tokens, ferry::Offload* offload) {
    auto positions = torch::arange(tokens.size(1), tokens.options());
    torch::Tensor h;
    {
      std::optional<ferry::OffloadGuard> guard;
      if (offload != nullptr) guard.emplace(*offload);
      h = tok_->forward(tokens) + pos_->forward(positions);
      for (auto& block : blocks_) h = block->forward(h);
    }
    return head_->forward(ln_f_->forward(h));
  }

  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace

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

  ferry::RealOptions options;
  options.loopback = !cuda;
  options.offload.policy = policy == "trl"    ? ferry::Policy::Trl
                           : policy == "none" ? ferry::Policy::None
                                              : ferry::Policy::Ferry;
  if (window >= 0) options.offload.window_bytes = ferry::Bytes(window);
  options.offload.faults.skip_reload_wait = plant;
  options.record = !record.empty();
  ferry::Offload offload(options);
  std::vector<torch::Tensor> excluded = model->parameters();
  for (const auto& b : model->buffers()) excluded.push_back(b);
  offload.exclude(excluded);

  fmt::print("model: {} blocks, width {}, seq {}, batch {}; policy {}; device {}{}\n", layers,
             width, seq, batch, policy, cuda ? "cuda" : "cpu (loopback)",
             no_checkpoint ? "" : "; MLPs checkpointed");
  for (int step = 1; step <= steps; ++step) {
    auto tokens = torch::randint(vocab, {batch, seq}, torch::TensorOptions().dtype(torch::kLong).device(device));
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
      peak = fmt::format("{:.1f} MiB",
                         static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20));
    }
#endif
    const ferry::OffloadTelemetry t = offload.telemetry();
    fmt::print("step {}: loss {:.4f}  peak memory {}  step time {:.1f} ms  offloaded {:.1f} MiB "
               "total, host pool peak {:.1f} MiB, tracked after step {}\n",
               step, loss.item<double>(), peak, ms,
               static_cast<double>(t.bytes_d2h.count()) / (1 << 20),
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
