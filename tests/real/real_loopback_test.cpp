// The asynchronous loopback device (Note [The asynchronous loopback device]): each planted
// ordering fault gives wrong gradients, the FERRY_LOOPBACK text, and the loopback streams'
// copies, releases and delays.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/real/api.hpp"
#include "ferry/real/loopback_streams.hpp"
#include "grads.hpp"
#include "real_fixtures.hpp"

namespace {

using ferry::testing::grads_of;
using ferry::testing::loopback;
using ferry::testing::Tensors;

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

}  // namespace
