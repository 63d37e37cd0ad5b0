#include "plan/budget_search.h"

#include <algorithm>
#include <limits>
#include <memory>

#include "spillway/error.h"

namespace spillway::plan {
namespace {


bool covers(std::pair<std::size_t, std::size_t> interval, std::size_t position) {
  return interval.first <= position && position <= interval.second;
}

}  // namespace

bool greedy(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d) {
  // Lazy: an action's added time per byte is cached and re-evaluated only
  // when it comes first; copies queue behind each other, so the added time
  // of an offload only grows as others are added, and a stale ratio is a
  // lower bound worth checking first.
  const std::size_t k = model.size();
  constexpr double kUnknown = -1;
  std::vector<double> ratio(2 * k, kUnknown);  // [2i]: recompute, [2i + 1]: offload
  ModelScore score = model.evaluate(d);
  auto true_ratio = [&](std::size_t i, Decision action) {
    const ModelCandidate& c = model.candidates()[i];
    const Decision was = d[i];
    double added;
    if (was == Decision::kKeep && action == Decision::kRecompute) {
      added = c.recompute_ms;  // a recompute costs its time
    } else {
      d[i] = action;
      added = model.evaluate(d).step_ms - score.step_ms;
      d[i] = was;
    }
    return std::max(added, 1e-6) / static_cast<double>(c.bytes);
  };
  struct Option {
    double ratio;
    std::size_t i;
    Decision action;
  };
  std::vector<Option> options;
  while (score.peak > budget) {
    const std::vector<std::size_t> before = model.needed_before(d);
    options.clear();
    for (std::size_t i = 0; i < k; ++i) {
      const ModelCandidate& c = model.candidates()[i];
      if (d[i] == Decision::kRecompute) continue;
      // Already offloaded: only a recompute frees longer (no prefetch lead).
      for (Decision action : {Decision::kRecompute, Decision::kOffload}) {
        if (action == d[i] || (action == Decision::kRecompute && !c.can_recompute) ||
            (action == Decision::kOffload && !c.can_offload)) {
          continue;
        }
        if (!covers(model.freed_interval(before, i, action), score.peak_position)) continue;
        double& cached = ratio[2 * i + (action == Decision::kOffload ? 1 : 0)];
        if (cached == kUnknown) cached = true_ratio(i, action);
        options.push_back({cached, i, action});
      }
    }
    if (options.empty()) return false;
    std::sort(options.begin(), options.end(),
              [](const Option& a, const Option& b) { return a.ratio < b.ratio; });
    // Refresh the front until it stays in front.
    std::size_t pick = 0;
    for (int refresh = 0; refresh < 8 && options.size() > 1; ++refresh) {
      Option& front = options[0];
      const double fresh = true_ratio(front.i, front.action);
      ratio[2 * front.i + (front.action == Decision::kOffload ? 1 : 0)] = fresh;
      front.ratio = fresh;
      if (fresh <= options[1].ratio) break;
      std::size_t j = 0;
      while (j + 1 < options.size() && options[j + 1].ratio < fresh) {
        std::swap(options[j], options[j + 1]);
        ++j;
      }
    }
    const std::size_t chosen = options[pick].i;
    d[chosen] = options[pick].action;
    ratio[2 * chosen] = ratio[2 * chosen + 1] = kUnknown;  // its options changed
    score = model.evaluate(d);
  }
  return true;
}

// Range maxima over a fixed array in O(1) after O(n log n) preparation.
class RangeMax {
 public:
  explicit RangeMax(const std::vector<std::int64_t>& values) {
    levels_.push_back(values);
    for (std::size_t width = 1; 2 * width <= values.size(); width *= 2) {
      const std::vector<std::int64_t>& last = levels_.back();
      std::vector<std::int64_t> next(last.size() - width);
      for (std::size_t p = 0; p < next.size(); ++p) next[p] = std::max(last[p], last[p + width]);
      levels_.push_back(std::move(next));
    }
  }
  // The largest value in [first, last]; INT64_MIN when empty.
  std::int64_t max(std::size_t first, std::size_t last) const {
    if (first > last || first >= levels_[0].size()) return std::numeric_limits<std::int64_t>::min();
    last = std::min(last, levels_[0].size() - 1);
    std::size_t level = 0;
    while ((std::size_t{2} << level) <= last - first + 1) ++level;
    return std::max(levels_[level][first], levels_[level][last + 1 - (std::size_t{1} << level)]);
  }

 private:
  std::vector<std::vector<std::int64_t>> levels_;
};

void improve(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d) {
  std::vector<std::int64_t> live;
  ModelScore score = model.evaluate(d, &live);
  std::unique_ptr<RangeMax> range = std::make_unique<RangeMax>(live);
  for (int pass = 0; pass < 2; ++pass) {
    bool changed = false;
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (d[i] == Decision::kKeep) continue;
      const ModelCandidate& c = model.candidates()[i];
      const Decision was = d[i];
      const std::vector<std::size_t> before = model.needed_before(d);
      const auto freed = model.freed_interval(before, i, was);
      for (Decision other : {Decision::kKeep, Decision::kOffload, Decision::kRecompute}) {
        if (other == was || (other == Decision::kOffload && !c.can_offload) ||
            (other == Decision::kRecompute && !c.can_recompute)) {
          continue;
        }
        // The bytes come back where the new action frees less than the old
        // one; when that breaks the budget, skip the full evaluation. (A
        // recompute's readers may move other intervals too: the evaluation
        // below decides.)
        const auto now = model.freed_interval(before, i, other);
        const bool left_fits =
            range->max(freed.first, std::min(freed.second, now.first == 0 ? 0 : now.first - 1)) <=
                budget - c.bytes ||
            now.first <= freed.first;
        const bool right_fits = range->max(std::max(freed.first, now.second + 1), freed.second) <=
                                    budget - c.bytes ||
                                now.second >= freed.second;
        if (other == Decision::kKeep ? range->max(freed.first, freed.second) > budget - c.bytes
                                     : !(left_fits && right_fits)) {
          continue;
        }
        d[i] = other;
        const ModelScore tried = model.evaluate(d);
        if (tried.peak <= budget && tried.step_ms < score.step_ms - 1e-9) {
          score = model.evaluate(d, &live);
          range = std::make_unique<RangeMax>(live);
          changed = true;
          break;
        }
        d[i] = was;
      }
    }
    if (!changed) break;
  }
}

bool relax(const BudgetModel& model, std::int64_t budget, std::vector<Decision>& d,
           std::size_t max_candidates) {
  if (model.size() > max_candidates) return false;
  ModelScore score = model.evaluate(d);
  if (score.peak > budget) return false;
  // Lazy, as greedy: each change's time saved per byte put back is cached and
  // evaluated again only when it comes first; when no cached change is worth
  // taking, every one is evaluated once more before giving up.
  const std::size_t k = model.size();
  constexpr double kUnknown = -2;
  constexpr double kNone = -1;  // puts the peak over budget or saves no time
  std::vector<double> ratio(2 * k, kUnknown);  // [2i]: back to keep, [2i + 1]: to offload
  auto allowed = [&](std::size_t i, Decision lighter) {
    const Decision was = d[i];
    if (lighter == Decision::kKeep) return was != Decision::kKeep;
    return was == Decision::kRecompute && model.candidates()[i].can_offload;
  };
  auto true_ratio = [&](std::size_t i, Decision lighter) {
    const Decision was = d[i];
    d[i] = lighter;
    const ModelScore tried = model.evaluate(d);
    d[i] = was;
    const double saved = score.step_ms - tried.step_ms;
    if (tried.peak > budget || saved <= 1e-9) return kNone;
    return saved / static_cast<double>(std::max<std::int64_t>(1, tried.peak - score.peak + 1));
  };
  struct Option {
    double ratio;
    std::size_t i;
    Decision lighter;
  };
  std::vector<Option> options;
  bool fresh = false;  // every cached ratio evaluated since the last change
  while (true) {
    options.clear();
    for (std::size_t i = 0; i < k; ++i) {
      for (Decision lighter : {Decision::kKeep, Decision::kOffload}) {
        if (!allowed(i, lighter)) continue;
        double& cached = ratio[2 * i + (lighter == Decision::kOffload ? 1 : 0)];
        if (cached == kUnknown) cached = true_ratio(i, lighter);
        if (cached > 0) options.push_back({cached, i, lighter});
      }
    }
    std::sort(options.begin(), options.end(),
              [](const Option& a, const Option& b) { return a.ratio > b.ratio; });
    // Refresh the front until it stays in front.
    while (!options.empty()) {
      Option& front = options[0];
      front.ratio = true_ratio(front.i, front.lighter);
      ratio[2 * front.i + (front.lighter == Decision::kOffload ? 1 : 0)] = front.ratio;
      if (front.ratio > 0 && (options.size() == 1 || front.ratio >= options[1].ratio)) break;
      const Option moved = front;
      options.erase(options.begin());
      if (moved.ratio > 0) {
        options.insert(std::upper_bound(options.begin(), options.end(), moved,
                                        [](const Option& a, const Option& b) {
                                          return a.ratio > b.ratio;
                                        }),
                       moved);
      }
    }
    if (options.empty()) {
      if (fresh) return true;
      std::fill(ratio.begin(), ratio.end(), kUnknown);
      fresh = true;
      continue;
    }
    const Option pick = options[0];
    d[pick.i] = pick.lighter;
    ratio[2 * pick.i] = ratio[2 * pick.i + 1] = kUnknown;  // its options changed
    score = model.evaluate(d);
    fresh = false;
  }
}

std::vector<Decision> search(const BudgetModel& model, std::int64_t budget,
                             std::vector<Decision>& state, bool from_both_ends) {
  if (!greedy(model, budget, state)) {
    // The greedy order can strand a candidate on an action that frees less
    // than another would; the most of everything is the last resort.
    state = everything(model);
  }
  std::vector<Decision> improved = state;
  improve(model, budget, improved);
  std::vector<Decision> relaxed = everything(model);
  if (!from_both_ends || !relax(model, budget, relaxed)) return improved;
  improve(model, budget, relaxed);
  const ModelScore from_top = model.evaluate(improved);
  const ModelScore from_bottom = model.evaluate(relaxed);
  const bool top_fits = from_top.peak <= budget;
  if (from_bottom.peak <= budget &&
      (!top_fits || from_bottom.step_ms < from_top.step_ms - 1e-9)) {
    return relaxed;
  }
  return improved;
}

std::vector<Decision> everything(const BudgetModel& model) {
  std::vector<Decision> d(model.size(), Decision::kKeep);
  for (std::size_t i = 0; i < model.size(); ++i) {
    const ModelCandidate& c = model.candidates()[i];
    if (c.can_recompute) {
      d[i] = Decision::kRecompute;
    } else if (c.can_offload) {
      d[i] = Decision::kOffload;
    }
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
