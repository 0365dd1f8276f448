#pragma once
// What the real backend's loopback tests share (real_test.cpp, real_loopback_test.cpp,
// real_checkpoint_test.cpp): the options of a run on the CPU loopback device, and a fixture that
// installs ferry and seeds torch.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdlib>

#include "ferry/real/api.hpp"
#include "ferry/real/loopback_streams.hpp"

namespace ferry::testing {

// The loopback device's streams: FERRY_LOOPBACK (sync, async, async:SEED[:MAX_DELAY_US]),
// as ctest sets it for each run of this suite.
inline ferry::real::LoopbackConfig loopback_streams() {
  const char* text = std::getenv("FERRY_LOOPBACK");
  return ferry::real::parse_loopback_streams(text == nullptr ? "" : text, "FERRY_LOOPBACK");
}

/// A run on the loopback device under `policy`: every offloaded tensor of at least `min_bytes`
/// comes back through its host copy.
inline ferry::real::RealOptions loopback(ferry::Policy policy, std::int64_t min_bytes = 0) {
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

/// Installs ferry and seeds torch before each test.
class RealFerry : public ::testing::Test {
 protected:
  void SetUp() override {
    ferry::install();
    torch::manual_seed(0);
  }
};

}  // namespace ferry::testing
