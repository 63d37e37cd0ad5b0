#pragma once
// What one node's operator and value say, read the way the reference pass
// (seed 000) reads torch FX facts:
//   is_view(node)                 -> the target's OpSchema::is_view (no schema: no)
//   _is_collective_or_wait(node)  -> namespace _c10d_functional[_autograd]
//   node.target in ao ops         -> a spillway.offload/reload/wait_tensor target,
//                                    or any target starting with "ao."
//   _storage_key(val)             -> TensorInfo::storage of a tensor value
//   nelement() * element_size()   -> hinted_nbytes (hints only, never a symbol)
// plus one fact the reference does not read: which element of a tuple/list
// value an operator.getitem selects (selects_aliased_element).
//
// Thread-safety: pure functions.

#include <cstdint>
#include <optional>

#include "analysis/graph_index.h"
#include "spillway/graph.h"

namespace spillway::analysis {

// A call_function whose schema says it returns an alias of an input.
bool is_view_op(const GraphIndex& index, const Node& node);
// A call_function whose schema is mutable (writes some argument).
bool is_mutating_op(const GraphIndex& index, const Node& node);
// A functional collective or its wait: schema namespace _c10d_functional or
// _c10d_functional_autograd (the target's first component when no schema).
bool is_collective_op(const GraphIndex& index, const Node& node);
// One of the nodes an offload plan inserts (spillway.* or ao.* transfer ops).
bool is_offload_op(const Node& node);
// A reload node (spillway.reload.default or ao.reload.default).
bool is_reload_op(const Node& node);

// The storage identity of a tensor-valued node; nullopt when the value is not
// a tensor or its storage is unknown.
std::optional<std::int64_t> storage_of(const Node& node);
// Two tensor values on the same known storage (unknown storage never matches).
bool shares_storage(const Node& a, const Node& b);
// Whether `getitem` is an operator.getitem of `sequence` (a tuple/list value)
// whose tensor value lives on the known storage of the element it selects: a
// half of split / chunk, a row of unbind, which aliases that element and so
// the storage the multi-output view shares with its base. False for anything
// else, an index out of range, or an unknown storage on either side.
bool selects_aliased_element(const Node& getitem, const Node& sequence);
// Whether the value is, or (for a tuple/list) contains, a tensor.
bool holds_tensor(const Value& value);
// numel * element_size from the size hints; nullopt when a size is unbacked.
// Saturates at INT64_MAX instead of overflowing on absurd shapes.
std::optional<std::int64_t> hinted_nbytes(const TensorInfo& info);

}  // namespace spillway::analysis
