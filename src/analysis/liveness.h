#pragma once
// Liveness of a storage group in the forward half, and its first backward use.
//
// The last forward use is the latest forward call_function reader (in graph
// order) of the producer or of any of its lifetime views; the producer itself
// when nothing later reads them. The forward wait that frees the storage sits
// after it and takes it as a data dependency ("last_use_of_storage"), so it
// must be a tensor: a tuple/list-producing last use (max, SDPA; a split none
// of whose elements is selected, since a getitem of a split is itself a
// lifetime view whose readers come later) has no single tensor to pin the
// edge and the candidate is skipped by the planner.
//
// Thread-safety: pure functions.

#include <optional>

#include "analysis/alias_chain.h"
#include "analysis/graph_index.h"

namespace spillway::analysis {

struct ForwardLifetime {
  NodeId last_forward_use = -1;
  // The node the forward wait depends on: the producer when it is its own last
  // use, the last use when that produces a tensor, nullopt otherwise.
  std::optional<NodeId> last_use_arg;
};

ForwardLifetime find_last_forward_use(const GraphIndex& index, const AliasChain& chain);

// The earliest backward reader of the chain (direct or through a view), or -1.
NodeId find_first_backward_reader(const GraphIndex& index, const AliasChain& chain);

}  // namespace spillway::analysis
