#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/model.hpp"
#include "model_paths.hpp"

namespace ferry::sim {
namespace workload_detail {

std::string tensor_path(std::size_t index) { return json_element_path("tensors", index); }

std::string op_path(std::size_t index) { return json_element_path("ops", index); }

std::string op_member(std::size_t index, std::string_view key) {
  return json_member_path(op_path(index), key);
}

std::int64_t tensor_bytes(const Model& model, const std::vector<std::uint32_t>& tensors) {
  std::int64_t sum = 0;
  for (const std::uint32_t t : tensors) {
    sum = std::min(sum + model.tensors[t].bytes.count(), std::int64_t{1} << 62);
  }
  return sum;
}

}  // namespace workload_detail

namespace {

/// The indefinite article before a role's name: "an input", "a param".
const char* article(TensorRole role) {
  return role == TensorRole::Input || role == TensorRole::Activation ||
                 role == TensorRole::OptimizerState
             ? "an"
             : "a";
}

using workload_detail::error_at;
using workload_detail::op_member;
using workload_detail::op_path;
using workload_detail::tensor_bytes;
using workload_detail::tensor_path;

// Note [Paths on demand]
// ~~~~~~~~~~~~~~~~~~~~~~
// validate_model runs once per model a run or a plan takes (check_model), and once more
// wherever a plain Model is simulated, so the checks must cost little beside the simulation
// they guard. Formatting each op's and tensor's JSON paths ("ops[3].inputs[1]") up front cost
// more than the checks themselves (when every simulation checked its model, a fifth of a Llama
// plan's instructions went to validation, most of it to these strings). A path is therefore a
// function that makes the string, called only on the way to an error.

/// The path of `key` inside tensor `index`: `tensors[5].bytes`.
std::string tensor_member(std::size_t index, std::string_view key) {
  return json_member_path(tensor_path(index), key);
}

/// `ops[i] "name"`, for messages that point at another op.
std::string op_label(const Model& model, std::size_t index) {
  return fmt::format("{} {}", op_path(index), json_quote(model.ops[index].name));
}

/// The first place a name repeats: the later index, and the earlier one that took the name.
struct Repeat {
  std::size_t index = std::numeric_limits<std::size_t>::max();  // none
  std::size_t first = 0;
};

/// The smallest index whose name an earlier index took. The names are sorted by their hash,
/// then by themselves: equal names end up side by side, most comparisons are of integers (the
/// presets' and traces' names share long prefixes, "layers.12.attn."), and colliding hashes fall
/// back to comparing names, so no file makes the check quadratic.
template <class Items>
Repeat first_repeat(const Items& items) {
  struct Entry {
    std::size_t hash;
    std::string_view name;
    std::size_t index;
    auto operator<=>(const Entry&) const = default;
  };
  std::vector<Entry> names;
  names.reserve(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string_view name = items[i].name;
    names.push_back({std::hash<std::string_view>{}(name), name, i});
  }
  std::sort(names.begin(), names.end());
  Repeat repeat;
  for (std::size_t k = 1; k < names.size(); ++k) {
    // Within a run of one name the indices ascend: the run's second is its first repeat.
    if (names[k].name != names[k - 1].name) continue;
    if (k >= 2 && names[k - 2].name == names[k].name) continue;
    if (names[k].index < repeat.index) repeat = {names[k].index, names[k - 1].index};
  }
  return repeat;
}

/// Whether `name`, at `index`, is non-empty and not `repeat`; otherwise an error at `path()`
/// (a repeat names the first user). See Note [Paths on demand].
template <class Path>
Status check_name(const Repeat& repeat, std::string_view name, std::size_t index,
                  std::string_view what, const Path& path, std::string (*first_path)(std::size_t)) {
  if (name.empty()) return error_at(path(), "a {} needs a non-empty name", what);
  if (index == repeat.index) {
    return error_at(path(), "duplicate {} name {} (first at {})", what, json_quote(name),
                    first_path(repeat.first));
  }
  return Ok{};
}

// A static-capacity buffer: a base activation's, at least its bytes, whole elements, with the
// rows of data it holds dividing its bytes.
Status check_capacity(const ModelTensor& tensor, std::size_t index) {
  const auto at = [index](std::string_view key) { return tensor_member(index, key); };
  const std::int64_t capacity = tensor.capacity.count();
  if (capacity == 0 && tensor.rows == 0) return Ok{};
  if (capacity == 0 || tensor.rows == 0) {
    return error_at(at(capacity == 0 ? "rows" : "capacity"),
                    "a static-capacity buffer gives both \"capacity\" and \"rows\"");
  }
  if (tensor.view_of != -1 || tensor.role != TensorRole::Activation) {
    const std::string what =
        tensor.view_of != -1 ? std::string("a view of ") : fmt::format("{} ", article(tensor.role));
    return error_at(at("capacity"), "only a base activation has a capacity; {} is {}{}",
                    json_quote(tensor.name), what, tensor_role_name(tensor.role));
  }
  if (capacity < tensor.bytes.count() || capacity > kMaxJsonBytes ||
      capacity % dtype_size(tensor.dtype) != 0) {
    return error_at(at("capacity"), "expected whole {} elements from its {} bytes up to {}, got {}",
                    dtype_name(tensor.dtype), tensor.bytes.count(), kMaxJsonBytes, capacity);
  }
  if (tensor.rows < 0 || tensor.bytes.count() % tensor.rows != 0) {
    return error_at(at("rows"), "{} rows do not divide its {} bytes", tensor.rows,
                    tensor.bytes.count());
  }
  return Ok{};
}

Status check_tensor(const Model& model, std::size_t index) {
  const ModelTensor& tensor = model.tensors[index];
  const auto at = [index](std::string_view key) { return tensor_member(index, key); };
  const std::int64_t bytes = tensor.bytes.count();
  if (bytes <= 0) {
    return error_at(at("bytes"), "expected a positive byte count, got {}", bytes);
  }
  if (bytes > kMaxJsonBytes) {
    return error_at(at("bytes"), "{} is above the limit of {}", bytes, kMaxJsonBytes);
  }
  const std::int64_t element = dtype_size(tensor.dtype);
  if (bytes % element != 0) {
    return error_at(at("bytes"), "{} bytes is not a whole number of {} elements ({} bytes each)",
                    bytes, dtype_name(tensor.dtype), element);
  }
  if (auto padded = check_capacity(tensor, index); !padded) return padded;
  if (tensor.held && (tensor.view_of != -1 || tensor.role != TensorRole::Activation)) {
    const std::string what =
        tensor.view_of != -1 ? std::string("a view of ") : fmt::format("{} ", article(tensor.role));
    return error_at(at("held"), "only a base activation is held; {} is {}{}",
                    json_quote(tensor.name), what, tensor_role_name(tensor.role));
  }
  const std::int64_t offset = tensor.view_offset.count();
  if (tensor.view_of == -1) {
    if (offset != 0) {
      return error_at(at("view_offset"), "only a view has an offset; {} has its own storage",
                      json_quote(tensor.name));
    }
    return Ok{};
  }
  if (tensor.view_of < 0 || static_cast<std::size_t>(tensor.view_of) >= model.tensors.size()) {
    return error_at(at("view_of"), "base index {} out of range ({} tensors)", tensor.view_of,
                    model.tensors.size());
  }
  const auto base_index = static_cast<std::size_t>(tensor.view_of);
  const ModelTensor& base = model.tensors[base_index];
  if (base_index == index) return error_at(at("view_of"), "a tensor cannot be a view of itself");
  if (base.view_of != -1) {
    const std::string root =
        base.view_of >= 0 && static_cast<std::size_t>(base.view_of) < model.tensors.size()
            ? json_quote(model.tensors[static_cast<std::size_t>(base.view_of)].name)
            : std::string("another tensor");
    return error_at(at("view_of"), "base {} is itself a view (of {}); take the view of {} instead",
                    json_quote(base.name), root, root);
  }
  if (base.role != tensor.role) {
    return error_at(at("view_of"), "a view has its base's role: {} is {}, base {} is {}",
                    json_quote(tensor.name), tensor_role_name(tensor.role), json_quote(base.name),
                    tensor_role_name(base.role));
  }
  if (offset < 0) {
    return error_at(at("view_offset"), "expected a non-negative offset, got {}", offset);
  }
  if (offset > base.bytes.count() - bytes) {
    return error_at(at("view_offset"), "{} bytes at offset {} lie outside its base {} ({} bytes)",
                    bytes, offset, json_quote(base.name), base.bytes.count());
  }
  return Ok{};
}

/// One of an op's counters (FLOPs, bytes, nanoseconds) and the largest value the JSON form takes.
struct Count {
  std::string_view key;
  std::int64_t value;
  std::int64_t max;
};

/// Whether `kind` reads `namespace.name[.overload]`: two or more identifiers joined by dots.
bool is_operator_name(std::string_view kind) {
  std::size_t parts = 0;
  std::size_t start = 0;
  while (start <= kind.size()) {
    const std::size_t dot = std::min(kind.find('.', start), kind.size());
    const std::string_view part = kind.substr(start, dot - start);
    if (part.empty() || (part.front() >= '0' && part.front() <= '9')) return false;
    for (const char c : part) {
      const bool word =
          (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
      if (!word) return false;
    }
    ++parts;
    start = dot + 1;
  }
  return parts >= 2;
}

/// A matmul's shape must be the product its FLOPs count: 2 m n k batch within 0.1 % (a
/// hand-written file may round), each dim in [1, kMaxGemmDim].
Status check_gemm(const ModelOp& op, std::size_t index) {
  if (op.gemm == GemmShape{}) return Ok{};
  for (const auto& [key, value] : {std::pair{"m", op.gemm.m}, std::pair{"n", op.gemm.n},
                                   std::pair{"k", op.gemm.k}, std::pair{"batch", op.gemm.batch}}) {
    if (value < 1 || value > kMaxGemmDim) {
      return error_at(json_member_path(op_member(index, "gemm"), key),
                      "expected an integer in [1, {}], got {}", kMaxGemmDim, value);
    }
  }
  __extension__ using Wide = unsigned __int128;
  // Each dim is at most 2^40; the product is checked against 2^126 step by step.
  Wide product = 2;
  for (const std::int64_t dim : {op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch}) {
    if (product > (Wide{1} << 86)) {
      product = Wide{1} << 126;
      break;
    }
    product *= static_cast<Wide>(dim);
  }
  const Wide flops = static_cast<Wide>(op.flops);
  const Wide gap = product > flops ? product - flops : flops - product;
  if (op.flops == 0 || gap > flops / 1000) {
    return error_at(op_member(index, "gemm"),
                    "{} x {} x {} (batch {}) is 2 m n k batch = {:.6g} FLOPs, but flops is {} "
                    "(they must agree within 0.1 %)",
                    op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch, static_cast<double>(product),
                    op.flops);
  }
  return Ok{};
}

/// A grouped matmul's rows per group (ModelOp::group_rows) are its rows split: a grouped matmul
/// only, together no more than the product's m.
Status check_group_rows(const ModelOp& op, std::size_t index) {
  if (op.group_rows.empty()) return Ok{};
  if (!is_grouped_matmul_kind(op.kind)) {
    return error_at(op_member(index, "group_rows"),
                    "applies to a grouped matmul (aten._grouped_mm, aten._scaled_grouped_mm) "
                    "only; the op's kind is {}",
                    op.kind.empty() ? std::string("not known") : json_quote(op.kind));
  }
  std::int64_t rows = 0;  // at most 2^20 groups of 2^40 rows
  for (const std::int64_t n : op.group_rows) rows += n;
  if (op.gemm.known() && rows > op.gemm.m) {
    return error_at(op_member(index, "group_rows"),
                    "the groups hold {} rows, more than the product's m of {}", rows, op.gemm.m);
  }
  return Ok{};
}

Status check_op_counts(const ModelOp& op, std::size_t index) {
  if (!op.kind.empty() && !is_operator_name(op.kind)) {
    return error_at(op_member(index, "kind"),
                    "expected an operator as namespace.name.overload (\"aten.mm.default\"), got {}",
                    json_quote(op.kind));
  }
  if (op.layer < -1) {
    return error_at(op_member(index, "layer"),
                    "expected -1 (outside the stack) or a layer index, got {}", op.layer);
  }
  for (const Count& count :
       {Count{"flops", op.flops, kMaxModelFlops}, Count{"bytes", op.bytes.count(), kMaxJsonBytes},
        Count{"backward_flops", op.backward_flops, kMaxModelFlops},
        Count{"backward_bytes", op.backward_bytes.count(), kMaxJsonBytes},
        Count{"duration_ns", op.duration.ns(), kMaxJsonNanoseconds},
        Count{"backward_duration_ns", op.backward_duration.ns(), kMaxJsonNanoseconds}}) {
    if (count.value < 0) {
      return error_at(op_member(index, count.key), "expected a non-negative count, got {}",
                      count.value);
    }
    if (count.value > count.max) {
      return error_at(op_member(index, count.key), "{} is above the limit of {}", count.value,
                      count.max);
    }
  }
  FERRY_JSON_RETURN_IF_ERROR(check_gemm(op, index));
  return check_group_rows(op, index);
}

/// Whether a collective of `kind` can turn `in` bytes into `out` over `ranks` ranks.
bool collective_shape_fits(CollectiveKind kind, std::int64_t in, std::int64_t out,
                           std::int32_t ranks) {
  switch (kind) {
    case CollectiveKind::AllGather:
      return out % ranks == 0 && out / ranks == in;
    case CollectiveKind::ReduceScatter:
      return in % ranks == 0 && in / ranks == out;
    case CollectiveKind::AllReduce:
      return in == out;
    case CollectiveKind::AllToAll:
      break;
  }
  return true;
}

// Note [Collective ops]
// ~~~~~~~~~~~~~~~~~~~~~
// A rank's model under tensor, context or expert parallelism holds the collectives those run
// as ops (ModelOp::collective), so that checkpointing, offloading and planning treat them as
// they treat any op. Such an op moves its inputs into its outputs over its group and computes
// nothing: its FLOP and byte counts are 0 and its time is the link model's. What it moves
// follows from its tensors: forward, the inputs into the outputs; backward, the outputs'
// gradients into the inputs'. So each direction's kind must fit the tensors' sizes (an
// all-gather's output is its input times the ranks), which also makes the two directions
// each other's transposes (an all-gather forward, a reduce-scatter backward).

/// Checks op `index`'s collective (Note [Collective ops]); its tensor indices are in range.
Status check_collective(const Model& model, const ModelOp& op, std::size_t index) {
  const OpCollective& c = op.collective;
  // See Note [Paths on demand]: most ops have no collective, and every op comes through here.
  const auto at = [index] { return op_member(index, "collective"); };
  if (!c.any()) {
    if (c.forward || c.backward) {
      return error_at(json_member_path(at(), "ranks"),
                      "a collective needs a group of 2 or more ranks");
    }
    return Ok{};
  }
  if (c.ranks < 2 || c.ranks > kMaxCollectiveRanks) {
    return error_at(json_member_path(at(), "ranks"), "expected an integer in [2, {}], got {}",
                    kMaxCollectiveRanks, c.ranks);
  }
  if (c.nodes < 1 || c.nodes > c.ranks) {
    return error_at(json_member_path(at(), "nodes"),
                    "expected an integer in [1, {}] (the group's ranks), got {}", c.ranks, c.nodes);
  }
  if (!c.forward && !c.backward) {
    return error_at(at(), "a collective op runs a collective in its forward, its backward or both");
  }
  if (op.flops != 0 || op.backward_flops != 0 || op.bytes.count() != 0 ||
      op.backward_bytes.count() != 0 || op.gemm.known()) {
    return error_at(at(),
                    "a collective op computes nothing: its time is its link's, so flops, bytes, "
                    "backward_flops and backward_bytes must be 0 and it has no gemm");
  }
  if (op.inputs.empty() || op.outputs.empty()) {
    return error_at(at(), "a collective op moves its inputs into its outputs: it needs both");
  }
  const std::int64_t in = tensor_bytes(model, op.inputs);
  const std::int64_t out = tensor_bytes(model, op.outputs);
  for (const bool backward : {false, true}) {
    const std::optional<CollectiveKind>& kind = backward ? c.backward : c.forward;
    if (!kind) continue;
    // Backward moves the outputs' gradients into the inputs'.
    const std::int64_t from = backward ? out : in;
    const std::int64_t to = backward ? in : out;
    if (!collective_shape_fits(*kind, from, to, c.ranks)) {
      return error_at(json_member_path(at(), backward ? "backward" : "forward"),
                      "{} over {} ranks cannot turn {} bytes into {} (the op's {} into its {})",
                      collective_kind_name(*kind), c.ranks, from, to,
                      backward ? "outputs' gradients" : "inputs",
                      backward ? "inputs' gradients" : "outputs");
    }
  }
  return Ok{};
}

/// The tensor index at `path()`, checked to be in range. See Note [Paths on demand].
template <class Path>
Result<std::size_t> tensor_index(const Model& model, std::uint32_t index, const Path& path) {
  if (index >= model.tensors.size()) {
    return error_at(path(), "tensor index {} out of range ({} tensors)", index,
                    model.tensors.size());
  }
  return static_cast<std::size_t>(index);
}

constexpr std::int64_t kNotProduced = -1;

bool contains(const std::vector<std::uint32_t>& list, std::uint32_t t) {
  return std::find(list.begin(), list.end(), t) != list.end();
}

// Note [What a node saves]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// An autograd node keeps SavedVariables of its forward's inputs and outputs: nothing else of the
// model exists for it to hold. The simulated autograd relies on that for lifetimes: an
// activation's storage is released after the last op that produces or reads it (its last
// forward use), and a pack then holds a storage that is live. A tensor saved by an op that
// neither reads nor produces it may already be gone (its last forward use was earlier), so the
// rule is checked here rather than discovered as a dead storage in the middle of a run.

/// Checks each op's references in forward order against the ops that produced each activation.
/// `producer[t]` is the op that produced tensor t, or kNotProduced.
Status check_ops(const Model& model, std::vector<std::int64_t>& producer) {
  const Repeat repeat = first_repeat(model.ops);
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const ModelOp& op = model.ops[i];
    // See Note [Paths on demand].
    const auto element = [i](std::string_view list, std::size_t j) {
      return [i, list, j] { return json_element_path(op_member(i, list), j); };
    };
    FERRY_JSON_RETURN_IF_ERROR(check_name(
        repeat, op.name, i, "op", [i] { return op_member(i, "name"); }, op_path));
    FERRY_JSON_RETURN_IF_ERROR(check_op_counts(op, i));

    for (std::size_t j = 0; j < op.inputs.size(); ++j) {
      const auto at = element("inputs", j);
      FERRY_JSON_TRY(const auto t, tensor_index(model, op.inputs[j], at));
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.role == TensorRole::Activation && producer[t] == kNotProduced) {
        return error_at(at(), "activation {} is read before it is produced",
                        json_quote(tensor.name));
      }
    }

    for (std::size_t j = 0; j < op.outputs.size(); ++j) {
      const auto at = element("outputs", j);
      FERRY_JSON_TRY(const auto t, tensor_index(model, op.outputs[j], at));
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.role != TensorRole::Activation) {
        return error_at(at(), "{} is {} {}; ops produce activations only", json_quote(tensor.name),
                        article(tensor.role), tensor_role_name(tensor.role));
      }
      if (producer[t] != kNotProduced) {
        return error_at(at(), "activation {} is produced twice (first by {})",
                        json_quote(tensor.name),
                        op_label(model, static_cast<std::size_t>(producer[t])));
      }
      producer[t] = static_cast<std::int64_t>(i);
    }
    // A view may come with its base from the same op, listed in either order.
    for (std::size_t j = 0; j < op.outputs.size(); ++j) {
      const ModelTensor& tensor = model.tensors[op.outputs[j]];
      if (tensor.view_of < 0) continue;
      const auto base = static_cast<std::size_t>(tensor.view_of);
      if (producer[base] == kNotProduced) {
        return error_at(element("outputs", j)(), "view {} is produced before its base {}",
                        json_quote(tensor.name), json_quote(model.tensors[base].name));
      }
    }

    FERRY_JSON_RETURN_IF_ERROR(check_collective(model, op, i));

    for (std::size_t j = 0; j < op.saved.size(); ++j) {
      const auto at = element("saved", j);
      FERRY_JSON_TRY(const auto t, tensor_index(model, op.saved[j], at));
      const ModelTensor& tensor = model.tensors[t];
      const auto first = std::find(op.saved.begin(),
                                   op.saved.begin() + static_cast<std::ptrdiff_t>(j), op.saved[j]);
      if (first != op.saved.begin() + static_cast<std::ptrdiff_t>(j)) {
        return error_at(at(), "{} is already saved by this op (saved[{}])", json_quote(tensor.name),
                        first - op.saved.begin());
      }
      // See Note [What a node saves].
      if (!contains(op.inputs, op.saved[j]) && !contains(op.outputs, op.saved[j])) {
        return error_at(at(),
                        "{} is neither an input nor an output of this op; an op saves only "
                        "tensors it reads or produces",
                        json_quote(tensor.name));
      }
    }
  }
  return Ok{};
}

}  // namespace

Status validate_model(const Model& model) {
  if (model.name.empty()) return Error{"name: a model needs a non-empty name"};
  if (model.tensors.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    return Error{fmt::format("tensors: {} tensors is more than a model may have ({})",
                             model.tensors.size(), std::numeric_limits<std::int32_t>::max())};
  }
  const Repeat repeat = first_repeat(model.tensors);
  for (std::size_t i = 0; i < model.tensors.size(); ++i) {
    FERRY_JSON_RETURN_IF_ERROR(check_name(
        repeat, model.tensors[i].name, i, "tensor", [i] { return tensor_member(i, "name"); },
        tensor_path));
    FERRY_JSON_RETURN_IF_ERROR(check_tensor(model, i));
  }
  if (model.ops.empty()) return Error{"ops: a model needs at least one op"};

  std::vector<std::int64_t> producer(model.tensors.size(), kNotProduced);
  FERRY_JSON_RETURN_IF_ERROR(check_ops(model, producer));
  for (std::size_t i = 0; i < model.tensors.size(); ++i) {
    const ModelTensor& tensor = model.tensors[i];
    if (tensor.role == TensorRole::Activation && producer[i] == kNotProduced) {
      return error_at(tensor_path(i), "activation {} is never produced by an op",
                      json_quote(tensor.name));
    }
  }

  FERRY_JSON_TRY(const auto loss,
                 tensor_index(model, model.loss, [] { return std::string("loss"); }));
  const ModelTensor& tensor = model.tensors[loss];
  if (tensor.role != TensorRole::Activation) {
    return error_at("loss", "{} is {} {}; the loss is an activation", json_quote(tensor.name),
                    article(tensor.role), tensor_role_name(tensor.role));
  }
  const std::size_t last = model.ops.size() - 1;
  if (producer[loss] != static_cast<std::int64_t>(last)) {
    return error_at(
        "loss", "{} is produced by {}, not by the last op ({})", json_quote(tensor.name),
        op_label(model, static_cast<std::size_t>(producer[loss])), op_label(model, last));
  }
  if (tensor.held) {
    return error_at(tensor_member(loss, "held"),
                    "the loss {} lives until backward ends in any case; hold another activation",
                    json_quote(tensor.name));
  }
  return Ok{};
}

Result<CheckedModel> check_model(Model model) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  return CheckedModel(std::make_shared<Model>(std::move(model)));
}

}  // namespace ferry::sim
