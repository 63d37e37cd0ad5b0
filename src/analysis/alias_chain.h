#pragma once
// Alias chains: the forward views of a value and who reads them in backward.
//
// Starting at a producer, the chain walks forward call_function readers that
// alias their input (a schema view, or a value on the same known storage, so
// aten._unsafe_view joins without an alias annotation), depth first, each view
// entered at most once (the first parent to reach it keeps it). Along the way
// it records the backward call_function readers of every chain node.
//
// Multi-output views (split, chunk, unbind) return a tuple/list whose
// elements share the base's storage; the operator.getitem that picks one has
// no schema and, seen from the tuple, no tensor storage to compare. So a
// getitem whose value is on the storage of the element it selects is an
// alias too (selects_aliased_element): the chain runs producer -> split ->
// getitem -> ..., and the backward readers of a half are the producer's. The
// reference pass (seed 000) stops at the tuple; there a value read in
// backward only through such a half is never moved (Phi3's fused gate_up
// projection, chunked in two: the plan then moved the bf16 SiLU and product
// that torch.compile never materialises, and gradients drifted).
//
//   lifetime_views  every forward view reached, in visit (pre-)order: they
//                   extend the producer's forward lifetime;
//   replay_views    the subset read in backward, directly or through a
//                   descendant view: they must be rebuilt on the reloaded
//                   value. Same order as lifetime_views;
//   view_backward_redirects
//                   (view, backward reader) for every replay view, to point
//                   each reader at the replayed view;
//   direct_backward_readers
//                   the producer's own backward readers (any node kind).
//
// Non-call_function readers of a view are not walked, exactly as in the
// reference pass; forward_aliases() gives the complete set for checks.
//
// Thread-safety: pure functions.

#include <utility>
#include <vector>

#include "analysis/graph_index.h"
#include "analysis/storage_groups.h"

namespace spillway::analysis {

struct AliasChain {
  NodeId producer = -1;
  std::vector<NodeId> lifetime_views;
  std::vector<NodeId> replay_views;
  std::vector<std::pair<NodeId, NodeId>> view_backward_redirects;
  std::vector<NodeId> direct_backward_readers;

  // Every backward reader: the direct ones, then those reached through views.
  std::vector<NodeId> all_backward_readers() const;
};

// Whether `user` aliases `current`: a schema view, the same known storage, or
// a getitem selecting an element of `current` on its own storage.
bool is_alias(const GraphIndex& index, const Node& user, const Node& current);

// The chain of `producer`. Throws InvalidGraph for an unknown id.
AliasChain trace_alias_chain(const GraphIndex& index, NodeId producer);

// Every forward node that may alias `producer`'s memory: its storage group
// members plus the closure of forward call_function readers that alias a node
// already in the set. Excludes `producer`; graph order.
std::vector<NodeId> forward_aliases(const GraphIndex& index, const StorageGroups& groups,
                                    NodeId producer);

}  // namespace spillway::analysis
