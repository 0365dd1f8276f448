#pragma once
// Private to the simulated autograd: the paged stash of saved tensors in static-capacity
// buffers (Note [Paged stash] in paged_stash.cpp).

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/device/device.hpp"
#include "step_hooks.hpp"

namespace ferry::sim::training {

/// The paged stash as a unit of the step's hooks (Note [Step hooks]): its step points run after
/// the parallelism's, and it pushes itself on the rank as the innermost saved-tensor hook, around
/// a layer's experts.
class PagedStash final : public StepHooks, private SavedTensorHook {
 public:
  /// A stash of `options.paged_stash` for the steps `options` runs on `rank`; it keeps
  /// references to every argument.
  PagedStash(const Model& model, const TrainingOptions& options, const PagedStashFaults& faults,
             RankContext& rank);

  /// Checks the page size and headroom, and refuses a backward that runs twice over one graph
  /// or inside forward.
  [[nodiscard]] Status validate() const override;
  /// Allocates the pool, before the first step.
  void reserve() override;
  /// A step's forward begins: the free lists start over (Megatron's reset).
  void step_begin() override;
  /// Forward, before op `op`: the stash issued before is awaited and its padded buffers let go.
  void before_op(std::uint32_t op) override;
  /// Forward, after op `op`: a layer's last op issues its stash.
  void after_op(std::uint32_t op) override;
  /// Backward's start: the last stash, were forward to end with one, is awaited as before_op.
  void backward_begin(const std::vector<std::uint32_t>& order) override;
  /// Backward, before node `node`: its layer's stash is restored if it was not.
  void before_node(std::uint32_t node) override;
  /// The last step's figures, as the run's PagedStashStats.
  void report(TrainingRun& run) const override;

 private:
  // --- the saved-tensor hook (SavedTensorHook) ---------------------------------------------

  // A pack of tensor `t` by op `op` goes to the stash: `t` lies in a static-capacity buffer,
  // packed by a layer whose stash is not skipped.
  [[nodiscard]] bool takes(std::uint32_t op, std::uint32_t t) const override;
  std::uint32_t pack(std::uint32_t op, std::uint32_t t, Device::Buffer buffer,
                     Bytes offset) override;
  std::pair<Device::Buffer, Bytes> unpack(std::uint32_t id) override;
  void release(std::uint32_t id) override;

  enum class State : std::uint8_t { Packed, Stashing, Stashed, Restored, Released };

  // One saved tensor (one pack; a second pack of the same bytes shares it).
  struct Entry {
    std::uint32_t tensor = 0;
    std::int32_t layer = -1;
    Device::Buffer original{};
    Bytes offset;
    Bytes bytes;   // its rows of data
    Bytes padded;  // the padded tensor a restore allocates
    std::size_t pool = 0;
    std::int64_t page_count = 0;      // the pages its rows take
    std::vector<std::int64_t> pages;  // those it holds, once stashed
    std::optional<Device::Buffer> restored;
    State state = State::Packed;
    int packs = 1;
  };

  // Pages of one row size: a device buffer and its free list (a queue, as Megatron's ring).
  struct Pool {
    Bytes page;  // page_rows rows
    std::int64_t pages = 0;
    std::optional<Device::Buffer> buffer;
    std::deque<std::int64_t> free;
  };

  std::int32_t layer_of(std::uint32_t op) const;
  // Tensor t's base (t itself unless a view).
  const ModelTensor& base_of(std::uint32_t t) const;
  // The rows of data of tensor t's static-capacity base; 0: it has none.
  std::int64_t rows_of(std::uint32_t t) const;
  // The pool of tensor t's row size, and the pages its rows take.
  std::pair<std::size_t, std::int64_t> pages_of(std::uint32_t t);
  // The stash issued before is awaited and its padded buffers let go.
  void await_stash();
  // Whether an entry of `layer` is in `state`.
  [[nodiscard]] bool any_in(std::int32_t layer, State state) const;
  // The current stream records an event; the stash stream waits for it, unless `wait` is false
  // (a planted fault).
  void follow_current(bool wait);
  void stash(std::int32_t layer);
  void restore(std::int32_t layer);
  void free_pages(Entry& e);
  // Entry `id`'s bytes are no longer what a pack of the same place shares.
  void forget(std::uint32_t id);
  // Copies a tensor's data between its buffer and its pages, a copy per run of pages.
  void copy_pages(const Entry& e, Device::Buffer buffer, Bytes offset, bool to_pages);

  const Model& model_;
  const TrainingOptions& training_;
  const PagedStashOptions& options_;  // training_.paged_stash
  const PagedStashFaults& faults_;
  RankContext& rank_;
  Device::Stream stream_{};
  std::vector<std::uint32_t> last_op_;  // by layer + 1: its last forward op
  std::int32_t kept_layer_ = -1;        // the last layer that stashes: kept on the device
  std::map<std::int64_t, std::size_t> pool_of_row_;  // row bytes -> pool
  std::vector<Pool> pools_;
  std::vector<Entry> entries_;
  std::map<std::tuple<std::uint32_t, std::int64_t, std::int64_t>, std::uint32_t> live_;
  std::optional<std::pair<std::int32_t, Device::Event>> pending_;  // a stash not yet awaited
  PagedStashStats stats_;
};

}  // namespace ferry::sim::training
