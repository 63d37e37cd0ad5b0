#pragma once
// Write safety: which storages a node may write in place.
//
// A returned tensor is not enough to see a write: aten._foreach_add_ returns
// nothing yet writes its Tensor(a!)[] input. So writes are read from the
// schema's write arguments, resolved by keyword name first, then by positional
// index (kwarg-only arguments take no positional slot), descending into lists.
//
// When the write target cannot be proven the answer is conservative: every
// storage of every tensor argument. That happens when
//   * the node has no schema (call_method, call_module, a plain callable such
//     as operator.getitem), or
//   * a mutable schema's write argument is absent (an omitted default, a
//     vararg layout), names no node, or names only nodes of unknown storage.
// Skipping an offload costs memory; missing a write corrupts a reload.
//
// Thread-safety: pure functions.

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "analysis/graph_index.h"

namespace spillway::analysis {

struct WrittenStorages {
  std::vector<std::int64_t> storages;  // may repeat; argument order
  bool conservative = false;           // the write target was not provable
};

// The storages `node` may write. Nodes that are not call_function, call_method
// or call_module write nothing.
WrittenStorages written_storages(const GraphIndex& index, const Node& node);

// Every storage the graph writes in place, mapped to the first node (in graph
// order) that may write it.
std::unordered_map<std::int64_t, NodeId> find_written_storages(const GraphIndex& index);

}  // namespace spillway::analysis
