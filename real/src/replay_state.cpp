#include "replay_state.hpp"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <mutex>

namespace ferry::real {
namespace {

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard lock(gen.mutex());
  gen.set_state(state);
}

void set_autocast(const AutocastState& state) {
  at::autocast::set_autocast_enabled(at::kCPU, state.cpu.enabled);
  at::autocast::set_autocast_dtype(at::kCPU, state.cpu.dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, state.cuda.enabled);
  at::autocast::set_autocast_dtype(at::kCUDA, state.cuda.dtype);
  at::autocast::set_autocast_cache_enabled(state.cache_enabled);
}

}  // namespace

RngState capture_rng(const std::vector<c10::DeviceIndex>& devices) {
  RngState state;
  state.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  for (const c10::DeviceIndex index : devices) {
    state.cuda.emplace_back(
        index, generator_state(at::globalContext().defaultGenerator(at::Device(at::kCUDA, index))));
  }
  return state;
}

std::vector<c10::DeviceIndex> cuda_devices(const std::vector<at::Tensor>& inputs) {
  std::vector<c10::DeviceIndex> devices;
  for (const at::Tensor& t : inputs) {
    if (t.defined() && t.is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device().index()) == devices.end()) {
      devices.push_back(t.device().index());
    }
  }
  return devices;
}

void restore_rng(const RngState& state) {
  set_generator_state(at::detail::getDefaultCPUGenerator(), state.cpu);
  for (const auto& [index, s] : state.cuda) {
    set_generator_state(at::globalContext().defaultGenerator(at::Device(at::kCUDA, index)), s);
  }
}

AutocastState capture_autocast() {
  const auto per_device = [](at::DeviceType type) {
    return AutocastState::PerDevice{at::autocast::is_autocast_enabled(type),
                                    at::autocast::get_autocast_dtype(type)};
  };
  return AutocastState{per_device(at::kCPU), per_device(at::kCUDA),
                       at::autocast::is_autocast_cache_enabled()};
}

AutocastScope::AutocastScope(const AutocastState& state) : outer_(capture_autocast()) {
  set_autocast(state);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast(outer_);
}

}  // namespace ferry::real
