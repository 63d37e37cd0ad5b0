#include "plan/node_sequence.h"

#include <string>

#include "spillway/error.h"

namespace spillway::plan {

NodeSequence::NodeSequence(const std::vector<NodeId>& initial) : slot_(initial.size(), kNone) {
  ids_.reserve(initial.size());
  for (NodeId id : initial) link_after(tail_, add(id));
}

std::int64_t NodeSequence::slot_of(NodeId id) const {
  const std::int64_t slot = slot_.get(id);
  if (slot == kNone) {
    throw Error("plan", "internal error: node " + std::to_string(id) + " is not in the sequence");
  }
  return slot;
}

std::int64_t NodeSequence::add(NodeId id) {
  const auto slot = static_cast<std::int64_t>(ids_.size());
  ids_.push_back(id);
  prev_.push_back(kNone);
  next_.push_back(kNone);
  slot_.set(id, slot);
  return slot;
}

void NodeSequence::link_after(std::int64_t at, std::int64_t slot) {
  const std::int64_t after = at == kNone ? head_ : next_[at];
  prev_[slot] = at;
  next_[slot] = after;
  if (at == kNone) {
    head_ = slot;
  } else {
    next_[at] = slot;
  }
  if (after == kNone) {
    tail_ = slot;
  } else {
    prev_[after] = slot;
  }
}

void NodeSequence::unlink(std::int64_t slot) {
  const std::int64_t before = prev_[slot];
  const std::int64_t after = next_[slot];
  if (before == kNone) {
    head_ = after;
  } else {
    next_[before] = after;
  }
  if (after == kNone) {
    tail_ = before;
  } else {
    prev_[after] = before;
  }
  prev_[slot] = next_[slot] = kNone;
}

NodeId NodeSequence::next(NodeId id) const {
  const std::int64_t n = next_[slot_of(id)];
  return n == kNone ? -1 : ids_[n];
}

NodeId NodeSequence::previous(NodeId id) const {
  const std::int64_t p = prev_[slot_of(id)];
  return p == kNone ? -1 : ids_[p];
}

NodeId NodeSequence::run_end(NodeId anchor) const {
  auto it = run_end_.find(anchor);
  return it == run_end_.end() ? anchor : it->second;
}

void NodeSequence::insert_after_run(NodeId anchor, NodeId id) {
  const NodeId end = run_end(anchor);
  link_after(slot_of(end), add(id));
  run_end_[anchor] = id;
}

void NodeSequence::insert_before(NodeId anchor, NodeId id) {
  link_after(prev_[slot_of(anchor)], add(id));
}

void NodeSequence::insert_right_after(NodeId anchor, NodeId id) {
  link_after(slot_of(anchor), add(id));
}

void NodeSequence::move_before(NodeId anchor, NodeId id) {
  const std::int64_t slot = slot_of(id);
  unlink(slot);
  link_after(prev_[slot_of(anchor)], slot);
}

void NodeSequence::move_right_after(NodeId anchor, NodeId id) {
  const std::int64_t slot = slot_of(id);
  unlink(slot);
  link_after(slot_of(anchor), slot);
}

std::vector<std::int64_t> NodeSequence::slot_order() const {
  std::vector<std::int64_t> out;
  out.reserve(ids_.size());
  for (std::int64_t s = head_; s != kNone; s = next_[s]) out.push_back(s);
  return out;
}

std::vector<NodeId> NodeSequence::order() const {
  std::vector<NodeId> out;
  out.reserve(ids_.size());
  for (std::int64_t s = head_; s != kNone; s = next_[s]) out.push_back(ids_[s]);
  return out;
}

}  // namespace spillway::plan
