#include "ferry/real/runtime.hpp"
// Offload sessions: the scheduler core over a loopback or CUDA device, behind torch's
// saved-tensor hooks.

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
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/offload/offloader.hpp"
#include "ferry/real/device.hpp"
#ifdef FERRY_HAVE_CUDA
#include "ferry/real/cuda_device.hpp"
#endif

#include "saved_tensors.hpp"

namespace ferry::real {

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
//
// The core prefetches in the order the backward is announced to need its nodes. A session
// may hold the saved tensors of several forwards at once: a pipeline stage runs the forwards
// of later micro-batches before the backward of an earlier one (1F1B, GPipe), each forward a
// graph of its own. The engine runs a graph's nodes in decreasing sequence number, starting
// from its last ones, and the first node of a backward to unpack was made by that backward's
// forward: the nodes made after it belong to forwards whose backward has not begun. So the
// order announced is every node up to the first unpacking one's sequence number, latest
// first; prefetching the later forwards' tensors instead (newest first) would fill the
// prefetch budget with tensors this backward never reads, and bring its own back on demand.
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
    if (options_.offload.policy == Policy::Trl17) {
      // Note [TRL 1.7's dedup key] in trl_policy.hpp.
      facts.address = reinterpret_cast<std::uint64_t>(t.storage().data());
      facts.dtype = static_cast<std::uint32_t>(t.scalar_type());
    }
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
        core_.backward_begin(faults_.prefetch_later_forwards
                                 ? std::vector<NodeId>()
                                 : backward_order(current->sequence_nr()));
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

  // Note [Nodes and backward passes]: the nodes made up to sequence number `first`, latest
  // first.
  std::vector<NodeId> backward_order(std::uint64_t first) const {
    std::vector<std::pair<std::uint64_t, NodeId>> made;
    made.reserve(nodes_.size());
    for (const auto& [seq, id] : nodes_) {
      if (seq <= first) made.emplace_back(seq, id);
    }
    std::sort(made.begin(), made.end(), [](const auto& a, const auto& b) { return a > b; });
    std::vector<NodeId> order;
    order.reserve(made.size());
    for (const auto& entry : made) order.push_back(entry.second);
    return order;
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

}  // namespace ferry::real
