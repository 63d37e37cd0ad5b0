// plan_memory_budget / sweep_memory_budget (spillway/budget.h).
//
// 1. The problem (budget_problem.h): candidates, recompute probes, the
//    simulator's baseline and the fast model (budget_model.h).
// 2. Search on the fast model (budget_search.h): greedy, then local search,
//    and with BudgetOptions::relax from the other end too; the faster.
// 3. Materialise, simulate in full, and search again with the full
//    simulation's overshoot taken off when it does not fit.
// 4. In torch.compile mode: the same with each longer just-in-time tail, the
//    fastest plan that fits (Note [A just-in-time tail]).
//
// Note [A just-in-time tail]
// A reload prefetched one region early is live beside the region computing
// there. At the backward's last layers everything else a compiled step holds
// is at its largest too (the gradients the compiled backward returns when it
// ends, the logits' zero gradient autograd holds to that end), so there the
// prefetched reloads set the smallest peak a plan reaches. On T1 (CPU trace,
// fast mode) that was 7.66 GiB whole-step; with the last two layers
// reloading right before their readers, 7.47 GiB, for the compute stream
// waiting on those copies (a 7.7 GiB plan forecasts 297.6 ms against 285.0 for
// 7.82 GiB with every reload prefetched). Near that floor a tail also buys
// time: what the plan does not have to recompute or stall on elsewhere (at
// 7.7 GiB, 308.0 ms without a tail, 297.6 with two layers). So with
// partitioner_recomputes_pointwise each budget is planned with the requested
// tail and with each tail up to kMaxJustInTimeRegions regions longer; the
// fastest plan that fits wins, a longer tail only when at least 0.5 %
// faster. Eager mode is left out: its offload store prefetches per block call
// on its own and does not follow the rewrite's reload placement.

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plan/budget_problem.h"
#include "plan/budget_search.h"
#include "spillway/budget.h"
#include "spillway/error.h"

namespace spillway {
namespace {

using plan::BudgetProblem;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// "12.50 GiB", "300.00 MiB", "12.00 KiB", "512 B".
std::string gib(std::int64_t bytes) {
  char text[32];
  const double b = static_cast<double>(bytes);
  if (b >= kGiB) {
    std::snprintf(text, sizeof text, "%.2f GiB", b / kGiB);
  } else if (b >= 1024.0 * 1024.0) {
    std::snprintf(text, sizeof text, "%.2f MiB", b / (1024.0 * 1024.0));
  } else if (b >= 1024.0) {
    std::snprintf(text, sizeof text, "%.2f KiB", b / 1024.0);
  } else {
    std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(bytes));
  }
  return text;
}

void validate(const BudgetOptions& options) {
  auto reject = [](const std::string& option, const std::string& value, const char* why) {
    throw InvalidArgument("plan", "option " + option + " is " + value + "; " + why);
  };
  if (!(options.budget_fraction >= 0 && options.budget_fraction <= 1)) {
    reject("budget_fraction", std::to_string(options.budget_fraction), "it must be in (0, 1]");
  }
  if (options.budget_fraction == 0 && options.budget_bytes <= 0) {
    reject("budget_bytes", std::to_string(options.budget_bytes), "it must be > 0");
  }
  if (options.prefetch_regions < 0) {
    reject("prefetch_regions", std::to_string(options.prefetch_regions), "it must be >= 0");
  }
  if (options.release_lag < 0) {
    reject("release_lag", std::to_string(options.release_lag), "it must be >= 0");
  }
  if (options.min_bytes < 0) reject("min_bytes", std::to_string(options.min_bytes), "it must be >= 0");
  if (!options.allow_offload && !options.allow_recompute) {
    reject("allow_offload/allow_recompute", "false/false", "at least one must be allowed");
  }
  if (options.just_in_time_regions < 0) {
    reject("just_in_time_regions", std::to_string(options.just_in_time_regions),
           "it must be >= 0");
  }
}

// The smaller of the unchanged graph's peak and that of every candidate of
// `model` taken off (recompute where allowed, else offload).
std::int64_t min_reachable(const BudgetProblem& problem, const plan::BudgetModel& model) {
  return std::min(problem.baseline_peak(),
                  problem.materialise(plan::everything(model)).forecast.peak_bytes);
}

std::int64_t min_reachable(const BudgetProblem& problem) {
  return min_reachable(problem, problem.model());
}

// min_reachable of BudgetProblem::narrow_model; 0 when the problem has none.
std::int64_t narrow_floor(const BudgetProblem& problem) {
  const plan::BudgetModel* narrow = problem.narrow_model();
  return narrow == nullptr ? 0 : min_reachable(problem, *narrow);
}

// Search `model`, materialise, and search again with the full simulation's
// overshoot taken off. nullopt when no plan fits.
// `margin`: what the full simulation added to the model's peak on earlier
// plans (a recompute's transients); the search aims that much lower, and
// learns it here for the next budget of a sweep.
std::optional<BudgetPlan> search(const BudgetProblem& problem, const plan::BudgetModel& model,
                                 std::int64_t budget, std::vector<Decision>& state,
                                 std::int64_t& margin) {
  std::int64_t target = budget - margin;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const std::vector<Decision> chosen =
        plan::search(model, target, state, problem.options().relax);
    BudgetPlan plan = problem.materialise(chosen);
    const std::int64_t model_peak = model.evaluate(chosen).peak;
    margin = std::max(margin, plan.forecast.peak_bytes - model_peak);
    if (plan.forecast.peak_bytes <= budget) return plan;
    // The model misses transients (a recompute's intermediates): aim its
    // peak lower by the overshoot, and a little more each time.
    const std::int64_t over = plan.forecast.peak_bytes - budget;
    target = std::min(target, model_peak) - over -
             over * (attempt + 1) / 8 - 1;
    if (target <= 0) break;
  }
  return std::nullopt;
}

// The narrow model first, where its floor (narrow_floor) allows the budget,
// then the full one; `state` (a sweep's, carried from budget to budget) is
// the last search's.
std::optional<BudgetPlan> solve(const BudgetProblem& problem, std::int64_t budget,
                                std::vector<Decision>& state, std::int64_t& margin,
                                std::int64_t floor_without_exact) {
  const plan::BudgetModel* narrow = problem.narrow_model();
  if (narrow != nullptr && budget >= floor_without_exact) {
    std::vector<Decision> narrow_state = state;
    for (std::size_t i = 0; i < narrow_state.size(); ++i) {
      if (narrow_state[i] == Decision::kOffload && !narrow->candidates()[i].can_offload) {
        narrow_state[i] = Decision::kKeep;
      }
    }
    if (std::optional<BudgetPlan> plan = search(problem, *narrow, budget, narrow_state, margin)) {
      state = std::move(narrow_state);
      return plan;
    }
  }
  return search(problem, problem.model(), budget, state, margin);
}

// The problems one call plans on: the requested options' and, in torch.compile
// mode with prefetch, the same with each longer just-in-time tail up to
// kMaxJustInTimeRegions (Note [A just-in-time tail]), each built when first
// asked for.
class Problems {
 public:
  Problems(const Graph& graph, const BudgetOptions& options, const CostModel& cost)
      : graph_(graph), options_(options), cost_(cost) {
    const bool tails = options.partitioner_recomputes_pointwise && options.prefetch_regions > 0 &&
                       options.allow_offload;
    problems_.resize(tails ? static_cast<std::size_t>(std::max(
                                 1, kMaxJustInTimeRegions - options.just_in_time_regions + 1))
                           : 1);
  }

  std::size_t size() const { return problems_.size(); }

  const BudgetProblem& at(std::size_t i) {
    if (!problems_[i]) {
      BudgetOptions options = options_;
      options.just_in_time_regions += static_cast<int>(i);
      problems_[i] = std::make_unique<BudgetProblem>(graph_, options, cost_);
    }
    return *problems_[i];
  }

  // The smaller of the requested problem's smallest reachable peak and the
  // longest tail's.
  std::int64_t floor() {
    if (!floor_) {
      floor_ = min_reachable(at(0));
      if (size() > 1) floor_ = std::min(*floor_, min_reachable(at(size() - 1)));
    }
    return *floor_;
  }

 private:
  const Graph& graph_;
  BudgetOptions options_;
  const CostModel& cost_;
  std::vector<std::unique_ptr<BudgetProblem>> problems_;
  std::optional<std::int64_t> floor_;
};

// A longer tail must forecast a step this much shorter to replace a plan
// that fits: its stalls are the fast model's guess, not a measurement.
constexpr double kTailGain = 0.995;

// solve() on the requested problem (with `state` and `margin`, a sweep's)
// and on each longer tail, searched from its own start (Note [A just-in-time
// tail]): the fastest plan that fits, a longer tail taken only when at least
// 0.5 % faster.
std::optional<BudgetPlan> solve_tails(Problems& problems, std::int64_t budget,
                                      std::vector<Decision>& state, std::int64_t& margin,
                                      std::int64_t floor_without_exact) {
  std::optional<BudgetPlan> best =
      solve(problems.at(0), budget, state, margin, floor_without_exact);
  for (std::size_t tail = 1; tail < problems.size(); ++tail) {
    const BudgetProblem& attempt = problems.at(tail);
    std::vector<Decision> tail_state = attempt.initial();
    std::int64_t tail_margin = 0;
    std::optional<BudgetPlan> plan =
        solve(attempt, budget, tail_state, tail_margin, narrow_floor(attempt));
    if (!plan || (best && plan->forecast.step_ms >= kTailGain * best->forecast.step_ms)) continue;
    best = std::move(plan);
  }
  return best;
}

}  // namespace

std::string_view to_string(Decision decision) {
  switch (decision) {
    case Decision::kKeep:
      return "keep";
    case Decision::kOffload:
      return "offload";
    case Decision::kRecompute:
      return "recompute";
  }
  return "unknown";
}

BudgetPlan plan_memory_budget(const Graph& graph, const BudgetOptions& requested,
                              const CostModel& cost) {
  validate(requested);
  verify_graph(graph);
  Problems problems(graph, requested, cost);
  const BudgetProblem& problem = problems.at(0);
  BudgetOptions options = requested;
  if (options.budget_fraction > 0) {
    options.budget_bytes = std::max<std::int64_t>(
        1, static_cast<std::int64_t>(options.budget_fraction *
                                     static_cast<double>(problem.baseline_peak())));
  }
  if (problem.baseline_peak() <= options.budget_bytes) {
    BudgetPlan plan = problem.unchanged();
    plan.options = options;
    plan.min_reachable_bytes = problems.floor();
    return plan;
  }
  std::vector<Decision> state = problem.initial();
  std::int64_t margin = 0;
  if (std::optional<BudgetPlan> plan =
          solve_tails(problems, options.budget_bytes, state, margin, narrow_floor(problem))) {
    plan->options.budget_bytes = options.budget_bytes;  // a budget_fraction's bytes
    plan->min_reachable_bytes = problems.floor();
    return std::move(*plan);
  }
  const std::int64_t floor = problems.floor();
  throw OutOfMemory("plan", "no plan fits a budget of " + gib(options.budget_bytes) + " (" +
                                std::to_string(options.budget_bytes) +
                                " bytes); the smallest reachable peak is " + gib(floor) + " (" +
                                std::to_string(floor) + " bytes), the graph's own peak " +
                                gib(problem.baseline_peak()));
}

std::vector<BudgetPlan> sweep_memory_budget(const Graph& graph, const BudgetOptions& options,
                                            const CostModel& cost,
                                            std::vector<std::int64_t> budgets) {
  BudgetOptions checked = options;
  if (checked.budget_bytes <= 0) checked.budget_bytes = 1;  // the sweep sets its own
  validate(checked);
  verify_graph(graph);
  Problems problems(graph, checked, cost);
  const BudgetProblem& problem = problems.at(0);
  const std::int64_t top = problem.baseline_peak();
  const std::int64_t floor = problems.floor();
  if (budgets.empty()) {
    for (int i = 0; i < 10; ++i) {
      budgets.push_back(floor + (top - floor) * i / 9);
    }
  }
  std::sort(budgets.begin(), budgets.end(), std::greater<>());
  budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());

  std::vector<BudgetPlan> plans;
  std::vector<Decision> state = problem.initial();
  std::int64_t margin = 0;
  const std::int64_t floor_without_exact = narrow_floor(problem);
  for (std::int64_t budget : budgets) {
    if (budget <= 0) continue;
    std::optional<BudgetPlan> plan;
    if (budget >= top) {
      plan = problem.unchanged();
    } else {
      plan = solve_tails(problems, budget, state, margin, floor_without_exact);
    }
    if (!plan) continue;
    plan->options.budget_bytes = budget;
    plan->min_reachable_bytes = floor;
    plans.push_back(std::move(*plan));
  }
  // Monotone: each budget takes the fastest plan (then the smallest peak) of
  // any budget that fits it; plans are sorted by budget, largest first. A
  // budget at or above the graph's peak keeps its plan that changes nothing.
  std::vector<BudgetPlan> out;
  for (std::size_t i = 0; i < plans.size(); ++i) {
    std::size_t best = i;
    if (plans[i].options.budget_bytes >= top) {
      out.push_back(plans[i]);
      continue;
    }
    for (std::size_t j = 0; j < plans.size(); ++j) {
      const Forecast& f = plans[j].forecast;
      if (f.peak_bytes > plans[i].options.budget_bytes) continue;
      const Forecast& b = plans[best].forecast;
      if (f.step_ms < b.step_ms || (f.step_ms == b.step_ms && f.peak_bytes < b.peak_bytes)) best = j;
    }
    BudgetPlan chosen = plans[best];
    chosen.options.budget_bytes = plans[i].options.budget_bytes;
    out.push_back(std::move(chosen));
  }
  return out;
}

}  // namespace spillway
