// The real backend on CUDA: the loopback gradient checks on the GPU, and copies that overlap
// compute. Every test skips where no CUDA device is present.

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ferry/real/api.hpp"
#include "grads.hpp"

namespace {

class Gpu : public ::testing::TestWithParam<ferry::Policy> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    ferry::install();
    torch::manual_seed(0);
  }
};

TEST_P(Gpu, GradientsAreBitwiseEqualOnCuda) {
  const auto opts = torch::TensorOptions().device(torch::kCUDA).requires_grad(true);
  auto w1 = torch::randn({256, 512}, opts);
  auto w2 = torch::randn({512, 256}, opts);
  auto x = torch::randn({64, 256}, opts);
  auto forward = [&] {
    auto h = x.matmul(w1).relu();
    auto v = h.t().contiguous().t();  // a non-contiguous view of a fresh storage
    auto a = h.narrow(0, 8, 32);
    return (v.matmul(w2).tanh() * 3).sum() + (a * a).sum() + torch::gelu(h).mean();
  };
  const auto want = ferry::testing::grads_of({w1, w2, x}, forward);
  ferry::real::RealOptions o;
  o.offload.policy = GetParam();
  o.offload.min_bytes = ferry::Bytes(0);
  o.offload.window_bytes = ferry::Bytes(0);
  ferry::Offload offload(o);
  for (int step = 0; step < 3; ++step) {
    const auto got = ferry::testing::grads_of({w1, w2, x}, [&] {
      ferry::OffloadGuard guard(offload);
      return forward();
    });
    torch::cuda::synchronize();
    ferry::testing::expect_bitwise_equal(want, got);
    EXPECT_EQ(offload.tracked(), 0U);
    EXPECT_EQ(offload.live_device_buffers(), 0);
  }
  EXPECT_GT(offload.telemetry().bytes_h2d.count(), 0);
}

TEST_P(Gpu, CheckpointWithDropoutOnCuda) {
  const auto opts = torch::TensorOptions().device(torch::kCUDA).requires_grad(true);
  auto w = torch::randn({128, 128}, opts);
  auto x = torch::randn({32, 128}, opts);
  auto block = [&](const torch::Tensor& h) {
    return torch::dropout(h.matmul(w), 0.3, true).sin().matmul(w);
  };
  torch::manual_seed(3);
  const auto want = ferry::testing::grads_of({w, x}, [&] { return block(x).pow(2).sum(); });
  ferry::real::RealOptions o;
  o.offload.policy = GetParam();
  ferry::Offload offload(o);
  torch::manual_seed(3);
  const auto got = ferry::testing::grads_of({w, x}, [&] {
    ferry::OffloadGuard guard(offload);
    return ferry::checkpoint(block, x * 1).pow(2).sum();
  });
  ferry::testing::expect_bitwise_equal(want, got);
}

INSTANTIATE_TEST_SUITE_P(Policies, Gpu, ::testing::Values(ferry::Policy::Ferry, ferry::Policy::Trl),
                         [](const auto& p) { return std::string(ferry::policy_name(p.param)); });

// Copies on ferry's streams overlap compute: a forward whose saved tensors are offloaded takes
// much less than the compute alone plus the copies alone (CUDA event timing).
TEST(GpuOverlap, OffloadCopiesOverlapCompute) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ferry::install();
  const auto opts = torch::TensorOptions().device(torch::kCUDA);
  auto w = torch::randn({4096, 4096}, opts.requires_grad(true));
  auto x = torch::randn({4096, 4096}, opts);
  auto timed = [&](const std::function<void()>& body) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    auto stream = c10::cuda::getCurrentCUDAStream();
    torch::cuda::synchronize();
    start.record(stream);
    body();
    torch::cuda::synchronize();  // includes the copy streams
    stop.record(stream);
    stop.synchronize();
    return static_cast<double>(start.elapsed_time(stop));
  };
  auto forward = [&] {
    torch::Tensor h = x;
    for (int i = 0; i < 8; ++i) h = (h.matmul(w) * 1e-3).tanh();
    return h;
  };
  ferry::real::RealOptions o;
  ferry::Offload offload(o);
  (void)timed([&] { (void)forward(); });  // warm-up
  const double compute = timed([&] { (void)forward(); });
  auto saved = torch::randn({8, 4096, 4096}, opts);
  auto host = torch::empty({8, 4096, 4096}, torch::TensorOptions().pinned_memory(true));
  const double copies = timed([&] { host.copy_(saved, true); });
  torch::Tensor out;
  auto offloaded = [&] {
    ferry::OffloadGuard guard(offload);
    out = forward();
  };
  // The first offloaded forward pins the host pool (cudaHostAlloc); later ones reuse it.
  const double first = timed(offloaded);
  out = torch::Tensor();
  const double both = timed(offloaded);
  out = torch::Tensor();
  RecordProperty("compute_ms", std::to_string(compute));
  RecordProperty("copies_ms", std::to_string(copies));
  RecordProperty("both_ms", std::to_string(both));
  RecordProperty("first_ms", std::to_string(first));
  std::cout << "compute " << compute << " ms, copies " << copies << " ms, offloaded forward "
            << both << " ms (the first, pinning its host pool: " << first << " ms)\n";
  EXPECT_GT(offload.telemetry().offloaded, 0);
  EXPECT_LT(both, 0.9 * (compute + copies));
}

}  // namespace
