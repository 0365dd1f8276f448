#include "ferry/sim/workload/model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/sim/json/json_reader.hpp"

namespace ferry::sim {
namespace {

/// An error at `path` ("ops[3].inputs[1]: ..."), without a source: parse_model adds that.
template <class... Args>
Error error_at(std::string_view path, fmt::format_string<Args...> format, Args&&... args) {
  return Error{fmt::format("{}: {}", path, fmt::format(format, std::forward<Args>(args)...))};
}

std::string tensor_path(std::size_t index) { return json_element_path("tensors", index); }

std::string op_path(std::size_t index) { return json_element_path("ops", index); }

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

/// The path of `key` inside op `index`: `ops[3].flops`.
std::string op_member(std::size_t index, std::string_view key) {
  return json_member_path(op_path(index), key);
}

/// `ops[i] "name"`, for messages that point at another op.
std::string op_label(const Model& model, std::size_t index) {
  return fmt::format("{} {}", op_path(index), json_quote(model.ops[index].name));
}

/// Whether `name` is free in `seen`; otherwise an error at `path()` that names the first user.
/// See Note [Paths on demand].
template <class Path>
Status declare_name(std::map<std::string_view, std::size_t, std::less<>>& seen,
                    std::string_view name, std::size_t index, std::string_view what,
                    const Path& path, std::string (*first_path)(std::size_t)) {
  if (name.empty()) return error_at(path(), "a {} needs a non-empty name", what);
  const auto [it, inserted] = seen.emplace(name, index);
  if (!inserted) {
    return error_at(path(), "duplicate {} name {} (first at {})", what, json_quote(name),
                    first_path(it->second));
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
    return error_at(at("capacity"), "only a base activation has a capacity; {} is a {}{}",
                    json_quote(tensor.name), tensor.view_of != -1 ? "view of " : "",
                    tensor_role_name(tensor.role));
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

/// Bytes of `tensors` summed (each at most kMaxJsonBytes, so the sum of up to 2^13 of them
/// fits; a longer list saturates).
std::int64_t tensor_bytes(const Model& model, const std::vector<std::uint32_t>& tensors) {
  std::int64_t sum = 0;
  for (const std::uint32_t t : tensors) {
    sum = std::min(sum + model.tensors[t].bytes.count(), std::int64_t{1} << 62);
  }
  return sum;
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
  const std::string at = op_member(index, "collective");
  if (!c.any()) {
    if (c.forward || c.backward) {
      return error_at(json_member_path(at, "ranks"),
                      "a collective needs a group of 2 or more ranks");
    }
    return Ok{};
  }
  if (c.ranks < 2 || c.ranks > kMaxCollectiveRanks) {
    return error_at(json_member_path(at, "ranks"), "expected an integer in [2, {}], got {}",
                    kMaxCollectiveRanks, c.ranks);
  }
  if (c.nodes < 1 || c.nodes > c.ranks) {
    return error_at(json_member_path(at, "nodes"),
                    "expected an integer in [1, {}] (the group's ranks), got {}", c.ranks, c.nodes);
  }
  if (!c.forward && !c.backward) {
    return error_at(at, "a collective op runs a collective in its forward, its backward or both");
  }
  if (op.flops != 0 || op.backward_flops != 0 || op.bytes.count() != 0 ||
      op.backward_bytes.count() != 0 || op.gemm.known()) {
    return error_at(at,
                    "a collective op computes nothing: its time is its link's, so flops, bytes, "
                    "backward_flops and backward_bytes must be 0 and it has no gemm");
  }
  if (op.inputs.empty() || op.outputs.empty()) {
    return error_at(at, "a collective op moves its inputs into its outputs: it needs both");
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
      return error_at(json_member_path(at, backward ? "backward" : "forward"),
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
  std::map<std::string_view, std::size_t, std::less<>> names;
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const ModelOp& op = model.ops[i];
    // See Note [Paths on demand].
    const auto element = [i](std::string_view list, std::size_t j) {
      return [i, list, j] { return json_element_path(op_member(i, list), j); };
    };
    FERRY_JSON_RETURN_IF_ERROR(declare_name(
        names, op.name, i, "op", [i] { return op_member(i, "name"); }, op_path));
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
                        tensor.role == TensorRole::Input ? "an" : "a",
                        tensor_role_name(tensor.role));
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

std::int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::U8:
      return 1;
    case DType::I64:
      return 8;
  }
  fail_check(__FILE__, __LINE__, "dtype", fmt::format("unknown dtype {}", static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::U8:
      return "u8";
    case DType::I64:
      return "i64";
  }
  return "?";
}

const char* tensor_role_name(TensorRole role) {
  switch (role) {
    case TensorRole::Input:
      return "input";
    case TensorRole::Param:
      return "param";
    case TensorRole::Buffer:
      return "buffer";
    case TensorRole::Activation:
      return "activation";
  }
  return "?";
}

Status validate_model(const Model& model) {
  if (model.name.empty()) return Error{"name: a model needs a non-empty name"};
  if (model.tensors.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    return Error{fmt::format("tensors: {} tensors is more than a model may have ({})",
                             model.tensors.size(), std::numeric_limits<std::int32_t>::max())};
  }
  std::map<std::string_view, std::size_t, std::less<>> names;
  for (std::size_t i = 0; i < model.tensors.size(); ++i) {
    FERRY_JSON_RETURN_IF_ERROR(declare_name(
        names, model.tensors[i].name, i, "tensor", [i] { return tensor_member(i, "name"); },
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
                    tensor.role == TensorRole::Input ? "an" : "a", tensor_role_name(tensor.role));
  }
  const std::size_t last = model.ops.size() - 1;
  if (producer[loss] != static_cast<std::int64_t>(last)) {
    return error_at(
        "loss", "{} is produced by {}, not by the last op ({})", json_quote(tensor.name),
        op_label(model, static_cast<std::size_t>(producer[loss])), op_label(model, last));
  }
  return Ok{};
}

Result<CheckedModel> check_model(Model model) {
  if (auto valid = validate_model(model); !valid) return valid.error();
  return CheckedModel(std::make_shared<Model>(std::move(model)));
}

// Note [Counting saved bytes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Korthikanti et al. (2022, Section 4.1) count what each op of a layer keeps for backward, term
// by term: the LayerNorm input (the residual stream, produced by the layer before) is a term of
// this layer; Q and K are 2sbh each although both live inside the QKV output; the dropout
// output and V are separate terms. saved_activation_bytes reproduces that accounting:
//
//   * the tensors saved by the ops whose `layer` is the given one, whoever produced them;
//   * activations only (params, buffers and the batch are not activation memory);
//   * each tensor once, however many ops save it (o_proj and flash attention both save the
//     attention output: it is one tensor and one term);
//   * a view with its own bytes, not its base's. Q, K and V are views of the QKV output, and the
//     formula counts exactly those slices.
//
// This is a logical count. Storage can be shared (a view and its base, or two views of one
// base, both saved), so an offloader that moves storages may move fewer or more bytes; the
// transformer generator never saves both a view and its base, so here the two counts agree.

Bytes saved_activation_bytes(const Model& model, std::int32_t layer) {
  std::vector<bool> counted(model.tensors.size(), false);
  Bytes total;
  for (const ModelOp& op : model.ops) {
    if (op.layer != layer) continue;
    for (const std::uint32_t t : op.saved) {
      FERRY_CHECK(t < model.tensors.size(), "op {} saves tensor {} of {}", op.name, t,
                  model.tensors.size());
      const ModelTensor& tensor = model.tensors[t];
      if (tensor.role != TensorRole::Activation || counted[t]) continue;
      counted[t] = true;
      total += tensor.bytes;
    }
  }
  return total;
}

namespace {

__extension__ using Wide = unsigned __int128;

/// ceil(amount x 10^9 x 1000 / (rate x permille)) nanoseconds: `amount` FLOPs or bytes moved at
/// `permille` thousandths of `rate` per second. 128-bit: amount x 10^12 overflows 64 bits above
/// ~9.2e6 FLOPs, and the result does too for the slowest rates a profile may give.
Wide roofline_ns_wide(std::int64_t amount, std::int64_t rate, std::int64_t permille) {
  const Wide scaled = static_cast<Wide>(amount) * 1'000'000'000U * 1000U;
  const Wide divisor = static_cast<Wide>(rate) * static_cast<Wide>(permille);
  return (scaled + divisor - 1) / divisor;
}

std::int64_t roofline_ns(std::int64_t amount, std::int64_t rate, std::int64_t permille) {
  const Wide ns = roofline_ns_wide(amount, rate, permille);
  FERRY_CHECK(ns <= static_cast<Wide>(kMaxJsonNanoseconds),
              "roofline time of {} at rate {} is above {} ns: check_roofline first", amount, rate,
              kMaxJsonNanoseconds);
  return static_cast<std::int64_t>(ns);
}

// Note [Kernel timing]
// ~~~~~~~~~~~~~~~~~~~~
// A profile without kernel figures times every op by the flat roofline: FLOPs at 60 % of the
// peak, bytes at 80 % of the HBM bandwidth, the longer of the two. A profile with them
// ("kernels", docs/devices.md) times each op by what its kernel class is measured to reach:
//
// * A matmul with a shape (ModelOp::gemm) runs as cuBLAS and CUTLASS do: the output is cut
//   into Tm x Tn tiles, one thread block each, and the blocks run in waves of one per SM. A
//   wave costs one tile's work, Tm Tn k 2 FLOPs, at one SM's share of the large-GEMM rate
//   (peak x matmul_permille / sm_count), so a product whose tiles fill 1.1 waves pays for 2 and
//   a product smaller than a tile pays for a whole one. Backward's two products, dX (m x k over
//   n) and dW (k x n over m), are timed the same way and scaled by the op's backward FLOPs over
//   their nominal 4 m n k batch (a frozen weight's op has no dW).
// * Flash and cuDNN attention run at their kernel's measured fraction of the peak, forward and
//   backward apart. Attention kernels without a figure (memory-efficient, flex) and every other
//   op with FLOPs but no shape run at the flat 60 %, or, for a matmul kind, at matmul_permille.
// * Bytes move at memory_permille of the bandwidth where the profile gives it, else 80 %.
//
// The figures are the sources' and no row of docs/validation.md's table set any of them.

/// `a` x `b`, or kSaturated when the product would pass it.
constexpr Wide kSaturated = Wide{1} << 120;
Wide saturating_mul(Wide a, Wide b) {
  if (a == 0 || b == 0) return 0;
  if (a > kSaturated / b) return kSaturated;
  return a * b;
}

Wide ceil_div(Wide a, Wide b) { return (a + b - 1) / b; }

/// Flash or cuDNN attention's figure for `kind` on `device` (forward or backward), 0: none.
std::int64_t attention_permille(std::string_view kind, const KernelFigures& k, bool backward) {
  if (kind.starts_with("aten._scaled_dot_product_flash_attention.") ||
      kind.starts_with("aten._flash_attention_forward.")) {
    return backward ? k.flash_backward_permille : k.flash_forward_permille;
  }
  if (kind.starts_with("aten._scaled_dot_product_cudnn_attention.")) {
    return backward ? k.cudnn_backward_permille : k.cudnn_forward_permille;
  }
  return 0;
}

/// One product's waves, ceil(tiles / sm), times a tile's Tm Tn depth 2 FLOPs times the SMs:
/// the FLOPs the chip could have done in that time.
Wide product_work(std::int64_t rows, std::int64_t cols, std::int64_t depth, std::int64_t batch,
                  const KernelFigures& k) {
  const Wide tiles = saturating_mul(
      saturating_mul(ceil_div(static_cast<Wide>(rows), static_cast<Wide>(k.matmul_tile_m)),
                     ceil_div(static_cast<Wide>(cols), static_cast<Wide>(k.matmul_tile_n))),
      static_cast<Wide>(batch));
  const Wide waves = ceil_div(tiles, static_cast<Wide>(k.sm_count));
  const Wide tile_flops = static_cast<Wide>(k.matmul_tile_m) * static_cast<Wide>(k.matmul_tile_n) *
                          static_cast<Wide>(depth) * 2U;
  return saturating_mul(saturating_mul(waves, tile_flops), static_cast<Wide>(k.sm_count));
}

/// Nanoseconds of `work` (a product's waves x one tile's FLOPs x SMs: each wave runs one tile
/// per SM at its share of the rate) at `permille` of the device's peak.
Wide work_ns(Wide work, const DeviceProfile& device, std::int64_t permille) {
  const Wide scaled = saturating_mul(work, Wide{1'000'000'000'000U});
  const Wide divisor = static_cast<Wide>(device.flops_per_s) * static_cast<Wide>(permille);
  return ceil_div(scaled, divisor);
}

/// The compute time of an op's forward or backward on `device` (Note [Kernel timing]), and the
/// permille it ran at (0: the tile model, which has no single one).
struct ComputeTime {
  Wide ns = 0;
  std::int64_t permille = 0;
};

ComputeTime compute_time(const ModelOp& op, bool backward, const DeviceProfile& device) {
  const std::int64_t flops = backward ? op.backward_flops : op.flops;
  const KernelFigures& k = device.kernels;
  if (flops == 0) return {};
  if (!k.known()) {
    return {roofline_ns_wide(flops, device.flops_per_s, kRooflineFlopsPermille),
            kRooflineFlopsPermille};
  }
  if (const std::int64_t permille = attention_permille(op.kind, k, backward); permille > 0) {
    return {roofline_ns_wide(flops, device.flops_per_s, permille), permille};
  }
  if (!op.gemm.known()) {
    const std::int64_t permille =
        is_matmul_kind(op.kind) ? k.matmul_permille : kRooflineFlopsPermille;
    return {roofline_ns_wide(flops, device.flops_per_s, permille), permille};
  }
  const GemmShape& g = op.gemm;
  if (!backward)
    return {work_ns(product_work(g.m, g.n, g.k, g.batch, k), device, k.matmul_permille)};
  const Wide pair =
      work_ns(product_work(g.m, g.k, g.n, g.batch, k) + product_work(g.k, g.n, g.m, g.batch, k),
              device, k.matmul_permille);
  // 4 m n k batch: the two products' nominal FLOPs (at most 2^123 with dims below 2^40 each, and
  // the validated FLOPs keep it near 2 x 10^18).
  const Wide nominal = saturating_mul(
      saturating_mul(
          saturating_mul(saturating_mul(4, static_cast<Wide>(g.m)), static_cast<Wide>(g.n)),
          static_cast<Wide>(g.k)),
      static_cast<Wide>(g.batch));
  return {ceil_div(saturating_mul(pair, static_cast<Wide>(flops)), nominal)};
}

SimTime op_time(const ModelOp& op, bool backward, const DeviceProfile& device) {
  const Wide compute = compute_time(op, backward, device).ns;
  FERRY_CHECK(compute <= static_cast<Wide>(kMaxJsonNanoseconds),
              "compute time of op {} is above {} ns: check_roofline first", op.name,
              kMaxJsonNanoseconds);
  const Bytes bytes = backward ? op.backward_bytes : op.bytes;
  const std::int64_t memory =
      roofline_ns(bytes.count(), device.memory_bandwidth.bytes_per_s(), memory_permille(device));
  return SimTime(std::max({static_cast<std::int64_t>(compute), memory, std::int64_t{1}}));
}

/// An error when `amount` (the op's member `key`) takes longer than the format's longest
/// duration at `permille` of `rate` (`unit` per second).
Status check_roofline_term(std::string_view path, std::string_view key, std::int64_t amount,
                           std::int64_t rate, std::int64_t permille, std::string_view unit,
                           const DeviceProfile& device) {
  const Wide ns = roofline_ns_wide(amount, rate, permille);
  if (ns <= static_cast<Wide>(kMaxJsonNanoseconds)) return Ok{};
  return error_at(json_member_path(path, key),
                  "{} {} at {} {}/s x {}/1000 on device {} take over {} ns, the longest duration "
                  "a model op may have",
                  amount, unit, rate, unit, permille, json_quote(device.name), kMaxJsonNanoseconds);
}

/// The same for the FLOPs of an op's forward or backward under Note [Kernel timing].
Status check_compute_term(std::string_view path, const ModelOp& op, bool backward,
                          const DeviceProfile& device) {
  const std::string_view key = backward ? "backward_flops" : "flops";
  const std::int64_t flops = backward ? op.backward_flops : op.flops;
  const ComputeTime time = compute_time(op, backward, device);
  if (time.permille > 0) {
    return check_roofline_term(path, key, flops, device.flops_per_s, time.permille, "FLOP", device);
  }
  if (time.ns <= static_cast<Wide>(kMaxJsonNanoseconds)) return Ok{};
  return error_at(json_member_path(path, key),
                  "{} FLOP of a {} x {} x {} (batch {}) matmul in {} x {} tiles on {} SMs of "
                  "device {} take over {} ns, the longest duration a model op may have",
                  flops, op.gemm.m, op.gemm.n, op.gemm.k, op.gemm.batch,
                  device.kernels.matmul_tile_m, device.kernels.matmul_tile_n,
                  device.kernels.sm_count, json_quote(device.name), kMaxJsonNanoseconds);
}

}  // namespace

bool is_matmul_kind(std::string_view kind) {
  for (const std::string_view name :
       {"aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._grouped_mm.",
        "aten._scaled_mm.", "aten._scaled_grouped_mm.", "aten.matmul.", "aten.linear."}) {
    if (kind.starts_with(name)) return true;
  }
  return false;
}

bool is_fused_attention_kind(std::string_view kind) {
  for (const std::string_view name :
       {"aten._scaled_dot_product_flash_attention.",
        "aten._scaled_dot_product_flash_attention_for_cpu.",
        "aten._scaled_dot_product_efficient_attention.",
        "aten._scaled_dot_product_cudnn_attention.",
        "aten._scaled_dot_product_fused_attention_overrideable.", "aten._flash_attention_forward.",
        "aten._efficient_attention_forward.", "torch_attn._varlen_attn."}) {
    if (kind.starts_with(name)) return true;
  }
  return kind == "higher_order.flex_attention";  // a higher-order op has no overloads
}

bool is_grouped_matmul_kind(std::string_view kind) {
  return kind.starts_with("aten._grouped_mm.") || kind.starts_with("aten._scaled_grouped_mm.");
}

Bytes collective_op_bytes(const Model& model, const ModelOp& op, bool backward) {
  const std::optional<CollectiveKind>& kind =
      backward ? op.collective.backward : op.collective.forward;
  if (!op.collective.any() || !kind) return Bytes(0);
  const std::int64_t in = tensor_bytes(model, op.inputs);
  const std::int64_t out = tensor_bytes(model, op.outputs);
  const std::int64_t from = backward ? out : in;
  const std::int64_t to = backward ? in : out;
  switch (*kind) {
    case CollectiveKind::AllGather:
      return Bytes(to);
    case CollectiveKind::ReduceScatter:
      return Bytes(from);
    case CollectiveKind::AllReduce:
    case CollectiveKind::AllToAll:
      break;
  }
  return Bytes(std::max(from, to));
}

namespace {

/// Op `op`'s collective time in its forward or backward on `device` (1 ns where that direction
/// runs none); the link must be known.
SimTime collective_op_time(const Model& model, const ModelOp& op, bool backward,
                           const DeviceProfile& device) {
  const std::optional<CollectiveKind>& kind =
      backward ? op.collective.backward : op.collective.forward;
  if (!kind) return SimTime(1);
  const SimTime t =
      collective_time(*kind, collective_op_bytes(model, op, backward),
                      GroupPlacement{op.collective.ranks, op.collective.nodes}, device.collectives);
  return std::max(t, SimTime(1));
}

/// Whether `device` has the link op `index`'s collective runs over, and its times fit the
/// format.
Status check_collective_time(const Model& model, std::size_t index, const DeviceProfile& device) {
  const ModelOp& op = model.ops[index];
  const bool inter = op.collective.nodes > 1;
  const CollectiveLink& link =
      inter ? device.collectives.inter_node : device.collectives.intra_node;
  const std::string at = op_member(index, "collective");
  if (!link.known()) {
    return error_at(at,
                    "device {} has no {} link for a collective over {} ranks on {} node{} (its "
                    "profile's \"collectives\" section, docs/devices.md)",
                    json_quote(device.name), inter ? "inter_node" : "intra_node",
                    op.collective.ranks, op.collective.nodes, op.collective.nodes > 1 ? "s" : "");
  }
  for (const bool backward : {false, true}) {
    const SimTime t = collective_op_time(model, op, backward, device);
    if (t.ns() > kMaxJsonNanoseconds) {
      return error_at(json_member_path(at, backward ? "backward" : "forward"),
                      "{} bytes over device {}'s {} link take over {} ns, the longest duration a "
                      "model op may have",
                      collective_op_bytes(model, op, backward).count(), json_quote(device.name),
                      inter ? "inter_node" : "intra_node", kMaxJsonNanoseconds);
    }
  }
  return Ok{};
}

}  // namespace

Status check_roofline(const Model& model, const DeviceProfile& device) {
  const std::int64_t flops_rate = device.flops_per_s;
  const std::int64_t byte_rate = device.memory_bandwidth.bytes_per_s();
  if (flops_rate <= 0 || byte_rate <= 0) {
    return Error{fmt::format("device profile {} needs positive flops_per_s and memory bandwidth",
                             json_quote(device.name))};
  }
  const std::int64_t bytes_permille = memory_permille(device);
  for (std::size_t i = 0; i < model.ops.size(); ++i) {
    const ModelOp& op = model.ops[i];
    if (op.collective.any()) {
      FERRY_JSON_RETURN_IF_ERROR(check_collective_time(model, i, device));
      continue;
    }
    const std::string path = op_path(i);
    FERRY_JSON_RETURN_IF_ERROR(check_compute_term(path, op, false, device));
    FERRY_JSON_RETURN_IF_ERROR(check_roofline_term(path, "bytes", op.bytes.count(), byte_rate,
                                                   bytes_permille, "bytes", device));
    FERRY_JSON_RETURN_IF_ERROR(check_compute_term(path, op, true, device));
    FERRY_JSON_RETURN_IF_ERROR(check_roofline_term(path, "backward_bytes",
                                                   op.backward_bytes.count(), byte_rate,
                                                   bytes_permille, "bytes", device));
  }
  return Ok{};
}

Result<CheckedModel> with_roofline_durations(CheckedModel model, const DeviceProfile& device) {
  if (auto fits = check_roofline(*model, device); !fits.ok()) return fits.error();
  std::shared_ptr<Model> owned = model.model_.use_count() == 1
                                     ? std::move(model.model_)
                                     : std::make_shared<Model>(*model.model_);
  assign_roofline_durations(*owned, device);
  return CheckedModel(std::move(owned));
}

void assign_roofline_durations(Model& model, const DeviceProfile& device) {
  FERRY_CHECK(device.flops_per_s > 0 && device.memory_bandwidth.bytes_per_s() > 0,
              "device profile {} needs positive flops_per_s and memory bandwidth", device.name);
  for (ModelOp& op : model.ops) {
    FERRY_CHECK(op.flops >= 0 && op.bytes.count() >= 0 && op.backward_flops >= 0 &&
                    op.backward_bytes.count() >= 0,
                "op {} has a negative FLOP or byte count", op.name);
    if (op.collective.any()) {
      op.duration = collective_op_time(model, op, false, device);
      op.backward_duration = collective_op_time(model, op, true, device);
      continue;
    }
    op.duration = op_time(op, false, device);
    op.backward_duration = op_time(op, true, device);
  }
}

bool has_static_capacity(const Model& model) {
  return std::ranges::any_of(model.tensors, [](const ModelTensor& t) { return t.rows > 0; });
}

}  // namespace ferry::sim
