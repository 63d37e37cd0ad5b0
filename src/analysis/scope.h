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
#include <vector>

#include "spillway/graph.h"

namespace spillway::analysis {

class ScopeRoots {
 public:
  // Discovers the roots of `leaf` on every node of `graph`.
  ScopeRoots(const Graph& graph, std::string leaf);
  // Takes `roots` (module paths, e.g. layer_roots(graph)) as the roots
  // themselves: a node is in scope when a module on its stack is one of them
  // or lies inside one.
  static ScopeRoots of_roots(const Graph& graph, const std::vector<std::string>& roots);

  bool empty() const { return roots_.empty(); }
  // The roots, sorted.
  std::vector<std::string> roots() const;
  // Both answers are precomputed for the nodes of the graph given to the
  // constructor (which must outlive this object); other nodes are computed on
  // the spot.
  bool in_scope(const Node& node) const;
  // The root containing `node`'s innermost module that lies in one; nullptr
  // when none does. The pointer stays valid for the lifetime of this object.
  const std::string* root_of(const Node& node) const;

 private:
  bool compute_in_scope(const Node& node) const;
  const std::string* compute_root_of(const Node& node) const;
  // The position of `node` in the constructor's graph, or -1.
  std::ptrdiff_t position_of(const Node& node) const;

  // Roots have the leaf as last component, so only prefixes that end at a
  // component equal to the leaf need a set lookup; most paths need none.
  const std::string* root_of_path(std::string_view path) const;
  bool has_leaf(std::string_view path) const;

  // Precomputes in_scope_ and root_ for every node of graph_.
  void index_nodes();

  std::string leaf_;
  bool explicit_roots_ = false;  // of_roots: roots_ is the whole set, leaf_ unused
  std::vector<std::string> root_storage_;  // sorted; never resized after construction
  std::unordered_map<std::string_view, const std::string*> roots_;  // into root_storage_
  const Graph* graph_;
  std::vector<char> in_scope_;             // by position in graph_
  std::vector<const std::string*> root_;   // by position in graph_
};

// The distinct last components of the module paths on the stacks of `graph`'s
// nodes, in order of first appearance, without list indices ("0" of
// "model.layers.0"): the one-component names a scope can take in this graph.
// Empty when no node carries a module stack.
std::vector<std::string> module_leaf_names(const Graph& graph);

// The model's repeated blocks: the children of the module list with the most
// children ("model.layers.0", "model.layers.1", ...), module paths whose last
// component is a list index, in order of first appearance. Ties go to the
// list seen first. Empty when no module path ends in an index.
std::vector<std::string> layer_roots(const Graph& graph);

}  // namespace spillway::analysis
