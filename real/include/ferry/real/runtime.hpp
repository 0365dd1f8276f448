#pragma once
/// The autograd side of the real backend, shared by the C++ API and the Python extension:
/// offload sessions, checkpoint frames and the per-thread stack of active regions that decides
/// what a saved tensor's pack hook does.

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ferry/checkpoint.hpp"
#include "ferry/ids.hpp"
#include "ferry/offload/faults.hpp"
#include "ferry/offload/options.hpp"
#include "ferry/real/loopback_config.hpp"

namespace ferry::real {

/// Options of one checkpointed region (torch.utils.checkpoint's).
struct CheckpointOptions {
  bool early_stop = true;          ///< stop the replay once every saved tensor is back
  bool determinism_check = true;   ///< compare count, shape, dtype and device of saved tensors
  bool preserve_rng_state = true;  ///< replay with the random state the forward saw
  /// torch's reentrant variant: the forward runs without grad and backward reruns the whole
  /// region and backpropagates through the rerun (early_stop and determinism_check unused).
  bool use_reentrant = false;
  /// Compare the inputs' versions when the region is recomputed (torch's error for an input
  /// changed in place since the forward); off where the inputs' values are kept by other means
  /// (torch's allow_mutation_on_saved_tensors). See Note [Saved-tensor contract].
  bool check_inputs = true;
};

/// Options of one offload session on the real backend.
struct RealOptions {
  OffloadOptions offload;
  /// Treat CPU tensors as device tensors and "offload" them to other CPU buffers: the whole
  /// integration without a GPU.
  bool loopback = false;
  /// How the loopback device runs its streams: synchronously (the default), or on worker
  /// threads with seeded delays so that a missing wait shows (Note [The asynchronous loopback
  /// device] in loopback_streams.hpp).
  LoopbackConfig loopback_streams;
  /// Record the session's stream operations in the program format (`ferry check`).
  bool record = false;
  /// The device profile named in the recorded program.
  std::string profile = "h100-sxm-pcie5";
  /// Host memory pinning must leave free (MemAvailable); a pin that would not is refused: the
  /// ferry policy keeps the tensor on the device (host_fallbacks), trl raises.
  Bytes host_reserve{1LL << 30};
};

/// The stand-in a pack hook returns for a saved tensor.
class Packed {
 public:
  virtual ~Packed() = default;
  virtual at::Tensor unpack() = 0;
};
using PackedPtr = std::shared_ptr<Packed>;

/// Thrown by a replay's pack hook once early stop has every tensor it needs.
class StopRecompute : public std::exception {
 public:
  [[nodiscard]] const char* what() const noexcept override {
    return "checkpoint recomputation stopped early";
  }
};

/// What the caller of a pack hook knows of the tensor's kind. Python knows an `nn.Parameter`
/// when it sees one; C++ cannot tell one from a leaf that requires grad.
enum class TensorKind : std::uint8_t {
  Unknown,     ///< a leaf that requires grad counts as a parameter
  Parameter,   ///< never offloaded
  Activation,  ///< offloaded by the usual rules, even a leaf that requires grad (an input)
};

/// One offload session: an Offloader over a loopback or CUDA device.
class Session {
 public:
  virtual ~Session() = default;
  /// A loopback session, or a CUDA one on the current device (throws when there is none).
  /// `faults` plants synchronization faults: tests only.
  static std::shared_ptr<Session> create(const RealOptions& options,
                                         const OffloadFaults& faults = {});

  /// A saved tensor to the scheduler. Its unpack raises torch's error when the tensor changed
  /// in place since (Note [Saved-tensor contract]), unless `check_version` is false: for a
  /// caller that checks versions its own way (OffloadedOutput).
  virtual PackedPtr pack(const at::Tensor& tensor, TensorKind kind = TensorKind::Unknown,
                         bool check_version = true) = 0;
  /// Parameters and module buffers: storages never offloaded.
  virtual void exclude(const at::Tensor& tensor) = 0;
  [[nodiscard]] virtual OffloadTelemetry telemetry() const = 0;
  /// Saved tensors the scheduler still tracks.
  [[nodiscard]] virtual std::size_t tracked() const = 0;
  /// Storages the scheduler holds a reference to, on the device and in host memory.
  [[nodiscard]] virtual std::int64_t live_device_buffers() const = 0;
  [[nodiscard]] virtual std::int64_t live_host_buffers() const = 0;
  /// The recorded program (empty unless RealOptions::record).
  [[nodiscard]] virtual std::string program_json() const = 0;
  [[nodiscard]] virtual const RealOptions& options() const = 0;
  /// Asynchronous loopback sessions: the races the device observed (each poisoned a buffer:
  /// Note [The asynchronous loopback device]); 0 on other devices.
  [[nodiscard]] virtual std::int64_t races() const = 0;
  /// Loopback sessions: makes the compute stream named `name` current ("compute" is the first;
  /// others are made on first use), as `with torch.cuda.stream(s)` does on a GPU (Note [The
  /// compute stream is the current one]). A CUDA session refuses: its current stream is
  /// torch's.
  virtual void set_current_stream(const std::string& name) = 0;
  /// The offload context is entered (a step begins) / left (it ends): the policy's own
  /// bookkeeping (today's reference clears stale state on entry and synchronizes on exit).
  virtual void enter() = 0;
  virtual void exit() = 0;
};

/// Selective checkpointing's third choice per op: the op's output is saved through an offload
/// session (copied to the host in forward, reloaded when the region is recomputed) instead of
/// kept on the device or recomputed. It holds the output's version counter, not its memory, so
/// that a mutation after the save is reported as torch reports one of a cached output.
class OffloadedOutput {
 public:
  OffloadedOutput(const std::shared_ptr<Session>& session, const at::Tensor& output);
  /// The output back (reloaded); throws std::logic_error when it was mutated after the save,
  /// unless `allow_mutation`, or when it was taken already.
  at::Tensor take(bool allow_mutation);

 private:
  PackedPtr packed_;
  c10::VariableVersion version_;
  std::uint32_t saved_version_;
};

/// The offload session of the innermost offload region open on this thread, looking through
/// checkpoint frames and replays; null when there is none or a no-offload region comes first
/// (`in_no_offload` says which).
std::shared_ptr<Session> enclosing_session(bool* in_no_offload = nullptr);

/// Checkpoint states alive in this process (frames of outermost regions not yet forgotten):
/// zero once every checkpointed graph is freed.
std::int64_t live_checkpoint_states();

class CheckpointState;

/// An active region on this thread's stack; the innermost decides what packing does.
struct Context {
  enum class Kind : std::uint8_t { Offload, NoOffload, Frame, Recompute };
  Kind kind = Kind::NoOffload;
  std::shared_ptr<Session> session;       // Offload
  std::shared_ptr<CheckpointState> ckpt;  // Frame, Recompute
  FrameId frame;                          // Frame
};

void push_context(Context context);
/// Pops the innermost region, which must be of `kind` (regions nest).
void pop_context(Context::Kind kind);
/// Removes this thread's `index`-th offload or no-offload region, counted from the outermost
/// (checkpoint frames and replays not counted), which must be of `kind`: a region left out of
/// order. Throws std::logic_error when there is no such region.
void remove_region(Context::Kind kind, std::size_t index);
/// For destructors: removes the innermost region of `kind`, warning on stderr when it is not the
/// innermost one (a guard destroyed out of order); never throws.
void close_context(Context::Kind kind) noexcept;
/// Whether the innermost region wants saved tensors packed by ferry (not a no-offload region).
bool packing_active();
/// Whether the innermost region is an offload session (not a no-offload region, a checkpoint
/// frame or a replay).
bool offloading_innermost();
/// The pack hook: what the innermost region does with a saved tensor (kept as is when none).
PackedPtr pack_saved(const at::Tensor& tensor, TensorKind kind = TensorKind::Unknown);

/// An open checkpoint frame.
struct FrameToken {
  std::shared_ptr<CheckpointState> state;
  FrameId frame;
};

/// Re-runs a region's forward with grad enabled, from detached copies of `inputs` (the tensors
/// given to frame_begin, given back in the same order).
using Replay = std::function<void(const std::vector<at::Tensor>& inputs)>;

/// Opens a checkpointed region on this thread. `inputs` are the region's tensor inputs: they
/// tell which devices' random state to preserve, and are kept for the replay (inside another
/// region they are saved by it, as torch.utils.checkpoint saves them through the parent's
/// hooks, so the frames never hold a graph that holds them).
FrameToken frame_begin(const CheckpointOptions& options, Replay replay,
                       const std::vector<at::Tensor>& inputs);
/// Closes the region `token` opened (the innermost one).
void frame_end(const FrameToken& token);

/// The reentrant variant of checkpoint (torch.utils.checkpoint with use_reentrant=True): runs
/// `fn(inputs)` without grad; backward reruns it with grad, with the forward's random and
/// autocast state, and backpropagates through the rerun. Refuses torch.autograd.grad and
/// backward(inputs=...) as torch does.
using RegionFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
std::vector<at::Tensor> checkpoint_reentrant(const RegionFn& fn,
                                             const std::vector<at::Tensor>& inputs,
                                             const CheckpointOptions& options);

}  // namespace ferry::real
