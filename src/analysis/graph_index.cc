#include "analysis/graph_index.h"

#include <string>

#include "spillway/error.h"

namespace spillway::analysis {
namespace {

std::string describe_node(const Node& node) {
  return "node " + std::to_string(node.id) + " (" + node.name + ")";
}

}  // namespace

GraphIndex::GraphIndex(const Graph& graph) : graph_(&graph), users_(graph.nodes.size()) {
  position_.reserve(graph.nodes.size() * 2);
  for (std::size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& node = graph.nodes[i];
    node.for_each_input([&](NodeId input) {
      auto it = position_.find(input);
      if (it == position_.end()) {
        throw InvalidGraph("analysis", describe_node(node) + " refers to node " +
                                           std::to_string(input) +
                                           ", which is not earlier in the graph");
      }
      std::vector<NodeId>& readers = users_[it->second];
      // Nodes are visited in order, so a repeated reader is always the last one.
      if (readers.empty() || readers.back() != node.id) readers.push_back(node.id);
    });
    if (!position_.emplace(node.id, i).second) {
      throw InvalidGraph("analysis", describe_node(node) + " reuses an id already taken");
    }
    if (node.id > max_id_) max_id_ = node.id;
  }
}

std::size_t GraphIndex::position(NodeId id) const {
  auto it = position_.find(id);
  if (it == position_.end()) {
    throw InvalidGraph("analysis", "node " + std::to_string(id) + " is not in graph '" +
                                       graph_->name + "'");
  }
  return it->second;
}

}  // namespace spillway::analysis
