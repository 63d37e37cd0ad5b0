#include "plan/activation_rules.h"

#include <algorithm>
#include <unordered_set>

#include "analysis/op_facts.h"
#include "plan/dense_layout.h"

namespace spillway::plan {
namespace {

using analysis::GroupHazard;

std::string node_label(const analysis::GraphIndex& index, NodeId id) {
  return "node " + std::to_string(id) + " (" + index.node(id).name + ")";
}

// The storage of a node that passed rule_known_storage.
std::int64_t storage_key(const Node& node) { return *node.value.tensor.storage; }

Rule hazard_rule(const RuleContext& ctx, const Node& node, GroupHazard hazard, Rule rule,
                 const char* what, std::string& detail) {
  analysis::GroupVerdict verdict = ctx.storage.verdict(storage_key(node));
  if (verdict.hazard != hazard) return kPass;
  detail = what + node_label(ctx.index, verdict.witness);
  return rule;
}

}  // namespace

std::optional<NodeId> last_tensor_getitem(const analysis::GraphIndex& index, NodeId tuple) {
  std::optional<NodeId> last;
  for (NodeId user : index.users(tuple)) {  // graph order
    const Node& reader = index.node(user);
    if (reader.kind == NodeKind::kCallFunction && reader.phase == Phase::kForward &&
        reader.target == "operator.getitem" && reader.value.is_tensor() && !reader.args.empty() &&
        reader.args[0].kind == Arg::Kind::kNode && reader.args[0].node == tuple) {
      last = user;
    }
  }
  return last;
}

std::size_t forward_wait_position(const analysis::GraphIndex& index,
                                  const analysis::ForwardLifetime& lifetime) {
  std::size_t position = index.position(lifetime.last_forward_use);
  if (lifetime.last_use_arg) position = std::max(position, index.position(*lifetime.last_use_arg));
  return position;
}

Rule rule_in_scope(const RuleContext& ctx, const Node& node, std::string&) {
  return ctx.scope.in_scope(node) ? kPass : Rule::kOutOfScope;
}

Rule rule_call_function(const RuleContext&, const Node& node, std::string& detail) {
  if (node.kind == NodeKind::kCallFunction) return kPass;
  detail = std::string(to_string(node.kind));
  return Rule::kNotCallFunction;
}

Rule rule_not_offload_op(const RuleContext&, const Node& node, std::string&) {
  return analysis::is_offload_op(node) ? Rule::kOffloadOp : kPass;
}

Rule rule_not_view(const RuleContext& ctx, const Node& node, std::string&) {
  return analysis::is_view_op(ctx.index, node) ? Rule::kView : kPass;
}

Rule rule_not_collective(const RuleContext& ctx, const Node& node, std::string&) {
  return analysis::is_collective_op(ctx.index, node) ? Rule::kCollective : kPass;
}

Rule rule_not_tagged_for_recompute(const RuleContext&, const Node& node, std::string&) {
  return node.recompute ? Rule::kTaggedForRecompute : kPass;
}

Rule rule_single_tensor(const RuleContext&, const Node& node, std::string&) {
  return node.value.is_tensor() ? kPass : Rule::kNotTensor;
}

Rule rule_not_dtensor(const RuleContext&, const Node& node, std::string&) {
  return node.value.tensor.dtensor_like ? Rule::kDTensor : kPass;
}

Rule rule_rank_at_least_two(const RuleContext&, const Node& node, std::string& detail) {
  if (node.value.tensor.rank() >= 2) return kPass;
  detail = "rank " + std::to_string(node.value.tensor.rank());
  return Rule::kRankBelowTwo;
}

Rule rule_contiguous(const RuleContext& ctx, const Node& node, std::string& detail) {
  const TensorInfo& tensor = node.value.tensor;
  if (tensor.contiguous) return kPass;
  if (!ctx.options.dense_storages) return Rule::kNotContiguous;
  if (!dense_order(tensor, &detail)) return Rule::kNotContiguous;
  // The whole storage must be the value's numel * element_size bytes: no
  // member of its group may reach further (a larger base, an as_strided).
  const std::optional<std::int64_t> bytes = analysis::hinted_nbytes(tensor);
  const analysis::StorageGroup* group =
      tensor.storage ? ctx.storage.groups().find(*tensor.storage) : nullptr;
  if (bytes == std::nullopt || group == nullptr) return kPass;  // later rules decide
  for (NodeId member : group->members) {
    const Node& other = ctx.index.node(member);
    if (member == node.id || !other.value.is_tensor()) continue;
    const std::optional<std::int64_t> reach = reach_bytes(other.value.tensor);
    const std::optional<std::int64_t> other_bytes = analysis::hinted_nbytes(other.value.tensor);
    const std::int64_t extent = std::max(reach.value_or(0), other_bytes.value_or(0));
    if (!reach || !other_bytes || extent > *bytes) {
      detail = "storage member " + node_label(ctx.index, member) +
               (reach && other_bytes ? " reaches " + std::to_string(extent) + " > " +
                                           std::to_string(*bytes) + " bytes"
                                     : " has an unknown extent");
      return Rule::kNotContiguous;
    }
  }
  return kPass;
}

Rule rule_known_size(const RuleContext&, const Node& node, std::string& detail) {
  if (analysis::hinted_nbytes(node.value.tensor)) return kPass;
  for (const SymSize& size : node.value.tensor.sizes) {
    if (!size.hint) {
      detail = "unbacked size " + size.symbol;
      break;
    }
  }
  return Rule::kUnknownSize;
}

Rule rule_large_enough(const RuleContext& ctx, const Node& node, std::string& detail) {
  const std::int64_t bytes = *analysis::hinted_nbytes(node.value.tensor);
  if (bytes >= ctx.options.min_bytes) return kPass;
  detail = std::to_string(bytes) + " < " + std::to_string(ctx.options.min_bytes) + " bytes";
  return Rule::kTooSmall;
}

Rule rule_known_storage(const RuleContext&, const Node& node, std::string&) {
  return node.value.tensor.storage ? kPass : Rule::kUnknownStorage;
}

Rule rule_storage_not_written(const RuleContext& ctx, const Node& node, std::string& detail) {
  return hazard_rule(ctx, node, GroupHazard::kWrittenInPlace, Rule::kStorageWrittenInPlace,
                     "written by ", detail);
}

Rule rule_storage_not_shared_externally(const RuleContext& ctx, const Node& node,
                                        std::string& detail) {
  return hazard_rule(ctx, node, GroupHazard::kSharedExternally, Rule::kStorageSharedExternally,
                     "shared with ", detail);
}

Rule rule_no_mutating_sharer(const RuleContext& ctx, const Node& node, std::string& detail) {
  return hazard_rule(ctx, node, GroupHazard::kMutatingSharer, Rule::kStorageMutatingSharer,
                     "mutating sharer ", detail);
}

Rule rule_storage_not_output(const RuleContext& ctx, const Node& node, std::string& detail) {
  return hazard_rule(ctx, node, GroupHazard::kOutputReader, Rule::kStorageIsOutput,
                     "output reads ", detail);
}

Rule rule_storage_owner(const RuleContext& ctx, const Node& node, std::string& detail) {
  const NodeId owner = ctx.storage.owner(storage_key(node));
  if (owner == node.id) return kPass;
  if (owner >= 0) detail = "owned by " + node_label(ctx.index, owner);
  return Rule::kNotStorageOwner;
}

const std::vector<ValueRule>& value_rules() {
  static const std::vector<ValueRule> rules{
      rule_in_scope,          rule_call_function,
      rule_not_offload_op,    rule_not_view,
      rule_not_collective,    rule_not_tagged_for_recompute,
      rule_single_tensor,
      rule_not_dtensor,       rule_rank_at_least_two,
      rule_contiguous,        rule_known_size,
      rule_large_enough,      rule_known_storage,
      rule_storage_not_written, rule_storage_not_shared_externally,
      rule_no_mutating_sharer, rule_storage_not_output,
      rule_storage_owner,
  };
  return rules;
}

CandidateFacts gather_candidate_facts(const RuleContext& ctx, const Node& node) {
  CandidateFacts facts;
  facts.chain = analysis::trace_alias_chain(ctx.index, node.id);
  facts.lifetime = analysis::find_last_forward_use(ctx.index, facts.chain);
  if (ctx.options.offload_tuple_outputs && !facts.lifetime.last_use_arg) {
    facts.lifetime.last_use_arg = last_tensor_getitem(ctx.index, facts.lifetime.last_forward_use);
  }
  facts.first_backward_reader = analysis::find_first_backward_reader(ctx.index, facts.chain);
  return facts;
}

Rule rule_read_by_backward(const RuleContext&, const CandidateFacts& facts, std::string&) {
  return facts.first_backward_reader >= 0 ? kPass : Rule::kNoBackwardReader;
}

Rule rule_tensor_last_use(const RuleContext& ctx, const CandidateFacts& facts,
                          std::string& detail) {
  if (facts.lifetime.last_use_arg) return kPass;
  detail = "last forward use is " + node_label(ctx.index, facts.lifetime.last_forward_use);
  if (ctx.options.offload_tuple_outputs) detail += ", which no forward tensor getitem reads";
  return Rule::kTupleLastUse;
}

Rule rule_readers_tracked(const RuleContext& ctx, const CandidateFacts& facts,
                          std::string& detail) {
  const analysis::GraphIndex& index = ctx.index;
  const NodeId producer = facts.chain.producer;
  const std::size_t last_position = index.position(facts.lifetime.last_forward_use);
  std::unordered_set<NodeId> followed(facts.chain.lifetime_views.begin(),
                                      facts.chain.lifetime_views.end());
  std::vector<NodeId> aliases =
      analysis::forward_aliases(index, ctx.storage.groups(), producer);
  aliases.push_back(producer);
  std::unordered_set<NodeId> alias_set(aliases.begin(), aliases.end());

  for (NodeId alias : aliases) {
    if (index.node(alias).phase == Phase::kForward && index.position(alias) > last_position) {
      detail = "alias " + node_label(index, alias) + " comes after the last forward use";
      return Rule::kUntrackedReader;
    }
    for (NodeId user : index.users(alias)) {
      const Node& reader = index.node(user);
      bool untracked = false;
      if (reader.phase == Phase::kBackward) {
        // The producer's own backward readers are all redirected; a view's only
        // when they are call_function nodes (the chain walks nothing else).
        untracked = alias != producer &&
                    (!followed.count(alias) || reader.kind != NodeKind::kCallFunction);
      } else {
        untracked = index.position(user) > last_position;
      }
      if (untracked) {
        detail = node_label(index, user) + " reads alias " + node_label(index, alias);
        return Rule::kUntrackedReader;
      }
    }
  }
  std::unordered_set<NodeId> replayed(facts.chain.replay_views.begin(),
                                      facts.chain.replay_views.end());
  replayed.insert(producer);
  for (NodeId view : facts.chain.replay_views) {
    NodeId stray = -1;
    index.node(view).for_each_input([&](NodeId input) {
      if (stray < 0 && alias_set.count(input) && !replayed.count(input)) stray = input;
    });
    if (stray >= 0) {
      detail = "replayed " + node_label(index, view) + " reads alias " + node_label(index, stray);
      return Rule::kUntrackedReader;
    }
  }
  return kPass;
}

Rule rule_backward_after_forward(const RuleContext& ctx, const CandidateFacts& facts,
                                 std::string& detail) {
  const analysis::GraphIndex& index = ctx.index;
  if (index.position(facts.first_backward_reader) > forward_wait_position(index, facts.lifetime)) {
    return kPass;
  }
  const NodeId wait_after = index.position(facts.lifetime.last_forward_use) >=
                                    forward_wait_position(index, facts.lifetime)
                                ? facts.lifetime.last_forward_use
                                : *facts.lifetime.last_use_arg;
  detail = node_label(index, facts.first_backward_reader) + " precedes " +
           node_label(index, wait_after);
  return Rule::kBackwardBeforeForwardUse;
}

const std::vector<ChainRule>& chain_rules() {
  static const std::vector<ChainRule> rules{rule_read_by_backward, rule_tensor_last_use,
                                            rule_readers_tracked, rule_backward_after_forward};
  return rules;
}

}  // namespace spillway::plan
