#include "ferry/real/runtime.hpp"

#include <ATen/SavedTensorHooks.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "ferry/check.hpp"
#include "ferry/offload/offloader.hpp"
#include "ferry/real/device.hpp"
#ifdef FERRY_HAVE_CUDA
#include "ferry/real/cuda_device.hpp"
#endif

namespace ferry::real {

namespace {

thread_local std::vector<Context> tl_stack;

// CheckpointStates alive (live_checkpoint_states()).
std::atomic<std::int64_t> g_live_states{0};

// Note [Saved-tensor contract]
// Under saved-tensor hooks torch checks nothing of what an unpack hook returns: the hook owns
// the value. What autograd gets back from ferry must still be what it would get without ferry,
// or torch's own error, in every region and under every policy:
// * Versions. Each pack records the tensor's version counter and its version then
//   (SavedVersion); each unpack compares, and a tensor changed in place since it was saved
//   raises torch's error ("one of the variables needed for gradient computation has been
//   modified by an inplace operation: ..."), whether it was kept, offloaded or deduplicated,
//   and for a checkpointed region's inputs at its recompute. What a checkpointed region
//   recomputes is not checked, as torch.utils.checkpoint does not check it.
// * Deduplication. Two packs share one copy only at one version of one storage
//   (TensorFacts::version): a storage changed in place between two saves is copied again.
// * Views. A tensor rebuilt over its storage gets back its sizes, strides, offset and dtype,
//   and its conjugate and negative bits (TensorMeta).
// * What has no storage ferry can copy is kept as it is and counted (kept_as_is in the
//   telemetry): subclasses whose data lives in other tensors (wrapper subclasses such as
//   DTensor), sparse, quantized and zero tensors.
// * torch.autograd.graph.allow_mutation_on_saved_tensors: a region entered under it leaves its
//   saved tensors to torch's own hooks (ferry/__init__.py, _Region), which clone a saved tensor
//   before it is changed in place.

// The tensor's type as torch's error messages print it: its legacy type name where the dtype has
// one (torch.FloatTensor, torch.cuda.HalfTensor), else the dispatch key's (CPUBFloat16Type,
// CUDAComplexFloatType).
std::string type_name(at::ScalarType dtype, bool cuda) {
  switch (dtype) {
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kHalf:
    case at::kFloat:
    case at::kDouble:
    case at::kBool:
      return fmt::format("torch.{}{}Tensor", cuda ? "cuda." : "", c10::toString(dtype));
    default:
      return fmt::format("{}{}Type", cuda ? "CUDA" : "CPU", c10::toString(dtype));
  }
}

// A saved tensor's version counter and its version when saved, and what torch names it by in
// its error. See Note [Saved-tensor contract].
class SavedVersion {
 public:
  explicit SavedVersion(const at::Tensor& t)
      : counter_(t.unsafeGetTensorImpl()->version_counter()),
        saved_(counter_.enabled() ? counter_.current_version() : 0),
        grad_fn_(t.grad_fn()),
        output_nr_(static_cast<std::uint32_t>(t.output_nr())),
        cuda_(t.is_cuda()) {}

  [[nodiscard]] std::uint32_t saved() const { return saved_; }

  /// Throws torch's error when the tensor changed in place since it was saved; `sizes` and
  /// `dtype` are the saved tensor's, for the message.
  void check(at::IntArrayRef sizes, at::ScalarType dtype) const {
    if (!counter_.enabled()) return;
    const std::uint32_t now = counter_.current_version();
    if (now == saved_) return;
    std::string origin;
    if (const std::shared_ptr<torch::autograd::Node> fn = grad_fn_.lock()) {
      origin = fmt::format(", which is output {} of {},", output_nr_, fn->name());
    }
    const char* hint =
        torch::autograd::AnomalyMode::is_enabled()
            ? "Hint: the backtrace further above shows the operation that failed to compute its "
              "gradient. The variable in question was changed in there or anywhere later. Good "
              "luck!"
            : "Hint: enable anomaly detection to find the operation that failed to compute its "
              "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).";
    throw std::runtime_error(fmt::format(
        "one of the variables needed for gradient computation has been modified by an inplace "
        "operation: [{} [{}]]{} is at version {}; expected version {} instead. {}",
        type_name(dtype, cuda_), fmt::join(sizes, ", "), origin, now, saved_, hint));
  }

 private:
  c10::VariableVersion counter_;
  std::uint32_t saved_;
  std::weak_ptr<torch::autograd::Node> grad_fn_;  // weak: a saved output's node saves it
  std::uint32_t output_nr_;
  bool cuda_;
};

// A saved tensor kept as it is. Detached: a saved output carries the node that saves it, and
// holding it from that node's own saved variable would make a cycle nothing frees (autograd
// gives an unpacked tensor its grad_fn back from the saved variable's metadata).
class KeptAsIs final : public Packed {
 public:
  explicit KeptAsIs(const at::Tensor& tensor) : tensor_(tensor.detach()), version_(tensor) {}
  at::Tensor unpack() override {
    version_.check(tensor_.sizes(), tensor_.scalar_type());
    return tensor_;
  }

 private:
  at::Tensor tensor_;
  SavedVersion version_;
};

// Whether ferry can copy the tensor through its storage: a dense strided tensor whose data is
// its own (not a subclass whose data lives in other tensors, not a zero tensor).
bool copyable(const at::Tensor& t) {
  return t.has_storage() && t.layout() == at::kStrided && !t.is_quantized() &&
         !t.key_set().has(c10::DispatchKey::Python) && !t._is_zerotensor() &&
         (t.numel() == 0 || t.storage().data() != nullptr);
}

// How to rebuild a saved tensor over its storage. See Note [Saved-tensor contract].
struct TensorMeta {
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
  at::ScalarType dtype = at::kFloat;
  Bytes span;  // bytes from the first to one past the last element
  bool conj = false;
  bool neg = false;
};

Bytes span_of(const at::Tensor& t) {
  if (t.numel() == 0) return Bytes(0);
  std::int64_t last = 0;
  for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return Bytes((last + 1) * static_cast<std::int64_t>(t.element_size()));
}

// `plain` (a view of the storage, no bits set) with the bits `meta` records.
at::Tensor with_view_bits(at::Tensor plain, const TensorMeta& meta) {
  if (!meta.conj && !meta.neg) return plain;
  at::AutoDispatchBelowADInplaceOrView guard;  // bits only: no autograd view of it
  if (meta.conj) plain = at::_conj(plain);
  if (meta.neg) plain = at::_neg_view(plain);
  return plain;
}

// The graph task of the backward running on this thread; -1 outside backward.
int current_graph_task() { return torch::autograd::get_current_graph_task_id(); }

}  // namespace

// --- offload sessions ------------------------------------------------------------------------

namespace {

class SessionBase : public Session, public std::enable_shared_from_this<SessionBase> {
 public:
  virtual at::Tensor unpack(TensorId id, const TensorMeta& meta) = 0;
  virtual void release(TensorId id) = 0;
};

class OffloadedTensor final : public Packed {
 public:
  OffloadedTensor(std::shared_ptr<SessionBase> session, TensorId id, TensorMeta meta,
                  std::optional<SavedVersion> version)
      : session_(std::move(session)),
        id_(id),
        meta_(std::move(meta)),
        version_(std::move(version)) {}
  ~OffloadedTensor() override { session_->release(id_); }
  OffloadedTensor(const OffloadedTensor&) = delete;
  OffloadedTensor& operator=(const OffloadedTensor&) = delete;
  at::Tensor unpack() override {
    if (version_) version_->check(meta_.sizes, meta_.dtype);
    return session_->unpack(id_, meta_);
  }

 private:
  std::shared_ptr<SessionBase> session_;
  TensorId id_;
  TensorMeta meta_;
  std::optional<SavedVersion> version_;  // none only with the planted skip_version_check
};

// The session's device: a loopback device runs its streams as the options say.
template <class Device>
Device make_device(const RealOptions& options) {
  std::unique_ptr<Recorder> recorder =
      options.record ? std::make_unique<Recorder>(options.profile) : nullptr;
  if constexpr (std::is_same_v<Device, LoopbackDevice>) {
    return LoopbackDevice(std::move(recorder), options.loopback_streams);
  } else {
    return Device(std::move(recorder));
  }
}

// Note [Nodes and backward passes]
// The core names the backward node that saves a tensor. At pack time that node was the last
// one created on this thread, so its sequence number is the next one minus one; sequence
// numbers map to small dense node ids, reset when a new step starts (nothing is tracked).
// At unpack the engine tells the current node; the first unpack of a graph task starts the
// core's backward and queues its end as an end-of-backward callback, and each node gets a
// post-hook that reports it done.
template <class Device>
class SessionImpl final : public SessionBase {
 public:
  SessionImpl(const RealOptions& options, const OffloadFaults& faults)
      : options_(options),
        device_(make_device<Device>(options)),
        core_(device_, options.offload, faults),
        faults_(faults) {
    device_.set_host_reserve(options.host_reserve);
  }

  PackedPtr pack(const at::Tensor& t, TensorKind kind, bool check_version) override {
    if (!copyable(t)) {
      std::lock_guard lock(mutex_);
      ++kept_as_is_;
      return std::make_shared<KeptAsIs>(t);
    }
    std::lock_guard lock(mutex_);
    if (core_.tracked() == 0) {
      nodes_.clear();
      hooked_.clear();
    }
    const std::uint64_t seq = at::sequence_number::peek();
    const NodeId node = node_id(seq == 0 ? 0 : seq - 1);
    const auto item = static_cast<std::int64_t>(t.element_size());
    TensorFacts facts;
    facts.storage_bytes = Bytes(static_cast<std::int64_t>(t.storage().nbytes()));
    facts.view_offset = Bytes(t.storage_offset() * item);
    facts.storage = reinterpret_cast<std::uint64_t>(t.storage().unsafeGetStorageImpl());
    TensorMeta meta{t.sizes().vec(),
                    t.strides().vec(),
                    t.scalar_type(),
                    span_of(t),
                    t.is_conj() && !faults_.drop_view_bits,
                    t.is_neg() && !faults_.drop_view_bits};
    SavedVersion version(t);
    facts.version = version.saved();
    // trl copies the tensor's own bytes (its span); ferry the whole storage.
    facts.bytes = is_trl(options_.offload.policy) ? meta.span : Bytes(t.numel() * item);
    facts.on_device = device_.is_device_tensor(t);
    // Note [Views of parameters]
    // A parameter's view (a linear layer saves `weight.t()`) is the parameter's memory: copying
    // it out frees nothing, and FSDP2 resizes an unsharded parameter's storage to zero after
    // forward (gathering it again for backward), so a copy still in flight would read freed
    // memory. It stays, as the parameter does; TRL checks the tensor's own class and copies
    // such views.
    const bool leaf_param = kind == TensorKind::Unknown && t.is_leaf() && t.requires_grad();
    const bool view_of_leaf_param = kind == TensorKind::Unknown && t.is_view() &&
                                    t._base().is_leaf() && t._base().requires_grad();
    facts.is_param = kind == TensorKind::Parameter || leaf_param || view_of_leaf_param ||
                     excluded_.count(t.storage().unsafeGetStorageImpl()) != 0;
    facts.node = node;
    BufferHandle storage = device_.adopt(t);
    const TensorId id = core_.pack(facts, storage);
    return std::make_shared<OffloadedTensor>(shared_from_this(), id, std::move(meta),
                                             faults_.skip_version_check || !check_version
                                                 ? std::nullopt
                                                 : std::optional(std::move(version)));
  }

  at::Tensor unpack(TensorId id, const TensorMeta& meta) override {
    std::lock_guard lock(mutex_);
    NodeId node(0);
    if (std::shared_ptr<torch::autograd::Node> current = torch::autograd::get_current_node()) {
      // A node that saved nothing through this session (a replay's, the unpack of an offloaded
      // output in selective checkpointing) gets an id of its own too: the trl policy tells
      // nodes apart as the reference compares node objects.
      node = node_id(current->sequence_nr());
      const int gid = current_graph_task();
      if (gid != graph_task_) {
        graph_task_ = gid;
        core_.backward_begin({});
        std::weak_ptr<SessionBase> weak = weak_from_this();
        torch::autograd::Engine::get_default_engine().queue_callback([weak] {
          if (auto s = weak.lock()) static_cast<SessionImpl&>(*s).end_backward();
        });
      }
      if (hooked_.insert(current.get()).second) {
        std::weak_ptr<SessionBase> weak = weak_from_this();
        current->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [weak, node](const torch::autograd::variable_list& outputs,
                         const torch::autograd::variable_list&) {
              if (auto s = weak.lock()) static_cast<SessionImpl&>(*s).node_done(node);
              return outputs;
            }));
      }
    }
    const Unpacked<BufferHandle> u = core_.unpack(id, node);
    device_.consume(u.storage, u.offset, meta.span);
    at::Tensor out = with_view_bits(
        DeviceBase::view(u.storage, u.offset, meta.sizes, meta.strides, meta.dtype), meta);
    device_.drop(u.storage);  // the tensor holds the storage now
    return out;
  }

  void release(TensorId id) override {
    std::lock_guard lock(mutex_);
    core_.release(id);
  }

  void node_done(NodeId node) {
    std::lock_guard lock(mutex_);
    core_.node_done(node);
  }

  void end_backward() {
    std::lock_guard lock(mutex_);
    core_.backward_end();
    graph_task_ = -1;
    hooked_.clear();
  }

  void exclude(const at::Tensor& t) override {
    if (!t.has_storage()) return;
    std::lock_guard lock(mutex_);
    excluded_.insert(t.storage().unsafeGetStorageImpl());
  }

  [[nodiscard]] OffloadTelemetry telemetry() const override {
    std::lock_guard lock(mutex_);
    OffloadTelemetry t = core_.telemetry();
    t.kept_as_is = kept_as_is_;
    return t;
  }
  [[nodiscard]] std::size_t tracked() const override {
    std::lock_guard lock(mutex_);
    return core_.tracked();
  }
  [[nodiscard]] std::int64_t live_device_buffers() const override {
    std::lock_guard lock(mutex_);
    return device_.live_device_buffers();
  }
  [[nodiscard]] std::int64_t live_host_buffers() const override {
    std::lock_guard lock(mutex_);
    return device_.live_host_buffers();
  }
  [[nodiscard]] std::string program_json() const override {
    std::lock_guard lock(mutex_);
    return device_.recorder() != nullptr ? device_.recorder()->json() : std::string();
  }
  [[nodiscard]] const RealOptions& options() const override { return options_; }
  [[nodiscard]] std::int64_t races() const override {
    std::lock_guard lock(mutex_);
    if constexpr (std::is_same_v<Device, LoopbackDevice>) {
      return device_.races();
    } else {
      return 0;
    }
  }
  void set_current_stream(const std::string& name) override {
    if constexpr (std::is_same_v<Device, LoopbackDevice>) {
      std::lock_guard lock(mutex_);
      device_.set_current_stream(name);
    } else {
      throw std::invalid_argument(
          "set_current_stream: only a loopback session has streams of its own; on a GPU the "
          "current stream is torch's (torch.cuda.stream)");
    }
  }
  void enter() override {
    std::lock_guard lock(mutex_);
    core_.enter();
  }
  void exit() override {
    std::lock_guard lock(mutex_);
    core_.exit();
  }

 private:
  NodeId node_id(std::uint64_t seq) {
    auto it = nodes_.find(seq);
    if (it != nodes_.end()) return it->second;
    const NodeId id(static_cast<std::uint32_t>(nodes_.size() + 1));
    nodes_.emplace(seq, id);
    return id;
  }

  RealOptions options_;
  mutable std::recursive_mutex mutex_;
  Device device_;
  Offloader<Device> core_;
  std::unordered_map<std::uint64_t, NodeId> nodes_;
  std::unordered_set<const torch::autograd::Node*> hooked_;
  std::unordered_set<const void*> excluded_;
  OffloadFaults faults_;         // the contract's planted breaches (tests only)
  std::int64_t kept_as_is_ = 0;  // see Note [Saved-tensor contract]
  int graph_task_ = -1;
};

}  // namespace

std::shared_ptr<Session> Session::create(const RealOptions& options, const OffloadFaults& faults) {
  const OffloadOptions& o = options.offload;
  for (const auto& [name, value] :
       {std::pair{"min_bytes", o.min_bytes}, std::pair{"window_bytes", o.window_bytes},
        std::pair{"prefetch_bytes", o.prefetch_bytes}, std::pair{"host_cap", o.host_cap},
        std::pair{"host_reserve_bytes", options.host_reserve}}) {
    if (value.count() < 0) {
      throw std::invalid_argument(
          fmt::format("ferry: option {} must not be negative (got {})", name, value.count()));
    }
  }
  check_offload_options(options.offload);
  if (options.loopback) return std::make_shared<SessionImpl<LoopbackDevice>>(options, faults);
#ifdef FERRY_HAVE_CUDA
  if (cuda_available()) return std::make_shared<SessionImpl<CudaDevice>>(options, faults);
#endif
  throw std::invalid_argument(
      "ferry: no CUDA device is available; use the CPU loopback device (C++: "
      "RealOptions::loopback = true, Python: ferry.offload(loopback=True))");
}

// --- the region stack ------------------------------------------------------------------------

void push_context(Context context) { tl_stack.push_back(std::move(context)); }

void pop_context(Context::Kind kind) {
  if (tl_stack.empty() || tl_stack.back().kind != kind) {
    throw std::logic_error(
        "ferry: regions must nest: the region being closed is not the innermost one");
  }
  tl_stack.pop_back();
}

void remove_region(Context::Kind kind, std::size_t index) {
  std::size_t seen = 0;
  for (auto it = tl_stack.begin(); it != tl_stack.end(); ++it) {
    if (it->kind != Context::Kind::Offload && it->kind != Context::Kind::NoOffload) continue;
    if (seen++ != index) continue;
    if (it->kind != kind) break;
    tl_stack.erase(it);
    return;
  }
  throw std::logic_error("ferry: regions must nest: no such region on this thread's stack");
}

void close_context(Context::Kind kind) noexcept {
  for (auto it = tl_stack.rbegin(); it != tl_stack.rend(); ++it) {
    if (it->kind != kind) continue;
    if (it != tl_stack.rbegin()) {
      std::fputs(
          "ferry: warning: a region guard was destroyed while a region opened after it "
          "is still open; regions must nest\n",
          stderr);
    }
    tl_stack.erase(std::next(it).base());
    return;
  }
}

std::shared_ptr<Session> enclosing_session(bool* in_no_offload) {
  if (in_no_offload != nullptr) *in_no_offload = false;
  for (auto it = tl_stack.rbegin(); it != tl_stack.rend(); ++it) {
    if (it->kind == Context::Kind::Offload) return it->session;
    if (it->kind == Context::Kind::NoOffload) {
      if (in_no_offload != nullptr) *in_no_offload = true;
      return nullptr;
    }
  }
  return nullptr;
}

// --- selective checkpointing's offload choice -------------------------------------------------

// Note [Offloaded outputs]
// Selective checkpointing keeps the outputs of the ops its policy saves and hands them back when
// the region is recomputed. An op whose policy is to offload has its output packed by an offload
// session instead: as an activation of the autograd node the op just created (the session names
// nodes by sequence number, see Note [Nodes and backward passes]), so it is copied to the host in
// forward and prefetched for backward like a saved tensor. The replay takes it back at the op,
// and lets it go at once: the session sees a reloaded storage still referenced (the replay's
// tensor) and frees it with record_stream on the compute stream when that reference dies.
OffloadedOutput::OffloadedOutput(const std::shared_ptr<Session>& session, const at::Tensor& output)
    : packed_(session->pack(output, TensorKind::Activation, /*check_version=*/false)),
      version_(output.unsafeGetTensorImpl()->version_counter()),
      saved_version_(version_.current_version()) {}

at::Tensor OffloadedOutput::take(bool allow_mutation) {
  if (!packed_) {
    throw std::logic_error(
        "ferry.checkpoint: an offloaded output of a selectively checkpointed region was taken "
        "twice; a region computed under selective checkpointing can be backpropagated once");
  }
  if (!allow_mutation && version_.current_version() != saved_version_) {
    throw std::logic_error(
        "ferry.checkpoint: Tensor cached during selective activation checkpoint has been "
        "mutated (an output the policy offloaded was modified in place after the op; pass "
        "allow_cache_entry_mutation=True to create_selective_checkpoint_contexts to allow it)");
  }
  const PackedPtr packed = std::move(packed_);
  packed_.reset();
  return packed->unpack();
}

std::int64_t live_checkpoint_states() { return g_live_states.load(); }

bool packing_active() {
  return !tl_stack.empty() && tl_stack.back().kind != Context::Kind::NoOffload;
}

// --- checkpoint --------------------------------------------------------------------------------

namespace {

// The random state a region's forward saw, to replay it (CPU and the CUDA devices its inputs
// live on).
struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;
};

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard lock(gen.mutex());
  gen.set_state(state);
}

// The CPU state and that of each CUDA device in `devices`.
RngState capture_rng(const std::vector<c10::DeviceIndex>& devices) {
  RngState state;
  state.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  for (const c10::DeviceIndex index : devices) {
    state.cuda.emplace_back(
        index, generator_state(at::globalContext().defaultGenerator(at::Device(at::kCUDA, index))));
  }
  return state;
}

// The CUDA devices of `inputs`, each once.
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

AutocastState capture_autocast() {
  const auto per_device = [](at::DeviceType type) {
    return AutocastState::PerDevice{at::autocast::is_autocast_enabled(type),
                                    at::autocast::get_autocast_dtype(type)};
  };
  return AutocastState{per_device(at::kCPU), per_device(at::kCUDA),
                       at::autocast::is_autocast_cache_enabled()};
}

void set_autocast(const AutocastState& state) {
  at::autocast::set_autocast_enabled(at::kCPU, state.cpu.enabled);
  at::autocast::set_autocast_dtype(at::kCPU, state.cpu.dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, state.cuda.enabled);
  at::autocast::set_autocast_dtype(at::kCUDA, state.cuda.dtype);
  at::autocast::set_autocast_cache_enabled(state.cache_enabled);
}

// Enters a captured autocast state for a scope; restores the one it found. See
// Note [Autocast in replays].
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state) : outer_(capture_autocast()) {
    set_autocast(state);
    at::autocast::increment_nesting();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  ~AutocastScope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set_autocast(outer_);
  }

 private:
  AutocastState outer_;
};

// Shape, dtype and device in words, as torch prints them:
// {shape: [2, 8], dtype: bfloat16, device: cuda:0}.
std::string describe_meta(const SavedMeta& m) {
  const auto dtype = static_cast<at::ScalarType>(m.dtype);
  const c10::Device device(static_cast<c10::DeviceType>(m.device / 256U),
                           static_cast<c10::DeviceIndex>(static_cast<int>(m.device % 256U) - 1));
  return fmt::format("{{shape: [{}], dtype: {}, device: {}}}", fmt::join(m.shape, ", "),
                     c10::getDtypeNames(dtype).first, device.str());
}

SavedMeta saved_meta(const at::Tensor& t) {
  SavedMeta meta;
  meta.bytes = Bytes(t.numel() * static_cast<std::int64_t>(t.element_size()));
  meta.shape = t.sizes().vec();
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
    frames_[id.value()] = FrameInfo{std::move(replay), std::move(rng), options.preserve_rng_state,
                                    autocast, std::move(inputs)};
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
    return core_.pack(frame, saved_meta(t));
  }
  PackedPtr recompute_pack(const at::Tensor& t) {
    RecomputePack result;
    {
      std::lock_guard lock(mutex_);
      result = core_.recompute_pack(saved_meta(t), t.detach());
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
    AutocastState autocast;  // the forward's; see Note [Autocast in replays]
    std::vector<Input> inputs;
  };

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
      if (in.version) in.version->check(in.tensor.sizes(), in.tensor.scalar_type());
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
  const HolderId id = core_.pack(frame, saved_meta(t));
  ++live_holders_;
  return std::make_shared<Holder>(shared_from_this(), id);
}

FrameToken frame_begin(const CheckpointOptions& options, Replay replay,
                       const std::vector<at::Tensor>& inputs) {
  std::shared_ptr<CheckpointState> state;
  for (auto it = tl_stack.rbegin(); it != tl_stack.rend() && !state; ++it) {
    if (it->kind == Context::Kind::Frame || it->kind == Context::Kind::Recompute) state = it->ckpt;
  }
  if (!state) state = std::make_shared<CheckpointState>();
  // The inputs are saved by the innermost region when it is a checkpoint frame; in its replay
  // they are recomputed tensors like the others (which may end the replay early, here).
  std::vector<CheckpointState::Input> saved;
  saved.reserve(inputs.size());
  const Context* top = tl_stack.empty() ? nullptr : &tl_stack.back();
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
      (void)state->recompute_pack(t);
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

// --- reentrant checkpoint ----------------------------------------------------------------------

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

PackedPtr pack_saved(const at::Tensor& tensor, TensorKind kind) {
  if (tl_stack.empty()) return std::make_shared<KeptAsIs>(tensor);
  const Context& top = tl_stack.back();
  switch (top.kind) {
    case Context::Kind::Offload:
      return top.session->pack(tensor, kind);
    case Context::Kind::NoOffload:
      return std::make_shared<KeptAsIs>(tensor);
    case Context::Kind::Frame:
      return top.ckpt->pack(top.frame, tensor);
    case Context::Kind::Recompute:
      return top.ckpt->recompute_pack(tensor);
  }
  return std::make_shared<KeptAsIs>(tensor);
}

}  // namespace ferry::real
