// spillway._C: the torch extension. Importing it registers the custom ops
// torch.ops.spillway.{offload,reload,wait_tensor}; use them through
// spillway.ops, which adds their fake kernels.

#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "Spillway's torch extension: custom ops and the runtime behind them";
  spillway::python::init_runtime(m);
  spillway::python::init_plan(m);
  spillway::python::init_budget(m);
  spillway::python::init_replay(m);
  spillway::python::init_fast_keep(m);
}
