#pragma once
// The parts of spillway._C, one init_<area>() per file; module.cc assembles
// them. The custom ops register themselves with the dispatcher when the
// library loads (offload_ops.cc) and need no init.

#include <pybind11/pybind11.h>

namespace spillway::python {

// spillway._C: synchronize, pending_waits, copy_stats, pool_stats,
// cuda_built (runtime_bindings.cc).
void init_runtime(pybind11::module_& m);

// spillway._C: plan_activation_offload (plan_bindings.cc).
void init_plan(pybind11::module_& m);

}  // namespace spillway::python
