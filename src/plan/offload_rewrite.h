#pragma once
// The graph edits that move chosen activations to host and back, exactly as
// the reference pass (seed 000) rewrites its FX graph:
//
//   forward, for each chosen value in selection order (largest first):
//     offload(P)                     right after the producer P;
//     wait_tensor(offload, P, last)  right after P's last forward use, or
//                                    after the offload when P is its own last
//                                    use (`last` is the last-use argument;
//                                    with offload_tuple_outputs, the last
//                                    getitem of a tuple last use, and the wait
//                                    sits right after that getitem);
//   then backward, for each chosen value in the same order, all forward waits
//   existing already:
//     reload(forward_wait, device)   before the first backward reader;
//     wait_tensor(reload, fwd_wait)  before the first backward reader;
//     P's backward readers redirected to the backward wait;
//     replay views (graph order)     before the first backward reader, args
//                                    mapped onto the reload chain, and the
//                                    views' backward readers redirected;
//   (with dense_storages, a non-contiguous dense P moves as
//     D = aten.permute(P, order)     right after P, the offload right after D
//                                    and offloading D;
//     reload and waits carry D's sizes; R = aten.permute(backward wait,
//     inverse) before the first backward reader, after the backward wait, and
//     P's backward readers and replay views read R instead; see dense_layout.h)
//   then, with replay_pointwise (pointwise_replay.h), for each replayed value
//   P in graph order:
//     a copy of P's node            before P's needed_before node, args mapped
//                                    onto the backward waits (restore
//                                    permutes), replayed views and earlier
//                                    replays, P's backward readers redirected
//                                    to it, and P's views replayed on it as
//                                    above (views a replay reads, though
//                                    backward does not, are replayed too)
//     (an offloaded input's reload and wait sit before its reload_before
//     node when a replay needs it before its first backward reader);
//   then, with release_lag N > 0, every forward wait that sits before the
//   first node of the forward scope region N regions after its producer's
//   moves right before that node (ActivationPlanOptions::release_lag);
//   then every new reload is moved `prefetch_regions` scope regions earlier
//   (regions located on the rewritten graph; see analysis/regions.h): before
//   the first node of that region (kRegionStart, the reference), or right
//   after its last in-root node and the reloads already moved there, in graph
//   order (kRegionEnd; ActivationPlanOptions::prefetch_anchor).
//
// FX inserts "after X" immediately after X, ahead of nodes inserted there
// before, and the prefetch moves nodes; plan.h edits only insert, with a
// different "after" rule. So the rewrite is first simulated with FX's list
// semantics, then expressed as edits: each edit keeps the reference anchor
// (producer, last use, first backward reader, prefetch anchor) when applying
// it in order lands the node where FX put it, and otherwise anchors "before"
// the next node already present at that point of the final order. Applying
// the edits in order therefore gives exactly the reference graph; the builder
// checks this before returning.
//
// Divergences, both where the reference would produce an invalid graph: a
// reload is not moved before its own forward wait, and reloads that were in
// the input graph are never moved (an edit cannot move an existing node).
//
// New nodes: ids above every existing id, names "spillway_offload_<P>",
// "spillway_wait_offload_<P>", "spillway_reload_<P>", "spillway_wait_reload_<P>",
// "spillway_replay_<view or replayed P>", "spillway_dense_<P>", "spillway_restore_<P>" (suffixed _1, _2... if taken). Offload and forward
// wait: forward, P's tensor on "cpu" with a fresh storage; reload and backward
// wait: backward, P's tensor with another fresh storage; both with P's module
// stack. Replays: backward, the view's module stack and time, its value on the
// reload's storage; a replayed P's copy: backward, P's module stack, time and
// value, on a fresh storage.
//
// Thread-safety: pure function.

#include <cstdint>
#include <vector>

#include "analysis/graph_index.h"
#include "analysis/scope.h"
#include "plan/activation_rules.h"
#include "plan/pointwise_replay.h"
#include "spillway/plan.h"

namespace spillway::plan {

struct ChosenValue {
  NodeId producer = -1;
  std::int64_t bytes = 0;
  const CandidateFacts* facts = nullptr;  // not owned
  // Where the reload and backward wait go: before this node when >= 0 (a
  // replay needs the value before its first backward reader), else before
  // the first backward reader.
  NodeId reload_before = -1;
  // The release lag of this value's forward wait when >= 0 (overrides
  // build_offload_rewrite's release_lag; one past the last forward region:
  // right after the last region's last node; two past: right before the
  // first backward node).
  int release_lag = -1;
};

struct OffloadRewrite {
  std::vector<Edit> edits;       // application order
  std::vector<Offload> offloads; // one per chosen value, same order
  std::int64_t reloads_prefetched = 0;
  std::vector<Replay> replays;   // one per replayed value, graph order
};

// `chosen` in selection order; `replay` from select_replays over them
// (empty: nothing replayed). Reloads in the last `just_in_time_regions`
// backward regions stay where they are (before their first reader) instead
// of being prefetched (BudgetOptions::just_in_time_regions). Throws Error("[plan] internal ...") if the edits
// would not reproduce the simulated graph (a bug, never bad input).
OffloadRewrite build_offload_rewrite(const analysis::GraphIndex& index,
                                     const analysis::ScopeRoots& scope,
                                     const std::vector<ChosenValue>& chosen, int prefetch_regions,
                                     const ReplaySelection& replay = {},
                                     ActivationPlanOptions::PrefetchAnchor prefetch_anchor =
                                         ActivationPlanOptions::PrefetchAnchor::kRegionStart,
                                     int release_lag = 0, int just_in_time_regions = 0);

// The schemas a rewritten graph records for the spillway targets.
OpSchema offload_schema();
OpSchema reload_schema();
OpSchema wait_schema();

}  // namespace spillway::plan
