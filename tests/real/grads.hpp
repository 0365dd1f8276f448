#pragma once
// Gradient helpers shared by the real backend's tests.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace ferry::testing {

using Tensors = std::vector<torch::Tensor>;

/// Gradients of `leaves` after backward of `loss_fn()` (earlier gradients cleared).
inline Tensors grads_of(const Tensors& leaves, const std::function<torch::Tensor()>& loss_fn) {
  for (const auto& l : leaves) {
    if (l.grad().defined()) l.mutable_grad().reset();
  }
  loss_fn().backward();
  Tensors out;
  for (const auto& l : leaves) out.push_back(l.grad().clone());
  return out;
}

inline void expect_bitwise_equal(const Tensors& want, const Tensors& got) {
  ASSERT_EQ(want.size(), got.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(want[i].defined() && got[i].defined()) << "gradient " << i;
    EXPECT_TRUE(torch::equal(want[i], got[i])) << "gradient " << i << " differs";
  }
}

}  // namespace ferry::testing
