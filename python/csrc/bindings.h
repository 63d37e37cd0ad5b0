#pragma once
// The parts of spillway._C, one init_<area>() per file; module.cc assembles
// them. The custom ops register themselves with the dispatcher when the
// library loads (offload_ops.cc) and need no init.

#include <pybind11/pybind11.h>

#include <nlohmann/json.hpp>
#include <vector>

#include "spillway/graph.h"
#include "spillway/plan.h"

namespace spillway::python {

// spillway._C: synchronize, pending_waits, copy_stats, pool_stats,
// cuda_built (runtime_bindings.cc).
void init_runtime(pybind11::module_& m);

// spillway._C: plan_activation_offload (plan_bindings.cc).
void init_plan(pybind11::module_& m);

// spillway._C: plan_memory_budget, sweep_memory_budget, simulate_graph,
// plan_resident_set, simulate_weight_stream (budget_bindings.cc).
void init_budget(pybind11::module_& m);

// spillway._C.ReplayDispatch: the trace replay's quiet ops in C++
// (replay_dispatch.cc).
void init_replay(pybind11::module_& m);

// spillway._C.FastKeep, FastTable, FastKept: a block call's kept saves by
// position, packed in C++ (fast_keep.cc).
void init_fast_keep(pybind11::module_& m);

// Each edit in order, as JSON; insertions carry their node as `rewritten`'s
// JSON writer writes it (plan_bindings.cc). Throws Error when an inserted
// node is missing from `rewritten`.
nlohmann::json edit_list(const Graph& rewritten, const std::vector<Edit>& edits);

}  // namespace spillway::python
