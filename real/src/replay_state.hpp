#pragma once
// What a checkpointed region's replay restores of its forward (not installed): the random state
// and the autocast state. Both checkpoint variants capture them when a region begins and
// re-enter them around its recompute.

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace ferry::real {

/// The random state a region's forward saw, to replay it (CPU and the CUDA devices its inputs
/// live on).
struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;
};

/// The CPU state and that of each CUDA device in `devices`.
RngState capture_rng(const std::vector<c10::DeviceIndex>& devices);

/// The CUDA devices of `inputs`, each once.
std::vector<c10::DeviceIndex> cuda_devices(const std::vector<at::Tensor>& inputs);

/// Sets the CPU generator and each captured CUDA one back to `state`.
void restore_rng(const RngState& state);

// Note [Autocast in replays]
// A region's replay runs in backward, outside the autocast context its forward ran in. Without
// that context a mixed-precision forward's ops recompute in float32, the saved tensors differ
// in dtype and the determinism check refuses them. So the forward's autocast state (enabled and
// dtype, for CPU and for CUDA, and the cast cache switch) is captured when the region begins
// and re-entered around its replay, as torch.utils.checkpoint does. Entering counts as one
// autocast nesting level: leaving the outermost level clears the cast cache, as leaving
// `torch.autocast` does.
struct AutocastState {
  struct PerDevice {
    bool enabled = false;
    at::ScalarType dtype = at::kFloat;
  };
  PerDevice cpu;
  PerDevice cuda;
  bool cache_enabled = true;
};

/// This thread's autocast state now.
AutocastState capture_autocast();

/// Enters a captured autocast state for a scope; restores the one it found. See
/// Note [Autocast in replays].
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state);
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  ~AutocastScope();

 private:
  AutocastState outer_;
};

}  // namespace ferry::real
