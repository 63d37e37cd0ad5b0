#include "spillway/graph.h"

#include <algorithm>
#include <array>

namespace spillway {
namespace {

constexpr std::array<std::pair<NodeKind, std::string_view>, 6> kNodeKindNames{{
    {NodeKind::kPlaceholder, "placeholder"},
    {NodeKind::kCallFunction, "call_function"},
    {NodeKind::kCallMethod, "call_method"},
    {NodeKind::kCallModule, "call_module"},
    {NodeKind::kGetAttr, "get_attr"},
    {NodeKind::kOutput, "output"},
}};

std::int64_t max_storage_of(const Value& value) {
  std::int64_t best = -1;
  if (value.is_tensor() && value.tensor.storage) best = *value.tensor.storage;
  for (const Value& element : value.elements) best = std::max(best, max_storage_of(element));
  return best;
}

}  // namespace

std::optional<std::int64_t> TensorInfo::nbytes() const {
  std::int64_t count = 1;
  for (const SymSize& size : sizes) {
    if (!size.hint) return std::nullopt;
    count *= *size.hint;
  }
  return count * element_size;
}

std::string_view to_string(NodeKind kind) {
  for (const auto& [k, name] : kNodeKindNames) {
    if (k == kind) return name;
  }
  return "unknown";
}

std::string_view to_string(Phase phase) {
  switch (phase) {
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kOptimizer:
      return "optimizer";
  }
  return "unknown";
}

std::optional<NodeKind> parse_node_kind(std::string_view text) {
  for (const auto& [kind, name] : kNodeKindNames) {
    if (name == text) return kind;
  }
  return std::nullopt;
}

std::optional<Phase> parse_phase(std::string_view text) {
  if (text == "forward") return Phase::kForward;
  if (text == "backward") return Phase::kBackward;
  if (text == "optimizer") return Phase::kOptimizer;
  return std::nullopt;
}

const OpSchema* Graph::schema_of(const Node& node) const {
  if (node.kind != NodeKind::kCallFunction) return nullptr;
  auto it = ops.find(node.target);
  return it == ops.end() ? nullptr : &it->second;
}

std::int64_t Graph::max_storage() const {
  std::int64_t best = -1;
  for (const Node& node : nodes) best = std::max(best, max_storage_of(node.value));
  return best;
}

}  // namespace spillway
