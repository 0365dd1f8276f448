#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/sim/workload/rank_model.hpp"
#include "tensor_parallel_cut.hpp"

namespace ferry::sim {
namespace rank_cut_detail {

Layout TensorParallelRewrite::layout_of(std::uint32_t t) const {
  // A view no op lists as an output (a trace's reshapes) is laid out as its base.
  if (t < whole_.tensors.size() && !assigned_[t] && whole_.tensors[t].view_of >= 0) {
    return layout_[base(t)];
  }
  return layout_[t];
}

std::uint32_t TensorParallelRewrite::new_tensor(std::uint32_t like, std::string name, Layout l) {
  layout_.push_back(l);
  assigned_.push_back(true);
  return add_tensor(out_, like, std::move(name));
}

// The partial sum `t` (or a view of all of it) as its tensor reduce-scattered over the tokens,
// the reduce-scatter added once, named by the op that made the sum, in `near`'s layer. Any other
// view of a partial sum is itself.
std::uint32_t TensorParallelRewrite::scatter(std::uint32_t t, const ModelOp& near) {
  const ModelTensor& read = out_.tensors[t];
  const std::uint32_t b = base_in(out_, t);
  if (b != t && (read.view_offset.count() != 0 || read.bytes != out_.tensors[b].bytes)) return t;
  if (b >= scattered_.size() || plan_.producer[b] < 0) return t;
  if (scattered_[b] == b) {
    const std::uint32_t s = new_tensor(b, name_of(b) + "/tp.scattered", Layout::Tokens);
    const std::string& by = op(static_cast<std::size_t>(plan_.producer[b])).name;
    out_.ops.push_back(collective_op(by + "/tp.reduce_scatter", kScatter, {b}, {s}, near));
    scattered_[b] = s;
  }
  return scattered_[b];
}

// A partial sum is read as its scattered tensor, and so is a view of all of it (a trace's
// reshape of a projection's output).
std::uint32_t TensorParallelRewrite::as_read(std::uint32_t t) const {
  const std::uint32_t b = base(t);
  const ModelTensor& v = whole_.tensors[t];
  if (b != t && scattered_[b] != b && v.view_offset.count() == 0 &&
      v.bytes == whole_.tensors[b].bytes) {
    return scattered_[b];
  }
  return scattered_[t];
}

// In a mixture-of-experts layer a partial sum stays one through the linear ops that read only
// partial sums (an add, a sum over a dimension, a copy or a change of dtype, a reshape:
// OpFamilyTraits::linear_in_sums), and is reduce-scattered before any other op reads it (Note
// [Tensor parallelism of a mixture of experts]).
bool TensorParallelRewrite::sums_partials(const ModelOp& o, Role role, bool in_moe) const {
  const auto partial = [&](std::uint32_t t) {
    return activation(t) && layout_of(t) == Layout::Partial;
  };
  return in_moe && role == Role::Other && is_linear_in_sums(o.kind.family()) &&
         std::ranges::any_of(o.inputs, partial) &&
         std::ranges::all_of(o.inputs,
                             [&](std::uint32_t t) { return !activation(t) || partial(t); });
}

void TensorParallelRewrite::scatter_inputs(ModelOp& o) {
  for (std::uint32_t& t : o.inputs) {
    if (!activation(t) || layout_of(t) != Layout::Partial) continue;
    const std::uint32_t was = t;
    t = scatter(t, o);
    std::ranges::replace(o.saved, was, t);
  }
}

// A projection that reads its operand whole (`whole_operand`), or an op of a mixture of experts'
// block that reads the block's input: gather a token-split operand first.
void TensorParallelRewrite::gather_inputs(ModelOp& o, bool whole_operand) {
  for (std::uint32_t& t : o.inputs) {
    if (!activation(t) || layout_of(t) != Layout::Tokens) continue;
    const ModelTensor& read = out_.tensors[t];
    const std::uint32_t b = base_in(out_, t);
    if (!whole_operand && !plan_.moe_inputs.contains(b)) continue;
    auto [at, fresh] = gathered_.try_emplace({b, read.view_offset.count(), read.bytes.count()}, 0);
    if (fresh) {
      at->second = new_tensor(t, name_of(t) + "/tp.gathered", Layout::Whole);
      out_.ops.push_back(collective_op(o.name + "/tp.all_gather", kGather, {t}, {at->second}, o));
    }
    const std::uint32_t g = at->second;
    std::ranges::replace(o.saved, t, g);
    t = g;
  }
}

// The layout of an op of no role follows from what it reads: split by features or tokens if an
// input is, routed rows (or, summed back to one row a token in `block`'s layer, a partial sum),
// or whole.
Result<TensorParallelRewrite::OpLayout> TensorParallelRewrite::derive_layout(
    const ModelOp& o, std::optional<std::int64_t> block) const {
  bool features = false;
  bool tokens = false;
  bool routed = false;
  bool indexed = false;              // reads an integer tensor
  std::int64_t routed_elements = 0;  // the most a routed input holds
  for (const std::uint32_t t : o.inputs) {
    if (!activation(t)) continue;
    const Layout l = layout_of(t);
    if (l == Layout::Partial) {
      return refuse("op \"{}\" reads \"{}\", a partial sum", o.name, name_of(t));
    }
    features |= l == Layout::Features;
    tokens |= l == Layout::Tokens;
    routed |= l == Layout::Routed;
    indexed |= is_index(out_.tensors[t].dtype);
    if (l == Layout::Routed && t < whole_.tensors.size()) {
      routed_elements = std::max(routed_elements, elements(t));
    }
  }
  if (features && tokens) {
    return refuse("op \"{}\" reads tensors split by features and by tokens", o.name);
  }
  if (routed && (features || tokens)) {
    return refuse("op \"{}\" reads routed rows and tensors split by {}", o.name,
                  features ? "features" : "tokens");
  }
  if (routed) {
    // Routed rows back to one row a token: a partial sum of the block's output.
    const std::int64_t out_elements = o.outputs.empty() ? 0 : elements(o.outputs.front());
    const bool combines =
        block && out_elements == *block && (indexed || routed_elements > out_elements);
    return OpLayout{combines ? Layout::Partial : Layout::Routed, false, !combines};
  }
  return OpLayout{features ? Layout::Features
                  : tokens ? Layout::Tokens
                           : Layout::Whole,
                  features && o.layer < 0, features || tokens};
}

Status TensorParallelRewrite::check_operands(const ModelOp& o, const RoleRule& rule) const {
  if (rule.operands == 0) return Ok{};
  for (const std::uint32_t t : o.inputs) {
    if (activation(t) && !allows(rule.operands, layout_of(t))) {
      return refuse("op \"{}\", {}, reads \"{}\" {}", o.name, rule.name, name_of(t),
                    allows(rule.operands, Layout::Whole) ? "split among the ranks" : "whole");
    }
  }
  return Ok{};
}

// The weights: cut as the role says, or read whole. An op that makes nothing but views of a
// parameter (a trace's transposed weight, listed with no outputs) reads nothing.
void TensorParallelRewrite::mark_params(const ModelOp& o, std::size_t i, const RoleRule& rule) {
  const bool viewing = std::ranges::all_of(
      o.outputs, [&](std::uint32_t t) { return out_.tensors[t].role == TensorRole::Param; });
  for (const std::uint32_t t : o.inputs) {
    if (t >= whole_.tensors.size() || !is_param(t) || viewing) continue;
    const bool cut = rule.params == ParamCut::All ||
                     (rule.params == ParamCut::Table && t == *plan_.table[i]) ||
                     (rule.params == ParamCut::Weight && t == *plan_.weight[i]);
    (cut ? cut_param_ : whole_param_)[t] = true;
    (cut ? cut_param_ : whole_param_)[base(t)] = true;
  }
}

void TensorParallelRewrite::lay_outputs(const ModelOp& o, const OpLayout& l) {
  for (const std::uint32_t t : o.outputs) {
    Layout result = l.result;
    if (l.reduced && (t == whole_.loss || (plan_.tokens > 0 && elements(t) <= plan_.tokens))) {
      result = Layout::Whole;
    }
    if (t == whole_.loss) result = Layout::Whole;
    layout_[t] = result;
    assigned_[t] = true;
  }
}

// 1/tp of a scaled op's work: of its product's dimension the rule names, its FLOPs and bytes.
Status TensorParallelRewrite::scale_work(ModelOp& o, const RoleRule& rule, bool scaled) const {
  if (!scaled) return Ok{};
  if (o.gemm.known()) {
    switch (rule.gemm) {
      case GemmCut::None:
        break;
      case GemmCut::N:
      case GemmCut::K: {
        std::int64_t& dim = rule.gemm == GemmCut::N ? o.gemm.n : o.gemm.k;
        if (dim % tp_ != 0) {
          return refuse("the {} features of op \"{}\" do not split among {} ranks", dim, o.name,
                        tp_);
        }
        dim /= tp_;
        break;
      }
      case GemmCut::Rows:  // each rank computes the routed rows of 1/tp of the tokens
        if (o.gemm.m % tp_ != 0) {
          return refuse("the {} routed rows of op \"{}\" do not split among {} ranks", o.gemm.m,
                        o.name, tp_);
        }
        o.gemm.m /= tp_;
        for (std::int64_t& rows : o.group_rows) rows /= tp_;
        break;
      case GemmCut::Batch:  // attention's product of activations split by heads
        if (o.gemm.batch % tp_ != 0) {
          return refuse("the {} products of op \"{}\" do not split among {} ranks", o.gemm.batch,
                        o.name, tp_);
        }
        o.gemm.batch /= tp_;
        break;
    }
  }
  o.flops /= tp_;
  o.backward_flops /= tp_;
  o.bytes = Bytes(o.bytes.count() / tp_);
  o.backward_bytes = Bytes(o.backward_bytes.count() / tp_);
  return Ok{};
}

Status TensorParallelRewrite::rewrite_op(std::size_t i) {
  ModelOp o = op(i);
  for (std::uint32_t& t : o.inputs) t = as_read(t);
  for (std::uint32_t& t : o.saved) t = as_read(t);
  const Role role = plan_.role[i];
  const RoleRule& rule = kRoleRules[static_cast<std::size_t>(role)];
  const auto moe = plan_.moe_layers.find(o.layer);
  const bool in_moe = moe != plan_.moe_layers.end();
  const bool sums = sums_partials(o, role, in_moe);
  if (!sums) scatter_inputs(o);
  if (rule.gathers || in_moe) gather_inputs(o, rule.gathers);
  OpLayout l{Layout::Partial, false, false};  // a sum of partial sums
  if (rule.output) {
    l = OpLayout{*rule.output, false, rule.scaled};
  } else if (!sums) {
    auto derived = derive_layout(o, in_moe ? std::optional(moe->second) : std::nullopt);
    if (!derived) return derived.error();
    l = derived.value();
  }
  FERRY_JSON_RETURN_IF_ERROR(check_operands(o, rule));
  mark_params(o, i, rule);
  lay_outputs(o, l);
  FERRY_JSON_RETURN_IF_ERROR(scale_work(o, rule, l.scaled));
  const ModelOp& kept = out_.ops.emplace_back(std::move(o));
  // A partial sum is reduce-scattered over the tokens before anything reads it (in a mixture
  // of experts' layer, before anything but a sum of partial sums reads it). The whole model's
  // op stands for `kept` (same layer and region), which the new op's push may move.
  if (l.result == Layout::Partial && !in_moe) scatter(kept.outputs.front(), op(i));
  return Ok{};
}

// An optimizer's state (its moments, which no op reads) belongs to a parameter of its size: cut
// with the parameters of that size, when no parameter read whole has it.
std::vector<bool> TensorParallelRewrite::held_state() const {
  std::set<std::int64_t> cut_sizes;
  std::set<std::int64_t> whole_sizes;
  for (std::uint32_t t = 0; t < whole_.tensors.size(); ++t) {
    if (!is_param(t) || base(t) != t) continue;
    if (cut_param_[t]) cut_sizes.insert(elements(t));
    if (whole_param_[t]) whole_sizes.insert(elements(t));
  }
  std::vector<bool> held(whole_.tensors.size(), false);
  for (std::uint32_t t = 0; t < whole_.tensors.size(); ++t) {
    held[t] = whole_.tensors[t].role == TensorRole::OptimizerState &&
              whole_.tensors[t].view_of < 0 && plan_.readers[t].empty() &&
              cut_sizes.contains(elements(t)) && !whole_sizes.contains(elements(t));
  }
  return held;
}

// Sizes: split tensors and cut parameters hold 1/tp of the bytes (views of the offsets).
Status TensorParallelRewrite::size_tensors() {
  const std::vector<bool> held = held_state();
  const auto split = [&](std::uint32_t u) {
    const Layout l = layout_of(u);
    return l == Layout::Features || l == Layout::Tokens || l == Layout::Routed;
  };
  for (std::uint32_t t = 0; t < out_.tensors.size(); ++t) {
    const bool original = t < whole_.tensors.size();
    const std::uint32_t b = original ? base(t) : t;
    bool cut = false;
    if (original && is_param(t)) {
      if ((cut_param_[t] || cut_param_[b]) && (whole_param_[t] || whole_param_[b])) {
        return refuse("parameter \"{}\" is cut by one op and read whole by another",
                      whole_.tensors[b].name);
      }
      cut = cut_param_[t] || cut_param_[b];
    } else if (original && held[t]) {
      cut = true;
    } else {
      cut = split(t);
      if (b != t && split(b) != cut) {
        return refuse("view \"{}\" and its base \"{}\" are not split alike", whole_.tensors[t].name,
                      whole_.tensors[b].name);
      }
    }
    if (!cut) continue;
    ModelTensor& tensor = out_.tensors[t];
    const std::int64_t size = dtype_size(tensor.dtype);
    const std::int64_t n = tensor.bytes.count() / size;
    if (n % tp_ != 0 || (tensor.view_offset.count() / size) % tp_ != 0) {
      return refuse("tensor \"{}\" of {} elements does not split among {} ranks", tensor.name, n,
                    tp_);
    }
    tensor.bytes = Bytes(tensor.bytes.count() / tp_);
    tensor.view_offset = Bytes(tensor.view_offset.count() / tp_);
  }
  return Ok{};
}

Result<Model> TensorParallelRewrite::run() {
  out_ = whole_;
  out_.ops.clear();
  out_.ops.reserve(whole_.ops.size() * 5 / 4 + 8);
  layout_.assign(whole_.tensors.size(), Layout::Whole);
  assigned_.assign(whole_.tensors.size(), false);
  cut_param_.assign(whole_.tensors.size(), false);
  whole_param_.assign(whole_.tensors.size(), false);
  scattered_.resize(whole_.tensors.size());
  for (std::uint32_t t = 0; t < scattered_.size(); ++t) scattered_[t] = t;
  for (std::size_t i = 0; i < whole_.ops.size(); ++i) FERRY_JSON_RETURN_IF_ERROR(rewrite_op(i));
  FERRY_JSON_RETURN_IF_ERROR(size_tensors());
  return checked(std::move(out_));
}

}  // namespace rank_cut_detail

namespace {

Result<Model> cut_at(const Model& whole, std::int32_t tp, bool validate) {
  auto plan = rank_cut_detail::TensorParallelRoles(whole, tp).run();
  if (!plan) return plan.error();
  rank_cut_detail::TensorParallelRewrite rewrite(whole, tp, plan.value());
  if (!validate) rewrite.skip_validation();
  return rewrite.run();
}

// The GPUs of a node where no device is named (tensor_parallel_model): every bundled device with
// intra-node links has nodes of 8.
constexpr std::int32_t kNodeGpus = 8;

// What --tp accepts of `whole`, said after a refusal at `refused`: the degrees up to `node_gpus`
// the mesh takes (`fits`) that cut it, or, where none does, that it plans without tensor
// parallelism.
std::string accepted_degrees(const Model& whole, std::int32_t refused, std::int32_t node_gpus,
                             const std::function<bool(std::int32_t)>& fits) {
  std::vector<std::int32_t> offered;
  for (std::int32_t tp = 2; tp <= node_gpus; ++tp) {
    if (fits(tp)) offered.push_back(tp);
  }
  std::vector<std::int32_t> cut;
  for (const std::int32_t tp : offered) {
    if (tp != refused && cut_at(whole, tp, true)) cut.push_back(tp);
  }
  const auto listed = [](std::span<const std::int32_t> degrees) {
    if (degrees.size() == 1) return fmt::format("{}", degrees.front());
    return fmt::format("{} or {}", fmt::join(degrees.first(degrees.size() - 1), ", "),
                       degrees.back());
  };
  const std::string_view flag = mesh_field(MeshField::Tp).flag;
  if (cut.empty()) {
    return offered.empty() ? fmt::format("plan it without {}", flag)
                           : fmt::format("none of {} {} cuts this model: plan it without {}", flag,
                                         listed(offered), flag);
  }
  return fmt::format("{} {} {} this model", flag, listed(cut), cut.size() == 1 ? "cuts" : "cut");
}

}  // namespace

// A refusal names what would be accepted instead (the model's other degrees are tried only
// then: a cut that succeeds costs one rewrite).
Result<Model> rank_cut_detail::tensor_parallel_cut(const Model& whole, std::int32_t tp,
                                                   std::int32_t node_gpus,
                                                   const std::function<bool(std::int32_t)>& fits,
                                                   bool validate) {
  auto cut = cut_at(whole, tp, validate);
  if (cut) return cut;
  return Error{
      fmt::format("{}; {}", cut.error().message, accepted_degrees(whole, tp, node_gpus, fits))};
}

Result<Model> tensor_parallel_model(const Model& whole, std::int32_t tp) {
  if (const MeshFieldRule& degree = mesh_field(MeshField::Tp); tp < degree.least) {
    return Error{fmt::format("{} {}: use {} or more ranks", degree.flag, tp, degree.least)};
  }
  if (tp == 1) return whole;
  // Without a device, the node's rule alone (tensor_group_fits in mesh.cpp): its GPUs hold whole
  // groups.
  return rank_cut_detail::tensor_parallel_cut(
      whole, tp, kNodeGpus, [](std::int32_t degree) { return kNodeGpus % degree == 0; }, true);
}

}  // namespace ferry::sim
