#pragma once
/// ferry for C++ LibTorch programs: offload and checkpoint regions over autograd's saved
/// tensors, through ferry's autograd engine.
///
///   int main() {
///     ferry::install();                       // before any autograd use
///     ferry::Offload offload({.loopback = true});
///     for (...) {
///       at::Tensor loss;
///       { ferry::OffloadGuard guard(offload); loss = model(x); }
///       loss.backward();
///     }
///   }

#include <functional>
#include <memory>
#include <vector>

#include "ferry/real/runtime.hpp"

namespace ferry {

/// Installs ferry's autograd engine as the default engine, so pure C++ programs get default
/// saved-tensor hooks. Call it before any autograd use. Idempotent; throws std::logic_error
/// when autograd was already used on this thread or another engine took the slot.
void install();
/// Whether ferry's engine is the default engine.
bool installed();

/// An offload session, meant to be reused step after step (like the reference offloader's
/// context object). Saved tensors packed under it stay its business until autograd frees them.
class Offload {
 public:
  explicit Offload(real::RealOptions options = {});
  /// As above, with synchronization faults planted: tests and demonstrations of the checker.
  Offload(real::RealOptions options, const OffloadFaults& faults);

  /// Never offload these (parameters, module buffers): their storages are remembered.
  void exclude(const std::vector<at::Tensor>& tensors);
  [[nodiscard]] OffloadTelemetry telemetry() const { return session_->telemetry(); }
  [[nodiscard]] std::size_t tracked() const { return session_->tracked(); }
  [[nodiscard]] std::int64_t live_device_buffers() const { return session_->live_device_buffers(); }
  [[nodiscard]] std::int64_t live_host_buffers() const { return session_->live_host_buffers(); }
  [[nodiscard]] std::string program_json() const { return session_->program_json(); }
  [[nodiscard]] const std::shared_ptr<real::Session>& session() const { return session_; }

 private:
  std::shared_ptr<real::Session> session_;
};

/// Saved tensors of autograd ops run while the guard lives are offloaded by `offload`.
class OffloadGuard {
 public:
  explicit OffloadGuard(Offload& offload);
  /// A guard with a session of its own.
  explicit OffloadGuard(real::RealOptions options = {});
  ~OffloadGuard();
  OffloadGuard(const OffloadGuard&) = delete;
  OffloadGuard& operator=(const OffloadGuard&) = delete;

  [[nodiscard]] Offload& offload() { return *offload_; }

 private:
  explicit OffloadGuard(std::shared_ptr<Offload> owned);

  std::shared_ptr<Offload> owned_;
  Offload* offload_;
};

/// Inside an offload region: saved tensors of ops run while the guard lives stay on the device.
class NoOffloadGuard {
 public:
  NoOffloadGuard();
  ~NoOffloadGuard();
  NoOffloadGuard(const NoOffloadGuard&) = delete;
  NoOffloadGuard& operator=(const NoOffloadGuard&) = delete;
};

/// The options of one checkpointed region, as the C++ API names them (the runtime's own type).
using real::CheckpointOptions;

using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs `fn(inputs)` keeping none of its saved tensors; backward recomputes them (non-reentrant,
/// nestable, early stop by default), as torch.utils.checkpoint(use_reentrant=False) does. With
/// `options.use_reentrant`, torch's reentrant variant: the forward runs without grad and
/// backward reruns the whole region (no .grad(), no backward(inputs=...)).
std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                                   CheckpointOptions options = {});
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, CheckpointOptions options = {});

using SequentialFn = std::function<at::Tensor(const at::Tensor&)>;

/// torch.utils.checkpoint.checkpoint_sequential (either variant, `options.use_reentrant`): runs
/// `functions` in order on `input`, in `segments` contiguous parts of len / segments functions, the
/// last taking the rest; every part but the last is checkpointed. Throws std::invalid_argument
/// unless 1 <= segments <= max(len, 1).
at::Tensor checkpoint_sequential(const std::vector<SequentialFn>& functions, std::int64_t segments,
                                 const at::Tensor& input, CheckpointOptions options = {});

}  // namespace ferry
