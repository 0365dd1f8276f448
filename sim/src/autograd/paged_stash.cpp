#include "paged_stash.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "ferry/check.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/memory/caching_allocator.hpp"
#include "step_failure.hpp"

namespace ferry::sim::training {

namespace {
__extension__ using Wide128 = __int128;
}  // namespace

// Note [Paged stash]
// ~~~~~~~~~~~~~~~~~~
// Under a static-capacity dispatcher (Note [Static capacity] in expert_parallel_cut.cpp) every
// routed tensor an expert layer saves is allocated for the worst case and kept, padding and all,
// from its forward to its backward: the layers' padded buffers add up. Megatron-Core's paged stash
// (`moe_paged_stash`, megatron/core/transformer/moe/paged_stash.py) and torchtitan's port of it to
// its graph trainer (`sac_and_paged_stash`) take the padding back out, and this is what the
// simulator runs, as the innermost saved-tensor hook around the layer's experts:
//
//   * pack: a saved tensor in a static-capacity buffer is kept by reference;
//   * the layer's forward ends: the stash stream waits for the current stream; each tensor's
//     rows of data (ModelTensor::rows; their bytes are the tensor's) are copied into pages of
//     `page_rows` rows taken from the front of the free list of the pool of its row size (one
//     copy per run of consecutive pages); an event is recorded;
//   * the next op's forward begins: the current stream waits for that event, and the padded
//     buffers are let go (Megatron's wait_for_stash_to_complete, before the next layer);
//   * the layer's backward begins: the stash stream waits for the current stream, allocates a
//     padded tensor for each, copies its pages back and puts them at the back of the free list
//     (the pop kernel's tail); the current stream waits for the copies before the layer's
//     nodes read them;
//   * autograd lets go of a restored tensor: the stash stream waits for the current stream,
//     then the padded tensor returns to the stash stream's pool;
//   * the last layer that stashes is kept as it is: its backward comes next
//     (`skip_immediate_backward`, Megatron's remove_paged_tensor_from_stash).
//
// Each pool is one device buffer allocated before the first step: the pages a step's stashes
// hold at once (every stashed layer's, without pipelining) times `headroom`, per row size as
// Megatron keeps one per (dtype, hidden size). Its free list starts over each step. The
// simulator times the copies as device-to-device copies and checks them as any: a stash that
// reads before the producer's writes, a padded buffer reused while the stash reads it, a restore
// read before it is written, a padded tensor handed to the next restore while backward reads it,
// each is a hazard. A stash that finds too few free pages (Megatron's overflow flag) stops the
// step.

PagedStash::PagedStash(const Model& model, const TrainingOptions& options,
                       const PagedStashFaults& faults, RankContext& rank)
    : model_(model),
      training_(options),
      options_(options.paged_stash),
      faults_(faults),
      rank_(rank) {
  rank_.push_saved_tensor_hook(*this);
  std::int32_t layers = 0;
  for (const ModelOp& op : model_.ops) layers = std::max(layers, op.layer + 1);
  last_op_.assign(static_cast<std::size_t>(layers) + 1, 0);
  for (std::uint32_t i = 0; i < model_.ops.size(); ++i) {
    last_op_[static_cast<std::size_t>(model_.ops[i].layer + 1)] = i;
    for (const std::uint32_t t : model_.ops[i].saved) {
      if (rows_of(t) > 0) kept_layer_ = std::max(kept_layer_, model_.ops[i].layer);
    }
  }
  if (!options_.on) return;
  stream_ = rank_.device().make_stream("paged stash");
  // The pages one step's stashes hold at once: every stashed tensor's, counted once.
  std::map<std::tuple<std::uint32_t, std::int64_t, std::int64_t>, bool> seen;
  std::map<std::size_t, std::int64_t> rows;  // by pool: the rows stashed
  for (std::uint32_t i = 0; i < model_.ops.size(); ++i) {
    for (const std::uint32_t t : model_.ops[i].saved) {
      if (!takes(i, t)) continue;
      const std::int32_t b = model_.tensors[t].view_of;
      const auto key =
          std::tuple{b >= 0 ? static_cast<std::uint32_t>(b) : t,
                     model_.tensors[t].view_offset.count(), model_.tensors[t].bytes.count()};
      if (!seen.emplace(key, true).second) continue;
      const auto [pool, pages] = pages_of(t);
      pools_[pool].pages += pages;
      rows[pool] += rows_of(t);
    }
  }
  if (faults_.pool_by_rows) {
    for (std::size_t k = 0; k < pools_.size(); ++k) {
      pools_[k].pages = (rows[k] + options_.page_rows - 1) / options_.page_rows;
    }
  }
  for (Pool& pool : pools_) {
    pool.pages =
        static_cast<std::int64_t>(std::ceil(options_.headroom * static_cast<double>(pool.pages)));
  }
}

Status PagedStash::validate() const {
  if (!options_.on) return Ok{};
  if (options_.page_rows < 1 || options_.page_rows > (std::int64_t{1} << 20)) {
    return Error{fmt::format("paged stash: {} rows a page; use 1 to 2^20", options_.page_rows)};
  }
  if (!(options_.headroom >= 1 && options_.headroom <= 16)) {
    return Error{fmt::format("paged stash: headroom {}; use 1 to 16", options_.headroom)};
  }
  if (training_.retain_graph || training_.backward_inside_op >= 0) {
    return Error{
        "paged stash: a backward that runs twice over one graph, or inside forward, would read "
        "pages given back (Megatron-Core and torchtitan refuse both)"};
  }
  return Ok{};
}

std::int32_t PagedStash::layer_of(std::uint32_t op) const { return model_.ops[op].layer; }

bool PagedStash::takes(std::uint32_t op, std::uint32_t t) const {
  if (!options_.on) return false;
  const std::int32_t layer = layer_of(op);
  if (layer < 0 || layer == kept_layer_) return false;
  return rows_of(t) > 0;
}

const ModelTensor& PagedStash::base_of(std::uint32_t t) const {
  const std::int32_t b = model_.tensors[t].view_of;
  return model_.tensors[b >= 0 ? static_cast<std::uint32_t>(b) : t];
}

std::int64_t PagedStash::rows_of(std::uint32_t t) const { return base_of(t).rows; }

std::pair<std::size_t, std::int64_t> PagedStash::pages_of(std::uint32_t t) {
  const ModelTensor& tensor = model_.tensors[t];
  const std::int64_t rows = rows_of(t);
  const std::int64_t row = (tensor.bytes.count() + rows - 1) / rows;  // a row's bytes
  const auto [at, fresh] = pool_of_row_.try_emplace(row, pools_.size());
  if (fresh) {
    // Past the largest buffer a device holds, reserve() refuses the pool.
    pools_.emplace_back().page = Bytes(static_cast<std::int64_t>(
        std::min<Wide128>(Wide128{row} * options_.page_rows, kMaxJsonBytes + 1)));
  }
  return {at->second, (rows + options_.page_rows - 1) / options_.page_rows};
}

void PagedStash::reserve() {
  stats_.pool = Bytes(0);
  stats_.pages = 0;
  for (std::size_t k = 0; k < pools_.size(); ++k) {
    Pool& pool = pools_[k];
    if (pool.pages == 0) continue;
    if (Wide128{pool.page.count()} * pool.pages > kMaxJsonBytes) {
      throw StepFailure{Failure{
          FailureKind::Infeasible,
          fmt::format("the paged stash's pool of {} pages of {} bytes is above the limit of {} "
                      "bytes",
                      pool.pages, pool.page.count(), kMaxJsonBytes)}};
    }
    pool.buffer =
        rank_.allocate_on(rank_.current_stream(), Bytes(pool.page.count() * pool.pages),
                          fmt::format("paged stash pool ({} B pages)", pool.page.count()));
    stats_.pool += round_size(Bytes(pool.page.count() * pool.pages));  // as allocated
    stats_.pages += pool.pages;
  }
}

void PagedStash::step_begin() {
  for (Pool& pool : pools_) {
    pool.free.clear();
    for (std::int64_t p = 0; p < pool.pages; ++p) pool.free.push_back(p);
  }
  entries_.clear();
  live_.clear();
  pending_.reset();
  stats_.stashed = 0;
  stats_.data = Bytes(0);
  stats_.padded = Bytes(0);
}

std::uint32_t PagedStash::pack(std::uint32_t op, std::uint32_t t, Device::Buffer buffer,
                               Bytes offset) {
  const ModelTensor& tensor = model_.tensors[t];
  const auto key = std::tuple{buffer.id.value(), offset.count(), tensor.bytes.count()};
  if (const auto it = live_.find(key); it != live_.end()) {
    ++entries_[it->second].packs;
    return it->second;
  }
  const ModelTensor& base = base_of(t);
  Entry e;
  e.tensor = t;
  e.layer = layer_of(op);
  e.original = buffer;
  e.offset = offset;
  e.bytes = tensor.bytes;
  // The tensor's padded shape: its share of the base's capacity, in whole elements.
  const std::int64_t element = dtype_size(tensor.dtype);
  const auto padded = static_cast<std::int64_t>(
      (Wide128{tensor.bytes.count()} * base.capacity.count() + base.bytes.count() - 1) /
      base.bytes.count());
  e.padded = Bytes((padded + element - 1) / element * element);
  std::tie(e.pool, e.page_count) = pages_of(t);
  rank_.device().hold(buffer);
  const auto id = static_cast<std::uint32_t>(entries_.size());
  entries_.push_back(std::move(e));
  live_.emplace(key, id);
  return id;
}

void PagedStash::copy_pages(const Entry& e, Device::Buffer buffer, Bytes offset, bool to_pages) {
  const Pool& pool = pools_[e.pool];
  const std::string label =
      fmt::format("{} {}", to_pages ? "stash" : "restore", model_.tensors[e.tensor].name);
  std::int64_t done = 0;
  for (std::size_t i = 0; i < e.pages.size() && done < e.bytes.count();) {
    std::size_t j = i + 1;
    while (j < e.pages.size() && e.pages[j] == e.pages[j - 1] + 1) ++j;
    const std::int64_t run =
        std::min(static_cast<std::int64_t>(j - i) * pool.page.count(), e.bytes.count() - done);
    const Region data{buffer.id, offset + Bytes(done), Bytes(run)};
    const Region pages{pool.buffer->id, Bytes(e.pages[i] * pool.page.count()), Bytes(run)};
    rank_.sim().copy(stream_.id, to_pages ? data : pages, to_pages ? pages : data, label);
    done += run;
    i = j;
  }
}

void PagedStash::after_op(std::uint32_t op) {
  const std::int32_t layer = layer_of(op);
  if (!options_.on || layer < 0 || last_op_[static_cast<std::size_t>(layer + 1)] != op) return;
  if (any_in(layer, State::Packed)) stash(layer);
}

bool PagedStash::any_in(std::int32_t layer, State state) const {
  return std::ranges::any_of(entries_,
                             [&](const Entry& e) { return e.layer == layer && e.state == state; });
}

void PagedStash::follow_current(bool wait) {
  Device& device = rank_.device();
  const Device::Event ready = device.make_event();
  device.record(ready, Device::Stream{rank_.current_stream()});
  if (wait) device.wait(stream_, ready);
}

void PagedStash::stash(std::int32_t layer) {
  follow_current(!faults_.skip_stash_launch_wait);
  for (Entry& e : entries_) {
    if (e.layer != layer || e.state != State::Packed) continue;
    Pool& pool = pools_[e.pool];
    const std::int64_t pages = e.page_count;
    if (std::cmp_less(pool.free.size(), pages)) {
      throw StepFailure{Failure{
          FailureKind::Infeasible,
          fmt::format("the paged stash overflowed: \"{}\" needs {} pages of {} bytes, {} are free "
                      "of {} (raise the pool's headroom)",
                      model_.tensors[e.tensor].name, pages, pool.page.count(), pool.free.size(),
                      pool.pages)}};
    }
    e.pages.assign(pool.free.begin(), pool.free.begin() + pages);
    pool.free.erase(pool.free.begin(), pool.free.begin() + pages);
    copy_pages(e, e.original, e.offset, true);
    e.state = State::Stashing;
    ++stats_.stashed;
    stats_.data += e.bytes;
    stats_.padded += e.padded;
  }
  const Device::Event done = rank_.device().make_event();
  rank_.device().record(done, stream_);
  pending_.emplace(layer, done);
}

void PagedStash::before_op(std::uint32_t /*op*/) { await_stash(); }

void PagedStash::backward_begin(const std::vector<std::uint32_t>& /*order*/) { await_stash(); }

void PagedStash::await_stash() {
  if (!pending_) return;
  Device& device = rank_.device();
  if (!faults_.skip_stash_done_wait) {
    device.wait(Device::Stream{rank_.current_stream()}, pending_->second);
  }
  for (std::uint32_t id = 0; id < entries_.size(); ++id) {
    Entry& e = entries_[id];
    if (e.layer != pending_->first || e.state != State::Stashing) continue;
    device.drop(e.original);
    forget(id);  // its buffer may hold another tensor next
    e.state = State::Stashed;
  }
  pending_.reset();
}

void PagedStash::free_pages(Entry& e) {
  Pool& pool = pools_[e.pool];
  pool.free.insert(pool.free.end(), e.pages.begin(), e.pages.end());
}

void PagedStash::before_node(std::uint32_t node) {
  const std::int32_t layer = layer_of(node);
  if (!options_.on || layer < 0) return;
  if (any_in(layer, State::Stashed)) restore(layer);
}

void PagedStash::restore(std::int32_t layer) {
  follow_current(true);
  for (Entry& e : entries_) {
    if (e.layer != layer || e.state != State::Stashed) continue;
    const Device::Buffer padded = rank_.allocate_on(
        stream_.id, e.padded, fmt::format("{} (restored)", model_.tensors[e.tensor].name));
    copy_pages(e, padded, Bytes(0), false);
    free_pages(e);
    e.restored = padded;
    e.state = State::Restored;
  }
  Device& device = rank_.device();
  const Device::Event done = device.make_event();
  device.record(done, stream_);
  if (!faults_.skip_restore_wait) device.wait(Device::Stream{rank_.current_stream()}, done);
}

std::pair<Device::Buffer, Bytes> PagedStash::unpack(std::uint32_t id) {
  FERRY_CHECK(id < entries_.size(), "paged stash id {} out of range", id);
  Entry& e = entries_[id];
  FERRY_CHECK(e.state != State::Released, "paged stash id {} unpacked after its release", id);
  if (e.state == State::Stashing) await_stash();
  if (e.state == State::Stashed) restore(e.layer);  // a node of another layer reads it first
  if (e.state == State::Restored) {
    rank_.device().hold(*e.restored);
    return {*e.restored, Bytes(0)};
  }
  rank_.device().hold(e.original);
  return {e.original, e.offset};
}

void PagedStash::release(std::uint32_t id) {
  FERRY_CHECK(id < entries_.size(), "paged stash id {} out of range", id);
  Entry& e = entries_[id];
  if (e.state == State::Released || --e.packs > 0) return;
  switch (e.state) {
    case State::Stashing:
      free_pages(e);
      [[fallthrough]];
    case State::Packed:
      rank_.device().drop(e.original);
      break;
    case State::Stashed:
      free_pages(e);
      break;
    case State::Restored: {
      // The padded tensor goes back to the stash stream's pool, where the next restore takes
      // memory: that stream first waits for the reads backward issued (as the offloader's
      // reload stream does, Note [Offload protocol]; Megatron's next reload waits likewise).
      follow_current(!faults_.skip_restored_free_wait);
      rank_.device().drop(*e.restored);
      break;
    }
    case State::Released:
      break;
  }
  e.state = State::Released;
  forget(id);
}

void PagedStash::report(TrainingRun& run) const { run.paged_stash = stats_; }

void PagedStash::forget(std::uint32_t id) {
  const Entry& e = entries_[id];
  const auto it = live_.find(std::tuple{e.original.id.value(), e.offset.count(), e.bytes.count()});
  if (it != live_.end() && it->second == id) live_.erase(it);
}

}  // namespace ferry::sim::training
