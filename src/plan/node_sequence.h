#pragma once
// NodeSequence: an ordered, mutable list of node ids with the insertion rules
// of plan.h's Placement, plus the FX list operations the reference pass uses.
//
//   insert_after_run(X, n)   plan.h kAfter: after X and the nodes already
//                            inserted after X this way (edits keep their order)
//   insert_before(X, n)      plan.h kBefore and FX X.prepend(n): just before X
//   insert_right_after(X, n) FX X.append(n) / inserting_after(X): just after X,
//                            ahead of anything inserted there earlier
//   move_before(X, n)        FX X.prepend(n) for a node already in the list
//   move_right_after(X, n)   FX X.append(n) for a node already in the list
//
// All operations are O(1) expected. Naming an absent anchor throws
// Error("[plan] internal error ..."): callers validate first. Not thread-safe.

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "plan/id_map.h"

#include "spillway/graph.h"

namespace spillway::plan {

class NodeSequence {
 public:
  explicit NodeSequence(const std::vector<NodeId>& initial);

  bool contains(NodeId id) const { return slot_.get(id) != kNone; }
  // The node after / before `id`, or -1 at the end / start. `id` must be present.
  NodeId next(NodeId id) const;
  NodeId previous(NodeId id) const;
  // The node that insert_after_run(anchor, ...) would place a node after.
  NodeId run_end(NodeId anchor) const;

  // Preconditions for every insertion: `anchor` present, `id` absent.
  void insert_after_run(NodeId anchor, NodeId id);
  void insert_before(NodeId anchor, NodeId id);
  void insert_right_after(NodeId anchor, NodeId id);
  void move_before(NodeId anchor, NodeId id);
  // Preconditions for the moves: both present, `anchor` != `id`.
  void move_right_after(NodeId anchor, NodeId id);

  std::vector<NodeId> order() const;
  // Slots: the i-th node given to the constructor has slot i; inserted nodes
  // take the next slots in insertion order. The slots in list order:
  std::vector<std::int64_t> slot_order() const;
  NodeId last() const { return tail_ < 0 ? -1 : ids_[tail_]; }

 private:
  static constexpr std::int64_t kNone = -1;
  std::int64_t add(NodeId id);
  std::int64_t slot_of(NodeId id) const;  // throws Error for an absent id
  void link_after(std::int64_t at, std::int64_t slot);  // at == kNone: at the head
  void unlink(std::int64_t slot);

  IdMap<std::int64_t> slot_;
  std::vector<NodeId> ids_;
  std::vector<std::int64_t> prev_;
  std::vector<std::int64_t> next_;
  std::unordered_map<NodeId, NodeId> run_end_;
  std::int64_t head_ = kNone;
  std::int64_t tail_ = kNone;
};

}  // namespace spillway::plan
