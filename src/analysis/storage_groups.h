#pragma once
// Storage groups: the nodes whose tensor values live in one real storage.
//
// Aliasing is a property of storage, not of operators: a replay op without a
// schema alias annotation (aten._unsafe_view) or a getitem of split still
// shares memory with its base. Grouping by TensorInfo::storage finds them all.
// Members are call_function, placeholder and get_attr nodes with a tensor value
// of known storage (call_method/call_module results are not members, as in the
// reference pass); the owner is the first member in graph order.
//
// Thread-safety: immutable after construction.

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "analysis/graph_index.h"

namespace spillway::analysis {

struct StorageGroup {
  std::int64_t storage = -1;
  std::vector<NodeId> members;  // graph order, never empty
  NodeId owner() const { return members.front(); }
};

class StorageGroups {
 public:
  explicit StorageGroups(const GraphIndex& index);

  // The group of `storage`, or nullptr when no member node has it.
  const StorageGroup* find(std::int64_t storage) const;
  // Every group, ordered by the position of its owner.
  const std::vector<StorageGroup>& groups() const { return groups_; }

 private:
  std::vector<StorageGroup> groups_;
  std::unordered_map<std::int64_t, std::size_t> by_storage_;
};

}  // namespace spillway::analysis
