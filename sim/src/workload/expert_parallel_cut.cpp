#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/rank_model.hpp"
#include "rank_cut.hpp"

namespace ferry::sim {

// Note [An expert-parallel rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under expert parallelism a mixture of experts' experts are split among `ep` GPUs: each holds
// 1/ep of them and computes their rows for every GPU of the group, as torchtitan's expert-
// parallel MoE does. expert_parallel_model finds the experts by what they run: a grouped
// matrix product (is_grouped_matmul_kind) reads the routed rows (its largest activation input),
// the experts' stacked weights (its largest parameter, or a view of one: one k x n matrix per
// expert, so their number follows from the product's shape) and the offsets. Per layer:
//
//   * each grouped matmul's weights hold 1/ep of the experts (their number must split among
//     the ranks);
//   * before the layer's first grouped matmul, an all-to-all dispatches its routed rows to the
//     ranks that hold their experts; the grouped matmuls (and the ops between them) read the
//     dispatched rows; after the last one, an all-to-all combines its output back to the ranks
//     the tokens came from (backward: the same exchanges of the gradients);
//   * each rank receives the rows routed to its experts. Where the trace gives each expert's
//     rows (ModelOp::group_rows, from the offsets its routing assumption gave), every rank of
//     the group is taken to route its own rows as the traced batch did, so rank r receives
//     ep x (the rows of its experts), rank r holding experts [r E/ep, (r+1) E/ep) as
//     torchtitan's Shard(0) of the experts places them. The layer is priced at its busiest
//     rank: the dispatched rows and everything the experts compute from them (the grouped
//     matmuls' FLOPs and m, the ops between them, their saved tensors) grow by its received
//     rows over the traced ones, and so does the dispatch's all-to-all, which the collective
//     model times by the larger of what a rank sends and receives. The combine waits for that
//     rank, so each layer goes at its busiest rank's pace, and the memory figured is a bound
//     above every rank's. Without group rows (or with balanced ones) each rank receives as
//     many rows as it sends and every op keeps its counts.
//
// The rest of the model (attention, shared experts, the router) is every GPU's own: expert
// parallelism borrows its GPUs from the data-parallel ones.

namespace {

using rank_cut_detail::kAllToAllKind;
using rank_cut_detail::RankCut;

class ExpertParallelCut : RankCut {
 public:
  ExpertParallelCut(const Model& whole, std::int32_t ep, std::int32_t nodes, double capacity)
      : RankCut(whole, "--ep", ep), ep_(ep), nodes_(nodes), capacity_(capacity) {}
  using RankCut::skip_validation;

  Result<Model> run();

 private:
  // A layer's rows: those its busiest rank receives and those the trace routed.
  struct RankLoad {
    std::int64_t busiest = 1;
    std::int64_t traced = 1;
    // n x busiest / traced, rounded; past 2^63 - 1 (a hostile file's counts) it stays there,
    // for the cut's check to refuse as above its limit.
    [[nodiscard]] std::int64_t scaled(std::int64_t n) const { return scale(n, traced / 2); }
    // Rounded down: a tensor's elements and a view's offset, so that views that lie inside
    // their base (halves of it) still do.
    [[nodiscard]] std::int64_t scaled_down(std::int64_t n) const { return scale(n, 0); }

   private:
    [[nodiscard]] std::int64_t scale(std::int64_t n, std::int64_t round) const {
      __extension__ using Signed = __int128;
      const Signed v = (Signed{n} * busiest + round) / traced;
      return static_cast<std::int64_t>(
          std::min<Signed>(v, std::numeric_limits<std::int64_t>::max()));
    }
  };
  Result<RankLoad> load_of(const ModelOp& o, std::int64_t experts) const;
  // Whether `o` reads routed rows; if so its outputs are routed rows too.
  static bool mark_routed(const Model& out, const ModelOp& o, std::vector<bool>& routed);
  static void scale_to_load(Model& out, ModelOp& o, const RankLoad& load,
                            const std::vector<bool>& routed);
  // The layer's routed rows, `traced` of them in the whole model, as its busiest rank holds
  // them (`load`, where the trace gives one), in static-capacity buffers where capacity_ asks.
  Status size_routed(Model& out, const std::vector<bool>& routed, const RankLoad* load,
                     std::int64_t traced) const;

  // The grouped matmuls of each layer, the experts' weights, the loads; or why there are none.
  Status find_experts();
  std::uint32_t exchange(std::string name, std::uint32_t from, const ModelOp& near);
  std::uint32_t as_read(std::uint32_t t, bool in_experts) const;
  void dispatch(ModelOp& o);
  Status cut_op(std::size_t i);
  Status split_experts();

  std::int32_t ep_;
  std::int32_t nodes_;
  double capacity_;  // Note [Static capacity]; 0: the rows as routed
  // The grouped matmuls of each layer, the first and the last.
  std::map<std::int32_t, std::pair<std::size_t, std::size_t>> span_;
  std::set<std::uint32_t> experts_;         // the experts' weights and their views
  std::map<std::int32_t, RankLoad> loads_;  // of the layers whose trace gives each expert's rows
  Model out_;                               // the rank's model
  std::vector<std::uint32_t> combined_;     // by tensor: a combined output's tensor, or itself
  std::map<std::uint32_t, std::uint32_t> dispatched_;  // within a layer's experts
  std::vector<bool> routed_;  // by tensor: the layer's routed rows, where its load is given
};

Result<ExpertParallelCut::RankLoad> ExpertParallelCut::load_of(const ModelOp& o,
                                                               std::int64_t experts) const {
  if (o.group_rows.empty()) return RankLoad{};
  if (std::cmp_not_equal(o.group_rows.size(), experts)) {
    return refuse("op \"{}\" gives the rows of {} groups, but its weights hold {} experts", o.name,
                  o.group_rows.size(), experts);
  }
  RankLoad load{0, 0};
  const std::int64_t each = experts / ep_;
  for (std::int64_t r = 0; r < ep_; ++r) {
    std::int64_t rows = 0;
    for (std::int64_t e = r * each; e < (r + 1) * each; ++e) rows += o.group_rows[e];
    load.traced += rows;
    load.busiest = std::max(load.busiest, rows * ep_);
  }
  if (load.traced == 0) return RankLoad{};
  return load;
}

bool ExpertParallelCut::mark_routed(const Model& out, const ModelOp& o, std::vector<bool>& routed) {
  const auto is_routed = [&](std::uint32_t t) {
    const std::int32_t b = out.tensors[t].view_of;
    return routed[t] || (b >= 0 && routed[static_cast<std::size_t>(b)]);
  };
  if (std::ranges::none_of(o.inputs, is_routed)) return false;
  for (const std::uint32_t t : o.outputs) routed[t] = true;
  return true;
}

// An op of the experts that reads routed rows (mark_routed) at its rank's load: its FLOPs, m and
// bytes grow with the rows (its weights' bytes do not).
void ExpertParallelCut::scale_to_load(Model& out, ModelOp& o, const RankLoad& load,
                                      const std::vector<bool>& routed) {
  const auto is_routed = [&](std::uint32_t t) {
    const std::int32_t b = out.tensors[t].view_of;
    return routed[t] || (b >= 0 && routed[static_cast<std::size_t>(b)]);
  };
  std::int64_t rows_bytes = 0;
  for (const std::uint32_t t : o.inputs) {
    if (is_routed(t)) rows_bytes += out.tensors[t].bytes.count();
  }
  for (const std::uint32_t t : o.outputs) rows_bytes += out.tensors[t].bytes.count();
  const std::int64_t before = o.bytes.count();
  if (before > 0) {  // a view moves nothing
    o.bytes = Bytes(before + load.scaled(rows_bytes) - rows_bytes);
    o.backward_bytes = Bytes(RankLoad{o.bytes.count(), before}.scaled(o.backward_bytes.count()));
  }
  o.backward_flops = load.scaled(o.backward_flops);
  if (o.gemm.known()) {
    // 2 m n k batch, so that the shape stays the FLOPs' product (check_gemm); past 2^63 - 1 it
    // stays there, for the cut's check to refuse.
    __extension__ using Signed = __int128;
    o.gemm.m = std::max<std::int64_t>(1, load.scaled(o.gemm.m));
    Signed flops = 2;
    for (const std::int64_t dim : {o.gemm.m, o.gemm.n, o.gemm.k, o.gemm.batch}) {
      flops = std::min<Signed>(flops * dim, std::numeric_limits<std::int64_t>::max());
    }
    o.flops = static_cast<std::int64_t>(flops);
  } else {
    o.flops = load.scaled(o.flops);
  }
}

// Note [Static capacity]
// ~~~~~~~~~~~~~~~~~~~~~~
// A dispatcher with a static capacity factor F (HybridEP's non_blocking_capacity_factor, which
// CUDA-graphed expert parallelism needs: shapes may not follow the routing) allocates each
// rank's routed rows for F times the rows a balanced routing gives it, whatever the routing
// gives: F x (the rows the trace routed) rows a tensor, of which the rows the rank receives
// hold data. The experts compute only those (their grouped matmuls take the rows each expert
// got), so the cut keeps every op's counts and each routed tensor's bytes, and gives each
// routed base activation a capacity (ModelTensor::capacity): its allocation, padded to F
// times its traced elements, with its rows of data (ModelTensor::rows). Its gradient is
// padded the same. A rank that receives more rows than its capacity would drop tokens; the
// cut refuses it, naming the layer and the factor that would hold them. The paged stash
// (paged_stash.hpp) is what takes the padding back out of the step's saved tensors.

Status ExpertParallelCut::size_routed(Model& out, const std::vector<bool>& routed,
                                      const RankLoad* load, std::int64_t traced) const {
  for (std::uint32_t t = 0; t < out.tensors.size(); ++t) {
    ModelTensor& tensor = out.tensors[t];
    const bool of_routed = tensor.view_of >= 0 && routed[static_cast<std::size_t>(tensor.view_of)];
    if (!routed[t] && !of_routed) continue;
    const std::int64_t size = dtype_size(tensor.dtype);
    const std::int64_t elements = tensor.bytes.count() / size;
    if (load != nullptr) {
      // The routed rows, and their views, at the busiest rank's load.
      tensor.bytes = Bytes(load->scaled_down(elements) * size);
      tensor.view_offset = Bytes(load->scaled_down(tensor.view_offset.count() / size) * size);
    }
    if (capacity_ <= 0 || tensor.view_of >= 0 || tensor.role != TensorRole::Activation) continue;
    __extension__ using Signed = __int128;
    const auto padded = static_cast<Signed>(std::ceil(capacity_ * static_cast<double>(elements)));
    if (padded * size > kMaxJsonBytes) {
      return refuse("--expert-capacity {}: tensor \"{}\" would take more than {} bytes", capacity_,
                    tensor.name, kMaxJsonBytes);
    }
    const Bytes capacity(static_cast<std::int64_t>(padded) * size);
    if (tensor.bytes > capacity) {
      return refuse(
          "--expert-capacity {}: the busiest rank receives {} bytes of routed rows into \"{}\", "
          "more than its capacity of {} (a static dispatcher would drop tokens); a factor of "
          "{:.2f} "
          "holds them",
          capacity_, tensor.bytes.count(), tensor.name, capacity.count(),
          std::ceil(100.0 * static_cast<double>(tensor.bytes.count()) /
                    static_cast<double>(elements * size)) /
              100.0);
    }
    tensor.capacity = capacity;
    tensor.rows = std::max<std::int64_t>(1, load != nullptr ? load->scaled_down(traced) : traced);
  }
  return Ok{};
}

Status ExpertParallelCut::find_experts() {
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) {
    const ModelOp& o = whole_.ops[i];
    if (!is_grouped_matmul_kind(o.kind)) continue;
    for (const std::uint32_t t : o.inputs) {
      if (whole_.tensors[base(t)].role == TensorRole::Param) experts_.insert({t, base(t)});
    }
    const std::optional<std::int64_t> experts = grouped_matmul_experts(whole_, o);
    if (!experts) {
      return refuse(
          "op \"{}\", a grouped matmul, has no weights or no \"gemm\" shape to count its "
          "experts by",
          o.name);
    }
    const std::int64_t count = *experts;
    if (count < 1 || count % ep_ != 0) {
      return refuse("{} experts (op \"{}\") do not split among {} ranks", count, o.name, ep_);
    }
    const auto [at, fresh] = span_.try_emplace(o.layer, i, i);
    if (!fresh) at->second.second = i;
    if (!o.group_rows.empty() && !loads_.contains(o.layer)) {
      auto load = load_of(o, count);
      if (!load) return load.error();
      loads_.emplace(o.layer, load.value());
    }
  }
  if (span_.empty()) {
    return refuse(
        "model \"{}\" has no grouped expert matmul: expert parallelism splits a mixture of "
        "experts' experts, run as grouped matmuls (python -m ferry trace with transformers' "
        "grouped_mm experts)",
        whole_.name);
  }
  return Ok{};
}

// Routed rows moved over the expert group into a tensor of their own, named by the exchange
// (names unique among ops: two layers' experts may read one tensor).
std::uint32_t ExpertParallelCut::exchange(std::string name, std::uint32_t from,
                                          const ModelOp& near) {
  const Exchange all_to_all{kAllToAllKind, CollectiveKind::AllToAll, CollectiveKind::AllToAll,
                            MeshAxis::Expert, nodes_};
  const std::uint32_t to = add_tensor(out_, from, name + ".out");
  ModelOp a2a = collective_op(std::move(name), all_to_all, {from}, {to}, near);
  out_.ops.push_back(std::move(a2a));
  return to;
}

// `t` as a later op reads it: a view of all of a combined output reads the combined tensor, and
// an op of the experts reads the rows dispatched to it.
std::uint32_t ExpertParallelCut::as_read(std::uint32_t t, bool in_experts) const {
  const std::uint32_t b = base(t);
  if (b != t && combined_[b] != b && whole_.tensors[t].view_offset.count() == 0 &&
      whole_.tensors[t].bytes == whole_.tensors[b].bytes) {
    return combined_[b];
  }
  if (in_experts) {
    if (const auto d = dispatched_.find(t); d != dispatched_.end()) return d->second;
  }
  return combined_[t];
}

// Before a layer's first grouped matmul `o`: its routed rows (its largest activation input; the
// other is the offsets) dispatched to the ranks that hold their experts.
void ExpertParallelCut::dispatch(ModelOp& o) {
  dispatched_.clear();
  std::uint32_t* rows = nullptr;
  for (std::uint32_t& t : o.inputs) {
    if (out_.tensors[t].role != TensorRole::Activation) continue;
    if (rows == nullptr || out_.tensors[t].bytes > out_.tensors[*rows].bytes) rows = &t;
  }
  if (rows == nullptr) return;
  const std::uint32_t t = *rows;
  const std::uint32_t d = exchange(o.name + "/ep.dispatch", t, o);
  dispatched_[t] = d;
  std::ranges::replace(o.saved, t, d);
  *rows = d;
  routed_[d] = true;
}

Status ExpertParallelCut::cut_op(std::size_t i) {
  ModelOp o = whole_.ops[i];
  const auto layer = span_.find(o.layer);
  const bool in_experts =
      layer != span_.end() && i >= layer->second.first && i <= layer->second.second;
  for (std::uint32_t& t : o.inputs) t = as_read(t, in_experts);
  for (std::uint32_t& t : o.saved) t = as_read(t, in_experts);
  if (in_experts && i == layer->second.first) dispatch(o);
  const auto load = in_experts ? loads_.find(o.layer) : loads_.end();
  if (in_experts && mark_routed(out_, o, routed_) && load != loads_.end()) {
    scale_to_load(out_, o, load->second, routed_);
  }
  const bool last = in_experts && i == layer->second.second;
  const std::string name = o.name;
  const ModelOp& kept = out_.ops.emplace_back(std::move(o));
  if (last && !kept.outputs.empty()) {
    const std::uint32_t t = kept.outputs.front();
    combined_[t] = exchange(name + "/ep.combine", t, out_.ops.back());
  }
  if (last) {
    const std::int64_t traced = whole_.ops[layer->second.first].gemm.m;
    FERRY_JSON_RETURN_IF_ERROR(
        size_routed(out_, routed_, load != loads_.end() ? &load->second : nullptr, traced));
    std::fill(routed_.begin(), routed_.end(), false);
  }
  return Ok{};
}

// Sizes: each rank holds 1/ep of the experts' weights (a view 1/ep of its offset).
Status ExpertParallelCut::split_experts() {
  for (const std::uint32_t t : experts_) {
    ModelTensor& tensor = out_.tensors[t];
    const std::int64_t size = dtype_size(tensor.dtype);
    const std::int64_t n = tensor.bytes.count() / size;
    if (n % ep_ != 0 || (tensor.view_offset.count() / size) % ep_ != 0) {
      return refuse("the experts' weights \"{}\" of {} elements do not split among {} ranks",
                    tensor.name, n, ep_);
    }
    tensor.bytes = Bytes(tensor.bytes.count() / ep_);
    tensor.view_offset = Bytes(tensor.view_offset.count() / ep_);
  }
  return Ok{};
}

Result<Model> ExpertParallelCut::run() {
  FERRY_JSON_RETURN_IF_ERROR(find_experts());
  out_ = whole_;
  out_.ops.clear();
  out_.ops.reserve(whole_.ops.size() + 2 * span_.size());
  combined_.resize(whole_.tensors.size());
  for (std::uint32_t t = 0; t < combined_.size(); ++t) combined_[t] = t;
  // Tensors of the layer's routed rows, where its load is given; the cut adds two a layer.
  routed_.assign(whole_.tensors.size() + 2 * span_.size(), false);
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) FERRY_JSON_RETURN_IF_ERROR(cut_op(i));
  FERRY_JSON_RETURN_IF_ERROR(split_experts());
  return checked(std::move(out_));
}

}  // namespace

Result<Model> expert_parallel_model(const Model& whole, std::int32_t ep, std::int32_t nodes,
                                    double capacity) {
  const MeshFieldRule& degree = mesh_field(MeshField::Ep);
  if (ep < degree.least) {
    return Error{fmt::format("{} {}: use {} or more ranks", degree.flag, ep, degree.least)};
  }
  const MeshFieldRule& factor = mesh_field(MeshField::ExpertCapacity);
  if (capacity != 0 && !factor.in_bounds(capacity)) {
    return Error{fmt::format("{} {}: use a factor from {} to {}", factor.flag, capacity,
                             factor.least, factor.most)};
  }
  if (capacity != 0 && ep < factor.needs_least) {
    return Error{
        fmt::format("{} {} needs {} {} or more: one GPU's routed rows are static without padding",
                    factor.flag, capacity, degree.flag, factor.needs_least)};
  }
  if (ep == 1) return whole;
  return rank_cut_detail::expert_parallel_cut(whole, ep, nodes, capacity, true);
}

Result<Model> rank_cut_detail::expert_parallel_cut(const Model& whole, std::int32_t ep,
                                                   std::int32_t nodes, double capacity,
                                                   bool validate) {
  ExpertParallelCut cut(whole, ep, std::max(1, nodes), capacity);
  if (!validate) cut.skip_validation();
  return cut.run();
}

std::string_view expert_routing_name(ExpertRouting routing) {
  return routing == ExpertRouting::BusiestRank ? "busiest_rank" : "balanced";
}

ExpertRouting expert_routing(const Model& model) {
  const bool given = std::ranges::any_of(model.ops, [](const ModelOp& o) {
    return is_grouped_matmul_kind(o.kind) && !o.group_rows.empty();
  });
  return given ? ExpertRouting::BusiestRank : ExpertRouting::Balanced;
}

}  // namespace ferry::sim
