#pragma once
// Note [Upcast sources]: in torch.compile mode the planner may offload the
// bf16 value a saved fp32 upcast is made from.
//
// RMSNorm in a bf16 model upcasts its input, the residual stream, to fp32, and
// its backward reads the fp32 copy. The partitioner saves the 2-byte source
// (or the matmul output it is summed from) and rebuilds the cast inside the
// backward kernels, for free. In the joint graph, though, backward reads only
// the cast: the source is no saved activation, so no plan could move it, and
// on T1 the residual stream (2 x 64 MiB a layer) stayed on the device at
// every budget, 2 GiB of the floor.
//
// upcast_source_edits() makes that rebuild explicit: for each forward
// widening cast S = cast(X) that backward reads, where backward reads X
// nowhere, a copy S' of S in backward (a replay_op edit, as the pointwise
// replays are) reads X, and S's backward readers read S'. Then X is a saved
// value like any other, and a candidate of the budget planner.
//
// Only casts inside the repeated blocks: the planner takes over every
// partitioner recompute there (its free recomputes become replays of the
// reload), not outside. The final norm's upcast of the last block's output
// stayed the partitioner's, which then kept that value on the device beside
// its offload (a bf16 tiny Llama on the CPU: the departure spillway.compile
// reports). For the same reason the planner prepares the graph only when it
// may recompute (allow_recompute).
//
// Not bit-exact against plain torch.compile: where the partitioner chose to
// save the matmul output instead (T1's first layer, on the CPU with a tiny
// Llama), backward rebuilt X in fp32 inside its kernel; a moved X is the
// bf16 value the forward wrote. So the planner applies this only with
// BudgetOptions::offload_materialised.
//
// Thread-safety: pure function.

#include <string>
#include <vector>

#include "spillway/plan.h"

namespace spillway::plan {

// The edits, in application order: per cast, its kReplayOp (named
// "spillway_replay_<S>_upcast", before S's first backward reader, `source`
// S, time 0: the partitioner fuses it) then a kRedirect per backward reader.
// Only casts with one of `blocks` (module paths, analysis::layer_roots) on
// their module stack.
std::vector<Edit> upcast_source_edits(const Graph& graph, const std::vector<std::string>& blocks);

}  // namespace spillway::plan
