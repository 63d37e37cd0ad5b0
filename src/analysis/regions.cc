#include "analysis/regions.h"

#include <algorithm>

#include "analysis/op_facts.h"

namespace spillway::analysis {

Regions find_regions(const std::vector<const Node*>& nodes, const ScopeRoots& scope,
                     Phase phase) {
  Regions regions;
  const std::string* previous_root = nullptr;
  for (std::size_t position = 0; position < nodes.size(); ++position) {
    const Node& node = *nodes[position];
    if (node.kind != NodeKind::kCallFunction || node.phase != phase ||
        is_offload_op(node)) {
      continue;
    }
    const std::string* root = scope.root_of(node);
    if (root == nullptr) continue;
    if (previous_root != nullptr && *root == *previous_root) {
      regions.ends.back() = position;  // the open region goes on
      continue;
    }
    regions.by_root[*root].push_back(regions.anchors.size());
    regions.anchors.push_back(position);
    regions.ends.push_back(position);
    previous_root = root;
  }
  return regions;
}

std::optional<std::size_t> prefetch_region(const Regions& regions, std::size_t region,
                                           int regions_earlier, int just_in_time_regions) {
  if (region + static_cast<std::size_t>(just_in_time_regions) >= regions.anchors.size()) {
    return std::nullopt;
  }
  const auto earlier = static_cast<std::size_t>(regions_earlier);
  return region >= earlier ? region - earlier : 0;
}

std::optional<std::size_t> region_of(const Regions& regions, const std::string& root,
                                     std::size_t position) {
  auto it = regions.by_root.find(root);
  if (it == regions.by_root.end() || it->second.empty()) return std::nullopt;
  const std::vector<std::size_t>& mine = it->second;
  // The anchors of one root are increasing, so binary search the last one at
  // or before `position`.
  auto after = std::upper_bound(mine.begin(), mine.end(), position, [&](std::size_t pos, std::size_t index) {
    return pos < regions.anchors[index];
  });
  return after == mine.begin() ? mine.front() : *(after - 1);
}

}  // namespace spillway::analysis
