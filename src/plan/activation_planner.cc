// plan_activation_offload: the seed-000 policy over the Spillway IR.
//
// 1. validate options and graph; mode kNone returns the graph unchanged;
// 2. discover the scope roots (an error when there are none);
// 3. decide every forward tensor-valued node with the value rules, then the
//    chain rules (activation_rules.h), in the reference order;
// 4. select largest-first within the budget (selection.h);
// 5. with replay_pointwise, replay cheap pointwise candidates over the moved
//    values instead of moving them (pointwise_replay.h);
// 6. build the edits (offload_rewrite.h) and apply them.

#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "analysis/group_safety.h"
#include "analysis/op_facts.h"
#include "analysis/scope.h"
#include "analysis/storage_groups.h"
#include "plan/activation_rules.h"
#include "plan/offload_rewrite.h"
#include "plan/pointwise_replay.h"
#include "plan/selection.h"
#include "spillway/error.h"
#include "spillway/plan.h"

namespace spillway {
namespace {

struct RuleText {
  Rule rule;
  std::string_view name;
  std::string_view description;
};

constexpr std::array<RuleText, 25> kRuleTexts{{
    {Rule::kChosen, "chosen", "offloaded to host memory"},
    {Rule::kOutOfScope, "out_of_scope", "not produced inside the scope modules"},
    {Rule::kNotCallFunction, "not_call_function",
     "not an operator call (placeholder, get_attr, method or module call)"},
    {Rule::kOffloadOp, "offload_op", "itself an offload, reload or wait node"},
    {Rule::kView, "view", "a view: it aliases its base and frees nothing"},
    {Rule::kCollective, "collective", "a collective or its wait"},
    {Rule::kNotTensor, "not_tensor", "does not produce a single tensor"},
    {Rule::kDTensor, "dtensor", "a DTensor-like wrapper the transfer ops cannot move"},
    {Rule::kRankBelowTwo, "rank_below_two", "rank 0 or 1"},
    {Rule::kNotContiguous, "not_contiguous", "not contiguous"},
    {Rule::kUnknownSize, "unknown_size", "an unbacked size: no hint for its byte count"},
    {Rule::kTooSmall, "too_small", "smaller than the minimum worth a transfer"},
    {Rule::kUnknownStorage, "unknown_storage", "its storage identity cannot be proven"},
    {Rule::kStorageWrittenInPlace, "storage_written_in_place",
     "its storage is written in place by some node"},
    {Rule::kStorageSharedExternally, "storage_shared_externally",
     "a placeholder, get_attr or non-operator node shares its storage"},
    {Rule::kStorageMutatingSharer, "storage_mutating_sharer",
     "a mutating op produces a value on its storage"},
    {Rule::kStorageIsOutput, "storage_is_output", "a graph output reads its storage"},
    {Rule::kNotStorageOwner, "not_storage_owner", "an earlier node owns its storage"},
    {Rule::kNoBackwardReader, "no_backward_reader", "backward never reads it"},
    {Rule::kTupleLastUse, "tuple_last_use",
     "its last forward use returns a tuple/list, so the free cannot be pinned to it"},
    {Rule::kOverBudget, "over_budget", "did not fit the host budget"},
    {Rule::kUntrackedReader, "untracked_reader",
     "an alias of its storage is read where the rewrite cannot follow it"},
    {Rule::kBackwardBeforeForwardUse, "backward_before_forward_use",
     "a backward reader comes before its last forward use"},
    {Rule::kTaggedForRecompute, "tagged_for_recompute",
     "the trace tagged it for recompute in backward (a checkpointed region)"},
    {Rule::kReplayed, "replayed",
     "a cheap pointwise op of moved values: recomputed in backward from their reloads, "
     "not moved"},
}};

constexpr std::array<std::pair<EditKind, std::string_view>, 9> kEditKindNames{{
    {EditKind::kOffload, "offload"},
    {EditKind::kForwardWait, "forward_wait"},
    {EditKind::kReload, "reload"},
    {EditKind::kBackwardWait, "backward_wait"},
    {EditKind::kReplayView, "replay_view"},
    {EditKind::kRedirect, "redirect"},
    {EditKind::kDensePermute, "dense_permute"},
    {EditKind::kRestorePermute, "restore_permute"},
    {EditKind::kReplayOp, "replay_op"},
}};

void validate(const ActivationPlanOptions& options) {
  auto reject = [](const std::string& option, const std::string& value, const char* why) {
    throw InvalidArgument("plan", "option " + option + " is " + value + "; " + why);
  };
  if (options.mode != ActivationMode::kNone && options.mode != ActivationMode::kScope) {
    reject("mode", std::to_string(static_cast<int>(options.mode)), "expected none or scope");
  }
  if (options.host_budget_bytes < 0) {
    reject("host_budget_bytes", std::to_string(options.host_budget_bytes),
           "it must be >= 0 (0 = unlimited)");
  }
  if (options.min_bytes < 0) {
    reject("min_bytes", std::to_string(options.min_bytes), "it must be >= 0");
  }
  if (options.prefetch_regions < 0) {
    reject("prefetch_regions", std::to_string(options.prefetch_regions), "it must be >= 0");
  }
  if (options.release_lag < 0) {
    reject("release_lag", std::to_string(options.release_lag), "it must be >= 0");
  }
  using PrefetchAnchor = ActivationPlanOptions::PrefetchAnchor;
  if (options.prefetch_anchor != PrefetchAnchor::kRegionStart &&
      options.prefetch_anchor != PrefetchAnchor::kRegionEnd) {
    reject("prefetch_anchor", std::to_string(static_cast<int>(options.prefetch_anchor)),
           "expected region start or region end");
  }
  if (options.mode == ActivationMode::kScope && options.scope.empty()) {
    reject("scope", "''", "it must name a module (e.g. self_attn)");
  }
}

// The error for a scope no module of `graph` has: it lists the names that would match.
InvalidArgument scope_matches_nothing(const Graph& graph, const std::string& scope) {
  std::string message =
      "scope '" + scope + "' matches no module in graph '" + graph.name + "'; ";
  const std::vector<std::string> names = analysis::module_leaf_names(graph);
  if (names.empty()) {
    return InvalidArgument("plan", message + "no node of it carries a module stack");
  }
  message += "its module names are: ";
  for (std::size_t i = 0; i < names.size(); ++i) message += (i == 0 ? "" : ", ") + names[i];
  return InvalidArgument("plan", message);
}

}  // namespace

std::string_view to_string(Rule rule) {
  for (const RuleText& text : kRuleTexts) {
    if (text.rule == rule) return text.name;
  }
  return "unknown";
}

std::string_view describe(Rule rule) {
  for (const RuleText& text : kRuleTexts) {
    if (text.rule == rule) return text.description;
  }
  return "unknown rule";
}

std::string_view to_string(EditKind kind) {
  for (const auto& [k, name] : kEditKindNames) {
    if (k == kind) return name;
  }
  return "unknown";
}

std::vector<std::string> scope_names(const Graph& graph) {
  return analysis::module_leaf_names(graph);
}

PlanResult plan_activation_offload(const Graph& graph, const ActivationPlanOptions& options) {
  validate(options);
  verify_graph(graph);
  PlanResult result;
  result.plan.options = options;
  if (options.mode == ActivationMode::kNone) {
    result.graph = graph;
    return result;
  }

  const analysis::ScopeRoots scope(graph, options.scope);
  if (scope.empty()) throw scope_matches_nothing(graph, options.scope);
  const analysis::GraphIndex index(graph);
  const analysis::StorageGroups groups(index);
  const analysis::StorageSafety safety(index, groups);
  const plan::RuleContext ctx{index, scope, safety, options};

  Plan& plan = result.plan;
  std::vector<plan::SizedCandidate> candidates;
  std::unordered_map<NodeId, plan::CandidateFacts> facts;
  std::unordered_map<NodeId, std::size_t> decision_of;
  for (const Node& node : graph.nodes) {
    if (node.phase != Phase::kForward || node.kind == NodeKind::kOutput ||
        !analysis::holds_tensor(node.value)) {
      continue;
    }
    ValueDecision decision;
    decision.node = node.id;
    decision.name = node.name;
    if (node.value.is_tensor()) decision.bytes = analysis::hinted_nbytes(node.value.tensor);
    decision.rule = plan::kPass;
    for (plan::ValueRule rule : plan::value_rules()) {
      decision.rule = rule(ctx, node, decision.detail);
      if (decision.rule != plan::kPass) break;
    }
    if (decision.rule == plan::kPass) {
      plan::CandidateFacts candidate = plan::gather_candidate_facts(ctx, node);
      for (plan::ChainRule rule : plan::chain_rules()) {
        decision.rule = rule(ctx, candidate, decision.detail);
        if (decision.rule != plan::kPass) break;
      }
      if (decision.rule == plan::kPass) {
        candidates.push_back({node.id, *decision.bytes});
        facts.emplace(node.id, std::move(candidate));
      }
    }
    decision_of.emplace(node.id, plan.decisions.size());
    plan.decisions.push_back(std::move(decision));
  }
  plan.candidate_count = static_cast<std::int64_t>(candidates.size());

  const plan::Selection selection = plan::select_within_budget(candidates, options.host_budget_bytes);
  for (const plan::SizedCandidate& skipped : selection.over_budget) {
    ValueDecision& decision = plan.decisions[decision_of.at(skipped.node)];
    decision.rule = Rule::kOverBudget;
    decision.detail = std::to_string(skipped.bytes) + " bytes; budget " +
                      std::to_string(options.host_budget_bytes);
  }
  plan.bytes_offloaded = selection.total_bytes;
  if (selection.chosen.empty()) {
    result.graph = graph;
    return result;
  }

  plan::ReplaySelection replay;
  if (options.replay_pointwise) {
    std::unordered_set<NodeId> offloaded;
    for (const plan::SizedCandidate& candidate : selection.chosen) offloaded.insert(candidate.node);
    std::vector<std::pair<NodeId, std::int64_t>> in_graph_order;
    for (const plan::SizedCandidate& candidate : candidates) {
      in_graph_order.emplace_back(candidate.node, candidate.bytes);
    }
    replay = plan::select_replays(ctx, in_graph_order, offloaded, facts);
  }
  std::unordered_set<NodeId> replayed;
  for (const plan::ReplayChoice& choice : replay.replays) {
    if (choice.facts == nullptr) continue;  // an intermediate: no decision of its own
    replayed.insert(choice.producer);
    ValueDecision& decision = plan.decisions[decision_of.at(choice.producer)];
    decision.rule = Rule::kReplayed;
    decision.detail = "from";
    for (NodeId input : choice.inputs) decision.detail += " " + index.node(input).name;
    const std::int64_t room = std::numeric_limits<std::int64_t>::max() - plan.bytes_replayed;
    plan.bytes_replayed += std::min(choice.bytes, room);
  }

  std::vector<plan::ChosenValue> chosen;
  if (!replayed.empty()) plan.bytes_offloaded = 0;
  for (const plan::SizedCandidate& candidate : selection.chosen) {
    if (replayed.count(candidate.node)) continue;
    const auto reload_before = replay.reload_before.find(candidate.node);
    chosen.push_back({candidate.node, candidate.bytes, &facts.at(candidate.node),
                      reload_before == replay.reload_before.end() ? -1 : reload_before->second});
    if (!replayed.empty()) {
      const std::int64_t room = std::numeric_limits<std::int64_t>::max() - plan.bytes_offloaded;
      plan.bytes_offloaded += std::min(candidate.bytes, room);
    }
  }
  plan::OffloadRewrite rewrite = plan::build_offload_rewrite(
      index, scope, chosen, options.prefetch_regions, replay, options.prefetch_anchor,
      options.release_lag);
  plan.replays = std::move(rewrite.replays);
  plan.offloads = std::move(rewrite.offloads);
  plan.edits = std::move(rewrite.edits);
  plan.reloads_prefetched = rewrite.reloads_prefetched;
  result.graph = apply_edits(graph, plan.edits);
  return result;
}

}  // namespace spillway
