#pragma once
// GraphIndex: positions and users of the nodes of one graph.
//
// Every analysis needs "where is node N" and "who reads N" in O(1); FX keeps
// the second as node.users. The index answers both for a graph it does not own.
//
// Ownership: the index keeps a pointer to the graph; the graph must outlive it
// and must not change while the index is in use. Thread-safety: immutable after
// construction, share freely.

#include <cstddef>
#include <unordered_map>
#include <vector>

#include "spillway/graph.h"

namespace spillway::analysis {

class GraphIndex {
 public:
  // Indexes `graph`. Throws InvalidGraph("[analysis] ...") naming the node when
  // two nodes share an id or a node refers to a node that is not earlier in the
  // graph (invariants (1) and (2) of graph.h).
  explicit GraphIndex(const Graph& graph);

  const Graph& graph() const { return *graph_; }
  std::size_t size() const { return graph_->nodes.size(); }
  bool contains(NodeId id) const { return position_.count(id) != 0; }
  // Position of `id` in graph order. Throws InvalidGraph for an unknown id.
  std::size_t position(NodeId id) const;
  const Node& node(NodeId id) const { return graph_->nodes[position(id)]; }
  const Node& at(std::size_t position) const { return graph_->nodes[position]; }
  // The distinct nodes that read `id` (any argument, any kind), in graph order.
  const std::vector<NodeId>& users(NodeId id) const { return users_[position(id)]; }
  // The largest node id in the graph, or -1 for an empty graph.
  NodeId max_id() const { return max_id_; }

 private:
  const Graph* graph_;
  std::unordered_map<NodeId, std::size_t> position_;
  std::vector<std::vector<NodeId>> users_;  // by position
  NodeId max_id_ = -1;
};

}  // namespace spillway::analysis
