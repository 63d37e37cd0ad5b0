#include "plan/pointwise_replay.h"

#include <algorithm>
#include <optional>
#include <set>

#include "analysis/op_facts.h"

namespace spillway::plan {
namespace {

bool replayable_op(const OpSchema* schema, bool pointwise_only) {
  return schema != nullptr && (schema->is_pointwise || !pointwise_only) && !schema->is_random &&
         !schema->is_mutable && !schema->is_view;
}

// `view` and the views of `owner`'s chain it is built on, or nullopt when a
// view on the way reads a tensor from outside the chain (it could not be
// rebuilt from the owner alone).
std::optional<std::vector<NodeId>> view_path(const analysis::GraphIndex& index,
                                             const CandidateFacts& owner, NodeId view) {
  const std::unordered_set<NodeId> chain(owner.chain.lifetime_views.begin(),
                                         owner.chain.lifetime_views.end());
  std::vector<NodeId> path;
  std::unordered_set<NodeId> seen{view};
  std::vector<NodeId> pending{view};
  bool ok = true;
  while (ok && !pending.empty()) {
    const NodeId current = pending.back();
    pending.pop_back();
    path.push_back(current);
    index.node(current).for_each_input([&](NodeId input) {
      if (input == owner.chain.producer || !analysis::holds_tensor(index.node(input).value)) return;
      if (!chain.count(input)) {
        ok = false;
      } else if (seen.insert(input).second) {
        pending.push_back(input);
      }
    });
  }
  if (!ok) return std::nullopt;
  return path;
}

// A forward pointwise node that no rule made a candidate (backward never
// reads it: the exp of a decomposed SiLU) may still be recomputed on the way
// to a candidate's replay, when its storage is its own and nothing writes it.
bool intermediate_ok(const RuleContext& ctx, const Node& node, bool pointwise_only) {
  if (node.phase != Phase::kForward || node.kind != NodeKind::kCallFunction ||
      !node.value.is_tensor() || !replayable_op(ctx.index.schema_of(node), pointwise_only) ||
      analysis::is_collective_op(ctx.index, node)) {
    return false;
  }
  const std::optional<std::int64_t> storage = analysis::storage_of(node);
  if (!storage || ctx.storage.owner(*storage) != node.id) return false;
  const analysis::GroupHazard hazard = ctx.storage.verdict(*storage).hazard;
  return hazard == analysis::GroupHazard::kNone || hazard == analysis::GroupHazard::kOutputReader;
}

// Chooses replays in graph order; see the header.
class ReplaySelector {
 public:
  ReplaySelector(const RuleContext& ctx, const std::unordered_set<NodeId>& offloaded,
                 const std::unordered_map<NodeId, CandidateFacts>& facts,
                 const ReplayPolicy& policy)
      : ctx_(ctx), offloaded_(offloaded), facts_(facts), policy_(policy) {
    if (policy.kept != nullptr) {
      for (NodeId id : *policy.kept) {
        if (auto storage = analysis::storage_of(ctx.index.node(id))) kept_storages_.insert(*storage);
      }
    }
  }

  void own_views(NodeId value) {
    for (NodeId view : facts_.at(value).chain.lifetime_views) owner_of_.emplace(view, value);
  }

  // Replays candidate `id` when it and the intermediates it needs qualify.
  void consider(NodeId id, std::int64_t bytes) {
    const CandidateFacts& own = facts_.at(id);
    Attempt attempt;
    int budget = kMaxIntermediates;
    std::optional<ReplayChoice> choice = gather(id, attempt, budget);
    if (!choice) return;
    const std::set<NodeId>& roots = attempt.roots.at(id);
    const std::size_t first_reader = ctx_.index.position(own.first_backward_reader);
    for (NodeId root : roots) {
      if (first_reader <= forward_wait_position(ctx_.index, facts_.at(root).lifetime)) return;
    }
    choice->bytes = bytes;
    choice->facts = &own;
    choice->needed_before = own.first_backward_reader;
    attempt.choices.push_back(std::move(*choice));
    commit(attempt);
    own_views(id);
  }

  ReplaySelection take() { return std::move(selection_); }

 private:
  // At most this many intermediates are recomputed for one candidate.
  static constexpr int kMaxIntermediates = 16;

  struct Attempt {
    std::vector<ReplayChoice> choices;                    // the intermediates it adds
    std::unordered_map<NodeId, std::set<NodeId>> roots;   // of every node gathered
    std::vector<std::pair<NodeId, std::vector<NodeId>>> views;  // (owner, view path)
  };

  const std::set<NodeId>* roots_of(NodeId id, const Attempt& attempt) const {
    if (auto it = roots_of_.find(id); it != roots_of_.end()) return &it->second;
    if (auto it = attempt.roots.find(id); it != attempt.roots.end()) return &it->second;
    return nullptr;
  }

  // The replay of `id` (inputs and sources set), with its roots in
  // attempt.roots and the intermediates it needs staged; nullopt when `id`
  // cannot be rebuilt from moved values.
  std::optional<ReplayChoice> gather(NodeId id, Attempt& attempt, int& budget) {
    const analysis::GraphIndex& index = ctx_.index;
    const Node& node = index.node(id);
    if (!replayable_op(index.schema_of(node), policy_.pointwise_only) ||
        analysis::is_collective_op(index, node)) {
      return std::nullopt;
    }
    ReplayChoice choice;
    choice.producer = id;
    std::set<NodeId> roots;
    bool ok = true;
    node.for_each_input([&](NodeId input) {
      if (!ok || !analysis::holds_tensor(index.node(input).value)) return;
      NodeId source = input;
      if (const std::set<NodeId>* known = roots_of(input, attempt)) {
        roots.insert(known->begin(), known->end());
      } else if (offloaded_.count(input)) {
        roots.insert(input);
      } else if (auto owner = owner_of_.find(input); owner != owner_of_.end()) {
        std::optional<std::vector<NodeId>> path =
            view_path(index, facts_.at(owner->second), input);
        if (!path) {
          ok = false;
          return;
        }
        source = owner->second;
        attempt.views.emplace_back(source, std::move(*path));
        const std::set<NodeId>* owner_roots = roots_of(source, attempt);
        if (owner_roots) {
          roots.insert(owner_roots->begin(), owner_roots->end());
        } else {
          roots.insert(source);
        }
      } else if (read_as_is(index.node(input))) {
        choice.inputs.push_back(input);  // roots nothing and needs no reload
        choice.kept_inputs.push_back(input);
        return;
      } else if (budget > 0 && !facts_.count(input) &&
                 intermediate_ok(ctx_, index.node(input), policy_.pointwise_only)) {
        --budget;
        std::optional<ReplayChoice> intermediate = gather(input, attempt, budget);
        if (!intermediate) {
          ok = false;
          return;
        }
        attempt.choices.push_back(std::move(*intermediate));
        const std::set<NodeId>& got = attempt.roots.at(input);
        roots.insert(got.begin(), got.end());
      } else {
        ok = false;
        return;
      }
      choice.inputs.push_back(input);
      if (std::find(choice.sources.begin(), choice.sources.end(), source) ==
          choice.sources.end()) {
        choice.sources.push_back(source);
      }
    });
    if (!ok || choice.inputs.empty()) return std::nullopt;
    attempt.roots[id] = std::move(roots);
    return choice;
  }

  void commit(Attempt& attempt) {
    for (auto& [owner, path] : attempt.views) {
      const std::vector<NodeId>& replayed_anyway = facts_.at(owner).chain.replay_views;
      std::vector<NodeId>& extra = selection_.extra_views[owner];
      for (NodeId view : path) {
        if (std::find(replayed_anyway.begin(), replayed_anyway.end(), view) ==
                replayed_anyway.end() &&
            std::find(extra.begin(), extra.end(), view) == extra.end()) {
          extra.push_back(view);
        }
      }
    }
    for (auto& [id, roots] : attempt.roots) roots_of_.emplace(id, std::move(roots));
    for (ReplayChoice& choice : attempt.choices) selection_.replays.push_back(std::move(choice));
  }

  // ReplayPolicy::kept: a placeholder or get_attr, or a value on a kept storage.
  bool read_as_is(const Node& input) const {
    if (policy_.kept == nullptr) return false;
    if (input.kind == NodeKind::kPlaceholder || input.kind == NodeKind::kGetAttr) return true;
    const std::optional<std::int64_t> storage = analysis::storage_of(input);
    return input.phase == Phase::kForward && storage && kept_storages_.count(*storage) != 0;
  }

  const RuleContext& ctx_;
  const std::unordered_set<NodeId>& offloaded_;
  const std::unordered_map<NodeId, CandidateFacts>& facts_;
  const ReplayPolicy& policy_;
  std::unordered_set<std::int64_t> kept_storages_;
  // Replayed node (candidate or intermediate) -> the offloaded values it is
  // rebuilt from.
  std::unordered_map<NodeId, std::set<NodeId>> roots_of_;
  // Forward view -> the moved or replayed value whose alias chain holds it.
  std::unordered_map<NodeId, NodeId> owner_of_;
  ReplaySelection selection_;
};

}  // namespace

ReplaySelection select_replays(const RuleContext& ctx,
                               const std::vector<std::pair<NodeId, std::int64_t>>& candidates,
                               const std::unordered_set<NodeId>& offloaded,
                               const std::unordered_map<NodeId, CandidateFacts>& facts,
                               const ReplayPolicy& policy) {
  const analysis::GraphIndex& index = ctx.index;
  ReplaySelector selector(ctx, offloaded, facts, policy);
  for (const auto& [id, bytes] : candidates) {
    if (offloaded.count(id)) selector.own_views(id);
  }
  for (const auto& [id, bytes] : candidates) {
    if (policy.only == nullptr || policy.only->count(id)) selector.consider(id, bytes);
  }
  ReplaySelection selection = selector.take();
  std::sort(selection.replays.begin(), selection.replays.end(),
            [&](const ReplayChoice& a, const ReplayChoice& b) {
              return index.position(a.producer) < index.position(b.producer);
            });

  // Latest first, so a replay's readers have their places when it is visited.
  std::unordered_map<NodeId, std::size_t> at;
  for (std::size_t i = 0; i < selection.replays.size(); ++i) at[selection.replays[i].producer] = i;
  auto earlier = [&](NodeId a, NodeId b) {
    if (a < 0) return b;
    return index.position(a) < index.position(b) ? a : b;
  };
  for (std::size_t i = selection.replays.size(); i-- > 0;) {
    const ReplayChoice& replay = selection.replays[i];  // writes go to earlier replays
    for (NodeId source : replay.sources) {
      if (auto it = at.find(source); it != at.end()) {
        NodeId& before = selection.replays[it->second].needed_before;
        before = earlier(before, replay.needed_before);
      } else {
        const NodeId own = facts.at(source).first_backward_reader;
        NodeId& before = selection.reload_before.emplace(source, own).first->second;
        before = earlier(before, replay.needed_before);
      }
    }
  }
  for (auto it = selection.reload_before.begin(); it != selection.reload_before.end();) {
    it = it->second == facts.at(it->first).first_backward_reader ? selection.reload_before.erase(it)
                                                                  : std::next(it);
  }
  return selection;
}

}  // namespace spillway::plan
