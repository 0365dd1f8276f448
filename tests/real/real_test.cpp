// The real backend on the CPU loopback device: gradients bitwise equal to runs without ferry,
// bookkeeping back to empty after every step, and the reference's errors for misuse.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ferry/real/api.hpp"
#include "ferry/real/loopback_streams.hpp"
#include "grads.hpp"
#include "real_fixtures.hpp"

namespace {

using ferry::testing::expect_bitwise_equal;
using ferry::testing::grads_of;
using ferry::testing::loopback;
using ferry::testing::RealFerry;
using ferry::testing::Tensors;

class Real : public ::testing::TestWithParam<ferry::Policy> {
 protected:
  void SetUp() override {
    ferry::install();
    torch::manual_seed(0);
  }

  // Reference gradients, then the same forward under an offload session (backward outside
  // the guard, as the reference offloader is used); the session must be empty afterwards.
  void check(const Tensors& leaves, const std::function<torch::Tensor()>& forward,
             ferry::real::RealOptions options) {
    const Tensors want = grads_of(leaves, forward);
    ferry::Offload offload(std::move(options));
    const Tensors got = grads_of(leaves, [&] {
      ferry::OffloadGuard guard(offload);
      return forward();
    });
    expect_bitwise_equal(want, got);
    EXPECT_GT(offload.telemetry().packed, 0);
    EXPECT_EQ(offload.tracked(), 0U);
    EXPECT_EQ(offload.live_device_buffers(), 0);
    EXPECT_EQ(offload.session()->races(), 0) << "the asynchronous device saw a race";
    telemetry_ = offload.telemetry();
    if (offload.session()->options().offload.policy != ferry::Policy::None) {
      EXPECT_GT(telemetry_.bytes_h2d.count(), 0) << "nothing came back from host memory";
    }
  }

  ferry::OffloadTelemetry telemetry_;
};

TEST_P(Real, MlpGradientsAreBitwiseEqual) {
  auto w1 = torch::randn({32, 64}, torch::requires_grad());
  auto w2 = torch::randn({64, 16}, torch::requires_grad());
  auto x = torch::randn({8, 32}, torch::requires_grad());
  check(
      {w1, w2, x}, [&] { return (x.matmul(w1).relu().matmul(w2).tanh() * 3).sum(); },
      loopback(GetParam()));
  if (GetParam() != ferry::Policy::None) {
    EXPECT_GT(telemetry_.offloaded, 0);
  }
}

TEST_P(Real, TransformerBlockWithAttention) {
  const std::int64_t b = 2, s = 16, d = 32, h = 4;
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({d}));
  torch::nn::Linear qkv(d, 3 * d), proj(d, d), up(d, 4 * d), down(4 * d, d);
  auto x = torch::randn({b, s, d}, torch::requires_grad());
  Tensors leaves{x};
  for (auto* m : std::initializer_list<torch::nn::Module*>{ln.get(), qkv.get(), proj.get(),
                                                           up.get(), down.get()}) {
    for (const auto& p : m->parameters()) leaves.push_back(p);
  }
  auto block = [&] {
    auto q = qkv->forward(ln->forward(x)).view({b, s, 3, h, d / h}).permute({2, 0, 3, 1, 4});
    auto att = q[0].matmul(q[1].transpose(-2, -1)) / std::sqrt(8.0);
    att = att.masked_fill(torch::ones({s, s}, torch::kBool).triu(1), -1e9).softmax(-1);
    auto y = x + proj->forward(att.matmul(q[2]).transpose(1, 2).reshape({b, s, d}));
    return (y + down->forward(torch::gelu(up->forward(ln->forward(y))))).pow(2).mean();
  };
  check(leaves, block, loopback(GetParam()));
}

TEST_P(Real, ViewsBroadcastsAndNonContiguousSavedTensors) {
  auto base = torch::randn({6, 10}, torch::requires_grad());
  auto row = torch::randn({10}, torch::requires_grad());
  check(
      {base, row},
      [&] {
        auto t = base * 2;                           // a fresh storage
        auto tr = t.t();                             // transposed view
        auto sl = t.narrow(0, 2, 3);                 // a view at an offset
        auto ex = row.unsqueeze(0).expand({6, 10});  // stride 0
        auto st = t.as_strided({3, 3}, {7, 2}, 1);   // arbitrary strides
        return (tr.sin() * 1.5).sum() + (sl * sl).sum() + (ex * t).exp().sum() +
               st.cos().pow(3).sum();
      },
      loopback(GetParam()));
}

TEST_P(Real, ParametersAndExcludedBuffersAreKept) {
  auto w = torch::randn({16, 16}, torch::requires_grad());  // a leaf that needs grad
  auto running = torch::randn({16});                        // a module buffer
  auto x0 = torch::randn({4, 16}, torch::requires_grad());
  ferry::real::RealOptions o = loopback(GetParam());
  const Tensors want = grads_of({w, x0}, [&] { return ((x0 * 1).matmul(w) * running).sum(); });
  ferry::Offload offload(o);
  offload.exclude({running});
  const Tensors got = grads_of({w, x0}, [&] {
    ferry::OffloadGuard guard(offload);
    return ((x0 * 1).matmul(w) * running).sum();
  });
  expect_bitwise_equal(want, got);
  const auto t = offload.telemetry();
  // Saved: mm saves x (offloaded) and w (a parameter, kept); mul saves the buffer (excluded,
  // kept) for the product's gradient.
  EXPECT_EQ(t.packed, 3);
  if (GetParam() != ferry::Policy::None) {
    EXPECT_EQ(t.offloaded, 1);
    EXPECT_EQ(t.kept, 2);
  }
}

TEST_P(Real, SharedStorages) {
  auto x = torch::randn({8, 8}, torch::requires_grad());
  check(
      {x},
      [&] {
        auto t = x.exp();
        auto a = t.narrow(0, 0, 4);
        auto b = t.narrow(0, 4, 4);
        return (a * b).sum() + (a.t() * 2).sin().sum();
      },
      loopback(GetParam()));
  if (GetParam() == ferry::Policy::Ferry) {
    EXPECT_GT(telemetry_.deduplicated, 0);
  }
}

TEST_P(Real, NoOffloadRegionKeepsItsTensors) {
  auto x = torch::randn({8, 8}, torch::requires_grad());
  auto forward = [&](bool region) {
    auto a = x.sin();
    torch::Tensor b;
    {
      std::optional<ferry::NoOffloadGuard> keep;
      if (region) keep.emplace();
      b = a.exp() * a;
    }
    return (b.tanh() * a).sum();
  };
  const Tensors want = grads_of({x}, [&] { return forward(false); });
  ferry::Offload offload(loopback(GetParam()));
  const Tensors got = grads_of({x}, [&] {
    ferry::OffloadGuard guard(offload);
    return forward(true);
  });
  expect_bitwise_equal(want, got);
  // exp's result and the inner mul's two inputs are saved inside the region: the session never
  // sees them. It sees sin's input, tanh's result and the last mul's two inputs.
  EXPECT_EQ(offload.telemetry().packed, 4);
  EXPECT_EQ(offload.tracked(), 0U);
}

// What the exception of `fn` says (empty when it throws none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// Note [Saved-tensor contract]: a saved tensor changed in place fails backward as it does
// without ferry, whether it stayed on the device or came back from the host.
TEST_P(Real, ASavedTensorChangedInPlaceFailsBackwardAsWithoutFerry) {
  const auto step = [](bool offloaded, ferry::Offload* offload) {
    auto w = torch::randn({8, 8}, torch::requires_grad());
    auto x = torch::randn({4, 8}, torch::requires_grad());
    torch::Tensor loss;
    {
      std::optional<ferry::OffloadGuard> guard;
      if (offloaded) guard.emplace(*offload);
      auto h = x.mm(w);
      auto y = h.sin();
      {
        torch::NoGradGuard no_grad;
        h.mul_(2);
      }
      loss = y.sum();
    }
    loss.backward();
  };
  const std::string plain = error_of([&] { step(false, nullptr); });
  ferry::Offload offload(loopback(GetParam()));
  const std::string ours = error_of([&] { step(true, &offload); });
  ASSERT_NE(plain.find("modified by an inplace operation"), std::string::npos) << plain;
  EXPECT_NE(ours.find("modified by an inplace operation"), std::string::npos) << ours;
  EXPECT_NE(ours.find("which is output 0 of MmBackward0, is at version 1; expected version 0"),
            std::string::npos)
      << ours;
}

INSTANTIATE_TEST_SUITE_P(Policies, Real,
                         ::testing::Values(ferry::Policy::Ferry, ferry::Policy::Trl,
                                           ferry::Policy::None),
                         [](const auto& p) { return std::string(ferry::policy_name(p.param)); });

TEST_F(RealFerry, RetainGraphAndDoubleBackward) {
  auto x = torch::randn({6, 6}, torch::requires_grad());
  auto forward = [&] { return (x.sin() * x.exp()).matmul(x).sum(); };
  // Reference: two backwards over one graph, then a gradient of a gradient.
  auto y = forward();
  y.backward({}, /*retain_graph=*/true);
  y.backward();
  const auto want_twice = x.grad().clone();
  x.mutable_grad().reset();
  auto g = torch::autograd::grad({forward()}, {x}, {}, true, true)[0];
  g.pow(2).sum().backward();
  const auto want_double = x.grad().clone();
  x.mutable_grad().reset();

  ferry::Offload offload(loopback(ferry::Policy::Ferry));
  torch::Tensor y2;
  {
    ferry::OffloadGuard guard(offload);
    y2 = forward();
  }
  y2.backward({}, true);
  y2.backward();
  EXPECT_TRUE(torch::equal(x.grad(), want_twice));
  x.mutable_grad().reset();
  torch::Tensor y3;
  {
    ferry::OffloadGuard guard(offload);
    y3 = forward();
  }
  auto g2 = torch::autograd::grad({y3}, {x}, {}, true, true)[0];
  g2.pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), want_double));
  y2 = y3 = g2 = torch::Tensor();
  EXPECT_EQ(offload.tracked(), 0U);
  EXPECT_EQ(offload.live_device_buffers(), 0);
}

TEST_F(RealFerry, TrlRejectsASecondUnpackLikeTheReference) {
  auto x = torch::randn({64}, torch::requires_grad());
  ferry::Offload offload(loopback(ferry::Policy::Trl));
  torch::Tensor y;
  {
    ferry::OffloadGuard guard(offload);
    y = (x.exp() * 2).sum();
  }
  y.backward({}, true);
  try {
    y.backward();
    FAIL() << "a second backward through trl must fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("untracked tensor with id"), std::string::npos)
        << e.what();
  }
}

// Today's reference clears what an unused branch left when the context is entered again.
// One step whose second branch is never backpropagated: its saved tensors stay tracked.
void step_with_an_unused_branch(ferry::Offload& offload, const torch::Tensor& x) {
  torch::Tensor used, unused;
  {
    ferry::OffloadGuard guard(offload);
    used = (x.exp() * 2).sum();
    unused = (x.sin() * 2).sum();
  }
  used.backward();
  EXPECT_GT(offload.tracked(), 0U);
}

TEST_F(RealFerry, TrlClearsAStaleTrackerOnTheNextEntry) {
  auto x = torch::randn({64}, torch::requires_grad());
  ferry::Offload offload(loopback(ferry::Policy::Trl));
  step_with_an_unused_branch(offload, x);
  ferry::OffloadGuard guard(offload);
  EXPECT_EQ(offload.tracked(), 0U);
  auto next = (x.cos() * 2).sum();
  next.backward();
  EXPECT_EQ(offload.tracked(), 0U);
}

// As first released, the reference refused the next forward instead.
TEST_F(RealFerry, TrlSeedRejectsANewForwardWithATrackerNotEmpty) {
  auto x = torch::randn({64}, torch::requires_grad());
  ferry::Offload offload(loopback(ferry::Policy::TrlSeed));
  step_with_an_unused_branch(offload, x);
  ferry::OffloadGuard guard(offload);
  try {
    (void)(x.cos() * 2);
    FAIL() << "the next forward must fail while the tracker is not empty";
  } catch (const std::exception& e) {
    EXPECT_NE(
        std::string(e.what()).find("Backward pass should have cleared tracker of all tensors"),
        std::string::npos)
        << e.what();
  }
}

TEST_F(RealFerry, TrlStashSizeMustBePositive) {
  ferry::real::RealOptions o = loopback(ferry::Policy::Trl);
  o.offload.trl_stash_count = 0;
  EXPECT_THROW(
      {
        try {
          ferry::Offload offload(o);
        } catch (const ferry::OffloadError& e) {
          EXPECT_STREQ(e.what(), "max_fwd_stash_size should be at least 1");
          throw;
        }
      },
      ferry::OffloadError);
}

TEST_F(RealFerry, NegativeSizesAreRejectedByName) {
  ferry::real::RealOptions o = loopback(ferry::Policy::Ferry);
  o.offload.window_bytes = ferry::Bytes(-5);
  try {
    ferry::Offload offload(o);
    FAIL() << "a negative window must be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("window_bytes must not be negative"), std::string::npos)
        << e.what();
  }
}

TEST_F(RealFerry, NoCudaWithoutLoopbackIsAClearError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  ferry::real::RealOptions o;
  try {
    ferry::Offload offload(o);
    FAIL() << "a CUDA session without CUDA must fail";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("loopback"), std::string::npos) << e.what();
  }
}

// Note [Views of parameters]: `w.t()` is the weight's memory; only the input is copied out.
TEST_F(RealFerry, AViewOfAParameterStaysAsTheParameterDoes) {
  ferry::real::RealOptions o = loopback(ferry::Policy::Ferry);
  ferry::Offload offload(o);
  auto w = torch::randn({64, 64}, torch::requires_grad());
  auto input = torch::randn({8, 64}, torch::requires_grad());
  torch::Tensor loss;
  torch::Tensor x;
  {
    ferry::OffloadGuard guard(offload);
    x = input * 2;  // an activation (a leaf that requires grad counts as a parameter)
    loss = torch::mm(x, w.t()).sum();
  }
  loss.backward();
  EXPECT_EQ(offload.telemetry().bytes_d2h.count(), x.numel() * 4);
  EXPECT_GE(offload.telemetry().kept, 1);
}

TEST_F(RealFerry, RegionsMustNest) {
  ferry::Offload offload(loopback(ferry::Policy::Ferry));
  auto guard = std::make_unique<ferry::OffloadGuard>(offload);
  auto keep = std::make_unique<ferry::NoOffloadGuard>();
  EXPECT_THROW(ferry::real::pop_context(ferry::real::Context::Kind::Offload), std::logic_error);
  // Guards destroyed out of order close their own region (with a warning), never throw.
  guard.reset();
  EXPECT_FALSE(ferry::real::packing_active());  // the no-offload region is still open
  keep.reset();
  auto x = torch::randn({64}, torch::requires_grad());
  (void)(x.exp() * 2).sum();
  EXPECT_EQ(offload.telemetry().packed, 0);  // nothing open: nothing reached the session
}

TEST_F(RealFerry, FiftyStepsLeaveNothingBehind) {
  for (const ferry::Policy policy : {ferry::Policy::Ferry, ferry::Policy::Trl}) {
    torch::nn::Sequential mlp(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64), torch::nn::GELU(),
                              torch::nn::Linear(64, 8));
    torch::optim::SGD sgd(mlp->parameters(), 0.01);
    ferry::real::RealOptions o = loopback(policy);
    o.offload.window_bytes = ferry::Bytes(0);  // every original leaves: backward reloads
    ferry::Offload offload(o);
    std::int64_t host_after_first = -1;
    for (int step = 0; step < 50; ++step) {
      auto x = torch::randn({16, 32});
      sgd.zero_grad();
      torch::Tensor loss;
      {
        ferry::OffloadGuard guard(offload);
        loss = mlp->forward(x).pow(2).mean();
      }
      loss.backward();
      sgd.step();
      loss = torch::Tensor();
      ASSERT_EQ(offload.tracked(), 0U) << "step " << step;
      ASSERT_EQ(offload.live_device_buffers(), 0) << "step " << step;
      if (host_after_first < 0) host_after_first = offload.live_host_buffers();
      ASSERT_EQ(offload.live_host_buffers(), host_after_first) << "step " << step;
    }
    const auto t = offload.telemetry();
    EXPECT_GT(t.bytes_h2d.count(), 0) << ferry::policy_name(policy);
    if (policy == ferry::Policy::Trl) {
      EXPECT_EQ(host_after_first, 0);
    }
  }
}

}  // namespace
