#include "ferry/real/runtime.hpp"
// The per-thread stack of regions that decides what a saved tensor's pack hook does, and
// selective checkpointing's offloaded outputs.

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

#include "saved_tensors.hpp"

namespace ferry::real {

namespace {

thread_local std::vector<Context> tl_stack;

}  // namespace

std::vector<Context>& region_stack() { return tl_stack; }

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

bool packing_active() {
  return !tl_stack.empty() && tl_stack.back().kind != Context::Kind::NoOffload;
}

bool offloading_innermost() {
  return !tl_stack.empty() && tl_stack.back().kind == Context::Kind::Offload;
}

}  // namespace ferry::real
