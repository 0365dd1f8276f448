// Checkpointing on the real backend: gradients bitwise equal to torch's, reentrant or not,
// nested, under autocast and inside an offload region, and the determinism check of a replay.

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/real/api.hpp"
#include "ferry/real/loopback_streams.hpp"
#include "grads.hpp"
#include "real_fixtures.hpp"

namespace {

using ferry::testing::expect_bitwise_equal;
using ferry::testing::grads_of;
using ferry::testing::RealFerry;
using ferry::testing::Tensors;

// --- checkpoint ------------------------------------------------------------------------------

TEST_F(RealFerry, CheckpointGradientsAreBitwiseEqual) {
  auto w = torch::randn({16, 16}, torch::requires_grad());
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto block = [&](const torch::Tensor& h) { return h.matmul(w).tanh().matmul(w).sigmoid(); };
  const Tensors want = grads_of({w, x}, [&] { return block(block(x)).sum(); });
  const Tensors got =
      grads_of({w, x}, [&] { return ferry::checkpoint(block, ferry::checkpoint(block, x)).sum(); });
  expect_bitwise_equal(want, got);
}

// checkpoint_sequential as torch's: len / segments functions a part, the last part plain.
TEST_F(RealFerry, CheckpointSequentialGradientsAreBitwiseEqual) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({2, 8}, torch::requires_grad());
  std::vector<ferry::SequentialFn> layers;
  for (int i = 0; i < 5; ++i) {
    layers.emplace_back([&w, i](const torch::Tensor& h) { return (h.matmul(w) + i).tanh(); });
  }
  const Tensors want = grads_of({w, x}, [&] {
    torch::Tensor h = x;
    for (const auto& f : layers) h = f(h);
    return h.sum();
  });
  for (const std::int64_t segments : {1, 2, 3, 5}) {
    const Tensors got =
        grads_of({w, x}, [&] { return ferry::checkpoint_sequential(layers, segments, x).sum(); });
    expect_bitwise_equal(want, got);
  }
  EXPECT_THROW((void)ferry::checkpoint_sequential(layers, 0, x), std::invalid_argument);
  EXPECT_THROW((void)ferry::checkpoint_sequential(layers, 6, x), std::invalid_argument);
}

// The reentrant variant (torch's use_reentrant=True): forward without grad, the whole region
// rerun in backward; checkpoint_sequential takes it too.
TEST_F(RealFerry, ReentrantCheckpointGradientsAreBitwiseEqual) {
  // Each weight is used inside one region only: a reentrant region's backward accumulates its
  // own weights' gradients before the rest of the graph does, as torch's reentrant variant.
  auto w1 = torch::randn({16, 16}, torch::requires_grad());
  auto w2 = torch::randn({16, 16}, torch::requires_grad());
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto block = [](const torch::Tensor& w) {
    return [w](const torch::Tensor& h) {
      return torch::dropout(h.matmul(w).tanh(), 0.25, /*train=*/true).matmul(w).sigmoid();
    };
  };
  ferry::CheckpointOptions opts;
  opts.use_reentrant = true;
  torch::manual_seed(3);
  const Tensors want = grads_of({w1, w2, x}, [&] { return block(w2)(block(w1)(x)).sum(); });
  torch::manual_seed(3);
  const Tensors got = grads_of({w1, w2, x}, [&] {
    return ferry::checkpoint(block(w2), ferry::checkpoint(block(w1), x, opts), opts).sum();
  });
  expect_bitwise_equal(want, got);

  Tensors weights;
  std::vector<ferry::SequentialFn> layers;
  for (int i = 0; i < 4; ++i) {
    weights.push_back(torch::randn({16, 16}, torch::requires_grad()));
    layers.emplace_back([w = weights.back()](const torch::Tensor& h) { return h.matmul(w).sin(); });
  }
  Tensors leaves = weights;
  leaves.push_back(x);
  const Tensors plain = grads_of(leaves, [&] {
    torch::Tensor h = x;
    for (const auto& f : layers) h = f(h);
    return h.sum();
  });
  for (const std::int64_t segments : {1, 2, 4}) {
    const Tensors seq = grads_of(
        leaves, [&] { return ferry::checkpoint_sequential(layers, segments, x, opts).sum(); });
    expect_bitwise_equal(plain, seq);
  }
}

TEST_F(RealFerry, ReentrantCheckpointRecomputesTheWholeRegionInBackward) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({2, 8}, torch::requires_grad());
  int runs = 0;
  bool grad_in_forward = true;
  auto fn = [&](const torch::Tensor& h) {
    if (runs++ == 0) grad_in_forward = at::GradMode::is_enabled();
    return h.matmul(w).exp().matmul(w);
  };
  ferry::CheckpointOptions opts;
  opts.use_reentrant = true;
  auto loss = ferry::checkpoint(fn, x, opts).sum();
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(grad_in_forward);  // the forward saves nothing
  loss.backward();
  EXPECT_EQ(runs, 2);
}

TEST_F(RealFerry, ReentrantCheckpointRefusesGradAsTorchDoes) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({2, 8}, torch::requires_grad());
  ferry::CheckpointOptions opts;
  opts.use_reentrant = true;
  auto fn = [&](const torch::Tensor& h) { return h.matmul(w).sin(); };
  auto loss = ferry::checkpoint(fn, x, opts).sum();
  try {
    (void)torch::autograd::grad({loss}, {x});
    FAIL() << "torch.autograd.grad through a reentrant region must fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "ferry.checkpoint: use_reentrant=True is incompatible with .grad()"),
              std::string::npos)
        << e.what();
  }
  // Outputs that need no grad: nothing to backpropagate, torch says the checkpoint is useless.
  auto frozen = torch::randn({2, 8});
  auto out = ferry::checkpoint([](const torch::Tensor& h) { return h.sin(); }, frozen, opts);
  EXPECT_FALSE(out.requires_grad());
}

TEST_F(RealFerry, ReentrantCheckpointUnderAutocastAndInsideAnOffloadRegion) {
  auto w = torch::randn({16, 16}, torch::requires_grad());
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto block = [&](const torch::Tensor& h) { return h.matmul(w).relu().matmul(w); };
  ferry::CheckpointOptions opts;
  opts.use_reentrant = true;
  const Tensors want = grads_of({w, x}, [&] {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
    auto out = block(x.tanh()).to(at::kFloat);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, false);
    return out.pow(2).sum();
  });
  ferry::Offload offload(ferry::testing::loopback(ferry::Policy::Ferry));
  const Tensors got = grads_of({w, x}, [&] {
    torch::Tensor out;
    {
      ferry::OffloadGuard guard(offload);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::increment_nesting();
      out = ferry::checkpoint(block, x.tanh(), opts).to(at::kFloat);
      if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
      at::autocast::set_autocast_enabled(at::kCPU, false);
    }
    return out.pow(2).sum();
  });
  expect_bitwise_equal(want, got);
  // The region's input (tanh's output, saved by the region's node and by tanh: one storage)
  // went through the session; nothing of the region itself did.
  EXPECT_GT(offload.telemetry().offloaded, 0);
  EXPECT_EQ(offload.tracked(), 0U);
  EXPECT_EQ(offload.live_device_buffers(), 0);
}

// The parts own their functions: the caller's list may be gone before backward.
TEST_F(RealFerry, CheckpointSequentialOutlivesItsFunctionList) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({2, 8}, torch::requires_grad());
  torch::Tensor loss;
  {
    std::vector<ferry::SequentialFn> layers(
        4, [&w](const torch::Tensor& h) { return h.matmul(w).sin(); });
    loss = ferry::checkpoint_sequential(layers, 2, x).sum();
  }
  loss.backward();
  EXPECT_TRUE(w.grad().defined());
}

TEST_F(RealFerry, NestedCheckpointWithAndWithoutEarlyStop) {
  auto w = torch::randn({12, 12}, torch::requires_grad());
  auto x = torch::randn({3, 12}, torch::requires_grad());
  auto inner = [&](const torch::Tensor& h) { return h.matmul(w).sin() * h; };
  auto outer_plain = [&](const torch::Tensor& h) { return inner(inner(h).exp()).cos(); };
  const Tensors want = grads_of({w, x}, [&] { return outer_plain(x).sum(); });
  for (const bool early_stop : {true, false}) {
    ferry::CheckpointOptions opts;
    opts.early_stop = early_stop;
    auto outer = [&](const torch::Tensor& h) {
      auto a = ferry::checkpoint(inner, h, opts).exp();
      return ferry::checkpoint(inner, a, opts).cos();
    };
    const Tensors got = grads_of({w, x}, [&] { return ferry::checkpoint(outer, x, opts).sum(); });
    expect_bitwise_equal(want, got);
  }
}

// A forward that never gets a backward leaves nothing alive: the inner region's input is saved
// by the outer region (an id), not held by the inner frame, so no frame holds a graph that
// holds the frames.
TEST_F(RealFerry, NestedCheckpointWithoutBackwardFreesEverything) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({2, 8}, torch::requires_grad());
  c10::weak_intrusive_ptr<c10::TensorImpl> inner_input(c10::make_intrusive<c10::TensorImpl>(
      c10::DispatchKeySet(), caffe2::TypeMeta(), std::nullopt));
  {
    auto inner = [&](const torch::Tensor& h) {
      inner_input = c10::weak_intrusive_ptr<c10::TensorImpl>(h.getIntrusivePtr());
      return h.matmul(w).sin();
    };
    auto outer = [&](const torch::Tensor& h) { return ferry::checkpoint(inner, h.exp()).cos(); };
    auto out = ferry::checkpoint(outer, x).sum();
  }
  EXPECT_TRUE(inner_input.expired()) << "the inner region's input outlived its graph";
}

TEST_F(RealFerry, DropoutUnderCheckpointReplaysTheSameMask) {
  auto w = torch::randn({32, 32}, torch::requires_grad());
  auto x = torch::randn({8, 32}, torch::requires_grad());
  auto block = [&](const torch::Tensor& h) {
    return torch::dropout(h.matmul(w), 0.5, /*train=*/true).relu().matmul(w);
  };
  torch::manual_seed(7);
  const Tensors want = grads_of({w, x}, [&] { return block(x).pow(2).sum(); });
  torch::manual_seed(7);
  const Tensors got = grads_of({w, x}, [&] { return ferry::checkpoint(block, x).pow(2).sum(); });
  expect_bitwise_equal(want, got);
}

// CPU autocast to bfloat16 for a scope, as `torch.autocast("cpu", dtype=torch.bfloat16)`.
class CpuAutocast {
 public:
  CpuAutocast()
      : enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
        dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;
  ~CpuAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, dtype_);
  }

 private:
  bool enabled_;
  at::ScalarType dtype_;
};

// The replay runs in backward, outside the forward's autocast scope: it must re-enter the
// forward's state (Note [Autocast in replays]), or it recomputes in float32 and the
// determinism check refuses the saved tensors.
TEST_F(RealFerry, CheckpointUnderAutocastReplaysInTheForwardsPrecision) {
  auto w = torch::randn({16, 16}, torch::requires_grad());
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto block = [&](const torch::Tensor& h) { return h.matmul(w).tanh().matmul(w).sigmoid(); };
  const auto forward = [&](bool checkpointed) {
    CpuAutocast autocast;
    auto h = checkpointed ? ferry::checkpoint(block, ferry::checkpoint(block, x)) : block(block(x));
    EXPECT_EQ(h.scalar_type(), at::kBFloat16);
    return h.to(at::kFloat).sum();
  };
  const Tensors want = grads_of({w, x}, [&] { return forward(false); });
  const Tensors got = grads_of({w, x}, [&] { return forward(true); });
  expect_bitwise_equal(want, got);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "the replay left autocast on";
}

TEST_F(RealFerry, CheckpointInsideAnOffloadRegion) {
  auto w = torch::randn({16, 16}, torch::requires_grad());
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto block = [&](const torch::Tensor& h) { return h.matmul(w).tanh() * h; };
  const Tensors want = grads_of({w, x}, [&] { return block(block(x * 1)).sum(); });
  ferry::Offload offload(ferry::testing::loopback(ferry::Policy::Ferry));
  const Tensors got = grads_of({w, x}, [&] {
    ferry::OffloadGuard guard(offload);
    return ferry::checkpoint(block, block(x * 1)).sum();
  });
  expect_bitwise_equal(want, got);
  // The outer block saves 5 tensors (mm: its input and w; tanh: its result; mul: both
  // operands); the region's input is the 6th: the session offloads it too.
  EXPECT_EQ(offload.telemetry().packed, 6);
  // All but w; with a zero window each original leaves at once, so tanh's result, saved twice,
  // is copied twice (no resident original to share).
  EXPECT_EQ(offload.telemetry().offloaded, 5);
  EXPECT_EQ(offload.tracked(), 0U);
  EXPECT_EQ(offload.live_device_buffers(), 0);
}

TEST_F(RealFerry, ReplaySavingMoreTensorsIsAnError) {
  auto x = torch::randn({8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& h) {
    auto y = h.sin();
    if (calls++ > 0) y = y.exp();  // the replay saves one tensor more
    return y;
  };
  ferry::CheckpointOptions opts;
  opts.early_stop = false;
  auto out = ferry::checkpoint(fn, x, opts).sum();
  try {
    out.backward();
    FAIL() << "a replay that saves more tensors must fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("trying to save more tensors during recomputation"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(RealFerry, ReplayWithOtherShapesFailsTheDeterminismCheck) {
  auto x = torch::randn({8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& h) {
    return calls++ == 0 ? h.sin() : h.narrow(0, 0, 4).sin();
  };
  ferry::CheckpointOptions opts;
  opts.early_stop = false;
  auto out = ferry::checkpoint(fn, x, opts).sum();
  try {
    out.backward();
    FAIL() << "a replay with other metadata must fail";
  } catch (const std::exception& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("different metadata"), std::string::npos) << message;
    EXPECT_NE(message.find("saved metadata: {shape: [8], dtype: float32, device: cpu}"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("recomputed metadata: {shape: [4], dtype: float32, device: cpu}"),
              std::string::npos)
        << message;
  }
}

// Only the shape differs (same bytes, dtype and device): torch's check compares shapes too.
TEST_F(RealFerry, ReplayWithAnotherShapeOfTheSameSizeFailsTheDeterminismCheck) {
  auto x = torch::randn({8}, torch::requires_grad());
  int calls = 0;
  auto fn = [&](const torch::Tensor& h) { return calls++ == 0 ? h.sin() : h.view({2, 4}).sin(); };
  ferry::CheckpointOptions opts;
  opts.early_stop = false;
  auto out = ferry::checkpoint(fn, x, opts).sum();
  try {
    out.backward();
    FAIL() << "a replay saving another shape must fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("recomputed metadata: {shape: [2, 4]"), std::string::npos)
        << e.what();
  }
}

}  // namespace
