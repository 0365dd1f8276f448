#pragma once
/// Non-reentrant activation checkpointing: frames, holders and recomputation, as the nestable
/// checkpoint of torch.utils.checkpoint behaves. The core keeps the books and raises the
/// reference's errors; the autograd (simulated or real) re-runs the region's ops.

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/ids.hpp"
#include "ferry/units.hpp"

namespace ferry {

using FrameId = StrongId<struct FrameTag>;
using HolderId = StrongId<struct HolderTag>;

/// Misuse torch.utils.checkpoint also rejects (same meanings, same wording where it has one).
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What the determinism check compares between forward and recompute.
struct SavedMeta {
  Bytes bytes;
  std::uint8_t dtype = 0;
  std::uint32_t device = 0;
  std::uint64_t hash = 0;  ///< content hash, compared only with the content check on
  /// The tensor's sizes where the autograd knows them (torch compares shapes); empty in the
  /// simulator, whose tensors have bytes only.
  std::vector<std::int64_t> shape = {};
  friend bool operator==(const SavedMeta&, const SavedMeta&) = default;
};

/// Per-call options of one checkpointed region.
struct FrameOptions {
  bool early_stop = true;         ///< stop recomputing once every saved tensor exists
  bool determinism_check = true;  ///< compare count, size (and shape), dtype and device
  bool content_check = false;     ///< also compare content hashes
};

/// What recompute_pack did with a recomputed tensor.
enum class RecomputePack : std::uint8_t {
  Kept,      ///< stored for its holder
  KeptLast,  ///< stored, and early stop says the replay can end now
  Ignored,   ///< past what a still-running frame has saved: not stored, the caller lets it go
};

// Note [Nestable checkpoint]
// Saved tensors belong to the innermost active frame: pack returns a holder and keeps nothing.
// The inputs of an inner frame are saved by its parent (they are packed before the frame
// begins), so unpacking an inner holder may first recompute the parent to get them back.
// Recomputation runs as if no checkpoint were active: the caller re-runs the region's ops,
// packing through recompute_pack, and frames begun during that replay are new frames that
// checkpoint as usual. Each backward graph task (gid) gets its own recomputation; a holder
// can be taken once per gid, and taking it clears it, even when the graph is retained. With
// early stop the replay ends as soon as the last holder is filled. A backward may also run
// inside a region whose forward is not over (torch.autograd.grad inside the checkpointed
// function): its replay fills the holders saved so far and ignores the rest.

template <class Tensor>
class Checkpointer {
 public:
  /// Names a saved tensor's metadata for an error message; the backend knows its dtypes and
  /// devices by name (`bfloat16`, `cuda:0`).
  using Describe = std::string (*)(const SavedMeta&);

  /// `names` names metadata in the determinism check's message; null prints the codes.
  explicit Checkpointer(Describe names = nullptr) : describe_(names) {}

  /// The global early-stop switch (set_checkpoint_early_stop): when set, it overrides the
  /// per-call option of frames begun afterwards.
  void set_global_early_stop(std::optional<bool> value) { global_early_stop_ = value; }

  /// Forward: a checkpointed region starts (it becomes the innermost frame).
  FrameId begin(FrameOptions options) {
    if (global_early_stop_) options.early_stop = *global_early_stop_;
    frames_.push_back(Frame{options, {}, {}, {}, {}, 0});
    const FrameId id(static_cast<std::uint32_t>(frames_.size() - 1));
    stack_.push_back(id);
    return id;
  }

  /// Forward: the innermost region ends.
  void end(FrameId frame) {
    FERRY_CHECK(!stack_.empty() && stack_.back() == frame, "checkpoint regions must nest");
    stack_.pop_back();
  }

  /// Forward: the innermost frame saves a tensor; nothing is kept but its metadata.
  HolderId pack(FrameId frame, const SavedMeta& meta) {
    Frame& f = frames_.at(frame.value());
    holders_.push_back(Holder{frame, static_cast<std::uint32_t>(f.metas.size())});
    f.metas.push_back(meta);
    f.holders.push_back(HolderId(static_cast<std::uint32_t>(holders_.size() - 1)));
    return f.holders.back();
  }

  /// Whether `frame` was recomputed in graph task `gid`.
  [[nodiscard]] bool recomputed(FrameId frame, std::uint64_t gid) const {
    return frames_.at(frame.value()).done.count(gid) != 0;
  }

  /// Whether `frame`'s forward is still running (it was begun and not ended).
  [[nodiscard]] bool open(FrameId frame) const {
    return std::find(stack_.begin(), stack_.end(), frame) != stack_.end();
  }

  [[nodiscard]] FrameId frame_of(HolderId holder) const {
    return holders_.at(holder.value()).frame;
  }
  [[nodiscard]] std::size_t saved_count(FrameId frame) const {
    return frames_.at(frame.value()).metas.size();
  }

  /// Backward: the caller is about to re-run `frame`'s region for graph task `gid`.
  void recompute_begin(FrameId frame, std::uint64_t gid) {
    FERRY_CHECK(!recomputed(frame, gid), "frame already recomputed for this graph task");
    Frame& f = frames_.at(frame.value());
    f.counter = 0;
    f.recomputed[gid].assign(f.metas.size(), std::nullopt);
    recompute_stack_.push_back(std::make_pair(frame, gid));
  }

  /// During recomputation: the holders the innermost replay still fills before early stop
  /// ends it; nullopt where nothing ends it early (early stop off, or every holder filled).
  [[nodiscard]] std::optional<std::size_t> holders_left() const {
    FERRY_CHECK(!recompute_stack_.empty(), "holders_left outside a recomputation");
    const Frame& f = frames_.at(recompute_stack_.back().first.value());
    if (!f.options.early_stop || f.counter >= f.metas.size()) return std::nullopt;
    return f.metas.size() - f.counter;
  }

  /// During recomputation: the replay saved `tensor`.
  RecomputePack recompute_pack(const SavedMeta& meta, const Tensor& tensor) {
    FERRY_CHECK(!recompute_stack_.empty(), "recompute_pack outside a recomputation");
    const auto [frame, gid] = recompute_stack_.back();
    Frame& f = frames_.at(frame.value());
    const std::size_t index = f.counter++;
    if (index >= f.metas.size()) {
      // Backward inside the region while its forward is still running: the replay goes past
      // what forward has saved so far; those tensors are not needed.
      if (open(frame)) return RecomputePack::Ignored;
      throw CheckpointError(
          "ferry.checkpoint: trying to save more tensors during recomputation than "
          "during the original forward pass.");
    }
    f.recomputed[gid][index] = Slot{tensor, meta};
    return f.options.early_stop && f.counter == f.metas.size() ? RecomputePack::KeptLast
                                                               : RecomputePack::Kept;
  }

  /// During recomputation: the replay of the innermost recomputing frame is over. Runs the
  /// determinism check.
  void recompute_end() {
    FERRY_CHECK(!recompute_stack_.empty(), "recompute_end outside a recomputation");
    const auto [frame, gid] = recompute_stack_.back();
    recompute_stack_.pop_back();
    Frame& f = frames_.at(frame.value());
    f.done[gid] = true;
    if (!f.options.determinism_check || open(frame)) return;
    if (f.counter != f.metas.size()) {
      throw CheckpointError(fmt::format(
          "ferry.checkpoint: A different number of tensors was saved during the original "
          "forward and recomputation.\nNumber of tensors saved during forward: {}\nNumber of "
          "tensors saved during recomputation: {}",
          f.metas.size(), f.counter));
    }
    std::string bad;
    const auto& slots = f.recomputed[gid];
    for (std::size_t i = 0; i < f.metas.size(); ++i) {
      if (!slots[i]) continue;
      SavedMeta want = f.metas[i];
      SavedMeta got = slots[i]->meta;
      if (!f.options.content_check) want.hash = got.hash = 0;
      if (want != got) {
        bad += fmt::format("tensor at position {}:\nsaved metadata: {}\nrecomputed metadata: {}\n",
                           i, describe_ ? describe_(want) : describe(want),
                           describe_ ? describe_(got) : describe(got));
      }
    }
    if (!bad.empty()) {
      throw CheckpointError(
          "ferry.checkpoint: Recomputed values for the following tensors have different "
          "metadata than during the forward pass.\n" +
          bad);
    }
  }

  /// Backward: the recomputed tensor for `holder` in graph task `gid`; taking clears it.
  Tensor take(HolderId holder, std::uint64_t gid) {
    const Holder& h = holders_.at(holder.value());
    Frame& f = frames_.at(h.frame.value());
    auto it = f.recomputed.find(gid);
    FERRY_CHECK(it != f.recomputed.end(), "take before the frame was recomputed");
    auto& slot = it->second.at(h.index);
    if (!slot) {
      throw CheckpointError(
          "ferry.checkpoint: Unpack is being triggered for a tensor that was already "
          "unpacked once. If you are calling ctx.saved_tensors in backward, make sure to do so "
          "only once. Otherwise please open an issue with details on your use case.");
    }
    Tensor out = slot->tensor;
    slot.reset();
    return out;
  }

  /// Recomputed tensors of graph task `gid` nobody took (e.g. holders of nodes that never
  /// ran); they are handed back for the caller to free, and forgotten.
  std::vector<Tensor> drain(std::uint64_t gid) {
    std::vector<Tensor> out;
    for (Frame& f : frames_) {
      auto it = f.recomputed.find(gid);
      if (it == f.recomputed.end()) continue;
      for (auto& slot : it->second) {
        if (slot) out.push_back(slot->tensor);
      }
      f.recomputed.erase(it);
    }
    return out;
  }

  /// Whether a recomputation is being replayed (its hook is the innermost).
  [[nodiscard]] bool recomputing() const { return !recompute_stack_.empty(); }

  /// Forgets every frame (a new step: the old graph is gone).
  void reset() {
    FERRY_CHECK(stack_.empty() && recompute_stack_.empty(), "reset inside a region");
    frames_.clear();
    holders_.clear();
  }

 private:
  struct Slot {
    Tensor tensor;
    SavedMeta meta;
  };
  struct Frame {
    FrameOptions options;
    std::vector<SavedMeta> metas;
    std::vector<HolderId> holders;
    std::map<std::uint64_t, std::vector<std::optional<Slot>>> recomputed;  // by gid
    std::map<std::uint64_t, bool> done;
    std::size_t counter;
  };
  struct Holder {
    FrameId frame;
    std::uint32_t index;
  };

  static std::string describe(const SavedMeta& m) {
    return fmt::format("{{bytes: {}, dtype: {}, device: {}{}}}", m.bytes.count(), m.dtype, m.device,
                       m.hash != 0 ? fmt::format(", hash: {:#x}", m.hash) : std::string());
  }

  Describe describe_ = nullptr;
  std::optional<bool> global_early_stop_;
  std::vector<Frame> frames_;
  std::vector<Holder> holders_;
  std::vector<FrameId> stack_;
  std::vector<std::pair<FrameId, std::uint64_t>> recompute_stack_;
};

}  // namespace ferry
