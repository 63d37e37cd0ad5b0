#pragma once
// IdMap: node id -> value, a flat vector for the dense ids graphs use and a
// hash map for ids far above the graph's size. Not thread-safe.

#include <cstddef>
#include <unordered_map>
#include <vector>

#include "spillway/graph.h"

namespace spillway::plan {

template <typename T>
class IdMap {
 public:
  // `expected` sizes the flat part (ids below 4 * expected + 1024).
  IdMap(std::size_t expected, T missing)
      : limit_(4 * expected + 1024), missing_(missing) {}

  T get(NodeId id) const {
    if (id >= 0 && static_cast<std::size_t>(id) < limit_) {
      return static_cast<std::size_t>(id) < flat_.size() ? flat_[static_cast<std::size_t>(id)]
                                                          : missing_;
    }
    auto it = sparse_.find(id);
    return it == sparse_.end() ? missing_ : it->second;
  }

  void set(NodeId id, T value) {
    if (id >= 0 && static_cast<std::size_t>(id) < limit_) {
      const auto at = static_cast<std::size_t>(id);
      if (at >= flat_.size()) flat_.resize(std::max(at + 1, flat_.size() * 2), missing_);
      flat_[at] = value;
    } else {
      sparse_[id] = value;
    }
  }

 private:
  std::size_t limit_;
  T missing_;
  std::vector<T> flat_;
  std::unordered_map<NodeId, T> sparse_;
};

}  // namespace spillway::plan
