// plan_memory_budget / sweep_memory_budget (spillway/budget.h).
//
// 1. The problem (budget_problem.h): candidates, recompute probes, the
//    simulator's baseline and the fast model (budget_model.h).
// 2. Search on the fast model (budget_search.h): greedy, then local search.
// 3. Materialise, simulate in full, and search again with the full
//    simulation's overshoot taken off when it does not fit.

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

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
    if (!plan::greedy(model, target, state)) {
      // The greedy order can strand a candidate on an action that frees less
      // than another would; the most of everything is the last resort.
      state = plan::everything(model);
    }
    std::vector<Decision> improved = state;
    plan::improve(model, target, improved);
    BudgetPlan plan = problem.materialise(improved);
    const std::int64_t model_peak = model.evaluate(improved).peak;
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
  const BudgetProblem problem(graph, requested, cost);
  BudgetOptions options = requested;
  if (options.budget_fraction > 0) {
    options.budget_bytes = std::max<std::int64_t>(
        1, static_cast<std::int64_t>(options.budget_fraction *
                                     static_cast<double>(problem.baseline_peak())));
  }
  std::vector<Decision> state = problem.initial();
  if (problem.baseline_peak() <= options.budget_bytes) {
    BudgetPlan plan = problem.unchanged();
    plan.options = options;
    plan.min_reachable_bytes = min_reachable(problem);
    return plan;
  }
  std::int64_t margin = 0;
  std::optional<BudgetPlan> plan =
      solve(problem, options.budget_bytes, state, margin, narrow_floor(problem));
  if (!plan) {
    const std::int64_t floor = min_reachable(problem);
    throw OutOfMemory("plan", "no plan fits a budget of " + gib(options.budget_bytes) +
                                  " (" + std::to_string(options.budget_bytes) +
                                  " bytes); the smallest reachable peak is " + gib(floor) + " (" +
                                  std::to_string(floor) + " bytes), the graph's own peak " +
                                  gib(problem.baseline_peak()));
  }
  plan->options = options;
  plan->min_reachable_bytes = min_reachable(problem);
  return std::move(*plan);
}

std::vector<BudgetPlan> sweep_memory_budget(const Graph& graph, const BudgetOptions& options,
                                            const CostModel& cost,
                                            std::vector<std::int64_t> budgets) {
  BudgetOptions checked = options;
  if (checked.budget_bytes <= 0) checked.budget_bytes = 1;  // the sweep sets its own
  validate(checked);
  verify_graph(graph);
  const BudgetProblem problem(graph, checked, cost);
  const std::int64_t top = problem.baseline_peak();
  const std::int64_t floor = min_reachable(problem);
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
      plan = solve(problem, budget, state, margin, floor_without_exact);
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
