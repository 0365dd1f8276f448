#include "ferry/real/api.hpp"

#include <ATen/SavedTensorHooks.h>
#include <ATen/SequenceNumber.h>
#include <c10/util/Type.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <typeinfo>

namespace ferry {

namespace {

using torch::autograd::Engine;

// The saved-variable hooks ferry's engine hands autograd: pack and unpack go through the
// innermost region of the thread that saves the tensor.
class EngineHooks final : public torch::autograd::SavedVariableHooks {
 public:
  void call_pack_hook(const at::Tensor& tensor) override { packed_ = real::pack_saved(tensor); }
  at::Tensor call_unpack_hook() override { return packed_->unpack(); }

 private:
  real::PackedPtr packed_;
};

// Note [Default saved-tensor hooks in C++]
// Autograd asks the default engine for hooks each time it saves a tensor; the base engine has
// none, and only Python's saved_tensors_hooks can push some. An engine subclass installed with
// set_default_engine_stub answers with ferry's hooks while a region is open on the saving
// thread, and honors torch's own switch that disables saved-tensor hooks.
class FerryEngine final : public Engine {
 public:
  ~FerryEngine() override { stop(); }
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (!at::SavedTensorDefaultHooks::is_enabled() || !real::packing_active()) return nullptr;
    return std::make_unique<EngineHooks>();
  }
  static Engine& get() {
    static FerryEngine engine;
    return engine;
  }
};

std::mutex install_mutex;

}  // namespace

bool installed() { return dynamic_cast<FerryEngine*>(&Engine::get_default_engine()) != nullptr; }

void install() {
  std::lock_guard lock(install_mutex);
  Engine& current = Engine::get_default_engine();
  if (dynamic_cast<FerryEngine*>(&current) != nullptr) return;
  if (typeid(current) != typeid(Engine)) {
    throw std::logic_error(fmt::format(
        "ferry::install: another autograd engine ({}) already took the default-engine slot; "
        "ferry's C++ hooks cannot be installed in this process (from Python, use the ferry "
        "module instead)",
        c10::demangle(typeid(current).name())));
  }
  if (const std::uint64_t used = at::sequence_number::peek(); used != 0) {
    throw std::logic_error(fmt::format(
        "ferry::install: called too late: autograd already recorded {} operation(s) on this "
        "thread; call ferry::install() before any autograd use (first thing in main)",
        used));
  }
  torch::autograd::set_default_engine_stub(&FerryEngine::get);
}

Offload::Offload(real::RealOptions options) : session_(real::Session::create(options)) {}

Offload::Offload(real::RealOptions options, const OffloadFaults& faults)
    : session_(real::Session::create(options, faults)) {}

void Offload::exclude(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) session_->exclude(t);
}

OffloadGuard::OffloadGuard(Offload& offload) : offload_(&offload) {
  install();
  offload_->session()->enter();
  real::push_context(real::Context{real::Context::Kind::Offload, offload_->session(), nullptr, {}});
}

OffloadGuard::OffloadGuard(real::RealOptions options)
    : OffloadGuard(std::make_shared<Offload>(std::move(options))) {}

OffloadGuard::OffloadGuard(std::shared_ptr<Offload> owned) : OffloadGuard(*owned) {
  owned_ = std::move(owned);
}

OffloadGuard::~OffloadGuard() {
  real::close_context(real::Context::Kind::Offload);
  try {
    offload_->session()->exit();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry: warning: leaving an offload region failed: %s\n", e.what());
  }
}

NoOffloadGuard::NoOffloadGuard() { real::push_context(real::Context{}); }

NoOffloadGuard::~NoOffloadGuard() { real::close_context(real::Context::Kind::NoOffload); }

std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                   CheckpointOptions options) {
  install();
  if (options.use_reentrant) return real::checkpoint_reentrant(fn, inputs, options);
  // The runtime hands the inputs back detached, leaves excepted (the same objects, as torch).
  auto replay = [fn](const std::vector<at::Tensor>& saved) { (void)fn(saved); };
  const real::FrameToken token = real::frame_begin(options, std::move(replay), inputs);
  std::vector<at::Tensor> out;
  try {
    out = fn(inputs);
  } catch (...) {
    real::frame_end(token);
    throw;
  }
  real::frame_end(token);
  return out;
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, CheckpointOptions options) {
  return checkpoint([fn](const std::vector<at::Tensor>& in) { return std::vector{fn(in[0])}; },
                    {input}, options)[0];
}

at::Tensor checkpoint_sequential(const std::vector<SequentialFn>& functions, std::int64_t segments,
                                 const at::Tensor& input, CheckpointOptions options) {
  const auto n = static_cast<std::int64_t>(functions.size());
  if (segments < 1 || segments > std::max<std::int64_t>(n, 1)) {
    throw std::invalid_argument(fmt::format(
        "ferry.checkpoint_sequential: segments must be between 1 and the number of functions "
        "({}), got {}",
        n, segments));
  }
  // Each part owns its functions: its replay runs in backward, after this call returned.
  const auto run = [&functions](std::int64_t start, std::int64_t end) {
    std::vector<SequentialFn> part(functions.begin() + start, functions.begin() + end);
    return [part = std::move(part)](const at::Tensor& x) {
      at::Tensor y = x;
      for (const SequentialFn& f : part) y = f(y);
      return y;
    };
  };
  const std::int64_t size = n / segments;
  std::int64_t start = 0;
  at::Tensor x = input;
  for (std::int64_t s = 0; s + 1 < segments; ++s, start += size) {
    x = checkpoint(run(start, start + size), x, options);
  }
  return run(start, n)(x);
}

}  // namespace ferry
