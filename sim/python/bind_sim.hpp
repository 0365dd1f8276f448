#pragma once
/// The simulator and planner inside the Python module `ferry._C`, as its submodule `_sim`:
/// `ferry.simulate`, `ferry.compare` and `ferry.plan` run here, in-process, and return the
/// documents the CLI prints with `--json`, as Python objects. Compiled into the module with the
/// simulator's sources (real/python/CMakeLists.txt); the real backend never includes it.

#include <pybind11/pybind11.h>

namespace ferry::python {

/// Adds `_sim` (simulate, compare, plan, validate_plan, plan_offload_options) to `m`.
void bind_sim(pybind11::module_& m);

}  // namespace ferry::python
