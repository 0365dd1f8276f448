#include "ferry/real/runtime.hpp"
// The reentrant variant of torch.utils.checkpoint (use_reentrant=True). The non-reentrant
// frames: checkpoint.cpp.

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "replay_state.hpp"

namespace ferry::real {

namespace {

// What the backward of a reentrant region needs besides its inputs (held by autograd's context
// as a capsule).
struct ReentrantRegion : torch::CustomClassHolder {
  RegionFn fn;
  bool preserve_rng = true;
  RngState rng;
  AutocastState autocast;
};

// Note [Reentrant checkpoint]
// As torch's CheckpointFunction: forward runs the region without grad (a custom Function's
// forward does) and saves only its inputs; backward reruns the region with grad, under the
// forward's random and autocast state, from detached inputs, and backpropagates through the
// rerun with a nested backward call. That nested call is why .grad() and backward(inputs=...)
// cannot work: the engine says whether the outer call may be reentered.
struct ReentrantFunction : torch::autograd::Function<ReentrantFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const c10::intrusive_ptr<ReentrantRegion>& region,
                                                at::TensorList inputs) {
    ctx->saved_data["region"] = c10::IValue::make_capsule(region);
    std::vector<at::Tensor> in = inputs.vec();
    ctx->save_for_backward(in);
    return region->fn(in);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      throw std::runtime_error(
          "ferry.checkpoint: use_reentrant=True is incompatible with .grad() or with passing "
          "`inputs` to .backward(); use use_reentrant=False, or call .backward() without "
          "`inputs`");
    }
    const auto region =
        c10::static_intrusive_pointer_cast<ReentrantRegion>(ctx->saved_data["region"].toCapsule());
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& saved : ctx->get_saved_variables()) {
      inputs.push_back(saved.defined() ? saved.detach().requires_grad_(saved.requires_grad())
                                       : saved);
    }
    std::vector<at::Tensor> outputs;
    {
      RngState outer;
      if (region->preserve_rng) {
        std::vector<c10::DeviceIndex> devices;
        for (const auto& entry : region->rng.cuda) devices.push_back(entry.first);
        outer = capture_rng(devices);
        restore_rng(region->rng);
      }
      try {
        at::AutoGradMode grad(true);
        AutocastScope autocast(region->autocast);
        outputs = region->fn(inputs);
      } catch (...) {
        if (region->preserve_rng) restore_rng(outer);
        throw;
      }
      if (region->preserve_rng) restore_rng(outer);
    }
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> root_grads;
    for (std::size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (roots.empty()) {
      throw std::runtime_error(
          "ferry.checkpoint: none of the outputs requires grad; this checkpoint is not "
          "necessary");
    }
    torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result{at::Tensor()};  // the region: not a tensor
    for (const at::Tensor& in : inputs) result.push_back(in.defined() ? in.grad() : at::Tensor());
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint_reentrant(const RegionFn& fn,
                                             const std::vector<at::Tensor>& inputs,
                                             const CheckpointOptions& options) {
  if (at::GradMode::is_enabled() &&
      std::none_of(inputs.begin(), inputs.end(),
                   [](const at::Tensor& t) { return t.defined() && t.requires_grad(); })) {
    TORCH_WARN(
        "ferry.checkpoint: none of the inputs has requires_grad=True; gradients will be "
        "None");
  }
  auto region = c10::make_intrusive<ReentrantRegion>();
  region->fn = fn;
  region->preserve_rng = options.preserve_rng_state;
  if (options.preserve_rng_state) region->rng = capture_rng(cuda_devices(inputs));
  region->autocast = capture_autocast();
  // A TensorList: each input is an autograd input of the Function (a vector would be one
  // opaque argument).
  return ReentrantFunction::apply(region, at::TensorList(inputs));
}

}  // namespace ferry::real
