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

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "ferry/plan/lower.hpp"
#include "ferry/sim/api/requests.hpp"
#include "ferry/sim/export/memory_snapshot.hpp"
#include "ferry/sim/io/plan_json.hpp"
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

// FSDP2, tensor, context and expert parallelism as the keyword arguments fsdp, nodes, hsdp,
// reshard_after_forward, fsdp_impl, tp, cp, ep and expert_capacity give them; None: not given.
sim::MeshRequest fsdp_request(std::optional<std::int32_t> ranks, std::optional<std::int32_t> nodes,
                              std::int32_t hsdp, const std::variant<bool, std::int64_t>& reshard,
                              const std::string& impl, std::int32_t tp, std::int32_t cp,
                              std::int32_t ep, double expert_capacity) {
  sim::MeshRequest fsdp{.ranks = ranks, .nodes = nodes, .replicas = hsdp};
  fsdp.tp = tp;
  fsdp.cp = cp;
  fsdp.ep = ep;
  fsdp.expert_capacity = expert_capacity;
  if (const auto* k = std::get_if<std::int64_t>(&reshard)) {
    fsdp.reshard_after_forward = value_or_raise(sim::reshard_ranks(*k));
  } else {
    fsdp.reshard_after_forward = std::get<bool>(reshard) ? Reshard::True() : Reshard::False();
  }
  fsdp.impl = value_or_raise(sim::fsdp_impl(impl));  // after the resharding, as the CLI
  return fsdp;
}

std::optional<sim::AllocatorMode> allocator_of(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  return value_or_raise(sim::allocator_mode(*name));
}

sim::Target target(const std::string& model, const std::optional<std::string>& model_text,
                   const std::string& device, const std::string& scenarios) {
  return sim::Target{
      .model = {.name = model, .text = model_text}, .device = device, .scenarios = scenarios};
}

// The keyword arguments simulate and compare share, as RunKnobs.
sim::RunKnobs knobs(std::int64_t min_bytes, std::int64_t window_mib, std::int64_t prefetch_mib,
                    std::int64_t host_cap_gib, std::int32_t stash, std::int32_t steps, bool check,
                    sim::MeshRequest fsdp, const std::optional<std::string>& allocator) {
  sim::RunKnobs run;
  run.mesh = fsdp;
  run.allocator = allocator_of(allocator);
  run.min_bytes = min_bytes;
  run.window_mib = window_mib;
  run.prefetch_mib = prefetch_mib;
  run.host_cap_gib = host_cap_gib;
  run.stash = stash;
  run.steps = steps;
  run.check = check;
  return run;
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

// simulate and compare: their keyword arguments are the requests' fields, with their defaults.
void bind_runs(py::module_& m) {
  const sim::SimulateRequest d;
  m.def(
      "simulate",
      [](const std::string& model, const std::optional<std::string>& model_text,
         const std::string& device, const std::string& scenarios, std::string policy,
         std::string checkpoint, std::string horizon, std::int64_t min_bytes,
         std::int64_t window_mib, std::int64_t prefetch_mib, std::int64_t host_cap_gib,
         std::int32_t stash, std::int32_t steps, bool prefetch, bool dedup, bool early_stop,
         bool check, bool set_to_none, bool memory_snapshot, std::optional<std::int32_t> fsdp,
         std::optional<std::int32_t> nodes, std::int32_t hsdp,
         const std::variant<bool, std::int64_t>& reshard_after_forward,
         const std::string& fsdp_impl, const std::optional<std::string>& allocator, std::int32_t tp,
         std::int32_t cp, std::int32_t ep, double expert_capacity, bool paged_stash,
         const std::optional<std::string>& trainer, const std::string& trainer_flags) {
        sim::SimulateRequest request;
        request.target = target(model, model_text, device, scenarios);
        request.run = knobs(min_bytes, window_mib, prefetch_mib, host_cap_gib, stash, steps, check,
                            fsdp_request(fsdp, nodes, hsdp, reshard_after_forward, fsdp_impl, tp,
                                         cp, ep, expert_capacity),
                            allocator);
        request.run.prefetch = prefetch;
        request.run.dedup = dedup;
        request.run.early_stop = early_stop;
        request.run.set_to_none = set_to_none;
        request.run.paged_stash = paged_stash;
        request.policy = std::move(policy);
        request.checkpoint = std::move(checkpoint);
        request.horizon = std::move(horizon);
        request.memory_snapshot = memory_snapshot;
        if (trainer) {
          request.trainer = value_or_raise(sim::parse_trainer(*trainer, "trainer"));
          request.trainer_flags = trainer_flags;
          request.trainer_source = "trainer_flags";
        }
        return simulate(request);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      py::kw_only(), py::arg("policy") = d.policy, py::arg("checkpoint") = d.checkpoint,
      py::arg("horizon") = d.horizon, py::arg("min_bytes") = d.run.min_bytes,
      py::arg("window_mib") = d.run.window_mib, py::arg("prefetch_mib") = d.run.prefetch_mib,
      py::arg("host_cap_gib") = d.run.host_cap_gib, py::arg("stash") = d.run.stash,
      py::arg("steps") = d.run.steps, py::arg("prefetch") = d.run.prefetch,
      py::arg("dedup") = d.run.dedup, py::arg("early_stop") = d.run.early_stop,
      py::arg("check") = d.run.check, py::arg("set_to_none") = d.run.set_to_none,
      py::arg("memory_snapshot") = false, py::arg("fsdp") = py::none(),
      py::arg("nodes") = py::none(), py::arg("hsdp") = d.run.mesh.replicas,
      py::arg("reshard_after_forward") = true, py::arg("fsdp_impl") = "fsdp2",
      py::arg("allocator") = py::none(), py::arg("tp") = d.run.mesh.tp,
      py::arg("cp") = d.run.mesh.cp, py::arg("ep") = d.run.mesh.ep,
      py::arg("expert_capacity") = d.run.mesh.expert_capacity,
      py::arg("paged_stash") = d.run.paged_stash, py::arg("trainer") = py::none(),
      py::arg("trainer_flags") = "",
      "(`ferry simulate --json`'s document, the memory snapshot pickle or None); with trainer, "
      "the trainer's settings its command-line flags give (`--for T --trainer-config FILE`)");
  m.def(
      "compare",
      [](const std::string& model, const std::optional<std::string>& model_text,
         const std::string& device, const std::string& scenarios, std::int64_t min_bytes,
         std::int64_t window_mib, std::int64_t prefetch_mib, std::int64_t host_cap_gib,
         std::int32_t stash, std::int32_t steps, bool check, bool set_to_none,
         std::optional<std::int32_t> fsdp, std::optional<std::int32_t> nodes, std::int32_t hsdp,
         const std::variant<bool, std::int64_t>& reshard_after_forward,
         const std::string& fsdp_impl, const std::optional<std::string>& allocator,
         std::int32_t devices, std::int32_t micro_batches, std::int32_t tp, std::int32_t cp,
         std::int32_t ep, double expert_capacity, bool paged_stash) {
        sim::CompareRequest request;
        request.target = target(model, model_text, device, scenarios);
        request.run = knobs(min_bytes, window_mib, prefetch_mib, host_cap_gib, stash, steps, check,
                            fsdp_request(fsdp, nodes, hsdp, reshard_after_forward, fsdp_impl, tp,
                                         cp, ep, expert_capacity),
                            allocator);
        request.run.set_to_none = set_to_none;
        request.run.paged_stash = paged_stash;
        request.run.devices = devices;
        request.run.micro_batches = micro_batches;
        return to_python(answer(request).document);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      py::kw_only(), py::arg("min_bytes") = d.run.min_bytes,
      py::arg("window_mib") = d.run.window_mib, py::arg("prefetch_mib") = d.run.prefetch_mib,
      py::arg("host_cap_gib") = d.run.host_cap_gib, py::arg("stash") = d.run.stash,
      py::arg("steps") = d.run.steps, py::arg("check") = d.run.check,
      py::arg("set_to_none") = d.run.set_to_none, py::arg("fsdp") = py::none(),
      py::arg("nodes") = py::none(), py::arg("hsdp") = d.run.mesh.replicas,
      py::arg("reshard_after_forward") = true, py::arg("fsdp_impl") = "fsdp2",
      py::arg("allocator") = py::none(), py::arg("devices") = d.run.devices,
      py::arg("micro_batches") = d.run.micro_batches, py::arg("tp") = d.run.mesh.tp,
      py::arg("cp") = d.run.mesh.cp, py::arg("ep") = d.run.mesh.ep,
      py::arg("expert_capacity") = d.run.mesh.expert_capacity,
      py::arg("paged_stash") = d.run.paged_stash, "`ferry compare --json`'s document");
}

void bind_plans(py::module_& m) {
  const sim::PlanRequest d;
  py::class_<sim::PlannerCache>(m, "PlannerCache",
                                "Planners kept between plan calls (sim::PlannerCache): a later "
                                "budget reuses the simulations of earlier ones")
      .def(py::init<>())
      .def_property_readonly("planners", &sim::PlannerCache::size, "planners kept")
      .def_property_readonly("simulations", &sim::PlannerCache::simulations,
                             "simulations the kept planners ran");
  m.def(
      "plan",
      [](const std::string& model, const std::optional<std::string>& model_text,
         const std::string& device, const std::string& scenarios,
         const std::optional<ByteCount>& budget, const std::optional<ByteCount>& host_budget,
         std::int32_t steps, std::optional<std::int32_t> fsdp, std::optional<std::int32_t> nodes,
         std::int32_t hsdp, const std::variant<bool, std::int64_t>& reshard_after_forward,
         const std::string& fsdp_impl, const std::optional<std::string>& allocator,
         const std::optional<std::variant<double, std::string>>& margin,
         sim::PlannerCache* planners, std::int32_t tp, std::int32_t cp, std::int32_t ep,
         double expert_capacity, const std::optional<std::string>& trainer, std::int32_t jobs,
         const std::optional<py::function>& progress) {
        sim::PlanRequest request;
        request.planners = planners;
        request.jobs = jobs;
        if (progress) {
          // Called on this thread, which released the GIL for the plan; the function outlives
          // the request, whose copies hold its address.
          const py::function* hook = &*progress;
          request.search_progress = [hook](const sim::PlanProgress& p) {
            const py::gil_scoped_acquire locked;
            (*hook)(std::string(p.stage), p.done, p.total,
                    p.best ? py::object(py::int_(p.best->ns())) : py::none());
          };
        }
        request.target = target(model, model_text, device, scenarios);
        // In the order `ferry plan` reads its flags' text.
        request.budget = bytes_of(budget, "--budget");
        request.host_budget = bytes_of(host_budget, "--host-budget");
        request.steps = steps;
        request.mesh = fsdp_request(fsdp, nodes, hsdp, reshard_after_forward, fsdp_impl, tp, cp, ep,
                                    expert_capacity);
        request.allocator = allocator_of(allocator);
        if (margin) {
          const auto* text = std::get_if<std::string>(&*margin);
          request.margin_permille = value_or_raise(
              text ? sim::margin_permille(*text) : sim::margin_permille(std::get<double>(*margin)));
        }
        if (trainer) request.trainer = value_or_raise(sim::parse_trainer(*trainer, "trainer"));
        return plan(request);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      py::kw_only(), py::arg("budget") = py::none(), py::arg("host_budget") = py::none(),
      py::arg("steps") = d.steps, py::arg("fsdp") = py::none(), py::arg("nodes") = py::none(),
      py::arg("hsdp") = d.mesh.replicas, py::arg("reshard_after_forward") = true,
      py::arg("fsdp_impl") = "fsdp2", py::arg("allocator") = py::none(),
      py::arg("margin") = py::none(),
      py::arg("planners") = static_cast<sim::PlannerCache*>(nullptr), py::arg("tp") = d.mesh.tp,
      py::arg("cp") = d.mesh.cp, py::arg("ep") = d.mesh.ep,
      py::arg("expert_capacity") = d.mesh.expert_capacity, py::arg("trainer") = py::none(),
      py::arg("jobs") = d.jobs, py::arg("progress") = py::none(),
      "{report, text, plan_text}, or {refused, floor, smallest_budget, document} when no plan "
      "fits; with planners, a PlannerCache, a model given as text is planned by the planner it "
      "keeps for it; with "
      "trainer, also trainer_flags (the trainer's best setting as its command-line flags); jobs: "
      "simulations at once (0: one per hardware thread); progress(stage, done, total, best_ns) "
      "hears each step of the search");
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

}  // namespace
}  // namespace ferry::python

PYBIND11_MODULE(_simulator, m) {
  m.doc() = "The simulator and planner, in-process (ferry.simulate, compare, plan)";
  m.attr("source_scenarios") = FERRY_DEFAULT_SCENARIOS_DIR;
  m.attr("policies") = std::string(ferry::sim::kPolicyNames);
  m.attr("default_device") = std::string(ferry::sim::kDefaultDevice);
  ferry::python::bind_runs(m);
  ferry::python::bind_plans(m);
}
