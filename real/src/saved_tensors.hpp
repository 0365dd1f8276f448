#pragma once
// What the real backend's sources share about saved tensors (not installed): torch's version
// check, a tensor kept as it is, how a tensor is rebuilt over its storage, and this thread's
// stack of regions.

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/real/runtime.hpp"
#include "ferry/units.hpp"

namespace ferry::real {

/// This thread's stack of active regions (offload, no-offload, checkpoint frames, replays).
std::vector<Context>& region_stack();

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
//   telemetry): subclasses whose data lives in other tensors, sparse, quantized and zero
//   tensors. The Python hooks hand an offload region a wrapper subclass's inner tensors
//   instead where it has a flatten protocol (Note [Wrapper subclasses] in
//   real/python/src/ferry_ext.cpp); what reaches this layer whole is kept. It is held detached,
//   so that a saved output holds no graph, and its sizes are read only as symbolic sizes.
// * `x.data = other` after the save bumps no version and is not seen: backward gets the storage
//   the tensor had at the save, copied (offloaded, as torch's save_on_cpu copies on a GPU) or
//   held detached (kept). Plain torch holds an input's tensor object and would read the new
//   data; no offloader can, so one rule holds for every saved tensor.
// * torch.autograd.graph.allow_mutation_on_saved_tensors: a region entered under it leaves its
//   saved tensors to torch's own hooks (ferry/_regions.py, Region), which clone a saved tensor
//   before it is changed in place.

// The tensor's type as torch's error messages print it: its legacy type name where the dtype has
// one (torch.FloatTensor, torch.cuda.HalfTensor), else the dispatch key's (CPUBFloat16Type,
// CUDAComplexFloatType).
inline std::string type_name(at::ScalarType dtype, bool cuda) {
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
    if (changed()) fail(fmt::format("{}", fmt::join(sizes, ", ")), dtype);
  }
  /// check() for the saved tensor `t` itself: its sizes are read only for the message, as
  /// symbolic sizes (a jagged nested tensor has no plain ones).
  void check(const at::Tensor& t) const {
    if (!changed()) return;
    std::ostringstream sizes;
    const char* sep = "";
    for (const c10::SymInt& s : t.sym_sizes()) {
      sizes << sep << s;
      sep = ", ";
    }
    fail(sizes.str(), t.scalar_type());
  }

 private:
  [[nodiscard]] bool changed() const {
    return counter_.enabled() && counter_.current_version() != saved_;
  }

  [[noreturn]] void fail(const std::string& sizes, at::ScalarType dtype) const {
    const std::uint32_t now = counter_.current_version();
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
        type_name(dtype, cuda_), sizes, origin, now, saved_, hint));
  }

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
    version_.check(tensor_);
    return tensor_;
  }

 private:
  at::Tensor tensor_;
  SavedVersion version_;
};

// Whether ferry can copy the tensor through its storage: a dense strided tensor whose data is
// its own (not a subclass whose data lives in other tensors, not a zero tensor).
inline bool copyable(const at::Tensor& t) {
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

inline Bytes span_of(const at::Tensor& t) {
  if (t.numel() == 0) return Bytes(0);
  std::int64_t last = 0;
  for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return Bytes((last + 1) * static_cast<std::int64_t>(t.element_size()));
}

// `plain` (a view of the storage, no bits set) with the bits `meta` records.
inline at::Tensor with_view_bits(at::Tensor plain, const TensorMeta& meta) {
  if (!meta.conj && !meta.neg) return plain;
  at::AutoDispatchBelowADInplaceOrView guard;  // bits only: no autograd view of it
  if (meta.conj) plain = at::_conj(plain);
  if (meta.neg) plain = at::_neg_view(plain);
  return plain;
}

// The graph task of the backward running on this thread; -1 outside backward.
inline int current_graph_task() { return torch::autograd::get_current_graph_task_id(); }

}  // namespace ferry::real
