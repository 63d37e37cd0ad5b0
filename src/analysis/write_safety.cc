#include "analysis/write_safety.h"

#include <optional>

#include "analysis/op_facts.h"

namespace spillway::analysis {
namespace {

void collect_nodes(const Arg& arg, std::vector<NodeId>& out) {
  if (arg.kind == Arg::Kind::kNode) out.push_back(arg.node);
  for (const Arg& item : arg.list) collect_nodes(item, out);
}

// Known storages of the tensor-valued nodes among `nodes`.
void append_storages(const GraphIndex& index, const std::vector<NodeId>& nodes,
                     std::vector<std::int64_t>& out) {
  for (NodeId id : nodes) {
    if (!index.contains(id)) continue;
    if (std::optional<std::int64_t> storage = storage_of(index.node(id))) out.push_back(*storage);
  }
}

WrittenStorages every_tensor_argument(const GraphIndex& index, const Node& node) {
  std::vector<NodeId> inputs;
  node.for_each_input([&](NodeId id) { inputs.push_back(id); });
  WrittenStorages result;
  result.conservative = true;
  append_storages(index, inputs, result.storages);
  return result;
}

const Arg* find_kwarg(const Node& node, const std::string& name) {
  for (const auto& [key, value] : node.kwargs) {
    if (key == name) return &value;
  }
  return nullptr;
}

}  // namespace

WrittenStorages written_storages(const GraphIndex& index, const Node& node) {
  if (node.kind != NodeKind::kCallFunction && node.kind != NodeKind::kCallMethod &&
      node.kind != NodeKind::kCallModule) {
    return {};
  }
  const OpSchema* schema = index.schema_of(node);
  if (schema == nullptr) return every_tensor_argument(index, node);
  if (!schema->is_mutable) return {};

  WrittenStorages result;
  bool resolved = false;
  bool unresolved = false;
  std::size_t position = 0;
  for (const OpArgument& argument : schema->arguments) {
    std::optional<std::size_t> slot;
    if (!argument.kwarg_only) slot = position++;
    if (!argument.is_write) continue;
    const Arg* value = find_kwarg(node, argument.name);
    if (value == nullptr && slot && *slot < node.args.size()) value = &node.args[*slot];
    if (value == nullptr) {
      unresolved = true;
      continue;
    }
    std::vector<NodeId> written;
    collect_nodes(*value, written);
    if (written.empty()) continue;  // None passed for an optional output
    resolved = true;
    std::size_t before = result.storages.size();
    append_storages(index, written, result.storages);
    if (result.storages.size() == before) unresolved = true;
  }
  if (unresolved || !resolved) return every_tensor_argument(index, node);
  return result;
}

std::unordered_map<std::int64_t, NodeId> find_written_storages(const GraphIndex& index) {
  std::unordered_map<std::int64_t, NodeId> first_writer;
  for (const Node& node : index.graph().nodes) {
    for (std::int64_t storage : written_storages(index, node).storages) {
      first_writer.emplace(storage, node.id);
    }
  }
  return first_writer;
}

}  // namespace spillway::analysis
