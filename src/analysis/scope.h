#pragma once
// Scope roots: the modules that define the offload scope.
//
// A root is any module path on any node's stack whose last component equals
// the scope's leaf name ("model.layers.3.self_attn" for "self_attn"). A node is
// in scope when a module on its stack has that leaf name or lies inside a root.
// Its root is found innermost module first; when nested roots both contain the
// module, the longest (innermost) root wins, so the answer never depends on
// set iteration order.
//
// Thread-safety: immutable after construction.

#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "spillway/graph.h"

namespace spillway::analysis {

class ScopeRoots {
 public:
  // Discovers the roots of `leaf` on every node of `graph`.
  ScopeRoots(const Graph& graph, std::string leaf);

  bool empty() const { return roots_.empty(); }
  // The roots, sorted.
  std::vector<std::string> roots() const;
  bool in_scope(const Node& node) const;
  // The root containing `node`'s innermost module that lies in one; nullptr
  // when none does. The pointer stays valid for the lifetime of this object.
  const std::string* root_of(const Node& node) const;

 private:
  const std::string* root_of_path(const std::string& path) const;
  bool has_leaf(std::string_view path) const;

  std::string leaf_;
  std::unordered_set<std::string> roots_;
  std::unordered_map<std::string, const std::string*> root_by_path_;  // paths seen in the graph
};

}  // namespace spillway::analysis
