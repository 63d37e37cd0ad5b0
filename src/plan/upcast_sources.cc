#include "plan/upcast_sources.h"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "analysis/graph_index.h"
#include "analysis/storage_groups.h"
#include "analysis/op_facts.h"

namespace spillway::plan {
namespace {

bool widening(const std::string& in, const std::string& out) {
  const bool half = in == "bfloat16" || in == "float16";
  return (half && (out == "float32" || out == "float64")) || (in == "float32" && out == "float64");
}

bool read_by_backward(const analysis::GraphIndex& index, NodeId id) {
  for (NodeId user : index.users(id)) {
    if (index.node(user).phase == Phase::kBackward) return true;
  }
  return false;
}

bool returned(const analysis::GraphIndex& index, NodeId id) {
  for (NodeId user : index.users(id)) {
    if (index.node(user).kind == NodeKind::kOutput) return true;
  }
  return false;
}

// X of S = cast(X), when S is a forward widening cast backward reads and X a
// forward value of its own storage that backward never reads; -1 otherwise.
NodeId upcast_source(const analysis::GraphIndex& index, const analysis::StorageGroups& groups,
                     const Node& cast) {
  if (cast.phase != Phase::kForward || cast.kind != NodeKind::kCallFunction ||
      (cast.target != "prims.convert_element_type.default" &&
       cast.target != "aten._to_copy.default") ||
      !cast.value.is_tensor() || cast.args.empty() || cast.args[0].kind != Arg::Kind::kNode) {
    return -1;
  }
  const Node& source = index.node(cast.args[0].node);
  if (source.phase != Phase::kForward || source.kind != NodeKind::kCallFunction ||
      !source.value.is_tensor() ||
      !widening(source.value.tensor.dtype, cast.value.tensor.dtype) ||
      !read_by_backward(index, cast.id) || returned(index, cast.id) ||
      returned(index, source.id)) {
    return -1;
  }
  // Backward must read neither X nor any alias of X, nor S through an alias
  // (only S's direct readers are redirected).
  for (const Node* node : {&source, &cast}) {
    const auto storage = analysis::storage_of(*node);
    const analysis::StorageGroup* group = storage ? groups.find(*storage) : nullptr;
    if (group == nullptr || group->owner() != node->id) return -1;
    for (NodeId member : group->members) {
      if ((member != cast.id || node == &source) && read_by_backward(index, member)) return -1;
    }
  }
  return source.id;
}

}  // namespace

std::vector<Edit> upcast_source_edits(const Graph& graph, const std::vector<std::string>& blocks) {
  const analysis::GraphIndex index(graph);
  const analysis::StorageGroups groups(index);
  NodeId next_id = index.max_id() + 1;
  std::int64_t next_storage = graph.max_storage() + 1;
  std::unordered_set<std::string> names;
  for (const Node& node : graph.nodes) names.insert(node.name);

  std::vector<Edit> edits;
  auto in_blocks = [&](const Node& node) {
    return std::any_of(node.module_stack.begin(), node.module_stack.end(), [&](const std::string& m) {
      return std::find(blocks.begin(), blocks.end(), m) != blocks.end();
    });
  };
  for (const Node& cast : graph.nodes) {
    if (!in_blocks(cast) || upcast_source(index, groups, cast) < 0) continue;
    std::vector<NodeId> readers;
    for (NodeId user : index.users(cast.id)) {
      if (index.node(user).phase == Phase::kBackward) readers.push_back(user);
    }
    Edit replay;
    replay.kind = EditKind::kReplayOp;
    replay.node = cast;
    replay.node.id = next_id++;
    std::string name = "spillway_replay_" + cast.name + "_upcast";
    while (names.count(name)) name += "_";
    names.insert(name);
    replay.node.name = name;
    replay.node.phase = Phase::kBackward;
    replay.node.time_ms = 0.0;
    replay.node.value.tensor.storage = next_storage++;
    replay.anchor = readers.front();  // users come in graph order
    replay.placement = Placement::kBefore;
    replay.source = cast.id;
    const NodeId copy = replay.node.id;
    edits.push_back(std::move(replay));
    for (NodeId reader : readers) {
      Edit redirect;
      redirect.kind = EditKind::kRedirect;
      redirect.reader = reader;
      redirect.from = cast.id;
      redirect.to = copy;
      redirect.source = cast.id;
      edits.push_back(std::move(redirect));
    }
  }
  return edits;
}

}  // namespace spillway::plan
