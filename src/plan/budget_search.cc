#include "plan/budget_search.h"

#include <algorithm>
#include <limits>

#include "spillway/error.h"

namespace spillway::plan {
namespace {


bool covers(std::pair<std::size_t, std::size_t> interval, std::size_t position) {
  return interval.first <= position && position <= interval.second;
}

}  // namespace

bool greedy(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d) {
  ModelScore score = model.evaluate(d);
  const std::size_t k = model.size();
  while (score.peak > budget) {
    double best_ratio = std::numeric_limits<double>::infinity();
    std::size_t best = k;
    Decision best_action = Decision::kKeep;
    for (std::size_t i = 0; i < k; ++i) {
      if (d[i] != Decision::kKeep) continue;
      const ModelCandidate& c = model.candidates()[i];
      for (Decision action : {Decision::kRecompute, Decision::kOffload}) {
        if (action == Decision::kRecompute && !c.can_recompute) continue;
        if (action == Decision::kOffload && !c.can_offload) continue;
        d[i] = action;
        if (!covers(model.freed_interval(d, i), score.peak_position)) {
          d[i] = Decision::kKeep;
          continue;
        }
        // A recompute costs its time; an offload costs what the model says.
        double added;
        if (action == Decision::kRecompute) {
          added = c.recompute_ms;
        } else {
          added = model.evaluate(d).step_ms - score.step_ms;
        }
        d[i] = Decision::kKeep;
        const double ratio = std::max(added, 1e-6) / static_cast<double>(c.bytes);
        if (ratio < best_ratio) {
          best_ratio = ratio;
          best = i;
          best_action = action;
        }
      }
    }
    if (best == k) return false;
    d[best] = best_action;
    score = model.evaluate(d);
  }
  return true;
}

void improve(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d) {
  ModelScore score = model.evaluate(d);
  for (int pass = 0; pass < 3; ++pass) {
    bool changed = false;
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (d[i] == Decision::kKeep) continue;
      const ModelCandidate& c = model.candidates()[i];
      const Decision was = d[i];
      for (Decision other : {Decision::kKeep, Decision::kOffload, Decision::kRecompute}) {
        if (other == was || (other == Decision::kOffload && !c.can_offload) ||
            (other == Decision::kRecompute && !c.can_recompute)) {
          continue;
        }
        d[i] = other;
        const ModelScore tried = model.evaluate(d);
        if (tried.peak <= budget && tried.step_ms < score.step_ms - 1e-9) {
          score = tried;
          changed = true;
          break;
        }
        d[i] = was;
      }
    }
    if (!changed) break;
  }
}

std::vector<Decision> everything(const BudgetModel& model) {
  std::vector<Decision> d(model.size(), Decision::kKeep);
  for (std::size_t i = 0; i < model.size(); ++i) {
    const ModelCandidate& c = model.candidates()[i];
    d[i] = c.can_recompute ? Decision::kRecompute : Decision::kOffload;
  }
  return d;
}


std::optional<std::vector<Decision>> exact(const BudgetModel& model, std::int64_t budget,
                                           std::size_t max_candidates) {
  const std::size_t k = model.size();
  if (k > max_candidates) {
    throw InvalidArgument("plan", "the exact solver takes at most " +
                                      std::to_string(max_candidates) + " candidates; this model has " +
                                      std::to_string(k));
  }
  std::vector<std::vector<Decision>> allowed(k);
  for (std::size_t i = 0; i < k; ++i) {
    const ModelCandidate& c = model.candidates()[i];
    allowed[i].push_back(Decision::kKeep);
    if (c.can_offload) allowed[i].push_back(Decision::kOffload);
    if (c.can_recompute) allowed[i].push_back(Decision::kRecompute);
  }
  std::vector<std::size_t> digit(k, 0);
  std::vector<Decision> d(k, Decision::kKeep);
  std::optional<std::vector<Decision>> best;
  ModelScore best_score;
  while (true) {
    const ModelScore score = model.evaluate(d);
    if (score.peak <= budget &&
        (!best || score.step_ms < best_score.step_ms ||
         (score.step_ms == best_score.step_ms && score.peak < best_score.peak))) {
      best = d;
      best_score = score;
    }
    std::size_t i = 0;
    while (i < k && ++digit[i] == allowed[i].size()) {
      digit[i] = 0;
      d[i] = allowed[i][0];
      ++i;
    }
    if (i == k) break;
    d[i] = allowed[i][digit[i]];
  }
  return best;
}

}  // namespace spillway::plan
