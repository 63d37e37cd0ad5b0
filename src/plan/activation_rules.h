#pragma once
// The selection rules of the activation planner, one named function each, in
// the order the reference pass (seed 000) applies them. A rule returns the
// Rule that rejects the value, or kPass (Rule::kChosen) to let it through; it
// may write a short explanation into `detail`.
//
// Value rules look at the node and its storage group; chain rules also need
// the value's alias chain and lifetime (CandidateFacts), computed only for
// values that passed every value rule.
//
// Thread-safety: pure functions over immutable analyses.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "analysis/alias_chain.h"
#include "analysis/graph_index.h"
#include "analysis/group_safety.h"
#include "analysis/liveness.h"
#include "analysis/scope.h"
#include "spillway/plan.h"

namespace spillway::plan {

inline constexpr Rule kPass = Rule::kChosen;

// Everything the rules read; built once per plan. Not owned.
struct RuleContext {
  const analysis::GraphIndex& index;
  const analysis::ScopeRoots& scope;
  const analysis::StorageSafety& storage;
  const ActivationPlanOptions& options;
};

// ---- value rules, in order ----
Rule rule_in_scope(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_call_function(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_not_offload_op(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_not_view(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_not_collective(const RuleContext& ctx, const Node& node, std::string& detail);
// Not in the reference pass: the trace tagged the node for recompute in
// backward (Node::recompute, a checkpointed region); moving it would spend a
// transfer and host bytes on a value the partitioner recomputes anyway.
Rule rule_not_tagged_for_recompute(const RuleContext& ctx, const Node& node,
                                   std::string& detail);
Rule rule_single_tensor(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_not_dtensor(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_rank_at_least_two(const RuleContext& ctx, const Node& node, std::string& detail);
// Contiguous; or, with options.dense_storages, dense (dense_layout.h) with no
// member of its storage group reaching beyond its bytes.
Rule rule_contiguous(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_known_size(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_large_enough(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_known_storage(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_storage_not_written(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_storage_not_shared_externally(const RuleContext& ctx, const Node& node,
                                        std::string& detail);
Rule rule_no_mutating_sharer(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_storage_not_output(const RuleContext& ctx, const Node& node, std::string& detail);
Rule rule_storage_owner(const RuleContext& ctx, const Node& node, std::string& detail);

using ValueRule = Rule (*)(const RuleContext&, const Node&, std::string&);
// The value rules above, in evaluation order.
const std::vector<ValueRule>& value_rules();

// ---- chain rules, in order ----
struct CandidateFacts {
  analysis::AliasChain chain;
  analysis::ForwardLifetime lifetime;
  NodeId first_backward_reader = -1;
};
// Chain, lifetime and first backward reader of a value that passed the value
// rules. With options.offload_tuple_outputs, a tuple/list last use takes its
// last forward tensor getitem as lifetime.last_use_arg (the forward wait sits
// after it and depends on it).
CandidateFacts gather_candidate_facts(const RuleContext& ctx, const Node& node);

// The last (in graph order) forward call_function operator.getitem of `tuple`
// whose value is a tensor, or nullopt.
std::optional<NodeId> last_tensor_getitem(const analysis::GraphIndex& index, NodeId tuple);

// Where the forward wait goes: the later of the last forward use and the
// last-use argument (a getitem of a tuple last use).
std::size_t forward_wait_position(const analysis::GraphIndex& index,
                                  const analysis::ForwardLifetime& lifetime);

Rule rule_read_by_backward(const RuleContext& ctx, const CandidateFacts& facts,
                           std::string& detail);
Rule rule_tensor_last_use(const RuleContext& ctx, const CandidateFacts& facts,
                          std::string& detail);
// Not in the reference pass: every alias of the storage (storage-group members
// and schema views, see analysis::forward_aliases) must be read only where the
// rewrite follows it: in forward up to the last forward use, in backward only
// by readers the rewrite redirects, and replayed views may read only the
// producer or other replayed views.
Rule rule_readers_tracked(const RuleContext& ctx, const CandidateFacts& facts,
                          std::string& detail);
// Not in the reference pass: the reload must follow the forward wait (the
// last forward use, or its getitem with offload_tuple_outputs).
Rule rule_backward_after_forward(const RuleContext& ctx, const CandidateFacts& facts,
                                 std::string& detail);

using ChainRule = Rule (*)(const RuleContext&, const CandidateFacts&, std::string&);
const std::vector<ChainRule>& chain_rules();

}  // namespace spillway::plan
