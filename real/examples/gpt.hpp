#pragma once
// A small GPT-style model for the example and the benchmark: token and position embeddings,
// pre-norm blocks with causal attention (dropout 0.1) and a GELU MLP that can be checkpointed,
// a final norm and an output head. The blocks run under an offload session, the head does not.

#include <fmt/format.h>
#include <torch/torch.h>

#include <optional>

#include "ferry/real/api.hpp"

namespace ferry::examples {

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

}  // namespace ferry::examples
