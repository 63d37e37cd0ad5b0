#pragma once
// Scope regions of one half (the backward by default), located by graph position.
//
// A region starts at the first backward call_function (offload ops excluded)
// whose root differs from the root of the region before it; nodes outside any
// root neither start nor end a region (the reference pass updates the
// previous root only when it opens a region, whatever its comment says). A
// module reused by several blocks therefore opens one region per occurrence,
// and region_of() maps a position to the occurrence it belongs to.
//
// A region ends at its last in-root node: the last backward call_function
// (offload ops excluded) of the region's root before the next region opens,
// or before the sequence ends. Nodes outside any root never end a region, so
// an out-of-scope gap after a region's last in-root node is not part of it.
// Such a gap does not reopen a region either: when the same root resumes after
// a gap with no other root in between, the region goes on and ends at the
// resumed part's last node, the gap inside it.
//
// Thread-safety: pure values and functions.

#include <cstddef>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "analysis/scope.h"
#include "spillway/graph.h"

namespace spillway::analysis {

struct Regions {
  // Position (in the sequence given to find_regions) of each region's first
  // node, increasing.
  std::vector<std::size_t> anchors;
  // Position of each region's last in-root node (see above), one per anchor:
  // anchors[i] <= ends[i] < anchors[i + 1].
  std::vector<std::size_t> ends;
  // For each root, the indices into `anchors` of its regions, increasing.
  std::unordered_map<std::string, std::vector<std::size_t>> by_root;
};

// Regions of `nodes`, a graph's nodes in order (not owned; read only here),
// among the call_functions of `phase` (the backward's, or the forward's with
// the same rules).
Regions find_regions(const std::vector<const Node*>& nodes, const ScopeRoots& scope,
                     Phase phase = Phase::kBackward);

// The region (index into regions.anchors) that a node of `root` at `position`
// belongs to: the latest region of `root` starting at or before `position`,
// or the first region of `root` when none does. nullopt when `root` has none.
std::optional<std::size_t> region_of(const Regions& regions, const std::string& root,
                                     std::size_t position);

// The region whose start a reload read in `region` is prefetched to:
// `regions_earlier` regions before it (region 0 when there are fewer), or
// nullopt when it stays where it is: it lies in the last
// `just_in_time_regions` regions (BudgetOptions::just_in_time_regions).
std::optional<std::size_t> prefetch_region(const Regions& regions, std::size_t region,
                                           int regions_earlier, int just_in_time_regions);

}  // namespace spillway::analysis
