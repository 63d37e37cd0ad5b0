#pragma once
// Group safety: whether a storage group may be moved to host as a whole.
//
// A storage is offloadable only when a single forward call_function owns it
// and nothing else can observe or change it behind the plan's back. The hazards
// are checked in the reference pass's order, and the first one found is kept:
//   1. kWrittenInPlace     some node writes the storage (write_safety.h);
//   2. kSharedExternally   a member is not a call_function (a placeholder or
//                          get_attr shares it: memory the plan does not own);
//   3. kMutatingSharer     a member is produced by a mutating op;
//   4. kOutputReader       the output node reads a member.
// `witness` names the node that showed the hazard (the first writer, the
// external or mutating member, the member the output reads).
//
// Thread-safety: immutable after construction.

#include <cstdint>
#include <unordered_map>

#include "analysis/graph_index.h"
#include "analysis/storage_groups.h"

namespace spillway::analysis {

enum class GroupHazard { kNone, kWrittenInPlace, kSharedExternally, kMutatingSharer, kOutputReader };

struct GroupVerdict {
  GroupHazard hazard = GroupHazard::kNone;
  NodeId witness = -1;
};

// The group hazards of `group` alone (2-4 above; writes are not looked at).
GroupVerdict check_group(const GraphIndex& index, const StorageGroup& group);

class StorageSafety {
 public:
  // `index` and `groups` must outlive this object.
  StorageSafety(const GraphIndex& index, const StorageGroups& groups);

  // The first hazard of `storage`: writes first, then the group checks.
  // A storage with no group and no writer has no hazard.
  GroupVerdict verdict(std::int64_t storage) const;
  // The owner of a hazard-free group, or -1.
  NodeId owner(std::int64_t storage) const;
  const StorageGroups& groups() const { return *groups_; }

 private:
  const StorageGroups* groups_;
  std::unordered_map<std::int64_t, NodeId> first_writer_;
  std::unordered_map<std::int64_t, GroupVerdict> group_verdicts_;  // hazardous groups only
};

}  // namespace spillway::analysis
