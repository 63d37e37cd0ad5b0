#pragma once
// The activation-offload planner: which saved forward activations of a joint
// forward+backward graph move to host memory, and the graph edits that do it.
//
// The default policy is the graph-mode activation swap of the reference system
// (DESIGN.md, seed 000):
//   * candidates are forward call_function results produced inside the scope
//     (a module whose qualified name ends in `scope`, default "self_attn") and
//     read by backward, directly or through a chain of aliases;
//   * a candidate is offloadable only when it is tensor-valued, not a view, not
//     a collective, not DTensor-like, rank >= 2, contiguous, at least
//     `min_bytes` large with a known (hinted) size, and the sole owner of a
//     storage that nothing writes in place, no input/get_attr shares, and no
//     graph output reads;
//   * selection is largest-first within the host budget (0 = unlimited);
//   * edits: offload right after the producer; a forward wait after the last
//     forward use of the storage group; a reload and a backward wait before the
//     first backward reader, backward readers redirected (views replayed on the
//     reloaded value); reloads prefetched `prefetch_regions` scope regions early.
// Two opt-in relaxations (ActivationPlanOptions::offload_tuple_outputs and
// dense_storages, both off by default) lift the tuple-last-use and contiguity
// rules; with both off the plan is the seed's, bit for bit.
//
// Thread-safety: every function here is pure (no shared state); call them from
// any thread.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/graph.h"

namespace spillway {

// Targets of the nodes the planner inserts (and the custom ops of the torch
// extension). Their schemas are added to Graph::ops of a rewritten graph.
inline constexpr std::string_view kOffloadTarget = "spillway.offload.default";
inline constexpr std::string_view kReloadTarget = "spillway.reload.default";
inline constexpr std::string_view kWaitTarget = "spillway.wait_tensor.default";

enum class ActivationMode {
  kNone,   // plan nothing; the graph comes back unchanged
  kScope,  // the seed policy over the modules named by `scope`
};

struct ActivationPlanOptions {
  ActivationMode mode = ActivationMode::kScope;
  // Leaf module name that defines the scope: a node is in scope when a module
  // on its stack has this last path component.
  std::string scope = "self_attn";
  // Host bytes the plan may move; 0 means unlimited. Negative is rejected.
  std::int64_t host_budget_bytes = 0;
  // Smallest activation worth a transfer. Negative is rejected.
  std::int64_t min_bytes = 1 << 20;
  // How many scope regions earlier each reload starts in backward. Negative is
  // rejected.
  int prefetch_regions = 1;

  // Appended after the first release (defaults keep the seed policy bit for bit).
  //
  // When the last forward use of a candidate's storage group returns a
  // tuple/list (SDPA, native_layer_norm), the forward wait goes right after
  // the last forward operator.getitem of that node that yields a tensor, and
  // depends on it: the getitem runs after the tuple node, so the storage is
  // freed only once every forward reader has run. A tuple last use without
  // such a getitem stays refused (kTupleLastUse): a wait with no data edge to
  // the tuple node could be scheduled before it.
  bool offload_tuple_outputs = false;
  // Accept a candidate that is not contiguous but non-overlapping and dense
  // (its strides a permutation of a contiguous layout, checked on hints; a
  // size-1 dimension must carry the stride the permutation gives it) when no
  // member of its storage group reaches beyond its numel * element_size bytes.
  // The rewrite offloads aten.permute(value, order), a contiguous view, and
  // backward readers see aten.permute(reloaded, inverse), a view with the
  // value's sizes and strides (EditKind::kDensePermute / kRestorePermute).
  // Graph format v1 records no storage_offset: a dense storage owner is taken
  // to start its storage, as for the contiguous case.
  bool dense_storages = false;
  // Replay cheap pointwise values in backward instead of moving them. A
  // candidate P whose op schema is pointwise (OpSchema::is_pointwise), neither
  // random, mutable nor a view, and whose every tensor input is a value the
  // plan offloads or replays (P reads it directly), is not offloaded: a copy of
  // P's node applied to the reloaded inputs runs in backward before P's first
  // backward reader (EditKind::kReplayOp; P's views are replayed on it), and
  // P's backward readers read it. Decided in graph order after the budget
  // selection, so replays chain (silu(gate), then silu * up); the budget a
  // replayed value leaves unused is not refilled. The replay recomputes the
  // same bits. Off: the plan is the one without this option, bit for bit.
  bool replay_pointwise = false;
  // Where a prefetched reload is issued (only with prefetch_regions > 0). A
  // reload belongs to region k, the occurrence of its value's scope root that
  // holds it (analysis/regions.h).
  //   kRegionStart: the reference semantics: just before the first node of
  //     region k - prefetch_regions (region 0 when k < prefetch_regions), so
  //     the value is resident while that whole region and everything after it
  //     runs.
  //   kRegionEnd: right after the last in-scope node of region k -
  //     prefetch_regions (region 0 when k < prefetch_regions), after the
  //     reloads moved there before it. The transfer overlaps the out-of-scope
  //     backward between that region and the next (the attention backward
  //     between two MLP regions) but the value is not resident during region
  //     k - prefetch_regions itself. When regions follow each other with no
  //     gap, the end of region k - 1 is the start of region k, so
  //     prefetch_regions N gives N - 1 regions of lead.
  //   In both, a reload that would not move earlier stays before its first
  //   backward reader, and none moves to or before its forward wait.
  enum class PrefetchAnchor { kRegionStart, kRegionEnd };
  PrefetchAnchor prefetch_anchor = PrefetchAnchor::kRegionStart;
  // How long the device copy of a moved value stays after its last forward
  // use, in forward scope regions (>= 0). 0, the reference: the forward wait
  // (where the compute stream waits for the D2H and the device memory can go)
  // sits right after the last use. N > 0: it sits no earlier than the first
  // node of the forward scope region N regions after the one that produced
  // the value (the next layer's attention for N = 1), so the copy overlaps
  // that much compute instead of stalling the stream when the last use
  // follows the producer closely (SDPA's output, read once right after it);
  // the device memory is held that much longer. A value of the last N
  // regions, with no such region after it, keeps the reference placement.
  // Forward regions are located like the backward ones (analysis/regions.h).
  int release_lag = 0;
};

// The rule that decided a value's fate. Each has a named, tested function in
// src/plan.
enum class Rule {
  kChosen,              // offloaded
  kOutOfScope,          // not produced inside the scope
  kNotCallFunction,     // placeholder, get_attr, call_method, ...
  kOffloadOp,           // itself an offload/reload/wait node
  kView,                // a view op: aliases its base, frees nothing
  kCollective,          // a collective or its wait
  kNotTensor,           // produces no single tensor
  kDTensor,             // DTensor-like wrapper
  kRankBelowTwo,        // rank 0 or 1
  kNotContiguous,
  kUnknownSize,         // an unbacked size: no hint
  kTooSmall,            // below min_bytes
  kUnknownStorage,      // storage identity unknown
  kStorageWrittenInPlace,   // some node writes the storage in place
  kStorageSharedExternally, // a placeholder/get_attr/non-call_function shares it
  kStorageMutatingSharer,   // a mutating op produces a member of the group
  kStorageIsOutput,         // a member of the group is a graph output
  kNotStorageOwner,         // an earlier node owns the storage
  kNoBackwardReader,        // backward never reads it
  kTupleLastUse,            // last forward use returns a tuple/list
  kOverBudget,              // did not fit the host budget
  // Appended after the first release of this header (values above unchanged).
  // Both guard cases where the reference pass would emit an unsafe or invalid
  // graph; they are checked after kTupleLastUse.
  kUntrackedReader,           // an alias of the storage is read where the rewrite
                              // cannot follow (after the forward wait, or in
                              // backward without being redirected)
  kBackwardBeforeForwardUse,  // a backward reader precedes the last forward use
  // Appended with Graph Node::recompute and ActivationPlanOptions::replay_pointwise.
  kTaggedForRecompute,  // the trace tagged it for recompute (a checkpoint region);
                        // checked right after kCollective
  kReplayed,            // recomputed in backward from reloaded inputs, not moved
                        // (replay_pointwise); a candidate, like kOverBudget
};
std::string_view to_string(Rule rule);
// One line a user can read: "storage is written in place by a later node".
std::string_view describe(Rule rule);

// The verdict on one forward tensor-valued node.
struct ValueDecision {
  NodeId node = -1;
  std::string name;
  std::optional<std::int64_t> bytes;  // hinted byte count, if known
  Rule rule = Rule::kOutOfScope;
  // Extra facts for the reader ("written by node 41 (add_)"); may be empty.
  std::string detail;
};

// Where an inserted node goes, relative to an anchor node of the rewritten
// graph. Several nodes inserted at one anchor keep the order of their edits:
// "after X" appends after X and the nodes already inserted after it; "before X"
// places the node just before X, after the nodes already inserted before it.
// Precisely (src/plan/node_sequence.h): kAfter X goes right after the last node
// inserted so far with kAfter X (X itself if none); kBefore X goes right
// before X. A node inserted with kBefore Y does not join X's kAfter run even
// when it sits between X and Y.
enum class Placement { kAfter, kBefore };

enum class EditKind {
  kOffload,       // new node: spillway.offload(value)
  kForwardWait,   // new node: spillway.wait_tensor(offload, keepalive, last_use)
  kReload,        // new node: spillway.reload(forward_wait, device)
  kBackwardWait,  // new node: spillway.wait_tensor(reload, forward_wait)
  kReplayView,    // new node: a copy of a forward view applied to the reloaded value
  kRedirect,      // existing node `reader`: replace input `from` with `to`
  // Appended (ActivationPlanOptions::dense_storages); both are aten.permute.default
  // views, recorded in Graph::ops when the graph lacks that schema.
  kDensePermute,    // new node: aten.permute(value, order), contiguous; what is offloaded
  kRestorePermute,  // new node: aten.permute(backward wait, inverse): the value's
                    // sizes and strides again, read by backward in its place
  // Appended (ActivationPlanOptions::replay_pointwise).
  kReplayOp,  // new node: a copy of a forward pointwise node applied to the
              // backward waits (or replays) of its inputs; P's backward readers
              // read it
};
std::string_view to_string(EditKind kind);

struct Edit {
  EditKind kind = EditKind::kOffload;
  // For insertions: the complete new node (a fresh id; phase, module stack and
  // value set as the rewritten graph should carry them), its anchor and placement.
  Node node;
  NodeId anchor = -1;
  Placement placement = Placement::kAfter;
  // For kRedirect: every reference to `from` in reader's args/kwargs becomes `to`.
  NodeId reader = -1;
  NodeId from = -1;
  NodeId to = -1;
  // The offloaded producer this edit serves; for kReplayOp, the forward node
  // it copies.
  NodeId source = -1;
};

// One chosen activation and the nodes that move it.
struct Offload {
  NodeId producer = -1;
  std::int64_t bytes = 0;
  NodeId last_forward_use = -1;    // after which the forward wait sits (after its
                                   // last getitem when it returns a tuple)
  NodeId first_backward_reader = -1;
  NodeId offload_node = -1;
  NodeId forward_wait_node = -1;
  NodeId reload_node = -1;
  NodeId backward_wait_node = -1;
  bool prefetched = false;  // the reload was moved earlier than its reader
  // Appended: with dense_storages, the kDensePermute and kRestorePermute nodes
  // of a non-contiguous value (-1 when the value is contiguous).
  NodeId dense_permute_node = -1;
  NodeId restore_permute_node = -1;
};

// One candidate recomputed in backward instead of moved (replay_pointwise).
struct Replay {
  NodeId producer = -1;
  std::int64_t bytes = 0;
  NodeId first_backward_reader = -1;  // of the producer, in the original graph
  NodeId replay_node = -1;            // the kReplayOp node
  // The node before which the replay sits: the first backward reader, or
  // earlier when a replay that reads this one needs it sooner.
  NodeId needed_before = -1;
};

struct Plan {
  ActivationPlanOptions options;
  // Every forward node (output excluded) whose value is a tensor or a tuple/list
  // holding one, in graph order.
  std::vector<ValueDecision> decisions;
  std::vector<Offload> offloads;         // chosen, largest first
  std::vector<Edit> edits;               // in application order
  std::int64_t candidate_count = 0;      // passed every rule but the budget
  std::int64_t bytes_offloaded = 0;
  std::int64_t reloads_prefetched = 0;
  // Appended (replay_pointwise): the values replayed instead of moved, in graph
  // order, and their hinted bytes (not part of bytes_offloaded).
  std::vector<Replay> replays;
  std::int64_t bytes_replayed = 0;
};

struct PlanResult {
  Plan plan;
  Graph graph;  // the input with plan.edits applied; passes verify_offload_graph
};

// Plan activation offload for a joint forward+backward graph.
// Throws InvalidArgument for options out of range or a scope that matches no
// module of the graph (the message names the scope and lists scope_names),
// InvalidGraph when `graph` breaks verify_graph. The input is never modified.
PlanResult plan_activation_offload(const Graph& graph, const ActivationPlanOptions& options);

// The names a scope can take in `graph`: the distinct last components of the
// module paths on its nodes' stacks ("self_attn" of "model.layers.0.self_attn"),
// in order of first appearance, without list indices ("0" of "model.layers.0").
// Each one, given as ActivationPlanOptions::scope, matches. Empty when no node
// carries a module stack.
std::vector<std::string> scope_names(const Graph& graph);

// Apply edits to a graph (insertions at anchors, then redirects), returning the
// rewritten graph. A redirected reader whose value shares the storage of the
// node it read (a view) takes the storage of the node it now reads, and so do
// the views of such a reader after it (Note [Aliases follow a redirect] in
// src/plan/apply_edits.cc). The schemas of inserted spillway.* nodes are recorded in
// Graph::ops, and that of aten.permute.default when the graph lacks one.
// Throws InvalidArgument when an edit names a node the graph lacks or reuses
// an existing id. The input is never modified.
Graph apply_edits(const Graph& graph, const std::vector<Edit>& edits);

// Check the offload invariants of a rewritten graph, on top of verify_graph:
//   (a) every offload node has exactly one forward wait, one reload and one
//       backward wait chained to it;
//   (b) every wait precedes the first reader of its result, and the forward wait
//       comes after every forward reader of the offloaded storage group;
//   (c) no backward node reads an offloaded value, or an alias of it, directly;
//   (d) no offloaded storage is written in place anywhere in the graph.
// An offload may move an aten.permute.default view (inserted by the plan) of an
// original node instead of the node itself (dense_storages); the view must be
// contiguous and the checks apply to the node it permutes.
// `original` is the graph before the edits. Throws InvalidGraph naming the
// offloaded value and the broken invariant.
void verify_offload_graph(const Graph& original, const Graph& rewritten);

}  // namespace spillway
