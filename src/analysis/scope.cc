#include "analysis/scope.h"

#include <algorithm>
#include <cctype>
#include <unordered_map>
#include <unordered_set>

namespace spillway::analysis {

ScopeRoots::ScopeRoots(const Graph& graph, std::string leaf)
    : leaf_(std::move(leaf)), graph_(&graph) {
  std::vector<std::string_view> found;  // distinct roots
  std::unordered_set<std::string_view> seen;
  const std::vector<std::string>* previous_stack = nullptr;
  for (const Node& node : graph.nodes) {
    // Neighbouring nodes usually share a stack; skip the repeat cheaply.
    if (previous_stack != nullptr && *previous_stack == node.module_stack) continue;
    previous_stack = &node.module_stack;
    for (const std::string& path : node.module_stack) {
      if (!has_leaf(path) || (!found.empty() && found.back() == path)) continue;
      if (seen.insert(path).second) found.push_back(path);
    }
  }
  std::sort(found.begin(), found.end());
  root_storage_.assign(found.begin(), found.end());
  roots_.reserve(root_storage_.size() * 2);
  for (const std::string& root : root_storage_) roots_.emplace(root, &root);
  index_nodes();
}

ScopeRoots ScopeRoots::of_roots(const Graph& graph, const std::vector<std::string>& roots) {
  ScopeRoots scope(graph, std::string());
  scope.explicit_roots_ = true;
  scope.root_storage_ = roots;
  std::sort(scope.root_storage_.begin(), scope.root_storage_.end());
  scope.root_storage_.erase(std::unique(scope.root_storage_.begin(), scope.root_storage_.end()),
                            scope.root_storage_.end());
  scope.roots_.clear();
  for (const std::string& root : scope.root_storage_) scope.roots_.emplace(root, &root);
  scope.index_nodes();
  return scope;
}

void ScopeRoots::index_nodes() {
  const Graph& graph = *graph_;
  in_scope_.assign(graph.nodes.size(), 0);
  root_.assign(graph.nodes.size(), nullptr);
  for (std::size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& node = graph.nodes[i];
    if (i > 0 && graph.nodes[i - 1].module_stack == node.module_stack) {
      in_scope_[i] = in_scope_[i - 1];
      root_[i] = root_[i - 1];
      continue;
    }
    in_scope_[i] = compute_in_scope(node) ? 1 : 0;
    root_[i] = compute_root_of(node);
  }
}

std::ptrdiff_t ScopeRoots::position_of(const Node& node) const {
  const Node* first = graph_->nodes.data();
  const Node* address = &node;
  if (graph_->nodes.empty() || address < first || address >= first + graph_->nodes.size()) {
    return -1;
  }
  return address - first;
}

bool ScopeRoots::has_leaf(std::string_view path) const {
  if (explicit_roots_) return roots_.count(path) != 0;
  if (leaf_.empty()) return false;
  if (path.size() < leaf_.size() || path.substr(path.size() - leaf_.size()) != leaf_) return false;
  return path.size() == leaf_.size() || path[path.size() - leaf_.size() - 1] == '.';
}

std::vector<std::string> ScopeRoots::roots() const { return root_storage_; }

const std::string* ScopeRoots::root_of_path(std::string_view path) const {
  if (roots_.empty()) return nullptr;
  if (explicit_roots_) {
    // The longest root that equals `path` or is a prefix of it ending at a dot.
    const std::string* found = nullptr;
    for (std::size_t end = path.find('.'); ; end = path.find('.', end + 1)) {
      const std::string_view prefix = path.substr(0, end);
      if (auto it = roots_.find(prefix); it != roots_.end()) found = it->second;
      if (end == std::string_view::npos) break;
    }
    return found;
  }
  if (leaf_.empty()) return nullptr;
  // A root containing `path` equals it or is a prefix ending at a dot; either
  // way the root's last component is the leaf. Longest first.
  const std::string* found = nullptr;
  for (std::size_t at = path.find(leaf_); at != std::string_view::npos;
       at = path.find(leaf_, at + 1)) {
    const std::size_t end = at + leaf_.size();
    const bool starts_component = at == 0 || path[at - 1] == '.';
    const bool ends_component = end == path.size() || path[end] == '.';
    if (!starts_component || !ends_component) continue;
    auto it = roots_.find(path.substr(0, end));
    if (it != roots_.end()) found = it->second;
  }
  return found;
}

bool ScopeRoots::in_scope(const Node& node) const {
  const std::ptrdiff_t at = position_of(node);
  return at >= 0 ? in_scope_[static_cast<std::size_t>(at)] != 0 : compute_in_scope(node);
}

const std::string* ScopeRoots::root_of(const Node& node) const {
  const std::ptrdiff_t at = position_of(node);
  return at >= 0 ? root_[static_cast<std::size_t>(at)] : compute_root_of(node);
}

bool ScopeRoots::compute_in_scope(const Node& node) const {
  if (roots_.empty()) return false;
  for (const std::string& path : node.module_stack) {
    if (has_leaf(path) || root_of_path(path) != nullptr) return true;
  }
  return false;
}

const std::string* ScopeRoots::compute_root_of(const Node& node) const {
  for (auto it = node.module_stack.rbegin(); it != node.module_stack.rend(); ++it) {
    if (const std::string* root = root_of_path(*it)) return root;
  }
  return nullptr;
}

std::vector<std::string> module_leaf_names(const Graph& graph) {
  std::vector<std::string> names;
  std::unordered_set<std::string_view> seen_paths;
  std::unordered_set<std::string> seen_names;
  for (const Node& node : graph.nodes) {
    for (const std::string& path : node.module_stack) {
      if (!seen_paths.insert(path).second) continue;
      const std::size_t dot = path.rfind('.');
      std::string leaf = dot == std::string::npos ? path : path.substr(dot + 1);
      const bool list_index =
          !leaf.empty() && std::all_of(leaf.begin(), leaf.end(), [](unsigned char c) {
            return std::isdigit(c) != 0;
          });
      if (leaf.empty() || list_index) continue;
      if (seen_names.insert(leaf).second) names.push_back(std::move(leaf));
    }
  }
  return names;
}

std::vector<std::string> layer_roots(const Graph& graph) {
  // parent path -> its index children, in order of first appearance
  std::vector<std::pair<std::string, std::vector<std::string>>> lists;
  std::unordered_map<std::string, std::size_t> list_of;
  std::unordered_set<std::string_view> seen_paths;
  for (const Node& node : graph.nodes) {
    for (const std::string& path : node.module_stack) {
      if (!seen_paths.insert(path).second) continue;
      const std::size_t dot = path.rfind('.');
      if (dot == std::string::npos || dot + 1 == path.size()) continue;
      const std::string_view leaf = std::string_view(path).substr(dot + 1);
      if (!std::all_of(leaf.begin(), leaf.end(),
                       [](unsigned char c) { return std::isdigit(c) != 0; })) {
        continue;
      }
      std::string parent = path.substr(0, dot);
      auto [it, added] = list_of.emplace(parent, lists.size());
      if (added) lists.emplace_back(std::move(parent), std::vector<std::string>{});
      lists[it->second].second.push_back(path);
    }
  }
  const std::vector<std::string>* best = nullptr;
  for (const auto& [parent, children] : lists) {
    if (best == nullptr || children.size() > best->size()) best = &children;
  }
  return best == nullptr ? std::vector<std::string>{} : *best;
}

}  // namespace spillway::analysis
