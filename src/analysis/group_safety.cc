#include "analysis/group_safety.h"

#include "analysis/op_facts.h"
#include "analysis/write_safety.h"

namespace spillway::analysis {

GroupVerdict check_group(const GraphIndex& index, const StorageGroup& group) {
  for (NodeId id : group.members) {
    if (index.node(id).kind != NodeKind::kCallFunction) {
      return {GroupHazard::kSharedExternally, id};
    }
  }
  for (NodeId id : group.members) {
    if (is_mutating_op(index, index.node(id))) return {GroupHazard::kMutatingSharer, id};
  }
  for (NodeId id : group.members) {
    for (NodeId user : index.users(id)) {
      if (index.node(user).kind == NodeKind::kOutput) return {GroupHazard::kOutputReader, id};
    }
  }
  return {};
}

StorageSafety::StorageSafety(const GraphIndex& index, const StorageGroups& groups)
    : groups_(&groups), first_writer_(find_written_storages(index)) {
  for (const StorageGroup& group : groups.groups()) {
    if (first_writer_.count(group.storage)) continue;
    GroupVerdict verdict = check_group(index, group);
    if (verdict.hazard != GroupHazard::kNone) group_verdicts_.emplace(group.storage, verdict);
  }
}

GroupVerdict StorageSafety::verdict(std::int64_t storage) const {
  if (auto it = first_writer_.find(storage); it != first_writer_.end()) {
    return {GroupHazard::kWrittenInPlace, it->second};
  }
  if (auto it = group_verdicts_.find(storage); it != group_verdicts_.end()) return it->second;
  return {};
}

NodeId StorageSafety::owner(std::int64_t storage) const {
  if (verdict(storage).hazard != GroupHazard::kNone) return -1;
  const StorageGroup* group = groups_->find(storage);
  return group == nullptr ? -1 : group->owner();
}

}  // namespace spillway::analysis
