// apply_edits: replay a plan's edits on a graph (plan.h).
//
// Insertions are applied in order with NodeSequence's placement rules, then
// redirects in order. Everything is validated before anything is built, so a
// bad edit list leaves nothing half-done (the input is never modified anyway).
//
// Note [Aliases follow a redirect]: a redirected reader may be a view of the
// value it read (a backward transpose of a forward activation that the plan
// moves); once it reads the reload (or a view replayed on it), the runtime's
// view lives in the reload's storage. So a reader whose value shares the
// storage of `from` takes the storage of `to`, and so, in graph order, does
// every alias of such a reader; otherwise the simulator would keep the
// offloaded storage alive until the view's last reader.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "plan/dense_layout.h"
#include "plan/id_map.h"
#include "plan/node_sequence.h"
#include "plan/offload_rewrite.h"
#include "spillway/error.h"
#include "spillway/plan.h"

namespace spillway {
namespace {

std::string edit_label(std::size_t i, const Edit& edit) {
  return "edit " + std::to_string(i) + " (" + std::string(to_string(edit.kind)) + ")";
}

void redirect_arg(Arg& arg, NodeId from, NodeId to) {
  if (arg.kind == Arg::Kind::kNode && arg.node == from) arg.node = to;
  for (Arg& item : arg.list) redirect_arg(item, from, to);
}

bool is_spillway_target(std::string_view target) {
  return target == kOffloadTarget || target == kReloadTarget || target == kWaitTarget;
}

// A storage id that a node's value moves from, and the one it moves to.
using StorageMove = std::pair<std::int64_t, std::int64_t>;

// Applies `moves` to the tensors of `value`; returns the moves that applied.
std::vector<StorageMove> move_storages(Value& value, const std::vector<StorageMove>& moves) {
  std::vector<StorageMove> applied;
  if (value.is_tensor()) {
    for (const StorageMove& move : moves) {
      if (value.tensor.storage == move.first) {
        value.tensor.storage = move.second;
        applied.push_back(move);
        break;
      }
    }
    return applied;
  }
  for (Value& element : value.elements) {
    for (const StorageMove& move : move_storages(element, moves)) applied.push_back(move);
  }
  return applied;
}

// Note [Aliases follow a redirect]. `redirected` maps each reader to the
// moves its redirects imply (the storage of `from` to that of `to`).
void move_aliases(Graph& graph,
                  const std::unordered_map<NodeId, std::vector<StorageMove>>& redirected) {
  std::unordered_map<NodeId, std::vector<StorageMove>> moved;  // node -> moves applied to it
  for (Node& node : graph.nodes) {
    std::vector<StorageMove> moves;
    if (auto it = redirected.find(node.id); it != redirected.end()) moves = it->second;
    node.for_each_input([&](NodeId input) {
      if (auto it = moved.find(input); it != moved.end()) {
        moves.insert(moves.end(), it->second.begin(), it->second.end());
      }
    });
    if (moves.empty()) continue;
    std::vector<StorageMove> applied = move_storages(node.value, moves);
    if (!applied.empty()) moved.emplace(node.id, std::move(applied));
  }
}

}  // namespace

Graph apply_edits(const Graph& graph, const std::vector<Edit>& edits) {
  std::vector<NodeId> original;
  original.reserve(graph.nodes.size());
  plan::IdMap<char> known(graph.nodes.size() + edits.size(), 0);
  for (const Node& node : graph.nodes) {
    original.push_back(node.id);
    known.set(node.id, 1);
  }
  plan::NodeSequence order(original);
  std::vector<const Node*> inserted_nodes;
  for (std::size_t i = 0; i < edits.size(); ++i) {
    const Edit& edit = edits[i];
    if (edit.kind == EditKind::kRedirect) continue;
    if (!known.get(edit.anchor)) {
      throw InvalidArgument("plan", edit_label(i, edit) + " anchors on node " +
                                        std::to_string(edit.anchor) + ", which graph '" +
                                        graph.name + "' lacks");
    }
    if (edit.node.id < 0 || known.get(edit.node.id)) {
      throw InvalidArgument("plan", edit_label(i, edit) + " inserts node " +
                                        std::to_string(edit.node.id) + " (" + edit.node.name +
                                        "), but that id is negative or already taken");
    }
    known.set(edit.node.id, 1);
    if (edit.placement == Placement::kAfter) {
      order.insert_after_run(edit.anchor, edit.node.id);
    } else {
      order.insert_before(edit.anchor, edit.node.id);
    }
    inserted_nodes.push_back(&edit.node);
  }
  for (std::size_t i = 0; i < edits.size(); ++i) {
    const Edit& edit = edits[i];
    if (edit.kind != EditKind::kRedirect) continue;
    for (NodeId id : {edit.reader, edit.from, edit.to}) {
      if (!known.get(id)) {
        throw InvalidArgument("plan", edit_label(i, edit) + " names node " + std::to_string(id) +
                                          ", which graph '" + graph.name + "' lacks");
      }
    }
  }

  Graph out;
  out.name = graph.name;
  out.metadata = graph.metadata;
  out.ops = graph.ops;
  // Slots below graph.nodes.size() are the original nodes in order; inserted
  // nodes follow in insertion order.
  const auto original_count = static_cast<std::int64_t>(graph.nodes.size());
  plan::IdMap<std::int64_t> position(graph.nodes.size() + inserted_nodes.size(), -1);
  out.nodes.reserve(graph.nodes.size() + inserted_nodes.size());
  for (std::int64_t slot : order.slot_order()) {
    const bool is_new = slot >= original_count;
    const Node& node = is_new ? *inserted_nodes[static_cast<std::size_t>(slot - original_count)]
                              : graph.nodes[static_cast<std::size_t>(slot)];
    position.set(node.id, static_cast<std::int64_t>(out.nodes.size()));
    out.nodes.push_back(node);
    if (is_new && is_spillway_target(node.target)) {
      if (node.target == kOffloadTarget) out.ops[node.target] = plan::offload_schema();
      if (node.target == kReloadTarget) out.ops[node.target] = plan::reload_schema();
      if (node.target == kWaitTarget) out.ops[node.target] = plan::wait_schema();
    }
    if (is_new && node.target == plan::kPermuteTarget && !out.ops.count(node.target)) {
      out.ops.emplace(node.target, plan::permute_schema());
    }
  }
  std::unordered_map<NodeId, std::vector<StorageMove>> redirected;
  for (const Edit& edit : edits) {
    if (edit.kind != EditKind::kRedirect) continue;
    Node& reader = out.nodes[static_cast<std::size_t>(position.get(edit.reader))];
    for (Arg& arg : reader.args) redirect_arg(arg, edit.from, edit.to);
    for (auto& kv : reader.kwargs) redirect_arg(kv.second, edit.from, edit.to);
    const Value& from = out.nodes[static_cast<std::size_t>(position.get(edit.from))].value;
    const Value& to = out.nodes[static_cast<std::size_t>(position.get(edit.to))].value;
    if (from.is_tensor() && to.is_tensor() && from.tensor.storage && to.tensor.storage &&
        *from.tensor.storage != *to.tensor.storage) {
      redirected[edit.reader].emplace_back(*from.tensor.storage, *to.tensor.storage);
    }
  }
  if (!redirected.empty()) move_aliases(out, redirected);
  return out;
}

}  // namespace spillway
