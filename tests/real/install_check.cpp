// ferry::install() in a fresh process: it succeeds first thing, and refuses clearly when
// autograd was used before it or when another engine took the default-engine slot.
//   install_check ok | too-late | other-engine

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <iostream>
#include <string>

#include "ferry/real/api.hpp"

namespace {
struct OtherEngine : torch::autograd::Engine {
  ~OtherEngine() override { stop(); }
  static torch::autograd::Engine& get() {
    static OtherEngine engine;
    return engine;
  }
};
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ok";
  try {
    if (mode == "too-late") {
      auto x = torch::randn({4}, at::requires_grad());
      (x * x).sum().backward();
    } else if (mode == "other-engine") {
      torch::autograd::set_default_engine_stub(&OtherEngine::get);
    }
    ferry::install();
    ferry::install();  // idempotent
    std::cout << "installed: " << ferry::installed() << "\n";
    // Saved tensors now reach ferry: one offload round trip on the loopback device.
    ferry::real::RealOptions o;
    o.loopback = true;
    o.offload.min_bytes = ferry::Bytes(0);
    ferry::Offload offload(o);
    auto x = torch::randn({16}, at::requires_grad());
    at::Tensor y;
    {
      ferry::OffloadGuard guard(offload);
      y = x.exp().sum();
    }
    y.backward();
    std::cout << "packed: " << offload.telemetry().packed << "\n";
    return offload.telemetry().packed == 1 && at::equal(x.grad(), x.exp()) ? 0 : 1;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << "\n";
    return 3;
  }
}
