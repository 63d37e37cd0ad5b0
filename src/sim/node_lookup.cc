#include "sim/node_lookup.h"

#include <algorithm>
#include <string>

#include "sim/tensor_bytes.h"
#include "spillway/error.h"

namespace spillway::sim {
namespace {

std::string label(const Node& node) {
  return "node " + std::to_string(node.id) + " (" + node.name + ")";
}

}  // namespace

NodeLookup::NodeLookup(const Graph& graph, Mode mode) : graph_(&graph), mode_(mode) {
  if (mode_ != Mode::kTable) return;
  const std::size_t n = graph.nodes.size();
  const std::size_t limit = 4 * n + 1024;  // ids below this go to the flat table
  std::size_t flat_size = 0;
  for (const Node& node : graph.nodes) {
    if (node.id >= 0 && static_cast<std::size_t>(node.id) < limit) {
      flat_size = std::max(flat_size, static_cast<std::size_t>(node.id) + 1);
    }
  }
  flat_.assign(flat_size, -1);
  value_bytes_.assign(n, 0);
  for (std::size_t at = 0; at < n; ++at) {
    const Node& node = graph.nodes[at];
    if (node.id < 0) throw InvalidGraph("sim", label(node) + ": field 'id' is negative");
    const auto position = static_cast<std::int32_t>(at);
    bool repeated = false;
    if (static_cast<std::size_t>(node.id) < flat_size) {
      std::int32_t& slot = flat_[static_cast<std::size_t>(node.id)];
      repeated = slot >= 0;
      slot = position;
    } else {
      repeated = !sparse_.emplace(node.id, position).second;
    }
    if (repeated) {
      throw InvalidGraph("sim", label(node) + ": field 'id' repeats the id of an earlier node");
    }
  }
}

std::int64_t NodeLookup::position(NodeId id) const {
  if (mode_ == Mode::kTable) {
    if (id >= 0 && static_cast<std::size_t>(id) < flat_.size()) {
      return flat_[static_cast<std::size_t>(id)];
    }
    auto it = sparse_.find(id);
    return it == sparse_.end() ? -1 : it->second;
  }
  const auto& nodes = graph_->nodes;
  if (id >= 0 && static_cast<std::size_t>(id) < nodes.size() &&
      nodes[static_cast<std::size_t>(id)].id == id) {
    return id;
  }
  for (std::size_t at = 0; at < nodes.size(); ++at) {
    if (nodes[at].id == id) return static_cast<std::int64_t>(at);
  }
  return -1;
}

std::int64_t NodeLookup::value_bytes(NodeId id) const {
  const std::int64_t at = position(id);
  if (at < 0) return 0;
  if (mode_ == Mode::kTable) return value_bytes_[static_cast<std::size_t>(at)];
  return value_nbytes(graph_->nodes[static_cast<std::size_t>(at)].value);
}

}  // namespace spillway::sim
