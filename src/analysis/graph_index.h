#pragma once
// GraphIndex: positions and users of the nodes of one graph.
//
// Every analysis needs "where is node N" and "who reads N" in O(1); FX keeps
// the second as node.users. The index answers both for a graph it does not own.
// Ids are looked up in a flat table when they are dense enough (they are in
// exported graphs), in a hash map otherwise; users are stored contiguously.
//
// Ownership: the index keeps a pointer to the graph; the graph must outlive it
// and must not change while the index is in use. Thread-safety: immutable after
// construction, share freely.

#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "spillway/graph.h"

namespace spillway::analysis {

class GraphIndex {
 public:
  // Indexes `graph`. Throws InvalidGraph("[analysis] ...") naming the node when
  // two nodes share an id, an id is negative, or a node refers to a node that
  // is not earlier in the graph (invariants (1) and (2) of graph.h).
  explicit GraphIndex(const Graph& graph);

  const Graph& graph() const { return *graph_; }
  std::size_t size() const { return graph_->nodes.size(); }
  bool contains(NodeId id) const { return find(id) >= 0; }
  // Position of `id` in graph order. Throws InvalidGraph for an unknown id.
  std::size_t position(NodeId id) const;
  const Node& node(NodeId id) const { return graph_->nodes[position(id)]; }
  const Node& at(std::size_t position) const { return graph_->nodes[position]; }
  // The distinct nodes that read `id` (any argument, any kind), in graph order.
  std::span<const NodeId> users(NodeId id) const;
  // graph().schema_of(node), looked up once per indexed node.
  const OpSchema* schema_of(const Node& node) const;
  // The largest node id in the graph, or -1 for an empty graph.
  NodeId max_id() const { return max_id_; }

 private:
  // Position of `id`, or -1.
  std::int64_t find(NodeId id) const;

  const Graph* graph_;
  bool dense_ = true;
  std::vector<std::int64_t> position_by_id_;               // when dense_
  std::unordered_map<NodeId, std::int64_t> position_map_;  // otherwise
  std::vector<std::size_t> user_begin_;  // by position; size() + 1 entries
  std::vector<NodeId> users_;
  std::vector<const OpSchema*> schema_;  // by position
  NodeId max_id_ = -1;
};

}  // namespace spillway::analysis
