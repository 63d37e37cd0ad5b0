#pragma once
// Searches over the fast model (budget_model.h).
//
// Thread-safety: pure functions.

#include <cstdint>
#include <optional>
#include <vector>

#include "plan/budget_model.h"

namespace spillway::plan {

// Adds decisions to `d` until the model's peak fits `budget`, the least added
// time per byte taken off the current peak first (a recompute costs its time,
// an offload what the model says). Returns false when nothing more helps.
bool greedy(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d);

// Undoes or swaps decisions of `d` while the model's peak still fits `budget`
// and the step gets faster (at most two passes; a change whose returning
// bytes break the budget is skipped without a full evaluation).
void improve(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d);

// The most each candidate can take off: recompute where allowed (it frees
// longer), else offload where allowed, else keep.
std::vector<Decision> everything(const BudgetModel& model);

// The exact optimum on the model: every combination of allowed decisions
// (3^k at most), the fastest whose peak fits, ties to the smaller peak.
// nullopt when none fits. Throws InvalidArgument beyond `max_candidates`.
std::optional<std::vector<Decision>> exact(const BudgetModel& model, std::int64_t budget,
                                           std::size_t max_candidates = 12);

}  // namespace spillway::plan
