#include "ferry/real/runtime.hpp"
// Checkpoint frames: the non-reentrant variant of torch.utils.checkpoint. The reentrant one:
// checkpoint_reentrant.cpp.

#include <ATen/SavedTensorHooks.h>
#include <ATen/SequenceNumber.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/offload/offloader.hpp"
#include "ferry/real/device.hpp"
#ifdef FERRY_HAVE_CUDA
#include "ferry/real/cuda_device.hpp"
#endif

#include "replay_state.hpp"
#include "saved_tensors.hpp"

namespace ferry::real {

namespace {

// CheckpointStates alive (live_checkpoint_states()).
std::atomic<std::int64_t> g_live_states{0};

}  // namespace

std::int64_t live_checkpoint_states() { return g_live_states.load(); }

// --- checkpoint --------------------------------------------------------------------------------

namespace {

// Note [Jagged sizes]
// A jagged nested tensor (torch.nested, layout=torch.jagged) has one size that is a nested int,
// jN: a symbolic integer tied to its offsets tensor, equal only to itself (times the same
// coefficient). torch's determinism check compares shapes with it, so a recomputation that
// builds its jagged tensor over other offsets (another nested int) fails it. SavedMeta::shape
// holds such a size as the negative number -(N * kNestedCoeffs + coefficient), which no plain
// size can be. Any other symbolic size is made concrete (torch's guard); bytes come from the
// element count (a jagged tensor's is that of its values), left at 0 where it is symbolic.
constexpr std::int64_t kNestedCoeffs = std::int64_t{1} << 24;

// `text` as a decimal number, when it is one and nothing else.
std::optional<std::int64_t> whole_number(std::string_view text) {
  std::int64_t n = 0;
  const char* end = text.data() + text.size();
  const auto [last, error] = std::from_chars(text.data(), end, n);
  if (text.empty() || error != std::errc() || last != end) return std::nullopt;
  return n;
}

// A nested int's id and coefficient: from the node where it is a C++ one, else (a Python
// NestedIntNode, as torch.nested makes them) from its name as torch prints it, jN or C*jN.
std::optional<std::pair<std::int64_t, std::int64_t>> nested_int(c10::SymNodeImpl& node) {
  if (const auto id = node.nested_int()) return std::pair{*id, node.nested_int_coeff().value_or(1)};
  if (!node.is_nested_int()) return std::nullopt;
  const std::string name = node.str();
  const std::string_view view(name);
  const std::size_t j = view.rfind('j');
  if (j == std::string_view::npos) return std::nullopt;
  const auto id = whole_number(view.substr(j + 1));
  const auto coeff = j == 0                         ? std::optional<std::int64_t>(1)
                     : j >= 2 && view[j - 1] == '*' ? whole_number(view.substr(0, j - 1))
                                                    : std::nullopt;
  if (!id || !coeff) return std::nullopt;
  return std::pair{*id, *coeff};
}

std::int64_t meta_size(const c10::SymInt& s) {
  if (const auto n = s.maybe_as_int()) return *n;
  const auto nested = nested_int(*s.toSymNodeImplUnowned());
  if (!nested) return s.guard_int(__FILE__, __LINE__);
  const auto [id, coeff] = *nested;
  FERRY_CHECK(id >= 0 && coeff > 0 && coeff < kNestedCoeffs, "nested int j", id,
              " with coefficient ", coeff, " out of range");
  return -(id * kNestedCoeffs + coeff);
}

// A size of SavedMeta::shape as torch prints it: 8, j1 or 2*j1.
std::string describe_size(std::int64_t size) {
  if (size >= 0) return std::to_string(size);
  const std::int64_t id = -size / kNestedCoeffs;
  const std::int64_t coeff = -size % kNestedCoeffs;
  return coeff == 1 ? fmt::format("j{}", id) : fmt::format("{}*j{}", coeff, id);
}

// Shape, dtype and device in words, as torch prints them:
// {shape: [2, 8], dtype: bfloat16, device: cuda:0}.
std::string describe_meta(const SavedMeta& m) {
  const auto dtype = static_cast<at::ScalarType>(m.dtype);
  const c10::Device device(static_cast<c10::DeviceType>(m.device / 256U),
                           static_cast<c10::DeviceIndex>(static_cast<int>(m.device % 256U) - 1));
  std::vector<std::string> shape;
  shape.reserve(m.shape.size());
  for (const std::int64_t size : m.shape) shape.push_back(describe_size(size));
  return fmt::format("{{shape: [{}], dtype: {}, device: {}}}", fmt::join(shape, ", "),
                     c10::getDtypeNames(dtype).first, device.str());
}

// See Note [Jagged sizes].
SavedMeta saved_meta(const at::Tensor& t) {
  SavedMeta meta;
  const auto numel = t.sym_numel().maybe_as_int();
  meta.bytes = Bytes(numel ? *numel * static_cast<std::int64_t>(t.element_size()) : 0);
  for (const c10::SymInt& s : t.sym_sizes()) meta.shape.push_back(meta_size(s));
  meta.dtype = static_cast<std::uint8_t>(t.scalar_type());
  meta.device = static_cast<std::uint32_t>(t.device().type()) * 256U +
                static_cast<std::uint32_t>(t.device().index() + 1);
  return meta;
}

}  // namespace

// Note [Real checkpoint]
// Frames of one outermost region share a CheckpointState (nested regions find it on the
// thread's stack). The region's inputs are kept for its replay: saved by the parent frame (a
// holder id, as torch.utils.checkpoint saves them through the parent's hooks) or by the offload
// session the region runs in, else kept detached by the frame; so no frame holds a graph whose
// holders hold the frames.
// Saved tensors are not kept at all: pack returns a holder. The first unpack of a holder in a
// graph task replays the region with the forward's random state, and the replay's pack hook
// hands the recomputed tensors to the core, which stops the replay early once the last one is
// back. Tensors recomputed but never taken are dropped at the end of the backward. The frames
// are forgotten when no holder is left.
class CheckpointState : public std::enable_shared_from_this<CheckpointState> {
 public:
  CheckpointState() { ++g_live_states; }
  ~CheckpointState() { --g_live_states; }
  CheckpointState(const CheckpointState&) = delete;
  CheckpointState& operator=(const CheckpointState&) = delete;

  // A region input: kept, or saved by the parent frame.
  struct Input {
    at::Tensor tensor;
    std::optional<HolderId> holder;
    bool requires_grad = false;  // the input's (recomputed tensors come back detached)
    PackedPtr packed;            // saved by the offload session the region runs in
    bool same = false;           // a leaf: the replay gets this very tensor, as torch's does
    std::optional<SavedVersion> version;  // of `tensor`: see Note [Saved-tensor contract]
  };

  FrameId begin(const CheckpointOptions& options, Replay replay, RngState rng,
                AutocastState autocast, std::vector<Input> inputs) {
    std::lock_guard lock(mutex_);
    FrameOptions frame_options;
    frame_options.early_stop = options.early_stop;
    frame_options.determinism_check = options.determinism_check;
    const FrameId id = core_.begin(frame_options);
    frames_.resize(std::max<std::size_t>(frames_.size(), id.value() + 1));
    frames_[id.value()] =
        FrameInfo{std::move(replay),         std::move(rng), options.preserve_rng_state,
                  options.determinism_check, autocast,       std::move(inputs)};
    ++open_;
    return id;
  }

  void end(FrameId frame) {
    std::lock_guard lock(mutex_);
    core_.end(frame);
    --open_;
    maybe_reset();
  }

  PackedPtr pack(FrameId frame, const at::Tensor& t);
  /// An inner region's input, saved by `frame` like its other tensors, but held by the inner
  /// frame (an id: no holder object, which would keep this state alive).
  HolderId pack_input(FrameId frame, const at::Tensor& t) {
    std::lock_guard lock(mutex_);
    return core_.pack(frame, meta_of(frame, t));
  }
  /// A tensor the replay of `frame` saved.
  PackedPtr recompute_pack(FrameId frame, const at::Tensor& t) {
    RecomputePack result;
    {
      std::lock_guard lock(mutex_);
      result = core_.recompute_pack(meta_of(frame, t), t.detach());
    }
    if (result == RecomputePack::KeptLast) throw StopRecompute();
    return std::make_shared<KeptAsIs>(t);
  }

  at::Tensor unpack(HolderId holder) {
    const int task = current_graph_task();
    std::uint64_t gid = 0;
    FrameId frame;
    bool again = false;
    {
      std::lock_guard lock(mutex_);
      gid = task >= 0 ? static_cast<std::uint64_t>(task) : (1ULL << 62) + outside_++;
      frame = core_.frame_of(holder);
      again = !core_.recomputed(frame, gid);
      if (again && task >= 0 && drained_.insert(gid).second) {
        std::weak_ptr<CheckpointState> weak = weak_from_this();
        torch::autograd::Engine::get_default_engine().queue_callback([weak, gid] {
          if (auto s = weak.lock()) s->drain(gid);
        });
      }
    }
    if (again) recompute(frame, gid);
    std::lock_guard lock(mutex_);
    at::Tensor out = core_.take(holder, gid);
    if (task < 0) drain(gid);
    return out;
  }

  void release() {
    std::lock_guard lock(mutex_);
    --live_holders_;
    maybe_reset();
  }

 private:
  struct FrameInfo {
    Replay replay;
    RngState rng;
    bool preserve_rng = true;
    bool determinism_check = true;
    AutocastState autocast;  // the forward's; see Note [Autocast in replays]
    std::vector<Input> inputs;
  };

  // The metadata `frame` keeps of a saved tensor: none without the determinism check, which
  // alone compares it (torch's check off reads no sizes: a strided nested tensor has none).
  SavedMeta meta_of(FrameId frame, const at::Tensor& t) {
    return frames_.at(frame.value()).determinism_check ? saved_meta(t) : SavedMeta{};
  }

  void recompute(FrameId frame, std::uint64_t gid) {
    FrameInfo info;
    {
      std::lock_guard lock(mutex_);
      info = frames_.at(frame.value());
    }
    // Inputs saved by the parent come back first (which may recompute the parent).
    std::vector<at::Tensor> inputs;
    inputs.reserve(info.inputs.size());
    for (const Input& in : info.inputs) {
      if (in.version) in.version->check(in.tensor);
      at::Tensor t = in.holder ? unpack(*in.holder) : in.packed ? in.packed->unpack() : in.tensor;
      inputs.push_back(!t.defined() || in.same ? t : t.detach().requires_grad_(in.requires_grad));
    }
    {
      std::lock_guard lock(mutex_);
      core_.recompute_begin(frame, gid);
      ++replaying_;
    }
    RngState outer;
    if (info.preserve_rng) {
      std::vector<c10::DeviceIndex> devices;
      for (const auto& entry : info.rng.cuda) devices.push_back(entry.first);
      outer = capture_rng(devices);
      restore_rng(info.rng);
    }
    push_context(Context{Context::Kind::Recompute, nullptr, shared_from_this(), frame});
    const auto finish = [&] {
      pop_context(Context::Kind::Recompute);
      if (info.preserve_rng) restore_rng(outer);
      std::lock_guard lock(mutex_);
      --replaying_;
      core_.recompute_end();
    };
    try {
      at::AutoGradMode grad(true);
      AutocastScope autocast(info.autocast);
      info.replay(inputs);
    } catch (const StopRecompute&) {
      // early stop: every saved tensor is back
    } catch (...) {
      try {
        finish();
      } catch (...) {  // the replay's own error is the one to report
      }
      throw;
    }
    finish();
  }

  void drain(std::uint64_t gid) {
    std::vector<at::Tensor> left;
    {
      std::lock_guard lock(mutex_);
      left = core_.drain(gid);
      drained_.erase(gid);
    }
  }

  void maybe_reset() {
    if (live_holders_ == 0 && open_ == 0 && replaying_ == 0) {
      core_.reset();
      frames_.clear();
    }
  }

  std::recursive_mutex mutex_;
  Checkpointer<at::Tensor> core_{describe_meta};
  std::vector<FrameInfo> frames_;
  std::int64_t live_holders_ = 0;
  int open_ = 0;
  int replaying_ = 0;
  std::uint64_t outside_ = 0;
  std::unordered_set<std::uint64_t> drained_;
};

namespace {

class Holder final : public Packed {
 public:
  Holder(std::shared_ptr<CheckpointState> state, HolderId id) : state_(std::move(state)), id_(id) {}
  ~Holder() override { state_->release(); }
  Holder(const Holder&) = delete;
  Holder& operator=(const Holder&) = delete;
  at::Tensor unpack() override { return state_->unpack(id_); }

 private:
  std::shared_ptr<CheckpointState> state_;
  HolderId id_;
};

}  // namespace

PackedPtr CheckpointState::pack(FrameId frame, const at::Tensor& t) {
  std::lock_guard lock(mutex_);
  const HolderId id = core_.pack(frame, meta_of(frame, t));
  ++live_holders_;
  return std::make_shared<Holder>(shared_from_this(), id);
}

FrameToken frame_begin(const CheckpointOptions& options, Replay replay,
                       const std::vector<at::Tensor>& inputs) {
  std::shared_ptr<CheckpointState> state;
  for (auto it = region_stack().rbegin(); it != region_stack().rend() && !state; ++it) {
    if (it->kind == Context::Kind::Frame || it->kind == Context::Kind::Recompute) state = it->ckpt;
  }
  if (!state) state = std::make_shared<CheckpointState>();
  // The inputs are saved by the innermost region when it is a checkpoint frame; in its replay
  // they are recomputed tensors like the others (which may end the replay early, here).
  std::vector<CheckpointState::Input> saved;
  saved.reserve(inputs.size());
  const Context* top = region_stack().empty() ? nullptr : &region_stack().back();
  for (const at::Tensor& t : inputs) {
    if (t.defined() && top != nullptr && top->kind == Context::Kind::Frame) {
      saved.push_back({at::Tensor(),
                       state->pack_input(top->frame, t),
                       t.requires_grad(),
                       {},
                       false,
                       std::nullopt});
      continue;
    }
    if (t.defined() && top != nullptr && top->kind == Context::Kind::Offload &&
        options.check_inputs) {
      // In an offload region the inputs are offloaded like the region's other saved tensors.
      saved.push_back({at::Tensor(), std::nullopt, t.requires_grad(), top->session->pack(t), false,
                       std::nullopt});
      continue;
    }
    if (t.defined() && top != nullptr && top->kind == Context::Kind::Recompute) {
      (void)state->recompute_pack(top->frame, t);
    }
    // A leaf as it is (no graph to hold; the replay gets the same object, as torch's does);
    // anything else detached: a frame begun during a replay would otherwise hold the replay's
    // graph, whose holders hold this state (a cycle).
    const bool leaf = t.defined() && t.is_leaf();
    saved.push_back({leaf || !t.defined() ? t : t.detach(),
                     std::nullopt,
                     t.defined() && t.requires_grad(),
                     {},
                     leaf,
                     t.defined() && options.check_inputs
                         ? std::optional<SavedVersion>(std::in_place, t)
                         : std::nullopt});
  }
  RngState rng = options.preserve_rng_state ? capture_rng(cuda_devices(inputs)) : RngState{};
  const FrameId frame = state->begin(options, std::move(replay), std::move(rng), capture_autocast(),
                                     std::move(saved));
  push_context(Context{Context::Kind::Frame, nullptr, state, frame});
  return FrameToken{state, frame};
}

void frame_end(const FrameToken& token) {
  pop_context(Context::Kind::Frame);
  token.state->end(token.frame);
}

// What the innermost region does with a saved tensor (its frame when a checkpoint's).
PackedPtr pack_saved(const at::Tensor& tensor, TensorKind kind) {
  const std::vector<Context>& stack = region_stack();
  if (stack.empty()) return std::make_shared<KeptAsIs>(tensor);
  const Context& top = stack.back();
  switch (top.kind) {
    case Context::Kind::Offload:
      return top.session->pack(tensor, kind);
    case Context::Kind::NoOffload:
      return std::make_shared<KeptAsIs>(tensor);
    case Context::Kind::Frame:
      return top.ckpt->pack(top.frame, tensor);
    case Context::Kind::Recompute:
      return top.ckpt->recompute_pack(top.frame, tensor);
  }
  return std::make_shared<KeptAsIs>(tensor);
}

}  // namespace ferry::real
