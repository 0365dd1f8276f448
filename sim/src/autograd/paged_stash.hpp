#pragma once
// Private to the simulated autograd: the paged stash of saved tensors in static-capacity
// buffers (Note [Paged stash] in paged_stash.cpp).

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include "ferry/sim/autograd/autograd.hpp"
#include "ferry/sim/device/device.hpp"
#include "step_hooks.hpp"

namespace ferry::sim::training {

/// The saved-tensor hook a paged stash sets around a layer's experts, as the innermost one:
/// the Trainer hands it the packs it takes() and asks it back at unpack.
class PagedStash {
 public:
  PagedStash(const Model& model, const PagedStashOptions& options, const TrainingFaults& faults,
             RankContext& rank);

  /// Whether a pack of tensor `t` by op `op` goes to the stash: `t` lies in a static-capacity
  /// buffer, packed by a layer whose stash is not skipped.
  [[nodiscard]] bool takes(std::uint32_t op, std::uint32_t t) const;
  /// Allocates the pool, before the first step.
  void setup();
  /// A step's forward begins: the free lists start over (Megatron's reset).
  void step_begin();
  /// Takes tensor `t`, which op `op` saves and which lives at `offset` in `buffer`; the stash
  /// holds a reference. Returns its id for unpack and release.
  std::uint32_t pack(std::uint32_t op, std::uint32_t t, Device::Buffer buffer, Bytes offset);
  /// Forward, after op `op`: a layer's last op issues its stash.
  void after_op(std::uint32_t op);
  /// Forward, before op `op` (and at backward's start): the stash issued before is awaited and
  /// its padded buffers let go.
  void before_op();
  /// Backward, before node `node`: its layer's stash is restored if it was not.
  void before_node(std::uint32_t node);
  /// The tensor behind `id` (where it lives, at which offset), and a reference for the caller.
  std::pair<Device::Buffer, Bytes> unpack(std::uint32_t id);
  /// Autograd lets go of `id`.
  void release(std::uint32_t id);

  [[nodiscard]] const PagedStashStats& stats() const { return stats_; }

 private:
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
  const PagedStashOptions& options_;
  const TrainingFaults& faults_;
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
