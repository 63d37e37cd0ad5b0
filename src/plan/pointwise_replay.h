#pragma once
// Which candidates are replayed in backward instead of moved
// (ActivationPlanOptions::replay_pointwise).
//
// Without offload, torch's min-cut partitioner recomputes a cheap pointwise
// value (SiLU of a projection) in backward from what it saves. Offloading the
// inputs hides that chance from it (it does not know a reload equals its
// value), so it would save the pointwise value too, or the plan would move it:
// a transfer of bytes a kernel of ~0.1 ms rebuilds. Here such a value P is
// rebuilt from the reloads by a copy of its node (EditKind::kReplayOp).
//
// P is replayed when, visiting candidates (every rule passed, budget aside) in
// graph order:
//   * its schema is pointwise and neither random, mutable nor a view;
//   * it reads at least one tensor, and each node input that holds a tensor
//     is a value the budget selection offloads, or one replayed already, or a
//     forward view in the alias chain of one of those built from it alone
//     (_unsafe_view of a projection): the replay reads only reloads, replays
//     and views replayed on them, never a forward value; or a forward
//     pointwise node no rule made a candidate (an intermediate: the neg, exp
//     and add of a decomposed SiLU), on its own storage that nothing writes,
//     whose inputs qualify the same way (at most 16 per candidate); it is
//     recomputed too;
//   * its first backward reader comes after the forward wait of every
//     offloaded value it is rebuilt from (directly or through replays).
// A replayed P is not offloaded even when the budget chose it.
//
// Where replays go: a replay sits before `needed_before`, the earliest of P's
// first backward reader and the places of the replays that read P; the
// reload of an offloaded input moves up to the earliest replay that reads it
// when that comes before its own first backward reader (`reload_before`).
//
// Thread-safety: pure function.

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "plan/activation_rules.h"

namespace spillway::plan {

struct ReplayChoice {
  NodeId producer = -1;
  // Inputs read as they are (kept values, parameters): ReplayPolicy::kept.
  std::vector<NodeId> kept_inputs;
  std::int64_t bytes = 0;                 // 0 for an intermediate
  const CandidateFacts* facts = nullptr;  // not owned; nullptr for an intermediate
  NodeId needed_before = -1;              // an original backward node
  std::vector<NodeId> inputs;             // tensor node inputs, in argument order
  // The moved or replayed values the inputs are (or are views of), distinct.
  std::vector<NodeId> sources;
};

struct ReplaySelection {
  std::vector<ReplayChoice> replays;  // candidates and intermediates, graph order
  // Offloaded value -> the node its reload must precede, only where that is
  // earlier than the value's own first backward reader.
  std::unordered_map<NodeId, NodeId> reload_before;
  // Moved or replayed value -> views of its alias chain that replays read and
  // that backward does not read (so the chain would not replay them), in no
  // particular order; they are replayed with the chain's views.
  std::unordered_map<NodeId, std::vector<NodeId>> extra_views;
};

// The budget planner's generalisation (budget.h): recompute chosen values of
// any deterministic op, from kept values as well as moved ones.
struct ReplayPolicy {
  // Only pointwise ops (replay_pointwise's rule); false: any op that is not
  // random, mutable, a view or a collective.
  bool pointwise_only = true;
  // Consider only these candidates; nullptr: every candidate.
  const std::unordered_set<NodeId>* only = nullptr;
  // A value is read as it is when it is a placeholder or get_attr, or when
  // its storage is the storage of a node in this set (the values the plan
  // keeps for backward); nullptr: nothing is read as it is. Such a read
  // roots nothing (no wait is needed before it).
  const std::unordered_set<NodeId>* kept = nullptr;
};

// `candidates` in graph order with their bytes; `offloaded` the budget's
// choice; `facts` holds every candidate's facts.
ReplaySelection select_replays(const RuleContext& ctx,
                               const std::vector<std::pair<NodeId, std::int64_t>>& candidates,
                               const std::unordered_set<NodeId>& offloaded,
                               const std::unordered_map<NodeId, CandidateFacts>& facts,
                               const ReplayPolicy& policy = {});

}  // namespace spillway::plan
