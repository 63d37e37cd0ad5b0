#include "analysis/op_facts.h"

#include <limits>
#include <string_view>

#include "spillway/plan.h"

namespace spillway::analysis {
namespace {

bool is_collective_namespace(std::string_view ns) {
  return ns == "_c10d_functional" || ns == "_c10d_functional_autograd";
}

}  // namespace

bool is_view_op(const GraphIndex& index, const Node& node) {
  const OpSchema* schema = index.schema_of(node);
  return schema != nullptr && schema->is_view;
}

bool is_mutating_op(const GraphIndex& index, const Node& node) {
  const OpSchema* schema = index.schema_of(node);
  return schema != nullptr && schema->is_mutable;
}

bool is_collective_op(const GraphIndex& index, const Node& node) {
  if (node.kind != NodeKind::kCallFunction) return false;
  if (const OpSchema* schema = index.schema_of(node)) return is_collective_namespace(schema->ns);
  std::string_view target = node.target;
  return is_collective_namespace(target.substr(0, target.find('.')));
}

bool is_offload_op(const Node& node) {
  if (node.kind != NodeKind::kCallFunction) return false;
  std::string_view target = node.target;
  return target == kOffloadTarget || target == kReloadTarget || target == kWaitTarget ||
         target.starts_with("ao.");
}

bool is_reload_op(const Node& node) {
  return node.kind == NodeKind::kCallFunction &&
         (node.target == kReloadTarget || node.target == "ao.reload.default");
}

std::optional<std::int64_t> storage_of(const Node& node) {
  if (!node.value.is_tensor()) return std::nullopt;
  return node.value.tensor.storage;
}

bool shares_storage(const Node& a, const Node& b) {
  std::optional<std::int64_t> left = storage_of(a);
  return left.has_value() && left == storage_of(b);
}

bool selects_aliased_element(const Node& getitem, const Node& sequence) {
  if (getitem.kind != NodeKind::kCallFunction || getitem.target != "operator.getitem" ||
      getitem.args.size() != 2 || getitem.args[0].kind != Arg::Kind::kNode ||
      getitem.args[0].node != sequence.id || getitem.args[1].kind != Arg::Kind::kInt ||
      !sequence.value.is_sequence()) {
    return false;
  }
  const auto size = static_cast<std::int64_t>(sequence.value.elements.size());
  std::int64_t i = getitem.args[1].i;
  if (i < 0) i += size;  // Python indexing: t[-1] is the last element
  if (i < 0 || i >= size) return false;
  const Value& element = sequence.value.elements[static_cast<std::size_t>(i)];
  const std::optional<std::int64_t> storage = storage_of(getitem);
  return storage.has_value() && element.is_tensor() && element.tensor.storage == storage;
}

bool holds_tensor(const Value& value) {
  if (value.is_tensor()) return true;
  for (const Value& element : value.elements) {
    if (holds_tensor(element)) return true;
  }
  return false;
}

std::optional<std::int64_t> hinted_nbytes(const TensorInfo& info) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (const SymSize& size : info.sizes) {
    if (!size.hint) return std::nullopt;
  }
  for (const SymSize& size : info.sizes) {
    if (*size.hint <= 0) return 0;
  }
  std::int64_t bytes = info.element_size > 0 ? info.element_size : 0;
  for (const SymSize& size : info.sizes) {
    if (bytes > kMax / *size.hint) return kMax;
    bytes *= *size.hint;
  }
  return bytes;
}

}  // namespace spillway::analysis
