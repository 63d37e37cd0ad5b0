#pragma once
// Budget selection: largest first within the host budget.
//
// Candidates are sorted by hinted bytes, largest first; ties keep graph order
// (a stable sort over candidates listed in graph order). Each one is taken
// when it still fits, otherwise skipped, and the scan goes on, so a smaller
// later candidate may still fit. A budget of 0 takes every candidate.
//
// Thread-safety: pure function.

#include <cstdint>
#include <vector>

#include "spillway/graph.h"

namespace spillway::plan {

struct SizedCandidate {
  NodeId node = -1;
  std::int64_t bytes = 0;
};

struct Selection {
  std::vector<SizedCandidate> chosen;       // largest first
  std::vector<SizedCandidate> over_budget;  // in the order they were skipped
  std::int64_t total_bytes = 0;             // saturates at INT64_MAX
};

// `candidates` in graph order; `budget_bytes` >= 0.
Selection select_within_budget(std::vector<SizedCandidate> candidates, std::int64_t budget_bytes);

}  // namespace spillway::plan
