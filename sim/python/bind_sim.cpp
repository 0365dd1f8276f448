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

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ferry/plan/lower.hpp"
#include "ferry/sim/api/load.hpp"
#include "ferry/sim/api/run_spec.hpp"
#include "ferry/sim/export/memory_snapshot.hpp"
#include "ferry/sim/io/model_json.hpp"
#include "ferry/sim/io/plan_json.hpp"
#include "ferry/sim/planner/planner.hpp"
#include "ferry/sim/planner/report.hpp"
#include "ferry/sim/report/tables.hpp"
#include "ferry/sim/runs/configurations.hpp"
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

py::object document(const std::string& text) { return to_python(Json::parse(text)); }

template <typename T>
T value_or_raise(Result<T> result) {
  if (!result) throw py::value_error(result.error().message);
  return std::move(result).value();
}

// The model: `text` (a ferry.model/1 document, e.g. a traced model's) when given, read as the
// model named `spec`; else a preset name or a file path.
sim::Workload workload(const std::string& spec, const std::optional<std::string>& text,
                       const std::string& device, const std::string& scenarios) {
  Result<sim::Model> model = text ? sim::parse_model(*text, spec) : sim::load_model(spec);
  return value_or_raise(sim::make_workload(std::move(model), spec, device, scenarios));
}

// simulate(model, model_text, device, scenarios, ..., memory_snapshot) -> (document, pickle)
py::tuple simulate(const std::string& model, const std::optional<std::string>& model_text,
                   const std::string& device, const std::string& scenarios, const sim::RunSpec& run,
                   bool memory_snapshot) {
  std::string out;
  std::optional<std::string> pickle;
  {
    py::gil_scoped_release unlocked;
    const sim::Workload w = workload(model, model_text, device, scenarios);
    sim::RunSpec spec = run;
    sim::adopt_model_parallelism(spec.fsdp, w.model);
    sim::adopt_model_allocator(spec.allocator, w.model);
    std::optional<sim::TrainingRun> kept;
    const sim::RowResult row = value_or_raise(
        sim::simulate_one(w, spec, memory_snapshot ? &kept : nullptr, memory_snapshot));
    // simulate_one ran it: the parallelism is one.
    out = sim::with_fsdp_json(sim::simulate_json(row, w.model, w.device),
                              sim::parallelism_of(spec.fsdp).value(), w.device);
    if (memory_snapshot && kept) pickle = value_or_raise(sim::memory_snapshot(kept->sim));
  }
  return py::make_tuple(document(out), pickle ? py::object(py::bytes(*pickle)) : py::none());
}

py::object compare(const std::string& model, const std::optional<std::string>& model_text,
                   const std::string& device, const std::string& scenarios,
                   const sim::RunSpec& run) {
  std::string out;
  {
    py::gil_scoped_release unlocked;
    const sim::Workload w = workload(model, model_text, device, scenarios);
    sim::RunSpec spec = run;
    sim::adopt_model_parallelism(spec.fsdp, w.model);
    sim::adopt_model_allocator(spec.allocator, w.model);
    const auto base = value_or_raise(sim::run_options(spec, w.model, false));
    if (auto valid = sim::validate_parallelism(base.fsdp.parallelism, w.device, sim::kFsdpFlags);
        !valid) {
      throw py::value_error(valid.error().message);
    }
    std::vector<sim::RowResult> rows;
    for (const auto& row : sim::default_rows(base, w.model, w.device)) {
      rows.push_back(sim::run_row(w.model, w.device, row));
    }
    out = sim::with_fsdp_json(sim::compare_json(rows, w.model, w.device, {}), base.fsdp.parallelism,
                              w.device);
  }
  return document(out);
}

// plan(...) -> {report, text, plan_text}: `ferry plan --json`'s report (the plan in it under
// "plan"), the text report, and the plan as `--out` writes it; or {refused, floor} when no plan
// fits the budget (floor: the smallest peak reserved reached, or None).
py::dict plan(const std::string& model, const std::optional<std::string>& model_text,
              const std::string& device, const std::string& scenarios, const sim::PlanSpec& asked) {
  std::string report;
  std::string text;
  std::string plan_text;
  std::string refused;
  Bytes floor{0};
  {
    py::gil_scoped_release unlocked;
    // As `ferry plan`: the arguments checked before the model is read, then with its parallelism.
    value_or_raise(sim::planner_options(asked));
    const sim::Workload w = workload(model, model_text, device, scenarios);
    sim::PlanSpec adopted = asked;
    sim::adopt_model_parallelism(adopted.fsdp, w.model);
    sim::adopt_model_allocator(adopted.allocator, w.model);
    auto planned = sim::planner_options(adopted);
    if (!planned) {
      throw py::value_error(fmt::format("{}: parallelism: {}", model, planned.error().message));
    }
    sim::PlannerOptions options = std::move(planned).value();
    if (!asked.budget) options.budget = w.device.memory;
    if (auto valid = sim::validate_parallelism(options.fsdp.parallelism, w.device, sim::kFsdpFlags);
        !valid) {
      throw py::value_error(valid.error().message);
    }
    auto outcome = sim::make_plan(w.model, w.device, options, &floor);
    if (outcome) {
      report = sim::with_fsdp_json(sim::plan_report_json(outcome.value(), w.model, w.device),
                                   options.fsdp.parallelism, w.device);
      text = sim::plan_text(outcome.value(), w.model, w.device);
      plan_text = sim::plan_to_json(outcome.value().plan);
    } else {
      refused = outcome.error().message;
    }
  }
  py::dict out;
  if (!refused.empty()) {
    out["refused"] = refused;
    out["floor"] = floor.count() > 0 ? py::object(py::int_(floor.count())) : py::none();
    return out;
  }
  out["report"] = document(report);
  out["text"] = text;
  out["plan_text"] = plan_text;
  return out;
}

// The plan in `text`, checked (sim::parse_plan: the format, then validate_plan), as the
// document plan_to_json writes: every field present, in one order.
Plan checked_plan(const std::string& text, const std::string& source) {
  return value_or_raise(sim::parse_plan(text, source));
}

py::dict offload_options(const std::string& text, const std::string& source) {
  const Plan p = checked_plan(text, source);
  const OffloadOptions o = plan_offload_options(p);
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

// FSDP2 as the keyword arguments fsdp, nodes, hsdp and reshard_after_forward give it; None:
// not given.
sim::FsdpSpec fsdp_spec(std::optional<std::int32_t> ranks, std::optional<std::int32_t> nodes,
                        std::int32_t hsdp, std::string reshard_after_forward) {
  return sim::FsdpSpec{.ranks = ranks,
                       .nodes = nodes,
                       .replicas = hsdp,
                       .reshard_after_forward = std::move(reshard_after_forward)};
}

// The keyword arguments simulate and compare share, as RunSpec's fields.
sim::RunSpec knobs(std::int64_t min_bytes, std::int64_t window_mib, std::int64_t prefetch_mib,
                   std::int64_t host_cap_gib, std::int32_t stash, std::int32_t steps, bool check,
                   sim::FsdpSpec fsdp) {
  sim::RunSpec run;
  run.fsdp = std::move(fsdp);
  run.min_bytes = min_bytes;
  run.window_mib = window_mib;
  run.prefetch_mib = prefetch_mib;
  run.host_cap_gib = host_cap_gib;
  run.stash = stash;
  run.steps = steps;
  run.no_checker = !check;
  return run;
}

// simulate and compare: their keyword arguments are RunSpec's fields, with its defaults.
void bind_runs(py::module_& m) {
  const sim::RunSpec d;
  m.def(
      "simulate",
      [](const std::string& model, const std::optional<std::string>& model_text,
         const std::string& device, const std::string& scenarios, std::string policy,
         std::string checkpoint, std::string horizon, std::int64_t min_bytes,
         std::int64_t window_mib, std::int64_t prefetch_mib, std::int64_t host_cap_gib,
         std::int32_t stash, std::int32_t steps, bool prefetch, bool dedup, bool early_stop,
         bool check, bool memory_snapshot, std::optional<std::int32_t> fsdp,
         std::optional<std::int32_t> nodes, std::int32_t hsdp, std::string reshard_after_forward,
         std::optional<std::string> allocator) {
        sim::RunSpec run = knobs(min_bytes, window_mib, prefetch_mib, host_cap_gib, stash, steps,
                                 check, fsdp_spec(fsdp, nodes, hsdp, reshard_after_forward));
        run.allocator = std::move(allocator);
        run.policy = std::move(policy);
        run.checkpoint = std::move(checkpoint);
        run.horizon = std::move(horizon);
        run.no_prefetch = !prefetch;
        run.no_dedup = !dedup;
        run.no_early_stop = !early_stop;
        return simulate(model, model_text, device, scenarios, run, memory_snapshot);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      py::kw_only(), py::arg("policy") = d.policy, py::arg("checkpoint") = d.checkpoint,
      py::arg("horizon") = d.horizon, py::arg("min_bytes") = d.min_bytes,
      py::arg("window_mib") = d.window_mib, py::arg("prefetch_mib") = d.prefetch_mib,
      py::arg("host_cap_gib") = d.host_cap_gib, py::arg("stash") = d.stash,
      py::arg("steps") = d.steps, py::arg("prefetch") = !d.no_prefetch,
      py::arg("dedup") = !d.no_dedup, py::arg("early_stop") = !d.no_early_stop,
      py::arg("check") = !d.no_checker, py::arg("memory_snapshot") = false,
      py::arg("fsdp") = py::none(), py::arg("nodes") = py::none(),
      py::arg("hsdp") = d.fsdp.replicas,
      py::arg("reshard_after_forward") = d.fsdp.reshard_after_forward,
      py::arg("allocator") = py::none(),
      "(`ferry simulate --json`'s document, the memory snapshot pickle or None)");
  m.def(
      "compare",
      [](const std::string& model, const std::optional<std::string>& model_text,
         const std::string& device, const std::string& scenarios, std::int64_t min_bytes,
         std::int64_t window_mib, std::int64_t prefetch_mib, std::int64_t host_cap_gib,
         std::int32_t stash, std::int32_t steps, bool check, std::optional<std::int32_t> fsdp,
         std::optional<std::int32_t> nodes, std::int32_t hsdp, std::string reshard_after_forward,
         std::optional<std::string> allocator) {
        sim::RunSpec run = knobs(min_bytes, window_mib, prefetch_mib, host_cap_gib, stash, steps,
                                 check, fsdp_spec(fsdp, nodes, hsdp, reshard_after_forward));
        run.allocator = std::move(allocator);
        return compare(model, model_text, device, scenarios, run);
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      py::kw_only(), py::arg("min_bytes") = d.min_bytes, py::arg("window_mib") = d.window_mib,
      py::arg("prefetch_mib") = d.prefetch_mib, py::arg("host_cap_gib") = d.host_cap_gib,
      py::arg("stash") = d.stash, py::arg("steps") = d.steps, py::arg("check") = !d.no_checker,
      py::arg("fsdp") = py::none(), py::arg("nodes") = py::none(),
      py::arg("hsdp") = d.fsdp.replicas,
      py::arg("reshard_after_forward") = d.fsdp.reshard_after_forward,
      py::arg("allocator") = py::none(), "`ferry compare --json`'s document");
}

void bind_plans(py::module_& m) {
  const sim::FsdpSpec d;
  m.def(
      "plan",
      [](const std::string& model, const std::optional<std::string>& model_text,
         const std::string& device, const std::string& scenarios,
         const std::optional<std::string>& budget, const std::optional<std::string>& host_budget,
         std::int32_t steps, std::optional<std::int32_t> fsdp, std::optional<std::int32_t> nodes,
         std::int32_t hsdp, std::string reshard_after_forward, std::optional<std::string> allocator,
         std::optional<std::string> margin) {
        return plan(
            model, model_text, device, scenarios,
            sim::PlanSpec{.budget = budget,
                          .host_budget = host_budget,
                          .steps = steps,
                          .fsdp = fsdp_spec(fsdp, nodes, hsdp, std::move(reshard_after_forward)),
                          .allocator = std::move(allocator),
                          .margin = std::move(margin)});
      },
      py::arg("model"), py::arg("model_text"), py::arg("device"), py::arg("scenarios"),
      py::kw_only(), py::arg("budget") = py::none(), py::arg("host_budget") = py::none(),
      py::arg("steps") = sim::PlanSpec{}.steps, py::arg("fsdp") = py::none(),
      py::arg("nodes") = py::none(), py::arg("hsdp") = d.replicas,
      py::arg("reshard_after_forward") = d.reshard_after_forward, py::arg("allocator") = py::none(),
      py::arg("margin") = py::none(),
      "{report, text, plan_text}, or {refused, floor} when no plan fits");
  m.def(
      "validate_plan",
      [](const std::string& text, const std::string& source) {
        return document(sim::plan_to_json(checked_plan(text, source)));
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
