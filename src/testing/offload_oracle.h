#pragma once
// An independent check of an activation-offload plan: it re-derives, from the
// original graph alone and without any planner code, the properties every
// plan must have, and lists the ones a PlanResult breaks.
//
// Written separately from src/plan on purpose: a property test that reused the
// planner's own analyses would agree with the planner's bugs.
//
// Thread-safety: pure functions; call from any thread.

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "spillway/graph.h"
#include "spillway/plan.h"

namespace spillway::testing {

// Storages that some node of `graph` may write in place, by the conservative
// rule of the reference system: a call_function whose mutable schema marks an
// argument as written (resolved by keyword, then by position, through lists)
// writes those storages; a node without a schema (call_method, call_module, a
// call_function missing from Graph::ops) or a mutable schema whose written
// argument cannot be resolved may write every tensor argument.
std::set<std::int64_t> possibly_written_storages(const Graph& graph);

// True when a module on the node's stack has `scope` as its last path component.
bool in_scope(const Node& node, const std::string& scope);

// Every violated property of `result` (planned from `original` with `options`),
// one readable line each; empty when the plan is sound:
//   * the rewritten graph passes verify_graph and verify_offload_graph;
//   * original nodes keep their value, kind, target, phase and relative order;
//   * each chosen value is a forward call_function, not a view nor a
//     collective, tensor-valued, not DTensor-like, rank >= 2, contiguous (or,
//     with dense_storages, strided as some permutation of a row-major layout,
//     found by trying every permutation, with no storage member reaching past
//     its bytes),
//     >= min_bytes, in scope, read by backward, its storage known, first
//     produced by it, shared by no placeholder/get_attr, returned by no output,
//     and never possibly written in place in the original graph;
//   * bytes add up, and stay within a positive host budget; a value left out
//     for the budget would not have fit beside the chosen ones (greedy fill),
//     and candidates = chosen + left out for the budget;
//   * no backward node of the rewritten graph reads an offloaded value or a
//     forward alias of it;
//   * each forward wait comes after every forward reader (other than the
//     inserted spillway.* transfer nodes) of its storage group, and its
//     last-use argument is the last forward reader (the value itself when
//     none) or, with offload_tuple_outputs only, a tensor getitem of a
//     tuple-returning last reader;
//   * the offload moves the value when it is contiguous, else a row-major
//     aten.permute.default view of it; a permuted reload is read only by
//     permute views, and every backward argument that read the value now
//     reads the backward wait or a permute of it with the value's exact sizes
//     and strides;
//   * mode kNone changes nothing.
std::vector<std::string> check_offload_plan(const Graph& original,
                                            const ActivationPlanOptions& options,
                                            const PlanResult& result);

}  // namespace spillway::testing
