#include "analysis/alias_chain.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "analysis/op_facts.h"

namespace spillway::analysis {

std::vector<NodeId> AliasChain::all_backward_readers() const {
  std::vector<NodeId> readers = direct_backward_readers;
  for (const auto& [view, reader] : view_backward_redirects) readers.push_back(reader);
  return readers;
}

bool is_alias(const GraphIndex& index, const Node& user, const Node& current) {
  return is_view_op(index, user) || shares_storage(user, current) ||
         selects_aliased_element(user, current);
}

AliasChain trace_alias_chain(const GraphIndex& index, NodeId producer) {
  AliasChain chain;
  chain.producer = producer;
  for (NodeId user : index.users(producer)) {
    if (index.node(user).phase == Phase::kBackward) chain.direct_backward_readers.push_back(user);
  }

  std::unordered_map<NodeId, std::vector<NodeId>> children;
  std::unordered_map<NodeId, std::vector<NodeId>> backward_readers;
  std::unordered_set<NodeId> visited;
  struct Frame {
    NodeId node;
    std::size_t next_user;
  };
  std::vector<Frame> stack{{producer, 0}};
  while (!stack.empty()) {
    const NodeId current = stack.back().node;
    const std::span<const NodeId> users = index.users(current);
    if (stack.back().next_user == users.size()) {
      stack.pop_back();
      continue;
    }
    const NodeId user = users[stack.back().next_user++];
    const Node& reader = index.node(user);
    if (reader.kind != NodeKind::kCallFunction) continue;
    if (reader.phase == Phase::kBackward) {
      backward_readers[current].push_back(user);
    } else if (is_alias(index, reader, index.node(current)) && visited.insert(user).second) {
      children[current].push_back(user);
      chain.lifetime_views.push_back(user);
      stack.push_back({user, 0});  // depth first: the view's subtree comes next
    }
  }

  // Pre-order reversed visits every child before its parent.
  std::unordered_set<NodeId> needed;
  for (auto it = chain.lifetime_views.rbegin(); it != chain.lifetime_views.rend(); ++it) {
    bool read = backward_readers.count(*it) != 0;
    for (NodeId child : children[*it]) read = read || needed.count(child) != 0;
    if (read) needed.insert(*it);
  }
  for (NodeId view : chain.lifetime_views) {
    if (!needed.count(view)) continue;
    chain.replay_views.push_back(view);
    for (NodeId reader : backward_readers[view]) chain.view_backward_redirects.emplace_back(view, reader);
  }
  return chain;
}

std::vector<NodeId> forward_aliases(const GraphIndex& index, const StorageGroups& groups,
                                    NodeId producer) {
  std::unordered_set<NodeId> seen{producer};
  std::vector<NodeId> work{producer};
  if (std::optional<std::int64_t> storage = storage_of(index.node(producer))) {
    if (const StorageGroup* group = groups.find(*storage)) {
      for (NodeId member : group->members) {
        if (index.node(member).phase == Phase::kForward && seen.insert(member).second) {
          work.push_back(member);
        }
      }
    }
  }
  for (std::size_t i = 0; i < work.size(); ++i) {
    const Node& current = index.node(work[i]);
    for (NodeId user : index.users(current.id)) {
      const Node& reader = index.node(user);
      if (reader.kind != NodeKind::kCallFunction || reader.phase != Phase::kForward) continue;
      if (is_alias(index, reader, current) && seen.insert(user).second) work.push_back(user);
    }
  }
  seen.erase(producer);
  std::vector<NodeId> aliases(seen.begin(), seen.end());
  std::sort(aliases.begin(), aliases.end(), [&](NodeId a, NodeId b) {
    return index.position(a) < index.position(b);
  });
  return aliases;
}

}  // namespace spillway::analysis
