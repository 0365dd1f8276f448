// ferry._C: the real backend's runtime (offload sessions, checkpoint frames and the per-thread
// region stack of ferry/real/runtime.hpp) for Python. The Python package installs the pack and
// unpack hooks with torch.autograd.graph.saved_tensors_hooks; this module only does the work.

#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/checkpoint.hpp"
#include "ferry/offload/options.hpp"
#include "ferry/real/loopback_config.hpp"
#include "ferry/real/probe.hpp"
#include "ferry/real/runtime.hpp"

namespace py = pybind11;

namespace {

using ferry::real::Context;
using ferry::real::FrameToken;
using ferry::real::Packed;
using ferry::real::Session;

// The Python type of ferry._C._StopRecomputation (owned by the module, never released).
PyObject* stop_type = nullptr;

ferry::Policy parse_policy(const std::string& name) {
  if (auto policy = ferry::parse_policy(name)) return *policy;
  throw std::invalid_argument("ferry: unknown policy '" + name +
                              "' (expected 'ferry', 'trl', 'trl-seed', 'trl-1.7' or 'none')");
}

Context::Kind parse_kind(const std::string& name) {
  if (name == "offload") return Context::Kind::Offload;
  if (name == "no_offload") return Context::Kind::NoOffload;
  throw std::invalid_argument("ferry: unknown region kind '" + name +
                              "' (expected 'offload' or 'no_offload')");
}

py::dict telemetry_dict(const ferry::OffloadTelemetry& t) {
  py::dict d;
  for (const ferry::TelemetryCount& c : ferry::kTelemetryCounts) {
    d[py::str(std::string(c.name))] = t.*c.field;
  }
  for (const ferry::TelemetryBytes& b : ferry::kTelemetryBytes) {
    d[py::str(std::string(b.name))] = (t.*b.field).count();
  }
  return d;
}

// Whether Python code may still run: the interpreter is initialized and not finalizing.
bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() != 0 && Py_IsFinalizing() == 0;
#else
  return Py_IsInitialized() != 0 && _Py_IsFinalizing() == 0;
#endif
}

// Note [Python replay]
// The runtime copies and destroys a frame's replay wherever its books say so, possibly without
// the GIL (an autograd worker thread, the last holder freed in C++). The Python callable is
// therefore held through a shared pointer whose deleter takes the GIL, unless the interpreter
// is finalizing or gone (a frame freed at exit: no Python code can run, the object is leaked),
// and called with the GIL; the stop exception raised by the replay's pack hook (translated to
// Python on its way out of _pack) becomes ferry::real::StopRecompute again here.
ferry::real::Replay make_replay(py::object callable) {
  std::shared_ptr<py::object> fn(new py::object(std::move(callable)), [](py::object* o) {
    if (!python_alive()) {
      o->release();  // Python is gone (a frame freed at exit): nothing can run, leak it
      delete o;
      return;
    }
    py::gil_scoped_acquire gil;
    delete o;
  });
  return [fn](const std::vector<at::Tensor>& inputs) {
    py::gil_scoped_acquire gil;
    try {
      (*fn)(inputs);
    } catch (py::error_already_set& e) {
      if (stop_type != nullptr && e.matches(stop_type)) throw ferry::real::StopRecompute();
      throw;
    }
  };
}

// ferry probe on this process's device: (the ferry.probe/1 report, the profile) as JSON texts.
std::pair<std::string, std::string> probe(const std::string& device, std::int32_t repeats,
                                          const std::string& bytes,
                                          const std::vector<std::int64_t>& matmul,
                                          const std::string& name, bool progress) {
  ferry::real::ProbeOptions options;
  options.device = device;
  options.repeats = repeats;
  if (!bytes.empty()) {
    auto parsed = ferry::parse_bytes(bytes, "bytes");
    if (!parsed) throw std::invalid_argument("ferry.probe: " + parsed.error().message);
    options.copy_bytes = parsed.value();
  }
  if (!matmul.empty()) {
    if (matmul.size() != 3) {
      throw std::invalid_argument("ferry.probe: matmul: expected (m, k, n)");
    }
    options.matmul = {matmul[0], matmul[1], matmul[2]};
  }
  if (!ferry::real::is_profile_name(name)) {
    throw std::invalid_argument("ferry.probe: name: '" + name +
                                "' is no profile name (lower-case letters, digits, '-', '_', "
                                "'.', not starting with '.')");
  }
  if (progress) {
    options.progress = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };
  }
  py::gil_scoped_release release;  // the probe runs no Python code
  auto result = ferry::real::run_probe(options);
  if (!result) throw std::invalid_argument("ferry.probe: " + result.error().message);
  return {ferry::real::report_json(result.value(), name),
          ferry::real::profile_json(result.value(), name)};
}

// The typed loopback options as the device's configuration, each named in its error.
ferry::real::LoopbackConfig loopback_config(bool loopback,
                                            const std::optional<std::string>& streams,
                                            std::optional<std::int64_t> seed,
                                            std::optional<std::int64_t> max_delay_us) {
  ferry::real::LoopbackConfig config;
  if (!streams && !seed && !max_delay_us) return config;
  if (!loopback) {
    throw std::invalid_argument(
        "ferry: options loopback_streams, loopback_seed and loopback_max_delay_us go with "
        "loopback=True");
  }
  if (streams && *streams != "sync" && *streams != "async") {
    throw std::invalid_argument(
        "ferry: option loopback_streams must be \"sync\" or \"async\" (got \"" + *streams + "\")");
  }
  config.async = streams == "async";
  if ((seed || max_delay_us) && !config.async) {
    throw std::invalid_argument(
        "ferry: options loopback_seed and loopback_max_delay_us go with "
        "loopback_streams=\"async\"");
  }
  if (seed) {
    if (*seed < 0) {
      throw std::invalid_argument("ferry: option loopback_seed must not be negative (got " +
                                  std::to_string(*seed) + ")");
    }
    config.seed = static_cast<std::uint64_t>(*seed);
  }
  if (max_delay_us) {
    if (*max_delay_us < 0 || *max_delay_us > ferry::real::kMaxLoopbackDelay.count()) {
      throw std::invalid_argument("ferry: option loopback_max_delay_us must be from 0 to " +
                                  std::to_string(ferry::real::kMaxLoopbackDelay.count()) +
                                  " (1 s; got " + std::to_string(*max_delay_us) + ")");
    }
    config.max_delay = std::chrono::microseconds(*max_delay_us);
  }
  return config;
}

std::shared_ptr<Session> make_session(
    const std::string& policy, std::int64_t min_bytes, std::int32_t max_fwd_stash_size,
    std::int64_t window_bytes, std::int64_t prefetch_bytes, std::int64_t host_cap, bool dedup,
    bool prefetch, bool use_streams, bool loopback, bool record, const std::string& profile,
    std::int64_t host_reserve_bytes, std::optional<std::int64_t> horizon_bytes,
    const std::optional<std::string>& loopback_streams, std::optional<std::int64_t> loopback_seed,
    std::optional<std::int64_t> loopback_max_delay_us, const ferry::OffloadFaults& faults) {
  ferry::real::RealOptions options;
  options.offload.policy = parse_policy(policy);
  options.offload.min_bytes = ferry::Bytes(min_bytes);
  options.offload.trl_stash_count = max_fwd_stash_size;
  options.offload.window_bytes = ferry::Bytes(window_bytes);
  options.offload.prefetch_bytes = ferry::Bytes(prefetch_bytes);
  options.offload.host_cap = ferry::Bytes(host_cap);
  options.offload.dedup = dedup;
  options.offload.prefetch = prefetch;
  options.offload.use_streams = use_streams;
  options.loopback = loopback;
  options.loopback_streams =
      loopback_config(loopback, loopback_streams, loopback_seed, loopback_max_delay_us);
  options.record = record;
  options.profile = profile;
  options.host_reserve = ferry::Bytes(host_reserve_bytes);
  if (horizon_bytes) {
    if (*horizon_bytes < 0) {
      throw std::invalid_argument("ferry: option horizon_bytes must not be negative (got " +
                                  std::to_string(*horizon_bytes) + ")");
    }
    options.offload.horizon_bytes = ferry::Bytes(*horizon_bytes);
  }
  return Session::create(options, faults);
}

// The runtime's errors as the Python exceptions the reference implementations raise.
void bind_errors(py::module_& m) {
  static py::exception<ferry::real::StopRecompute>& stop =
      py::register_local_exception<ferry::real::StopRecompute>(m, "_StopRecomputation");
  stop_type = stop.ptr();
  Py_INCREF(stop_type);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ferry::OffloadError& e) {
      // The reference offloader raises ValueError for these misuses.
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const ferry::CheckpointError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::logic_error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

// Note [Wrapper subclasses]
// A tensor of a traceable wrapper subclass (torch.distributed.tensor.DTensor; any subclass with
// __tensor_flatten__ and __tensor_unflatten__) keeps its data in inner tensors and has no
// storage of its own that ferry could copy. Saved inside an offload region, each inner tensor is
// packed as a saved tensor of the wrapper's kind (a DTensor's local shard is offloaded as any
// activation is, a parameter's is kept), and unpacking rebuilds the wrapper with
// __tensor_unflatten__ over the inner tensors brought back, with the wrapper's sizes and
// strides (a DTensor's mesh and placements are in its flatten context). Inner tensors that are
// wrappers again are flattened in turn. An AsyncCollectiveTensor (a functional collective's
// result, waited for at its first use) is saved as the tensor its wait returns: rebuilt, it
// would wait again, on a tensor no collective wrote, and the collectives' registry of pending
// work finds works by their tensors' memory, which a reloaded copy may share with another
// collective's result still in flight. Elsewhere (no-offload regions, checkpoint frames and
// their replays), and for a wrapper with a symbolic size (a jagged nested tensor), it is kept
// as it is, as any tensor ferry cannot copy
// (Note [Saved-tensor contract] in real/src/saved_tensors.hpp).

// What the pack hook returned for a wrapper subclass: its type, flatten context, sizes and
// strides, and each inner tensor's attribute name and what its pack returned.
struct PackedWrapper {
  py::object type;
  py::object context;
  py::object size;
  py::object stride;
  std::vector<std::pair<py::str, py::object>> inner;
};

// torch.distributed's AsyncCollectiveTensor, the lazy result of a functional collective (None
// where torch has no distributed package); looked up at the first wrapper packed, kept.
py::handle async_collective_type() {
  static const py::handle type = [] {
    try {
      return py::object(py::module_::import("torch.distributed._functional_collectives")
                            .attr("AsyncCollectiveTensor"))
          .release();
    } catch (const py::error_already_set&) {
      return py::object(py::none()).release();
    }
  }();
  return type;
}

// torch.utils._python_dispatch.is_traceable_wrapper_subclass, looked up at the first tensor
// with the Python dispatch key (plain tensors never call it); kept for the module's life.
py::handle traceable_wrapper_check() {
  static const py::handle check =
      py::object(
          py::module_::import("torch.utils._python_dispatch").attr("is_traceable_wrapper_subclass"))
          .release();
  return check;
}

py::object pack_hook(const py::handle& tensor, const py::handle& parameter, bool part_of_param);

// Whether every size of `t` is a number: a jagged nested tensor's ragged size is a nested int
// tied to its offsets tensor, which a rebuilt tensor would not share, so it is kept.
bool concrete_sizes(const at::Tensor& t) {
  return std::ranges::none_of(t.sym_sizes(),
                              [](const c10::SymInt& s) { return s.is_heap_allocated(); });
}

// The wrapper's inner tensors packed as saved tensors of its kind (`param`: a parameter's).
py::object pack_wrapper(const py::handle& tensor, const py::handle& parameter, bool param) {
  const py::tuple flat = tensor.attr("__tensor_flatten__")();
  PackedWrapper packed{py::type::handle_of(tensor).cast<py::object>(),
                       flat[1],
                       tensor.attr("size")(),
                       tensor.attr("stride")(),
                       {}};
  for (const py::handle name : flat[0].cast<py::list>()) {
    const py::object inner = tensor.attr(name);
    packed.inner.emplace_back(name.cast<py::str>(), pack_hook(inner, parameter, param));
  }
  return py::cast(std::move(packed));
}

// The pack hook. Python knows a parameter (frozen or not) when it sees one, and a view of one
// (a linear layer saves `weight.t()`); any other tensor is an activation, a leaf input that
// requires grad included, as the reference treats it. See Note [Views of parameters]. An inner
// tensor of a wrapper that is a parameter (`part_of_param`) is a parameter's part.
py::object pack_hook(const py::handle& tensor, const py::handle& parameter, bool part_of_param) {
  const at::Tensor t = tensor.cast<at::Tensor>();
  const py::object base = tensor.attr("_base");
  const bool param = part_of_param || py::isinstance(tensor, parameter) ||
                     (!base.is_none() && py::isinstance(base, parameter));
  // Note [Wrapper subclasses]
  if (t.key_set().has(c10::DispatchKey::Python) && ferry::real::offloading_innermost() &&
      concrete_sizes(t)) {
    const py::handle collective = async_collective_type();
    if (!collective.is_none() && py::isinstance(tensor, collective)) {
      return pack_hook(tensor.attr("trigger_wait")(), parameter, param);
    }
    if (traceable_wrapper_check()(tensor).cast<bool>()) {
      return pack_wrapper(tensor, parameter, param);
    }
  }
  const auto kind =
      param ? ferry::real::TensorKind::Parameter : ferry::real::TensorKind::Activation;
  return py::cast(ferry::real::pack_saved(t, kind));
}

// The unpack hook: the saved tensor back, a wrapper rebuilt over its inner tensors.
py::object unpack_hook(const py::handle& packed) {
  if (py::isinstance<PackedWrapper>(packed)) {
    const auto& wrapper = packed.cast<const PackedWrapper&>();
    py::dict inner;
    for (const auto& [name, part] : wrapper.inner) inner[name] = unpack_hook(part);
    return wrapper.type.attr("__tensor_unflatten__")(inner, wrapper.context, wrapper.size,
                                                     wrapper.stride);
  }
  return py::cast(packed.cast<std::shared_ptr<Packed>>()->unpack());
}

// The pack and unpack hooks of saved tensors.
void bind_saved_tensor_hooks(py::module_& m) {
  py::class_<Packed, std::shared_ptr<Packed>>(m, "_Packed",
                                              "What a pack hook returned for a saved tensor.");
  py::class_<PackedWrapper>(m, "_PackedWrapper",
                            "What a pack hook returned for a tensor of a wrapper subclass.");

  // torch.nn.Parameter, looked up once; kept for the module's life (never released).
  const py::handle parameter =
      py::object(py::module_::import("torch.nn").attr("Parameter")).release();
  m.def(
      "_pack",
      [parameter](const py::handle& tensor) { return pack_hook(tensor, parameter, false); },
      py::arg("tensor"), "The pack hook: what the innermost region does with a saved tensor.");
  m.def(
      "_unpack", [](const py::handle& packed) { return unpack_hook(packed); }, py::arg("packed"),
      "The unpack hook: the saved tensor back.");
}

// Planted faults, for tests of the checker only (ferry.testing); not an option of ferry.offload.
void bind_faults(py::module_& m) {
  py::class_<ferry::OffloadFaults>(m, "_Faults", "Synchronizations dropped on purpose (tests).")
      .def(py::init([](bool skip_offload_wait, bool skip_reload_wait, bool skip_forward_guard,
                       bool skip_backward_guard, bool skip_record_stream, bool skip_host_guard,
                       bool skip_exit_sync, bool dedup_across_versions, bool skip_version_check,
                       bool drop_view_bits, bool stale_compute_stream, bool reuse_pinned_early,
                       bool prefetch_later_forwards) {
             return ferry::OffloadFaults{
                 skip_offload_wait,      skip_reload_wait,      skip_forward_guard,
                 skip_backward_guard,    skip_record_stream,    skip_host_guard,
                 skip_exit_sync,         dedup_across_versions, skip_version_check,
                 drop_view_bits,         stale_compute_stream,  reuse_pinned_early,
                 prefetch_later_forwards};
           }),
           py::kw_only(), py::arg("skip_offload_wait") = false, py::arg("skip_reload_wait") = false,
           py::arg("skip_forward_guard") = false, py::arg("skip_backward_guard") = false,
           py::arg("skip_record_stream") = false, py::arg("skip_host_guard") = false,
           py::arg("skip_exit_sync") = false, py::arg("dedup_across_versions") = false,
           py::arg("skip_version_check") = false, py::arg("drop_view_bits") = false,
           py::arg("stale_compute_stream") = false, py::arg("reuse_pinned_early") = false,
           py::arg("prefetch_later_forwards") = false);
}

// Offload sessions and their options.
void bind_session(py::module_& m) {
  // The names of Session.telemetry()'s counts and bytes, in its order: the tables of
  // ferry/offload/options.hpp, which the simulator's reports write too.
  py::list counts;
  for (const ferry::TelemetryCount& c : ferry::kTelemetryCounts) counts.append(std::string(c.name));
  py::list bytes;
  for (const ferry::TelemetryBytes& b : ferry::kTelemetryBytes) bytes.append(std::string(b.name));
  m.attr("TELEMETRY_COUNTS") = py::tuple(counts);
  m.attr("TELEMETRY_BYTES") = py::tuple(bytes);

  const ferry::real::RealOptions defaults;
  const ferry::OffloadOptions& d = defaults.offload;
  py::class_<Session, std::shared_ptr<Session>>(m, "Session", "One offload session.")
      .def(py::init(&make_session), py::kw_only(), py::arg("policy") = "ferry",
           py::arg("min_bytes") = d.min_bytes.count(),
           py::arg("max_fwd_stash_size") = d.trl_stash_count,
           py::arg("window_bytes") = d.window_bytes.count(),
           py::arg("prefetch_bytes") = d.prefetch_bytes.count(),
           py::arg("host_cap") = d.host_cap.count(), py::arg("dedup") = d.dedup,
           py::arg("prefetch") = d.prefetch, py::arg("use_streams") = d.use_streams,
           py::arg("loopback") = defaults.loopback, py::arg("record") = defaults.record,
           py::arg("profile") = defaults.profile,
           py::arg("host_reserve_bytes") = defaults.host_reserve.count(),
           py::arg("horizon_bytes") = std::optional<std::int64_t>{},
           py::arg("loopback_streams") = std::optional<std::string>{},
           py::arg("loopback_seed") = std::optional<std::int64_t>{},
           py::arg("loopback_max_delay_us") = std::optional<std::int64_t>{},
           py::arg("faults") = ferry::OffloadFaults{})
      .def("exclude", &Session::exclude, py::arg("tensor"),
           "Never offload this tensor's storage (parameters, module buffers).")
      .def(
          "telemetry", [](const Session& s) { return telemetry_dict(s.telemetry()); },
          "The scheduler's counters (bytes as ints).")
      .def("tracked", &Session::tracked, "Saved tensors the scheduler still tracks.")
      .def("live_device_buffers", &Session::live_device_buffers)
      .def("live_host_buffers", &Session::live_host_buffers)
      .def("_exit", &Session::exit, "The offload context was left.")
      .def("program_json", &Session::program_json,
           "The recorded program (empty unless record=True).")
      .def("races", &Session::races,
           "Asynchronous loopback sessions: the races the device observed (each poisoned a "
           "buffer); 0 otherwise.")
      .def("set_current_stream", &Session::set_current_stream, py::arg("name"),
           "Loopback sessions: make the compute stream `name` current (\"compute\" first).");
}

// The region stack of each thread: offload and no-offload regions, offloaded outputs.
void bind_regions(py::module_& m) {
  m.def(
      "_push_offload",
      [](const std::shared_ptr<Session>& session, bool begin_step) {
        if (begin_step) session->enter();
        ferry::real::push_context(Context{Context::Kind::Offload, session, nullptr, {}});
      },
      py::arg("session"), py::arg("begin_step") = true,
      "Opens an offload region of `session` on this thread; `begin_step`: the session's step "
      "begins (false for a region nested in an open one of the same session).");
  m.def("_push_no_offload", [] { ferry::real::push_context(Context{}); });
  m.def(
      "_pop", [](const std::string& kind) { ferry::real::pop_context(parse_kind(kind)); },
      py::arg("kind"));
  m.def(
      "_remove",
      [](const std::string& kind, std::size_t index) {
        ferry::real::remove_region(parse_kind(kind), index);
      },
      py::arg("kind"), py::arg("index"),
      "Removes the index-th offload or no-offload region of this thread (from the outermost), "
      "which must be of `kind`: a region left out of order.");

  py::class_<ferry::real::OffloadedOutput, std::shared_ptr<ferry::real::OffloadedOutput>>(
      m, "_OffloadedOutput", "An op's output saved through an offload session (selective).")
      .def(py::init<const std::shared_ptr<Session>&, const at::Tensor&>(), py::arg("session"),
           py::arg("output"))
      .def("take", &ferry::real::OffloadedOutput::take, py::arg("allow_mutation") = false,
           "The output back, reloaded; refused when it was mutated after the save.");
  m.def(
      "_enclosing_session",
      []() -> py::object {
        bool in_no_offload = false;
        if (auto session = ferry::real::enclosing_session(&in_no_offload)) return py::cast(session);
        if (in_no_offload) return py::str("no_offload");
        return py::none();
      },
      "The session of the innermost offload region on this thread (through checkpoint frames), "
      "'no_offload' when a no-offload region comes first, else None.");
}

// Checkpoint frames.
void bind_checkpoint(py::module_& m) {
  m.def("_live_checkpoint_states", &ferry::real::live_checkpoint_states,
        "Checkpoint states alive in this process: zero once every checkpointed graph is freed.");

  py::class_<FrameToken>(m, "_FrameToken", "An open checkpoint frame.");
  m.def(
      "_frame_begin",
      [](py::object replay, const std::vector<at::Tensor>& inputs, bool early_stop,
         bool determinism_check, bool preserve_rng_state, bool check_inputs) {
        ferry::real::CheckpointOptions options;
        options.early_stop = early_stop;
        options.determinism_check = determinism_check;
        options.preserve_rng_state = preserve_rng_state;
        options.check_inputs = check_inputs;
        return ferry::real::frame_begin(options, make_replay(std::move(replay)), inputs);
      },
      py::arg("replay"), py::arg("inputs"), py::arg("early_stop") = true,
      py::arg("determinism_check") = true, py::arg("preserve_rng_state") = true,
      py::arg("check_inputs") = true);
  m.def("_frame_end", &ferry::real::frame_end, py::arg("token"));
}

// ferry probe: the device measurement.
void bind_probe(py::module_& m) {
  m.def(
      "_probe_main",
      [](const std::vector<std::string>& args) {
        py::gil_scoped_release release;  // the probe runs no Python code
        return ferry::real::probe_main(args);
      },
      py::arg("args"),
      "ferry probe's command line (args[0] is the program's name); returns the exit code.");
  m.def("_probe", &probe, py::kw_only(), py::arg("device") = "", py::arg("repeats") = 5,
        py::arg("bytes") = "", py::arg("matmul") = std::vector<std::int64_t>{},
        py::arg("name") = "probe", py::arg("progress") = false,
        "Measures the device: (the ferry.probe/1 report, the device profile) as JSON texts.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ferry's real backend: offload sessions and checkpoint frames over saved tensors";
  bind_errors(m);
  bind_saved_tensor_hooks(m);
  bind_faults(m);
  bind_session(m);
  bind_regions(m);
  bind_checkpoint(m);
  bind_probe(m);
}
