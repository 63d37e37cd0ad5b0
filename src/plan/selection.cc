#include "plan/selection.h"

#include <algorithm>
#include <limits>

namespace spillway::plan {

Selection select_within_budget(std::vector<SizedCandidate> candidates, std::int64_t budget_bytes) {
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const SizedCandidate& a, const SizedCandidate& b) { return a.bytes > b.bytes; });
  Selection selection;
  for (const SizedCandidate& candidate : candidates) {
    // With a budget, total <= budget always holds, so the subtraction is safe.
    if (budget_bytes > 0 && candidate.bytes > budget_bytes - selection.total_bytes) {
      selection.over_budget.push_back(candidate);
      continue;
    }
    selection.chosen.push_back(candidate);
    const std::int64_t room = std::numeric_limits<std::int64_t>::max() - selection.total_bytes;
    selection.total_bytes += std::min(candidate.bytes, room);
  }
  return selection;
}

}  // namespace spillway::plan
