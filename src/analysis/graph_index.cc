#include "analysis/graph_index.h"

#include <string>
#include <string_view>

#include "spillway/error.h"

namespace spillway::analysis {
namespace {

std::string describe_node(const Node& node) {
  return "node " + std::to_string(node.id) + " (" + node.name + ")";
}

}  // namespace

GraphIndex::GraphIndex(const Graph& graph) : graph_(&graph) {
  const std::size_t n = graph.nodes.size();
  for (const Node& node : graph.nodes) {
    if (node.id < 0) throw InvalidGraph("analysis", describe_node(node) + " has a negative id");
    if (node.id > max_id_) max_id_ = node.id;
  }
  // A flat table costs 8 bytes per id; use it unless ids are very sparse.
  dense_ = max_id_ < static_cast<NodeId>(4 * n + 1024);
  if (dense_) {
    position_by_id_.assign(static_cast<std::size_t>(max_id_ + 1), -1);
  } else {
    position_map_.reserve(n * 2);
  }

  // One pass over the nodes (they are large and scattered: touch each once)
  // records positions, schemas and the distinct (input, reader) edges. Readers
  // come in graph order, so a repeated reader is always the latest one.
  std::unordered_map<std::string_view, const OpSchema*> schemas;
  schemas.reserve(graph.ops.size() * 2);
  for (const auto& [target, schema] : graph.ops) schemas.emplace(target, &schema);
  schema_.reserve(n);
  std::vector<std::int64_t> last_reader(n, -1);
  std::vector<std::size_t> reader_count(n, 0);
  std::vector<std::pair<std::int64_t, NodeId>> edges;  // (input position, reader id)
  edges.reserve(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    const Node& node = graph.nodes[i];
    node.for_each_input([&](NodeId input) {
      const std::int64_t at = find(input);
      if (at < 0) {
        throw InvalidGraph("analysis", describe_node(node) + " refers to node " +
                                           std::to_string(input) +
                                           ", which is not earlier in the graph");
      }
      if (last_reader[at] == static_cast<std::int64_t>(i)) return;
      last_reader[at] = static_cast<std::int64_t>(i);
      ++reader_count[at];
      edges.emplace_back(at, node.id);
    });
    if (find(node.id) >= 0) {
      throw InvalidGraph("analysis", describe_node(node) + " reuses an id already taken");
    }
    if (dense_) {
      position_by_id_[static_cast<std::size_t>(node.id)] = static_cast<std::int64_t>(i);
    } else {
      position_map_.emplace(node.id, static_cast<std::int64_t>(i));
    }
    // One hash lookup per node instead of a std::map walk of string compares.
    const OpSchema* schema = nullptr;
    if (node.kind == NodeKind::kCallFunction) {
      if (auto it = schemas.find(node.target); it != schemas.end()) schema = it->second;
    }
    schema_.push_back(schema);
  }

  // Readers stored contiguously per input, keeping graph order.
  user_begin_.assign(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) user_begin_[i + 1] = user_begin_[i] + reader_count[i];
  users_.resize(user_begin_[n]);
  std::vector<std::size_t> filled(user_begin_.begin(), user_begin_.end() - 1);
  for (const auto& [at, reader] : edges) users_[filled[static_cast<std::size_t>(at)]++] = reader;
}

std::int64_t GraphIndex::find(NodeId id) const {
  if (dense_) {
    if (id < 0 || id > max_id_) return -1;
    return position_by_id_[static_cast<std::size_t>(id)];
  }
  auto it = position_map_.find(id);
  return it == position_map_.end() ? -1 : it->second;
}

std::size_t GraphIndex::position(NodeId id) const {
  const std::int64_t at = find(id);
  if (at < 0) {
    throw InvalidGraph("analysis", "node " + std::to_string(id) + " is not in graph '" +
                                       graph_->name + "'");
  }
  return static_cast<std::size_t>(at);
}

const OpSchema* GraphIndex::schema_of(const Node& node) const {
  const std::int64_t at = find(node.id);
  if (at >= 0 && &graph_->nodes[static_cast<std::size_t>(at)] == &node) return schema_[at];
  return graph_->schema_of(node);  // a node that is not part of the indexed graph
}

std::span<const NodeId> GraphIndex::users(NodeId id) const {
  const std::size_t at = position(id);
  return {users_.data() + user_begin_[at], user_begin_[at + 1] - user_begin_[at]};
}

}  // namespace spillway::analysis
