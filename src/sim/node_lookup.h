#pragma once
// NodeLookup: node id -> position in graph.nodes, for the cost model and the
// simulator. Internal to spillway_sim.
//
// Two modes. kTable builds a table once (O(nodes): a flat vector for the
// dense ids graphs use, a hash map for ids far above the graph's size) and
// checks that ids are unique and non-negative. kScan builds nothing: an id
// equal to its position is found at once (exported graphs), any other by a
// linear scan; it serves single CostModel calls that must not pay O(nodes)
// up front.
//
// Ownership: keeps a pointer to the graph, which must outlive the lookup and
// not change. Thread-safety: none; one simulation (or one CostModel call)
// owns its lookup.

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "spillway/graph.h"

namespace spillway::sim {

class NodeLookup {
 public:
  enum class Mode { kTable, kScan };

  // Throws InvalidGraph("[sim] node 4 (mm): ...") in kTable mode when an id
  // is negative or repeats.
  NodeLookup(const Graph& graph, Mode mode);

  // Position of `id` in graph.nodes, or -1 when no node has it.
  std::int64_t position(NodeId id) const;
  // The node with `id`, or nullptr.
  const Node* find(NodeId id) const {
    const std::int64_t at = position(id);
    return at < 0 ? nullptr : &graph_->nodes[static_cast<std::size_t>(at)];
  }
  // value_nbytes (tensor_bytes.h) of the node with `id`, 0 when there is
  // none. kTable mode answers what set_value_bytes recorded for the node (0
  // before), so a caller that walks the graph once records each node's bytes
  // as it goes; kScan mode computes them.
  std::int64_t value_bytes(NodeId id) const;
  // kTable mode only; `position` < graph.nodes.size().
  void set_value_bytes(std::size_t position, std::int64_t bytes) { value_bytes_[position] = bytes; }

 private:
  const Graph* graph_;
  Mode mode_;
  std::vector<std::int32_t> flat_;  // kTable: position by id, -1 for none
  std::unordered_map<NodeId, std::int32_t> sparse_;  // kTable: ids >= flat_.size()
  std::vector<std::int64_t> value_bytes_;             // kTable: by position
};

}  // namespace spillway::sim
