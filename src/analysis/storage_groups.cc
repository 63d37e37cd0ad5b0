#include "analysis/storage_groups.h"

#include "analysis/op_facts.h"

namespace spillway::analysis {

StorageGroups::StorageGroups(const GraphIndex& index) {
  for (const Node& node : index.graph().nodes) {
    if (node.kind != NodeKind::kCallFunction && node.kind != NodeKind::kPlaceholder &&
        node.kind != NodeKind::kGetAttr) {
      continue;
    }
    std::optional<std::int64_t> storage = storage_of(node);
    if (!storage) continue;
    auto [it, inserted] = by_storage_.emplace(*storage, groups_.size());
    if (inserted) groups_.push_back(StorageGroup{*storage, {}});
    groups_[it->second].members.push_back(node.id);
  }
}

const StorageGroup* StorageGroups::find(std::int64_t storage) const {
  auto it = by_storage_.find(storage);
  return it == by_storage_.end() ? nullptr : &groups_[it->second];
}

}  // namespace spillway::analysis
