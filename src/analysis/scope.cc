#include "analysis/scope.h"

#include <algorithm>

namespace spillway::analysis {

ScopeRoots::ScopeRoots(const Graph& graph, std::string leaf) : leaf_(std::move(leaf)) {
  for (const Node& node : graph.nodes) {
    for (const std::string& path : node.module_stack) {
      if (has_leaf(path)) roots_.insert(path);
    }
  }
  for (const Node& node : graph.nodes) {
    for (const std::string& path : node.module_stack) {
      if (!root_by_path_.count(path)) root_by_path_.emplace(path, root_of_path(path));
    }
  }
}

bool ScopeRoots::has_leaf(std::string_view path) const {
  std::size_t dot = path.rfind('.');
  return path.substr(dot == std::string_view::npos ? 0 : dot + 1) == leaf_;
}

std::vector<std::string> ScopeRoots::roots() const {
  std::vector<std::string> sorted(roots_.begin(), roots_.end());
  std::sort(sorted.begin(), sorted.end());
  return sorted;
}

const std::string* ScopeRoots::root_of_path(const std::string& path) const {
  if (auto cached = root_by_path_.find(path); cached != root_by_path_.end()) return cached->second;
  // A root contains `path` when it equals it or is a prefix ending at a dot.
  if (auto it = roots_.find(path); it != roots_.end()) return &*it;
  for (std::size_t dot = path.rfind('.'); dot != std::string::npos && dot > 0;
       dot = path.rfind('.', dot - 1)) {
    if (auto it = roots_.find(path.substr(0, dot)); it != roots_.end()) return &*it;
  }
  return nullptr;
}

bool ScopeRoots::in_scope(const Node& node) const {
  if (roots_.empty()) return false;
  for (const std::string& path : node.module_stack) {
    if (has_leaf(path) || root_of_path(path) != nullptr) return true;
  }
  return false;
}

const std::string* ScopeRoots::root_of(const Node& node) const {
  for (auto it = node.module_stack.rbegin(); it != node.module_stack.rend(); ++it) {
    if (const std::string* root = root_of_path(*it)) return root;
  }
  return nullptr;
}

}  // namespace spillway::analysis
