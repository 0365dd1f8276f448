// The real backend on the CPU loopback device: gradients bitwise equal to runs without ferry,
// bookkeeping back to empty after every step, and the reference's errors for misuse.

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "ferry/real/api.hpp"
#include "ferry/real/loopback_streams.hpp"
#include "grads.hpp"

namespace {

using ferry::testing::expect_bitwise_equal;
using ferry::testing::grads_of;
using ferry::testing::Tensors;

// The loopback device's streams: FERRY_LOOPBACK (sync, async, async:SEED[:MAX_DELAY_US]),
// as ctest sets it for each run of this suite.
ferry::real::LoopbackConfig loopback_streams() {
  const char* text = std::getenv("FERRY_LOOPBACK");
  return ferry::real::parse_loopback_streams(text == nullptr ? "" : text, "FERRY_LOOPBACK");
}

ferry::real::RealOptions loopback(ferry::Policy policy, std::int64_t min_bytes = 0) {
  ferry::real::RealOptions o;
  o.loopback = true;
  o.loopback_streams = loopback_streams();
  o.offload.policy = policy;
  o.offload.min_bytes = ferry::Bytes(min_bytes);
  // No original stays on the device for backward: every offloaded tensor comes back through
  // its host copy.
  o.offload.window_bytes = ferry::Bytes(0);
  o.offload.trl_stash_count = 1;
  return o;
}

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

class RealFerry : public ::testing::Test {
 protected:
  void SetUp() override {
    ferry::install();
    torch::manual_seed(0);
  }
};

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

// Note [The asynchronous loopback device]: with a synchronization dropped, copies that run
// late on worker threads make a training step's gradients wrong (poison is NaN), where the
// same step without the fault gives torch's gradients. A race shows with some probability per
// copy, not with certainty (the threads' interleaving is the system's), so each fault gets up
// to ten seeds and must show in one of them; the run without it must be right for each. The
// stream whose lateness the race needs runs 50 ms behind (LoopbackConfig::slow_stream), far
// longer than a loaded host takes between the two accesses, so the race does not depend on how
// the system schedules the threads.
struct PlantedOrdering {
  const char* name;
  ferry::Policy policy;
  ferry::OffloadFaults faults;
  const char* slow_stream;         // the stream the race needs behind (TRL's copies: "offload")
  bool side_stream = false;        // forward and backward on a second compute stream
  bool frozen_first_step = false;  // the first step leaves a branch's reloads unread
};

void PrintTo(const PlantedOrdering& p, std::ostream* os) { *os << p.name; }

class AsyncLoopback : public ::testing::TestWithParam<PlantedOrdering> {
 protected:
  void SetUp() override { ferry::install(); }
};

// One MLP step on the asynchronous device; true when every gradient is torch's.
bool step_is_right(const PlantedOrdering& p, std::uint64_t seed, bool planted) {
  torch::manual_seed(0);
  const auto mlp = [] {
    return torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::GELU(),
                                 torch::nn::Linear(256, 256), torch::nn::Tanh(),
                                 torch::nn::Linear(256, 8));
  };
  // Two branches; the first step of a frozen-branch run asks for the gradients of `trained`
  // only, so the tensors `frozen` saved are prefetched but never unpacked, and their host
  // buffers go back to the pool while the reloads may still read them (the next forward packs
  // `frozen` first and takes those buffers again).
  torch::nn::Sequential frozen = mlp();
  torch::nn::Sequential trained = mlp();
  const Tensors all = [&] {
    Tensors out = trained->parameters();
    for (const auto& t : frozen->parameters()) out.push_back(t);
    return out;
  }();
  const auto x = torch::randn({64, 64});
  const auto loss = [&] {
    // The frozen branch first: backward reloads its tensors last, after every reload that
    // compute waits for.
    const torch::Tensor frozen_loss = frozen->forward(x).pow(2).mean();
    return trained->forward(x).pow(2).mean() + frozen_loss;
  };
  const auto grads = [&](bool only_trained, const std::function<torch::Tensor()>& loss_fn) {
    if (!only_trained) return grads_of(all, loss_fn);
    return Tensors(torch::autograd::grad({loss_fn()}, trained->parameters()));
  };
  ferry::real::RealOptions o = loopback(p.policy);
  o.loopback_streams.async = true;
  o.loopback_streams.seed = seed;
  o.loopback_streams.max_delay = std::chrono::microseconds(2000);
  // A reload nobody waits for is still in flight when backward reads it, a D2H copy still to
  // run when the original it reads is let go, a producer's kernel still running when a copy
  // that does not wait for it reads its output, an unread reload still in flight when the next
  // step takes its pinned buffer: whatever the machine's load (under the sanitizers too).
  o.loopback_streams.slow_stream = p.slow_stream;
  o.loopback_streams.slow_by = std::chrono::microseconds(50000);
  o.offload.window_bytes = ferry::Bytes(1);  // every original leaves after a few copies
  // Prefetch all of a frozen branch: each of its tensors is reloaded and left unread.
  o.offload.prefetch_bytes = ferry::Bytes(p.frozen_first_step ? 1 << 20 : 1);
  ferry::Offload offload(o, planted ? p.faults : ferry::OffloadFaults{});
  offload.exclude(all);
  // torch's gradients first: the steps under ferry follow each other with nothing between.
  std::vector<Tensors> want;
  for (int step = 0; step < 2; ++step)
    want.push_back(grads(p.frozen_first_step && step == 0, loss));
  bool right = true;
  for (int step = 0; step < 2; ++step) {
    if (p.side_stream) offload.session()->set_current_stream("side");
    const Tensors got = grads(p.frozen_first_step && step == 0, [&] {
      ferry::OffloadGuard guard(offload);
      return loss();
    });
    if (p.side_stream) offload.session()->set_current_stream("compute");
    for (std::size_t i = 0; i < got.size(); ++i)
      right = right && torch::equal(want[step][i], got[i]);
  }
  return right;
}

TEST_P(AsyncLoopback, APlantedOrderingFaultGivesWrongGradients) {
  const PlantedOrdering& p = GetParam();
  bool noticed = false;
  for (std::uint64_t seed = 1; seed <= 10 && !noticed; ++seed) {
    ASSERT_TRUE(step_is_right(p, seed, /*planted=*/false)) << "seed " << seed << " without fault";
    noticed = !step_is_right(p, seed, /*planted=*/true);
  }
  EXPECT_TRUE(noticed) << p.name << " went unnoticed with ten seeds";
}

ferry::OffloadFaults fault(bool ferry::OffloadFaults::*which) {
  ferry::OffloadFaults f;
  f.*which = true;
  return f;
}

INSTANTIATE_TEST_SUITE_P(
    Faults, AsyncLoopback,
    ::testing::Values(
        PlantedOrdering{"ferry_skip_reload_wait", ferry::Policy::Ferry,
                        fault(&ferry::OffloadFaults::skip_reload_wait), "h2d"},
        PlantedOrdering{"trl_skip_reload_wait", ferry::Policy::Trl,
                        fault(&ferry::OffloadFaults::skip_reload_wait), "offload"},
        PlantedOrdering{"ferry_skip_offload_wait", ferry::Policy::Ferry,
                        fault(&ferry::OffloadFaults::skip_offload_wait), "compute"},
        PlantedOrdering{"trl_skip_offload_wait", ferry::Policy::Trl,
                        fault(&ferry::OffloadFaults::skip_offload_wait), "compute"},
        PlantedOrdering{"ferry_skip_forward_guard", ferry::Policy::Ferry,
                        fault(&ferry::OffloadFaults::skip_forward_guard), "d2h"},
        PlantedOrdering{"trl_skip_forward_guard", ferry::Policy::Trl,
                        fault(&ferry::OffloadFaults::skip_forward_guard), "offload"},
        PlantedOrdering{"ferry_reuse_pinned_early", ferry::Policy::Ferry,
                        fault(&ferry::OffloadFaults::reuse_pinned_early), "h2d", false, true},
        PlantedOrdering{"ferry_stale_compute_stream", ferry::Policy::Ferry,
                        fault(&ferry::OffloadFaults::stale_compute_stream), "side", true},
        PlantedOrdering{"trl_stale_compute_stream", ferry::Policy::Trl,
                        fault(&ferry::OffloadFaults::stale_compute_stream), "side", true}),
    [](const auto& test) { return std::string(test.param.name); });

TEST(LoopbackConfigText, ParsesEveryFormAndNamesThePlaceOfAnError) {
  using ferry::real::parse_loopback_streams;
  EXPECT_FALSE(parse_loopback_streams("", "X").async);
  EXPECT_FALSE(parse_loopback_streams("sync", "X").async);
  EXPECT_EQ(parse_loopback_streams("async", "X").seed, 0U);
  EXPECT_EQ(parse_loopback_streams("async:7", "X").seed, 7U);
  const auto full = parse_loopback_streams("async:7:250", "X");
  EXPECT_EQ(full.max_delay, std::chrono::microseconds(250));
  EXPECT_EQ(ferry::real::to_string(full), "async:7:250");
  for (const char* bad :
       {"asnyc", "async:", "async:x", "async:1:", "async:1:2:3", "async:-1", "async:1:2000000"}) {
    try {
      (void)parse_loopback_streams(bad, "FERRY_LOOPBACK");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("FERRY_LOOPBACK"), std::string::npos) << e.what();
    }
  }
}

using Block = ferry::real::LoopbackStreams::Block;
using Release = ferry::real::LoopbackStreams::Release;

/// Loopback streams of `config` with two streams: 0 computes ("compute"), 1 copies ("d2h").
std::unique_ptr<ferry::real::LoopbackStreams> compute_and_d2h(
    const ferry::real::LoopbackConfig& config) {
  auto streams = ferry::real::make_loopback_streams(config);
  streams->add_stream(0, /*compute=*/true, "compute");
  streams->add_stream(1, /*compute=*/false, "d2h");
  return streams;
}

TEST(InlineLoopbackStreams, CopyAndLetGoAtOnce) {
  const auto streams = compute_and_d2h({});
  ferry::real::LoopbackStreams& s = *streams;
  std::vector<std::uint8_t> device(64, 1);
  std::vector<std::uint8_t> host(64, 0);
  s.allocated(Block{&host, host.data(), host.size(), nullptr});
  s.copy(1, Block{&device, device.data(), device.size(), nullptr}, 0,
         Block{&host, host.data(), host.size(), nullptr}, 0, 64);
  EXPECT_EQ(host, device);
  EXPECT_FALSE(s.record(1));  // nothing to wait for
  bool asked = false;
  bool released = false;
  s.release(Block{&device, device.data(), device.size(), nullptr}, {0, 1},
            Release{[&] { return asked = true; }, [&] { released = true; }});
  EXPECT_FALSE(asked);
  EXPECT_TRUE(released);
  EXPECT_EQ(device, std::vector<std::uint8_t>(64, 1));
  EXPECT_EQ(s.races(), 0);
}

// Both callbacks of a Release may call back into the streams: under their lock such a call
// would never return.
TEST(AsyncLoopbackStreams, RunReleaseCallbacksWithTheLockDropped) {
  ferry::real::LoopbackConfig config;
  config.async = true;
  config.seed = 1;
  config.max_delay = std::chrono::microseconds(100);
  const auto streams = compute_and_d2h(config);
  ferry::real::LoopbackStreams& s = *streams;
  std::vector<std::uint8_t> device(64, 1);
  std::vector<std::uint8_t> host(64, 0);
  const Block src{&device, device.data(), device.size(), nullptr};
  s.copy(1, src, 0, Block{&host, host.data(), host.size(), nullptr}, 0, 64);
  s.wait(0, s.record(1));  // the host waits for the worker's signal
  EXPECT_EQ(host, device);
  std::atomic<bool> asked{false};
  std::atomic<bool> released{false};
  s.release(src, {0, 1},
            Release{[&] {
                      asked = s.races() == 0;
                      return true;
                    },
                    [&] { released = s.races() == 0; }});
  // The host lets go of a poisoned block at its next call.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!released && std::chrono::steady_clock::now() < until) s.synchronize(0);
  EXPECT_TRUE(asked);
  EXPECT_TRUE(released);
  EXPECT_EQ(device, std::vector<std::uint8_t>(64, 0xFF));  // the sole holder: poisoned
}

// LoopbackConfig::slow_stream naming a compute stream: its work ends slow_by later, so a copy
// that does not wait for it reads the block before it is written (a race, poison), and the same
// copy after the copy stream waits for the compute stream reads what was written.
TEST(AsyncLoopbackStreams, ASlowComputeStreamEndsItsWorkThatMuchLater) {
  ferry::real::LoopbackConfig config;
  config.async = true;
  config.seed = 1;
  config.max_delay = std::chrono::microseconds(0);
  config.slow_stream = "compute";
  config.slow_by = std::chrono::microseconds(50000);
  const auto streams = compute_and_d2h(config);
  ferry::real::LoopbackStreams& s = *streams;
  std::vector<std::uint8_t> device(64, 1);
  std::vector<std::uint8_t> host(64, 0);
  const Block src{&device, device.data(), device.size(), nullptr};
  const Block dst{&host, host.data(), host.size(), nullptr};
  s.produced(src);
  s.copy(1, src, 0, dst, 0, 64);  // no wait for the compute stream
  s.synchronize(1);
  EXPECT_EQ(s.races(), 1);
  EXPECT_EQ(host, std::vector<std::uint8_t>(64, 0xFF));
  s.produced(src);
  s.wait(1, s.record(0));
  s.copy(1, src, 0, dst, 0, 64);
  s.synchronize(1);
  EXPECT_EQ(s.races(), 1);
  EXPECT_EQ(host, device);
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
  ferry::Offload offload(loopback(ferry::Policy::Ferry));
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
  ferry::Offload offload(loopback(ferry::Policy::Ferry));
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
