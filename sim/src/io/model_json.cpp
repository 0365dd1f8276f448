#include "ferry/sim/io/model_json.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/check.hpp"
#include "ferry/sim/io/parallelism_json.hpp"
#include "ferry/sim/json/json_reader.hpp"
#include "ferry/sim/workload/model.hpp"

namespace ferry::sim {
namespace {

constexpr std::string_view kModelFormat = "ferry.model/1";
/// Largest layer index accepted.
constexpr std::int64_t kMaxLayer = std::numeric_limits<std::int32_t>::max();
/// Largest routing seed accepted.
constexpr std::int64_t kMaxRoutingSeed = std::numeric_limits<std::int64_t>::max();

constexpr std::array kDTypes{DType::F32, DType::BF16, DType::F16, DType::U8, DType::I64};
constexpr std::array kRoles{TensorRole::Input, TensorRole::Param, TensorRole::Buffer,
                            TensorRole::Activation, TensorRole::OptimizerState};

// Note [Optimizer state in earlier traces]
// Traces written before the optimizer_state role gave an optimizer's state the role buffer and
// the names the trace gives it, optimizer.<parameter>.<key> (docs/model-format.md). A file in
// which no tensor has the role optimizer_state is read as such a trace: its buffers so named are
// optimizer state, as they were when it was written. A file that uses the role is read by the
// role alone.
void read_state_of_earlier_traces(std::vector<ModelTensor>& tensors) {
  const auto has_role = [](const ModelTensor& t) { return t.role == TensorRole::OptimizerState; };
  if (std::any_of(tensors.begin(), tensors.end(), has_role)) return;
  for (ModelTensor& t : tensors) {
    if (t.role == TensorRole::Buffer && t.name.starts_with("optimizer.")) {
      t.role = TensorRole::OptimizerState;
    }
  }
}

/// The enumerator of `values` whose name (by `name_of`) is the string at `value`.
template <class Enum, std::size_t N>
Result<Enum> read_enum(const JsonValue& value, const std::array<Enum, N>& values,
                       const char* (*name_of)(Enum), std::string_view what) {
  FERRY_JSON_TRY(const auto text, value.string());
  std::vector<std::string_view> names;
  for (const Enum candidate : values) {
    if (text == name_of(candidate)) return candidate;
    names.emplace_back(name_of(candidate));
  }
  return value.error("unknown {} {} (allowed: {})", what, json_quote(text), fmt::join(names, ", "));
}

/// Reads one model document, resolving tensor names to indices.
class ModelReader {
 public:
  Result<Model> read(const JsonValue& root) {
    FERRY_JSON_TRY(const auto first_look, root.object_with_any_keys());
    FERRY_JSON_TRY(const auto format_value, first_look.required("format"));
    FERRY_JSON_TRY(const auto format, format_value.string());
    if (format != kModelFormat) {
      return format_value.error("expected {}, got {}", json_quote(kModelFormat),
                                json_quote(format));
    }
    FERRY_JSON_TRY(
        const auto object,
        root.object({"format", "name", "tensors", "ops", "loss", "parallelism", "allocator",
                     "routing", "optimizer_step", "matmul_fp32_precision", "conv_fp32_precision"}));
    FERRY_JSON_TRY(model_.name, object.required_name("name"));
    FERRY_JSON_RETURN_IF_ERROR(read_tensors(object));
    FERRY_JSON_RETURN_IF_ERROR(read_ops(object));
    FERRY_JSON_TRY(const auto loss_value, object.required("loss"));
    FERRY_JSON_TRY(model_.loss, resolve(loss_value));
    if (auto parallelism = object.optional("parallelism")) {
      FERRY_JSON_TRY(model_.parallelism, read_parallelism(*parallelism));
    }
    if (auto allocator = object.optional("allocator")) {
      FERRY_JSON_TRY(const std::string name, allocator->string());
      model_.allocator = parse_allocator_mode(name);
      if (!model_.allocator) {
        return allocator->error("expected \"{}\" or \"{}\", got {}",
                                allocator_mode_name(AllocatorMode::Default),
                                allocator_mode_name(AllocatorMode::Expandable), json_quote(name));
      }
    }
    if (auto routing = object.optional("routing")) {
      FERRY_JSON_TRY(model_.routing, read_routing(*routing));
    }
    if (auto step = object.optional("optimizer_step")) {
      FERRY_JSON_TRY(model_.optimizer_step, read_optimizer_step(*step));
    }
    if (auto precision = object.optional("matmul_fp32_precision")) {
      FERRY_JSON_TRY(const std::string name, precision->string());
      if (name != "ieee" && name != "tf32") {
        return precision->error(
            "expected \"ieee\" or \"tf32\" (torch.backends.cuda.matmul."
            "fp32_precision), got {}",
            json_quote(name));
      }
      model_.matmul_tf32 = name == "tf32";
    }
    if (auto precision = object.optional("conv_fp32_precision")) {
      FERRY_JSON_TRY(const std::string name, precision->string());
      if (name != "ieee" && name != "tf32") {
        return precision->error(
            "expected \"ieee\" or \"tf32\" (torch.backends.cudnn.conv.fp32_precision), got {}",
            json_quote(name));
      }
      model_.conv_tf32 = name == "tf32";
    }
    // The checks that need the whole model: producers, views inside their bases, the loss.
    // Its paths are the document's, since tensors and ops keep their order.
    if (auto status = validate_model(model_); !status.ok()) {
      return root.error_message(status.error().message);
    }
    return std::move(model_);
  }

 private:
  /// A finite number (integer or not) at least `min`.
  static Result<double> read_number(const JsonValue& value, double min) {
    const auto& json = value.json();
    if (!json.is_number() || !std::isfinite(json.get<double>()) || json.get<double>() < min) {
      return value.error("expected a number >= {}", min);
    }
    return json.get<double>();
  }

  static Result<OptimizerStep> read_optimizer_step(const JsonValue& value) {
    FERRY_JSON_TRY(const auto members, value.object({"bytes", "temporaries"}));
    OptimizerStep step;
    FERRY_JSON_TRY(const auto bytes, members.required_integer("bytes", 0, kMaxJsonBytes));
    step.bytes = Bytes(bytes);
    FERRY_JSON_TRY(const auto list, members.required_array("temporaries"));
    Bytes total;
    for (const JsonValue& element : list) {
      FERRY_JSON_TRY(const auto size, element.integer(1, kMaxJsonBytes));
      total += Bytes(size);
      if (total.count() > kMaxJsonBytes) {
        return element.error("the temporaries exceed {} bytes together", kMaxJsonBytes);
      }
      step.temporaries.push_back(Bytes(size));
    }
    return step;
  }

  static Result<RoutingAssumption> read_routing(const JsonValue& value) {
    FERRY_JSON_TRY(const auto object,
                   value.object({"assumption", "loads", "seed", "capacity_factor"}));
    RoutingAssumption routing;
    FERRY_JSON_TRY(const auto assumption, object.required("assumption"));
    FERRY_JSON_TRY(routing.assumption, assumption.string());
    if (routing.assumption != "balanced" && routing.assumption != "loads" &&
        routing.assumption != "random") {
      return assumption.error("expected \"balanced\", \"loads\" or \"random\", got {}",
                              json_quote(routing.assumption));
    }
    const bool loads = routing.assumption == "loads";
    const bool random = routing.assumption == "random";
    for (const auto& [key, allowed] : {std::pair<std::string_view, bool>{"loads", loads},
                                       {"seed", random},
                                       {"capacity_factor", random}}) {
      if (const auto member = object.optional(key); member && !allowed) {
        return member->error("{} applies to the assumption {} only", json_quote(key),
                             json_quote(key == "loads" ? "loads" : "random"));
      }
    }
    if (loads) {
      FERRY_JSON_TRY(const auto list, object.required_array("loads"));
      bool any = false;
      for (const JsonValue& element : list) {
        FERRY_JSON_TRY(const auto load, read_number(element, 0));
        routing.loads.push_back(load);
        any = any || load > 0;
      }
      if (!any) return value.error("\"loads\": expected at least one load above 0");
    }
    if (random) {
      FERRY_JSON_TRY(routing.seed, object.required_integer("seed", 0, kMaxRoutingSeed));
      if (const auto capacity = object.optional("capacity_factor")) {
        FERRY_JSON_TRY(routing.capacity_factor, read_number(*capacity, 1));
      }
    }
    return routing;
  }

  Status read_tensors(const JsonObject& root) {
    FERRY_JSON_TRY(const auto tensors, root.required_array("tensors"));
    model_.tensors.reserve(tensors.size());
    // Bases are resolved once every name is declared, so a view may precede its base.
    std::vector<std::optional<JsonValue>> bases;
    bases.reserve(tensors.size());
    for (const JsonValue& value : tensors) {
      FERRY_JSON_TRY(const auto object,
                     value.object({"name", "bytes", "dtype", "role", "view_of", "view_offset",
                                   "no_offload", "capacity", "rows", "held"}));
      ModelTensor tensor;
      FERRY_JSON_TRY(const auto name_value, object.required("name"));
      FERRY_JSON_RETURN_IF_ERROR(declare(name_value));
      FERRY_JSON_TRY(tensor.name, name_value.name());
      FERRY_JSON_TRY(const auto bytes, object.required_integer("bytes", 1, kMaxJsonBytes));
      tensor.bytes = Bytes(bytes);
      FERRY_JSON_TRY(const auto dtype_value, object.required("dtype"));
      FERRY_JSON_TRY(tensor.dtype, read_enum(dtype_value, kDTypes, &dtype_name, "dtype"));
      FERRY_JSON_TRY(const auto role_value, object.required("role"));
      FERRY_JSON_TRY(tensor.role, read_enum(role_value, kRoles, &tensor_role_name, "role"));
      bases.push_back(object.optional("view_of"));
      if (const auto offset_value = object.optional("view_offset")) {
        if (!bases.back()) {
          return offset_value->error("\"view_offset\" applies to views only: add \"view_of\"");
        }
        FERRY_JSON_TRY(const auto offset, offset_value->integer(0, kMaxJsonBytes));
        tensor.view_offset = Bytes(offset);
      }
      FERRY_JSON_TRY(tensor.no_offload, object.optional_boolean("no_offload", false));
      FERRY_JSON_TRY(const auto capacity, object.optional_integer("capacity", 0, 0, kMaxJsonBytes));
      tensor.capacity = Bytes(capacity);
      FERRY_JSON_TRY(tensor.rows, object.optional_integer("rows", 0, 0, kMaxJsonBytes));
      FERRY_JSON_TRY(tensor.held, object.optional_boolean("held", false));
      model_.tensors.push_back(std::move(tensor));
    }
    for (std::size_t i = 0; i < bases.size(); ++i) {
      if (!bases[i]) continue;
      FERRY_JSON_TRY(const auto base, resolve(*bases[i]));
      model_.tensors[i].view_of = static_cast<std::int32_t>(base);
    }
    read_state_of_earlier_traces(model_.tensors);
    return Ok{};
  }

  Status read_ops(const JsonObject& root) {
    FERRY_JSON_TRY(const auto ops, root.required_array("ops"));
    model_.ops.reserve(ops.size());
    for (const JsonValue& value : ops) {
      FERRY_JSON_TRY(auto op, read_op(value));
      model_.ops.push_back(std::move(op));
    }
    return Ok{};
  }

  Result<ModelOp> read_op(const JsonValue& value) const {
    FERRY_JSON_TRY(const auto object,
                   value.object({"name", "kind", "layer", "flops", "bytes", "backward_flops",
                                 "backward_bytes", "duration_ns", "backward_duration_ns", "inputs",
                                 "outputs", "saved", "no_offload", "draws_rng", "draws_cpu_rng",
                                 "gemm", "collective", "group_rows"}));
    ModelOp op;
    FERRY_JSON_TRY(op.name, object.required_name("name"));
    if (const auto kind = object.optional("kind")) {
      FERRY_JSON_TRY(op.kind, kind->name());
    }
    FERRY_JSON_TRY(const auto layer, object.optional_integer("layer", -1, -1, kMaxLayer));
    op.layer = static_cast<std::int32_t>(layer);
    FERRY_JSON_TRY(op.flops, object.required_integer("flops", 0, kMaxModelFlops));
    FERRY_JSON_TRY(const auto bytes, object.required_integer("bytes", 0, kMaxJsonBytes));
    op.bytes = Bytes(bytes);
    FERRY_JSON_TRY(op.backward_flops, object.required_integer("backward_flops", 0, kMaxModelFlops));
    FERRY_JSON_TRY(const auto backward_bytes,
                   object.required_integer("backward_bytes", 0, kMaxJsonBytes));
    op.backward_bytes = Bytes(backward_bytes);
    FERRY_JSON_TRY(const auto duration,
                   object.optional_integer("duration_ns", 0, 0, kMaxJsonNanoseconds));
    op.duration = SimTime(duration);
    FERRY_JSON_TRY(const auto backward_duration,
                   object.optional_integer("backward_duration_ns", 0, 0, kMaxJsonNanoseconds));
    op.backward_duration = SimTime(backward_duration);
    FERRY_JSON_TRY(op.inputs, read_tensor_list(object, "inputs"));
    FERRY_JSON_TRY(op.outputs, read_tensor_list(object, "outputs"));
    FERRY_JSON_TRY(op.saved, read_tensor_list(object, "saved"));
    FERRY_JSON_TRY(op.no_offload, object.optional_boolean("no_offload", false));
    FERRY_JSON_TRY(op.draws_rng, object.optional_boolean("draws_rng", false));
    FERRY_JSON_TRY(op.draws_cpu_rng, object.optional_boolean("draws_cpu_rng", false));
    if (object.has("gemm")) {
      FERRY_JSON_TRY(const auto gemm, object.required_object("gemm", {"m", "n", "k", "batch"}));
      FERRY_JSON_TRY(op.gemm.m, gemm.required_integer("m", 1, kMaxGemmDim));
      FERRY_JSON_TRY(op.gemm.n, gemm.required_integer("n", 1, kMaxGemmDim));
      FERRY_JSON_TRY(op.gemm.k, gemm.required_integer("k", 1, kMaxGemmDim));
      FERRY_JSON_TRY(op.gemm.batch, gemm.optional_integer("batch", 1, 1, kMaxGemmDim));
    }
    if (const auto collective = object.optional("collective")) {
      FERRY_JSON_TRY(op.collective, read_collective(*collective));
    }
    FERRY_JSON_TRY(const auto groups, object.optional_array("group_rows"));
    if (groups.size() > static_cast<std::size_t>(kMaxGroups)) {
      return groups[kMaxGroups].error("more than {} groups", kMaxGroups);
    }
    op.group_rows.reserve(groups.size());
    for (const JsonValue& rows : groups) {
      FERRY_JSON_TRY(const auto n, rows.integer(0, kMaxGemmDim));
      op.group_rows.push_back(n);
    }
    return op;
  }

  // An op's "collective" (docs/model-format.md, Collective ops); validate_model checks that it
  // fits the op.
  static Result<OpCollective> read_collective(const JsonValue& value) {
    FERRY_JSON_TRY(const auto object,
                   value.object({"forward", "backward", "axis", "ranks", "nodes", "sharing"}));
    OpCollective c;
    FERRY_JSON_TRY(c.forward, read_collective_kind(object, "forward"));
    FERRY_JSON_TRY(c.backward, read_collective_kind(object, "backward"));
    FERRY_JSON_TRY(const auto axis, object.required("axis"));
    FERRY_JSON_TRY(const auto axis_name, axis.string());
    bool known = false;
    for (const MeshAxis a : {MeshAxis::Tensor, MeshAxis::Context, MeshAxis::Expert}) {
      if (axis_name == mesh_axis_name(a)) {
        c.axis = a;
        known = true;
      }
    }
    if (!known)
      return axis.error("expected \"tp\", \"cp\" or \"ep\", got {}", json_quote(axis_name));
    FERRY_JSON_TRY(const auto ranks, object.required_integer("ranks", 2, kMaxCollectiveRanks));
    c.ranks = static_cast<std::int32_t>(ranks);
    FERRY_JSON_TRY(const auto nodes, object.optional_integer("nodes", 1, 1, ranks));
    c.nodes = static_cast<std::int32_t>(nodes);
    FERRY_JSON_TRY(const auto sharing,
                   object.optional_integer("sharing", 1, 1, kMaxGroupsSharingANode));
    c.sharing = static_cast<std::int32_t>(sharing);
    return c;
  }

  // "forward" or "backward" of a collective: a kind's name, or absent (none).
  static Result<std::optional<CollectiveKind>> read_collective_kind(const JsonObject& object,
                                                                    std::string_view key) {
    const auto member = object.optional(key);
    if (!member) return std::optional<CollectiveKind>{};
    FERRY_JSON_TRY(const auto name, member->string());
    for (const CollectiveKind kind : {CollectiveKind::AllGather, CollectiveKind::ReduceScatter,
                                      CollectiveKind::AllReduce, CollectiveKind::AllToAll}) {
      if (name == collective_kind_name(kind)) return std::optional<CollectiveKind>{kind};
    }
    return member->error(
        "expected \"all_gather\", \"reduce_scatter\", \"all_reduce\" or \"all_to_all\", got {}",
        json_quote(name));
  }

  Result<std::vector<std::uint32_t>> read_tensor_list(const JsonObject& object,
                                                      std::string_view key) const {
    FERRY_JSON_TRY(const auto elements, object.optional_array(key));
    std::vector<std::uint32_t> indices;
    indices.reserve(elements.size());
    for (const JsonValue& element : elements) {
      FERRY_JSON_TRY(const auto index, resolve(element));
      indices.push_back(index);
    }
    return indices;
  }

  Status declare(const JsonValue& at) {
    FERRY_JSON_TRY(auto name, at.name());
    if (const auto it = index_.find(name); it != index_.end()) {
      return at.error("duplicate tensor name {} (first declared at {})", json_quote(name),
                      json_member_path(json_element_path("tensors", it->second), "name"));
    }
    if (index_.size() >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
      return at.error("too many tensors");
    }
    index_.emplace(std::move(name), static_cast<std::uint32_t>(index_.size()));
    return Ok{};
  }

  [[nodiscard]] Result<std::uint32_t> resolve(const JsonValue& at) const {
    FERRY_JSON_TRY(const auto name, at.name());
    if (const auto it = index_.find(name); it != index_.end()) return it->second;
    return at.error("unknown tensor {}", json_quote(name));
  }

  Model model_;
  std::map<std::string, std::uint32_t, std::less<>> index_;
};

using OrderedJson = nlohmann::ordered_json;

const std::string& tensor_name(const Model& model, std::uint32_t index) {
  FERRY_CHECK(index < model.tensors.size(), "tensor index {} out of range ({} tensors)", index,
              model.tensors.size());
  return model.tensors[index].name;
}

OrderedJson names_json(const Model& model, const std::vector<std::uint32_t>& indices) {
  OrderedJson out = OrderedJson::array();
  for (const std::uint32_t index : indices) out.push_back(tensor_name(model, index));
  return out;
}

OrderedJson tensor_json(const Model& model, const ModelTensor& tensor) {
  OrderedJson out;
  out["name"] = tensor.name;
  out["bytes"] = tensor.bytes.count();
  out["dtype"] = dtype_name(tensor.dtype);
  out["role"] = tensor_role_name(tensor.role);
  if (tensor.view_of >= 0) {
    out["view_of"] = tensor_name(model, static_cast<std::uint32_t>(tensor.view_of));
    out["view_offset"] = tensor.view_offset.count();
  }
  if (tensor.no_offload) out["no_offload"] = true;
  if (tensor.capacity.count() > 0) {
    out["capacity"] = tensor.capacity.count();
    out["rows"] = tensor.rows;
  }
  if (tensor.held) out["held"] = true;
  return out;
}

OrderedJson op_json(const Model& model, const ModelOp& op) {
  OrderedJson out;
  out["name"] = op.name;
  if (!op.kind.empty()) out["kind"] = op.kind.name();
  if (op.layer != -1) out["layer"] = op.layer;
  out["flops"] = op.flops;
  out["bytes"] = op.bytes.count();
  out["backward_flops"] = op.backward_flops;
  out["backward_bytes"] = op.backward_bytes.count();
  if (op.duration.ns() != 0) out["duration_ns"] = op.duration.ns();
  if (op.backward_duration.ns() != 0) out["backward_duration_ns"] = op.backward_duration.ns();
  out["inputs"] = names_json(model, op.inputs);
  out["outputs"] = names_json(model, op.outputs);
  out["saved"] = names_json(model, op.saved);
  if (op.no_offload) out["no_offload"] = true;
  if (op.draws_rng) out["draws_rng"] = true;
  if (op.draws_cpu_rng) out["draws_cpu_rng"] = true;
  if (op.gemm.known()) {
    OrderedJson gemm;
    gemm["m"] = op.gemm.m;
    gemm["n"] = op.gemm.n;
    gemm["k"] = op.gemm.k;
    gemm["batch"] = op.gemm.batch;
    out["gemm"] = std::move(gemm);
  }
  if (op.collective.any()) {
    const OpCollective& c = op.collective;
    OrderedJson collective;
    if (c.forward) collective["forward"] = collective_kind_name(*c.forward);
    if (c.backward) collective["backward"] = collective_kind_name(*c.backward);
    collective["axis"] = mesh_axis_name(c.axis);
    collective["ranks"] = c.ranks;
    collective["nodes"] = c.nodes;
    if (c.sharing != 1) collective["sharing"] = c.sharing;
    out["collective"] = std::move(collective);
  }
  if (!op.group_rows.empty()) out["group_rows"] = op.group_rows;
  return out;
}

/// A number as the file writes it: an integer where it is one.
OrderedJson number_json(double value) {
  if (std::trunc(value) == value && std::fabs(value) < 9.0e15) {
    return static_cast<std::int64_t>(value);
  }
  return value;
}

OrderedJson routing_json(const RoutingAssumption& routing) {
  OrderedJson out;
  out["assumption"] = routing.assumption;
  if (routing.assumption == "loads") {
    OrderedJson loads = OrderedJson::array();
    for (const double load : routing.loads) loads.push_back(number_json(load));
    out["loads"] = std::move(loads);
  }
  if (routing.assumption == "random") {
    out["seed"] = routing.seed;
    if (routing.capacity_factor > 0) out["capacity_factor"] = number_json(routing.capacity_factor);
  }
  return out;
}

}  // namespace

Result<Model> parse_model(std::string_view text, std::string_view source) {
  FERRY_JSON_TRY(const auto document, parse_json_text(text, source));
  ModelReader reader;
  return reader.read(JsonValue(document, source));
}

Result<CheckedModel> parse_checked_model(std::string_view text, std::string_view source) {
  auto model = parse_model(text, source);
  if (!model) return model.error();
  return CheckedModel(std::make_shared<Model>(std::move(model).value()));
}

std::string model_to_json(const Model& model) {
  OrderedJson out;
  out["format"] = std::string(kModelFormat);
  out["name"] = model.name;
  OrderedJson tensors = OrderedJson::array();
  for (const ModelTensor& tensor : model.tensors) tensors.push_back(tensor_json(model, tensor));
  out["tensors"] = std::move(tensors);
  OrderedJson ops = OrderedJson::array();
  for (const ModelOp& op : model.ops) ops.push_back(op_json(model, op));
  out["ops"] = std::move(ops);
  out["loss"] = tensor_name(model, model.loss);
  if (model.parallelism.sharded() || model.parallelism.pp > 1) {
    out["parallelism"] = parallelism_json(model.parallelism);
  }
  if (model.allocator) out["allocator"] = std::string(allocator_mode_name(*model.allocator));
  if (!model.routing.assumption.empty()) out["routing"] = routing_json(model.routing);
  if (model.optimizer_step) {
    OrderedJson step;
    step["bytes"] = model.optimizer_step->bytes.count();
    OrderedJson temporaries = OrderedJson::array();
    for (const Bytes t : model.optimizer_step->temporaries) temporaries.push_back(t.count());
    step["temporaries"] = std::move(temporaries);
    out["optimizer_step"] = std::move(step);
  }
  if (model.matmul_tf32) out["matmul_fp32_precision"] = "tf32";
  if (!model.conv_tf32) out["conv_fp32_precision"] = "ieee";
  return out.dump(2, ' ', false, OrderedJson::error_handler_t::replace) + "\n";
}

}  // namespace ferry::sim
