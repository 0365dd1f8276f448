// ferry._simulator: the simulator and planner as a Python extension of their own, so that
// `ferry.simulate`, `ferry.compare` and `ferry.plan` run in-process and return the documents the
// CLI prints with `--json`, as Python objects. Built from this folder (CMakeLists.txt) over the
// simulator's libraries and the system fmt; it links neither torch nor the real backend, and
// nothing but plain Python objects (str, bytes, int, float, bool, None, dict, list) passes
// between it and ferry._C.

#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "ferry/plan/lower.hpp"
#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/export/memory_snapshot.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/mesh/axes.hpp"
#include "ferry/units.hpp"

namespace py = pybind11;

namespace ferry::python {
namespace {

using Json = nlohmann::ordered_json;

// Note [Documents as Python objects]
// `ferry.simulate`, `compare` and `plan` return what `ferry simulate / compare / plan --json`
// print, built by the same functions: the document is turned into dicts, lists, ints, floats,
// strings, bools and None, in the document's key order, so a field has the one name and value
// on both sides. A bad input raises ValueError with the message the CLI prints after "error: ".

py::object to_python(const Json& j) {
  switch (j.type()) {
    case Json::value_t::object: {
      py::dict d;
      for (const auto& [key, value] : j.items()) d[py::str(key)] = to_python(value);
      py::object o = std::move(d);
      return o;
    }
    case Json::value_t::array: {
      py::list l;
      for (const Json& value : j) l.append(to_python(value));
      py::object o = std::move(l);
      return o;
    }
    case Json::value_t::string:
      return py::str(j.get_ref<const std::string&>());
    case Json::value_t::boolean:
      return py::bool_(j.get<bool>());
    case Json::value_t::number_integer:
      return py::int_(j.get<std::int64_t>());
    case Json::value_t::number_unsigned:
      return py::int_(j.get<std::uint64_t>());
    case Json::value_t::number_float:
      return py::float_(j.get<double>());
    default:
      return py::none();
  }
}

template <typename T>
T value_or_raise(Result<T> result) {
  if (!result) throw py::value_error(result.error().message);
  return std::move(result).value();
}

// Note [Python values into requests]
// The binding turns Python's values into a request's (sim/api/requests.hpp) with the functions
// the command line reads its text with, in the order it reads them, so both edges refuse a value
// with one message: a byte count is an int or its text, resharding True, False or an int, a
// margin a number or its text, the allocator its name. What is no such value at all is
// refused in Python, as a TypeError (ferry/_sim.py). A caller that must refuse a budget before
// anything else (ferry.auto, before it traces) reads it here once, with read_bytes, and hands
// the ReadBytes it gets to plan, which takes it as read.

/// A byte count read_bytes has read and checked.
struct ReadBytes {
  Bytes bytes;
};

using ByteCount = std::variant<ReadBytes, std::int64_t, std::string>;

// `value` (a byte count's text or an int) as `what` names it, or None for None where it is not
// `required`: ValueError as the request layer refuses the value, TypeError for a value of no
// byte count's kind, both naming `what`.
std::optional<ReadBytes> read_bytes(const py::object& value, const std::string& what,
                                    bool required) {
  if (value.is_none() && !required) return std::nullopt;
  if (py::isinstance<py::str>(value)) {
    return ReadBytes{value_or_raise(sim::byte_count(value.cast<std::string>(), what, !required))};
  }
  if (py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value)) {
    const auto count = PyLong_AsLongLong(value.ptr());
    if (count == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::value_error(fmt::format("{}: {} is not in 0..{}", what,
                                        py::repr(value).cast<std::string>(), sim::kMaxByteCount));
    }
    return ReadBytes{value_or_raise(sim::byte_count(static_cast<std::int64_t>(count), what))};
  }
  throw py::type_error(fmt::format(
      "{}: {} is not a byte count; give a string such as \"40GiB\" or an integer number of bytes",
      what, py::repr(value).cast<std::string>()));
}

std::optional<Bytes> bytes_of(const std::optional<ByteCount>& value, std::string_view option) {
  if (!value) return std::nullopt;
  if (const auto* read = std::get_if<ReadBytes>(&*value)) return read->bytes;
  if (const auto* count = std::get_if<std::int64_t>(&*value)) {
    return value_or_raise(sim::byte_count(*count, option));
  }
  return value_or_raise(sim::byte_count(std::get<std::string>(*value), option));
}

// Note [One table of keywords]
// simulate, compare and plan take their request's fields as keyword arguments, each one row of
// a table: the keyword, and how its value goes into the request (Note [Python values into
// requests]). A row casts the value as pybind11 casts a typed argument (a TypeError naming the
// keyword otherwise) and stores it, through the text form's function where the field has one.
// A call's keywords are all cast first, so a value of no such kind is a TypeError before any
// other error; they are then stored in the table's order, which is the order the command line
// reads its flags' text, so the first error is the CLI's. A keyword no row has is a TypeError
// that lists those the function takes, and a keyword left out keeps the request's default. The
// mesh's keywords are kMeshFields' Python names. A new option is one row.

template <typename Request>
struct Keyword {
  std::string name;
  std::function<void(py::handle)> check;            // the cast alone
  std::function<void(Request&, py::handle)> store;  // cast, read and stored
};

template <typename Request>
using Keywords = std::vector<Keyword<Request>>;

// The Python type an argument of type T takes, as pybind11 names it in a signature: "int",
// "Optional[str]", a bound class by its Python name.
template <typename T>
std::string type_text() {
  constexpr auto descr = py::detail::make_caster<T>::name;
  const auto types = decltype(descr)::types();
  std::string text;
  std::size_t k = 0;
  for (const char* c = descr.text; *c != '\0'; ++c) {
    if (*c != '%') {
      text += *c;
      continue;
    }
    const py::detail::type_info* info =
        types[k] != nullptr ? py::detail::get_type_info(*types[k]) : nullptr;
    ++k;
    text += info != nullptr ? info->type->tp_name : "object";
  }
  return text;
}

// `value`, the keyword `name`'s, as pybind11 casts an argument of type T.
template <typename T>
T cast_keyword(std::string_view name, py::handle value) {
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(
        fmt::format("{}: {} is not {}", name, py::repr(value).cast<std::string>(), type_text<T>()));
  }
}

// The keyword `name`, a T that `store` puts into the request.
template <typename T, typename Request>
Keyword<Request> keyword(std::string_view name, std::function<void(Request&, T)> store) {
  const std::string n(name);
  return Keyword<Request>{
      .name = n,
      .check = [n](py::handle value) { cast_keyword<T>(n, value); },
      .store = [n, put = std::move(store)](Request& r,
                                           py::handle value) { put(r, cast_keyword<T>(n, value)); },
  };
}

// The keyword `name`, the request's `field` as it is.
template <typename T, typename Request>
Keyword<Request> keyword(std::string_view name, T Request::*field) {
  return keyword<T, Request>(name, [field](Request& r, T value) { r.*field = std::move(value); });
}

// `rows`, for a request that holds theirs as its `part`.
template <typename Outer, typename Inner>
Keywords<Outer> lifted(const Keywords<Inner>& rows, Inner Outer::*part) {
  Keywords<Outer> out;
  for (const Keyword<Inner>& row : rows) {
    out.push_back(Keyword<Outer>{
        .name = row.name,
        .check = row.check,
        .store = [part, put = row.store](Outer& r, py::handle value) { put(r.*part, value); },
    });
  }
  return out;
}

template <typename Request>
Keywords<Request>& operator+=(Keywords<Request>& rows, const Keywords<Request>& more) {
  rows.insert(rows.end(), more.begin(), more.end());
  return rows;
}

// The keywords of `function`, a comma-separated list.
template <typename Request>
std::string keyword_list(const Keywords<Request>& rows) {
  std::string list;
  for (const Keyword<Request>& row : rows) list += (list.empty() ? "" : ", ") + row.name;
  return list;
}

// The request `function` builds from its keyword arguments `given` (Note [One table of
// keywords]).
template <typename Request>
Request request_of(const Keywords<Request>& rows, std::string_view function,
                   const py::kwargs& given) {
  const auto row_of = [&rows](const std::string& name) -> const Keyword<Request>* {
    for (const Keyword<Request>& row : rows) {
      if (row.name == name) return &row;
    }
    return nullptr;
  };
  for (const auto& [key, value] : given) {
    const auto name = py::cast<std::string>(key);
    const Keyword<Request>* row = row_of(name);
    if (row == nullptr) {
      throw py::type_error(fmt::format("{}() got an unexpected keyword argument '{}' (it takes {})",
                                       function, name, keyword_list(rows)));
    }
    row->check(value);
  }
  Request request;
  for (const Keyword<Request>& row : rows) {
    if (given.contains(row.name)) row.store(request, given[py::str(row.name)]);
  }
  return request;
}

// The mesh's keywords, kMeshFields' Python names in its order: resharding is True, False, an
// int K or the command line's text of one ("true", "2"), the implementation its name.
Keywords<sim::MeshRequest> mesh_keywords() {
  using sim::MeshField;
  using sim::MeshRequest;
  const auto name = [](MeshField field) { return sim::mesh_field(field).python; };
  using ReshardArg = std::variant<bool, std::int64_t, std::string>;
  return {
      keyword(name(MeshField::Fsdp), &MeshRequest::ranks),
      keyword(name(MeshField::Nodes), &MeshRequest::nodes),
      keyword(name(MeshField::Hsdp), &MeshRequest::replicas),
      keyword<ReshardArg, MeshRequest>(
          name(MeshField::ReshardAfterForward),
          [](MeshRequest& r, const ReshardArg& reshard) {
            if (const auto* text = std::get_if<std::string>(&reshard)) {
              r.reshard_after_forward = value_or_raise(sim::parse_reshard(*text));
            } else if (const auto* k = std::get_if<std::int64_t>(&reshard)) {
              r.reshard_after_forward = value_or_raise(sim::reshard_ranks(*k));
            } else {
              r.reshard_after_forward =
                  std::get<bool>(reshard) ? Reshard::True() : Reshard::False();
            }
          }),
      keyword<std::string, MeshRequest>(name(MeshField::FsdpImpl),
                                        [](MeshRequest& r, const std::string& impl) {
                                          r.impl = value_or_raise(sim::fsdp_impl(impl));
                                        }),
      keyword<std::string, MeshRequest>(name(MeshField::ReduceDtype),
                                        [](MeshRequest& r, const std::string& dtype) {
                                          r.reduce = value_or_raise(sim::reduce_dtype(dtype));
                                        }),
      keyword(name(MeshField::Tp), &MeshRequest::tp),
      keyword(name(MeshField::Cp), &MeshRequest::cp),
      keyword(name(MeshField::Ep), &MeshRequest::ep),
      keyword(name(MeshField::ExpertCapacity), &MeshRequest::expert_capacity),
      keyword(name(MeshField::Pp), &MeshRequest::pp),
  };
}

// `allocator`: its name, or None for the model file's.
template <typename Request>
Keyword<Request> allocator_keyword(std::optional<sim::AllocatorMode> Request::*field) {
  return keyword<std::optional<std::string>, Request>(
      "allocator", [field](Request& r, const std::optional<std::string>& name) {
        if (name) r.*field = value_or_raise(sim::allocator_mode(*name));
      });
}

// Which of the run requests take a RunKnobs keyword.
enum class Runs : std::uint8_t { Both, Simulate, Compare };

// The keywords of RunKnobs that `command` takes (Runs::Simulate or Runs::Compare).
Keywords<sim::RunKnobs> knob_keywords(Runs command) {
  using sim::RunKnobs;
  const std::pair<Runs, Keyword<RunKnobs>> rows[] = {
      {Runs::Both, keyword("min_bytes", &RunKnobs::min_bytes)},
      {Runs::Both, keyword("window_mib", &RunKnobs::window_mib)},
      {Runs::Both, keyword("prefetch_mib", &RunKnobs::prefetch_mib)},
      {Runs::Both, keyword("host_cap_gib", &RunKnobs::host_cap_gib)},
      {Runs::Both, keyword("stash", &RunKnobs::stash)},
      {Runs::Both, keyword("steps", &RunKnobs::steps)},
      {Runs::Simulate, keyword("prefetch", &RunKnobs::prefetch)},
      {Runs::Simulate, keyword("dedup", &RunKnobs::dedup)},
      {Runs::Simulate, keyword("early_stop", &RunKnobs::early_stop)},
      {Runs::Both, keyword("check", &RunKnobs::check)},
      {Runs::Both, keyword("horizon", &RunKnobs::horizon)},
      {Runs::Both, keyword("set_to_none", &RunKnobs::set_to_none)},
      {Runs::Both, keyword("paged_stash", &RunKnobs::paged_stash)},
      {Runs::Both, keyword("micro_batches", &RunKnobs::micro_batches)},
      {Runs::Both, keyword("schedule", &RunKnobs::schedule)},
      {Runs::Both, keyword("virtual_stages", &RunKnobs::virtual_stages)},
      {Runs::Both, keyword("split", &RunKnobs::split)},
  };
  Keywords<RunKnobs> out;
  for (const auto& [runs, row] : rows) {
    if (runs == Runs::Both || runs == command) out.push_back(row);
  }
  out += lifted(mesh_keywords(), &RunKnobs::mesh);
  out.push_back(allocator_keyword(&RunKnobs::allocator));
  return out;
}

// simulate's keywords: the run's, then the policy's and the trainer's.
Keywords<sim::SimulateRequest> simulate_keywords() {
  using sim::SimulateRequest;
  Keywords<SimulateRequest> rows = lifted(knob_keywords(Runs::Simulate), &SimulateRequest::run);
  rows += {
      keyword("policy", &SimulateRequest::policy),
      keyword("checkpoint", &SimulateRequest::checkpoint),
      keyword("pipeline_checkpoint", &SimulateRequest::pipeline_checkpoint),
      keyword("memory_snapshot", &SimulateRequest::memory_snapshot),
      keyword("trainer_flags", &SimulateRequest::trainer_flags),
      // The trainer's settings are its command-line flags in `trainer_flags`.
      keyword<std::optional<std::string>, SimulateRequest>(
          "trainer",
          [](SimulateRequest& r, const std::optional<std::string>& trainer) {
            if (!trainer) return;
            r.trainer = value_or_raise(sim::parse_trainer(*trainer, "trainer"));
            r.trainer_source = "trainer_flags";
          }),
  };
  return rows;
}

// plan's keywords, in the order `ferry plan` reads its flags' text.
Keywords<sim::PlanRequest> plan_keywords() {
  using sim::PlanRequest;
  using Margin = std::optional<std::variant<double, std::string>>;
  const auto read_into = [](std::string_view option, std::optional<Bytes> PlanRequest::*field) {
    return [option, field](PlanRequest& r, const std::optional<ByteCount>& value) {
      r.*field = bytes_of(value, option);
    };
  };
  Keywords<PlanRequest> rows = {
      keyword<std::optional<ByteCount>, PlanRequest>("budget",
                                                     read_into("--budget", &PlanRequest::budget)),
      keyword<std::optional<ByteCount>, PlanRequest>(
          "host_budget", read_into("--host-budget", &PlanRequest::host_budget)),
      keyword("steps", &PlanRequest::steps),
  };
  rows += lifted(mesh_keywords(), &PlanRequest::mesh);
  rows += {
      allocator_keyword(&PlanRequest::allocator),
      keyword<Margin, PlanRequest>("margin",
                                   [](PlanRequest& r, const Margin& margin) {
                                     if (!margin) return;
                                     const auto* text = std::get_if<std::string>(&*margin);
                                     r.margin_permille = value_or_raise(
                                         text ? sim::margin_permille(*text)
                                              : sim::margin_permille(std::get<double>(*margin)));
                                   }),
      keyword("planners", &PlanRequest::planners),
      keyword<std::optional<std::string>, PlanRequest>(
          "trainer",
          [](PlanRequest& r, const std::optional<std::string>& trainer) {
            if (trainer) r.trainer = value_or_raise(sim::parse_trainer(*trainer, "trainer"));
          }),
      keyword("jobs", &PlanRequest::jobs),
      keyword("micro_batches", &PlanRequest::micro_batches),
      keyword("schedule", &PlanRequest::schedule),
      keyword("virtual_stages", &PlanRequest::virtual_stages),
      keyword("split", &PlanRequest::split),
      keyword<std::optional<py::function>, PlanRequest>(
          "progress",
          [](PlanRequest& r, const std::optional<py::function>& progress) {
            if (!progress) return;
            // Called on the planning thread, which released the GIL; the function (held by
            // the call's keyword arguments) outlives the request, whose copies hold it
            // borrowed.
            r.search_progress = [hook = py::handle(*progress)](const sim::PlanProgress& p) {
              const py::gil_scoped_acquire locked;
              hook(std::string(p.stage), p.done, p.total,
                   p.best ? py::object(py::int_(p.best->ns())) : py::none());
            };
          }),
  };
  return rows;
}

sim::Target target(const std::string& model, const std::optional<std::string>& model_text,
                   const std::string& device, const std::string& scenarios) {
  return sim::Target{
      .model = {.name = model, .text = model_text}, .device = device, .scenarios = scenarios};
}

// The request's response, run with the GIL released; ValueError for bad input.
template <typename Request>
sim::Response answer(const Request& request) {
  py::gil_scoped_release unlocked;
  return value_or_raise(sim::respond(request));
}

// simulate(...) -> (document, memory snapshot pickle or None)
py::tuple simulate(const sim::SimulateRequest& request) {
  sim::Response response = answer(request);
  std::optional<std::string> pickle;
  if (request.memory_snapshot && response.run) {
    pickle = value_or_raise(sim::memory_snapshot(response.run->sim));
  }
  return py::make_tuple(to_python(response.document),
                        pickle ? py::object(py::bytes(*pickle)) : py::none());
}

// ferry.offload's options (its keyword arguments) that `o`, the offload options `p` lowers
// to, fix: the pinned cap only where the plan has a host budget.
py::dict options_dict(const OffloadOptions& o, const Plan& p) {
  py::dict d;
  d["policy"] = policy_name(o.policy);
  d["min_bytes"] = o.min_bytes.count();
  d["window_bytes"] = o.window_bytes.count();
  d["prefetch_bytes"] = o.prefetch_bytes.count();
  d["prefetch"] = o.prefetch;
  if (o.horizon_bytes) d["horizon_bytes"] = o.horizon_bytes->count();
  if (p.host_budget) d["host_cap"] = o.host_cap.count();
  return d;
}

// plan(...) -> {report, text, plan_text, offload_options}: `ferry plan --json`'s report (the
// plan in it under "plan"), the text report, the plan as `--out` writes it, and the offload
// options the planner lowered it to for its checked run (as plan_offload_options gives them);
// with pp above 1 {report, text}, the report a `ferry.pipeline-plan/1` document;
// or {refused, floor, smallest_budget, document} when no plan fits the budget (floor: the
// smallest peak reserved reached, or None; smallest_budget: the smallest budget that plans, the
// floor with the margin added back, or None; document: the `ferry.plan-refusal/1` document
// `ferry plan --json` prints, whose floor is the smallest budget that plans on the device).
py::dict plan(const sim::PlanRequest& request) {
  const sim::Response response = answer(request);
  py::dict out;
  if (response.outcome == sim::Outcome::Refused) {
    out["refused"] = response.refusal;
    out["floor"] =
        response.floor.count() > 0 ? py::object(py::int_(response.floor.count())) : py::none();
    out["smallest_budget"] = response.smallest_budget.count() > 0
                                 ? py::object(py::int_(response.smallest_budget.count()))
                                 : py::none();
    out["document"] = to_python(response.document);
    return out;
  }
  out["report"] = to_python(response.document);
  out["text"] = response.text;
  // A pipeline's plan is its configuration (`ferry.pipeline-plan/1`), no ferry.plan/1.
  if (!response.plan) return out;
  out["plan_text"] = sim::plan_document_text(response.document.at("plan"));
  out["offload_options"] = options_dict(response.plan->offload, response.plan->plan);
  if (request.trainer) out["trainer_flags"] = response.trainer_flags;
  return out;
}

// The plan in `text`, checked (sim::parse_plan: the format, then validate_plan), as the
// document plan_to_json writes: every field present, in one order.
Plan checked_plan(const std::string& text, const std::string& source) {
  return value_or_raise(sim::parse_plan(text, source));
}

py::dict offload_options(const std::string& text, const std::string& source) {
  const Plan p = checked_plan(text, source);
  return options_dict(plan_offload_options(p), p);
}

// A function's docstring: `what` it returns, and the keywords it takes (`rows`).
template <typename Request>
std::string doc(std::string_view what, const Keywords<Request>& rows) {
  return fmt::format("{}. Keywords (the request's fields, each its default when left out): {}",
                     what, keyword_list(rows));
}

// simulate and compare: the model (its name, and its document when traced), the device and the
// scenarios folder, then their requests' fields as keywords (Note [One table of keywords]).
void bind_runs(py::module_& m) {
  const Keywords<sim::SimulateRequest> simulate_rows = simulate_keywords();
  m.def(
      "simulate",
      [simulate_rows](const std::string& model, const std::optional<std::string>& model_text,
                      const std::string& device, const std::string& scenarios,
                      const py::kwargs& options) {
        auto request = request_of(simulate_rows, "simulate", options);
        request.target = target(model, model_text, device, scenarios);
        request.text = false;  // the document only
        return simulate(request);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      doc("(`ferry simulate --json`'s document, the memory snapshot pickle or None); with "
          "trainer, the trainer's settings its command-line flags give (`--for T "
          "--trainer-config FILE`)",
          simulate_rows)
          .c_str());
  const Keywords<sim::CompareRequest> compare_rows =
      lifted(knob_keywords(Runs::Compare), &sim::CompareRequest::run);
  m.def(
      "compare",
      [compare_rows](const std::string& model, const std::optional<std::string>& model_text,
                     const std::string& device, const std::string& scenarios,
                     const py::kwargs& options) {
        auto request = request_of(compare_rows, "compare", options);
        request.target = target(model, model_text, device, scenarios);
        request.text = false;  // the document only
        return to_python(answer(request).document);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      doc("`ferry compare --json`'s document", compare_rows).c_str());
}

void bind_plans(py::module_& m) {
  py::class_<sim::PlannerCache>(m, "PlannerCache",
                                "Planners kept between plan calls (sim::PlannerCache): a later "
                                "budget reuses the simulations of earlier ones")
      .def(py::init<>())
      .def_property_readonly("planners", &sim::PlannerCache::size, "planners kept")
      .def_property_readonly("simulations", &sim::PlannerCache::simulations,
                             "simulations the kept planners ran");
  const Keywords<sim::PlanRequest> plan_rows = plan_keywords();
  m.def(
      "plan",
      [plan_rows](const std::string& model, const std::optional<std::string>& model_text,
                  const std::string& device, const std::string& scenarios,
                  const py::kwargs& options) {
        auto request = request_of(plan_rows, "plan", options);
        request.target = target(model, model_text, device, scenarios);
        return plan(request);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      doc("{report, text, plan_text}, or {refused, floor, smallest_budget, document} when no plan "
          "fits; with planners, a PlannerCache, a model given as text is planned by the planner "
          "it keeps for it; with trainer, also trainer_flags (the trainer's best setting as its "
          "command-line flags); jobs: simulations at once (0: one per hardware thread); "
          "progress(stage, done, total, best_ns) hears each step of the search",
          plan_rows)
          .c_str());
  py::class_<ReadBytes>(m, "ReadBytes", "A byte count read_bytes read: plan takes it as read")
      .def_property_readonly("bytes", [](const ReadBytes& r) { return r.bytes.count(); })
      .def("__repr__",
           [](const ReadBytes& r) { return fmt::format("ReadBytes({})", r.bytes.count()); });
  m.def("read_bytes", &read_bytes, py::arg("value"), py::arg("what"), py::kw_only(),
        py::arg("required") = false,
        "A byte count (its text or an int) read and checked once, as ferry plan reads its "
        "option: a ReadBytes, or None for None where not required");
  m.def(
      "validate_plan",
      [](const std::string& text, const std::string& source) {
        return to_python(sim::plan_json(checked_plan(text, source)));
      },
      py::arg("text"), py::arg("source"),
      "The ferry.plan/1 in `text`, checked, with every field present; ValueError names the "
      "place");
  m.def("plan_offload_options", &offload_options, py::arg("text"), py::arg("source"),
        "ferry.offload's options the plan fixes (ferry::plan_offload_options)");
}

// The mesh's "parallelism" section of a model file, from the mesh's keywords (the tracer's), and
// those keywords' names, in kMeshFields' order (the fields of ferry.Mesh).
void bind_mesh(py::module_& m) {
  const Keywords<sim::MeshRequest> mesh_rows = mesh_keywords();
  py::tuple names(mesh_rows.size());
  for (std::size_t i = 0; i < mesh_rows.size(); ++i) names[i] = mesh_rows[i].name;
  m.attr("mesh_fields") = names;
  m.def(
      "parallelism_section",
      [mesh_rows](const py::kwargs& mesh) {
        const auto request = request_of(mesh_rows, "parallelism_section", mesh);
        return to_python(value_or_raise(sim::parallelism_section(request)));
      },
      doc("The \"parallelism\" section of a model file that records the mesh, or None where "
          "it records none (sim::parallelism_section); ValueError names the flag",
          mesh_rows)
          .c_str());
}

}  // namespace
}  // namespace ferry::python

PYBIND11_MODULE(_simulator, m) {
  m.doc() = "The simulator and planner, in-process (ferry.simulate, compare, plan)";
  m.attr("source_scenarios") = FERRY_DEFAULT_SCENARIOS_DIR;
  m.attr("policies") = ferry::policy_names(", ");
  py::tuple impls(std::size(ferry::kFsdpImpls));
  for (std::size_t i = 0; i < impls.size(); ++i) impls[i] = to_string(ferry::kFsdpImpls[i]);
  m.attr("fsdp_impls") = impls;
  py::tuple reduce_dtypes(std::size(ferry::kReduceDtypes));
  for (std::size_t i = 0; i < reduce_dtypes.size(); ++i) {
    reduce_dtypes[i] = to_string(ferry::kReduceDtypes[i]);
  }
  m.attr("reduce_dtypes") = reduce_dtypes;
  m.attr("default_device") = std::string(ferry::sim::kDefaultDevice);
  ferry::python::bind_runs(m);
  ferry::python::bind_plans(m);
  ferry::python::bind_mesh(m);
}
