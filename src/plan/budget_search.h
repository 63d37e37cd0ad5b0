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

// From `d`, whose model peak fits `budget`, takes decisions back one at a
// time (recompute to offload or keep, offload to keep) while the peak still
// fits: each round the change that saves the most time per byte it puts
// back, until none saves time. The search from the other end: greedy adds
// what frees bytes at the current peak cheapest, and can end where no single
// change of improve() helps (on T1's block graph at full checkpointing's
// memory, checkpointed blocks where recomputing only their cheap parts and
// offloading the rest is faster). Returns false, `d` unchanged, where `d`
// does not fit or the model has more than `max_candidates` candidates (it
// evaluates each at least once a round: on this repository's 2-core CPU host,
// the Llama-3-8B graph's 512 take `spillway plan --sweep` from 0.9 s to 2.2 s,
// T1's compiled graph's 209 from 1.4 s to 1.7 s).
bool relax(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d,
           std::size_t max_candidates = 1024);

// The search: greedy from `state` (everything it can take off where greedy
// strands), then improve; and, from_both_ends, relax from everything, then
// improve.
// Returns the faster of the two whose model peak fits `budget` (the greedy
// one when neither fits or relax does not run); `state` is left where greedy ended, for the next
// budget of a sweep.
std::vector<Decision> search(const BudgetModel& model, std::int64_t budget,
                             std::vector<Decision>& state, bool from_both_ends = true);

// The most each candidate can take off: recompute where allowed (it frees
// longer), else offload where allowed, else keep.
std::vector<Decision> everything(const BudgetModel& model);

// The exact optimum on the model: every combination of allowed decisions
// (3^k at most), the fastest whose peak fits, ties to the smaller peak.
// nullopt when none fits. Throws InvalidArgument beyond `max_candidates`.
std::optional<std::vector<Decision>> exact(const BudgetModel& model, std::int64_t budget,
                                           std::size_t max_candidates = 12);

}  // namespace spillway::plan
