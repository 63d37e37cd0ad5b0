// The resident-set scheduler (include/spillway/weights.h): which blocks'
// weights stay on the device under a budget, and how many buffers the others
// stream through, scored by the weight-stream simulator (Note [Weight stream]
// in src/sim/weight_stream.cc).
//
// Every candidate resident set is tried with each slot count in
// [min_slots, max_slots]; the set's score is its fastest fitting slot count.
// Three strategies propose sets: nothing resident; greedy (from nothing, add
// the block whose addition saves the most call time per byte, while one
// fits and the call gets no slower: a block that saves nothing is still
// added, so blocks the budget has room for stay resident); exact (every subset, for small block counts). The best
// plan of those run wins: least call time, then more resident bytes (less
// traffic on the link for the same time), then fewer slots.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "spillway/error.h"
#include "spillway/weights.h"

namespace spillway {
namespace {

[[noreturn]] void bad(const std::string& message) { throw InvalidArgument("plan", message); }

struct Scored {
  WeightPlan plan;
  WeightForecast forecast;
};

// a better than b: faster; then more resident; then fewer slots.
bool better(const Scored& a, const Scored& b) {
  constexpr double kTie = 1e-9;
  if (a.forecast.call_ms < b.forecast.call_ms - kTie) return true;
  if (a.forecast.call_ms > b.forecast.call_ms + kTie) return false;
  if (a.forecast.resident_bytes != b.forecast.resident_bytes) {
    return a.forecast.resident_bytes > b.forecast.resident_bytes;
  }
  return a.plan.slots < b.plan.slots;
}

class Scheduler {
 public:
  Scheduler(const WeightModel& model, const ResidentSetOptions& options, const CostModel& cost)
      : model_(model), options_(options), cost_(cost) {}

  // The fastest fitting slot count for this resident set, if one fits.
  std::optional<Scored> score(const std::vector<bool>& resident) const {
    std::int64_t fixed = model_.fixed_bytes;
    for (std::size_t b = 0; b < resident.size(); ++b) {
      if (resident[b]) fixed += round_allocation(model_.block_bytes[b], cost_.profile());
    }
    if (fixed > options_.budget_bytes) return std::nullopt;
    std::optional<Scored> best;
    for (int slots = options_.min_slots; slots <= options_.max_slots; ++slots) {
      WeightPlan plan{resident, slots};
      WeightForecast forecast = simulate_weight_stream(model_, plan, cost_);
      if (forecast.peak_bytes > options_.budget_bytes) break;  // more slots only grow it
      Scored candidate{std::move(plan), forecast};
      if (!best || better(candidate, *best)) best = std::move(candidate);
    }
    return best;
  }

  std::optional<Scored> nothing() const {
    return score(std::vector<bool>(model_.block_bytes.size(), false));
  }

  std::optional<Scored> greedy() const {
    std::vector<bool> resident(model_.block_bytes.size(), false);
    std::optional<Scored> current = score(resident);
    if (!current) return std::nullopt;
    for (;;) {
      std::optional<Scored> pick;
      double pick_gain = 0;
      for (std::size_t b = 0; b < resident.size(); ++b) {
        if (resident[b] || model_.block_bytes[b] == 0) continue;
        resident[b] = true;
        std::optional<Scored> candidate = score(resident);
        resident[b] = false;
        if (!candidate) continue;
        const double gain = (current->forecast.call_ms - candidate->forecast.call_ms) /
                            static_cast<double>(model_.block_bytes[b]);
        if (!pick || gain > pick_gain + 1e-15) {
          pick = std::move(candidate);
          pick_gain = gain;
        }
      }
      if (!pick || pick_gain < -1e-15) return current;  // every addition is slower
      resident = pick->plan.resident;
      current = std::move(pick);
    }
  }

  std::optional<Scored> exact() const {
    const std::size_t n = model_.block_bytes.size();
    std::optional<Scored> best;
    std::vector<bool> resident(n, false);
    for (std::uint64_t mask = 0; mask < (std::uint64_t{1} << n); ++mask) {
      bool empty_block = false;
      for (std::size_t b = 0; b < n; ++b) {
        resident[b] = (mask >> b) & 1U;
        empty_block |= resident[b] && model_.block_bytes[b] == 0;
      }
      if (empty_block) continue;  // the same plan as without it
      std::optional<Scored> candidate = score(resident);
      if (candidate && (!best || better(*candidate, *best))) best = std::move(candidate);
    }
    return best;
  }

 private:
  const WeightModel& model_;
  const ResidentSetOptions& options_;
  const CostModel& cost_;
};

}  // namespace

std::string_view to_string(ResidentStrategy strategy) {
  switch (strategy) {
    case ResidentStrategy::kBest: return "best";
    case ResidentStrategy::kNothing: return "nothing";
    case ResidentStrategy::kGreedy: return "greedy";
    case ResidentStrategy::kExact: return "exact";
  }
  return "?";
}

std::int64_t smallest_weight_budget(const WeightModel& model, const CostModel& cost) {
  std::int64_t largest = 0;
  for (std::int64_t bytes : model.block_bytes) {
    largest = std::max(largest, round_allocation(bytes, cost.profile()));
  }
  return model.fixed_bytes + largest;
}

ResidentSetResult plan_resident_set(const WeightModel& model, const ResidentSetOptions& options,
                                    const CostModel& cost) {
  if (options.budget_bytes <= 0) {
    bad("resident set: budget_bytes must be > 0, got " + std::to_string(options.budget_bytes));
  }
  if (options.min_slots < 1 || options.max_slots < options.min_slots) {
    bad("resident set: slots must satisfy 1 <= min_slots <= max_slots, got " +
        std::to_string(options.min_slots) + ".." + std::to_string(options.max_slots));
  }
  const std::size_t n = model.block_bytes.size();
  const bool exact_fits = n <= static_cast<std::size_t>(std::min(options.exact_max_blocks, 24));
  if (options.strategy == ResidentStrategy::kExact && !exact_fits) {
    bad("resident set: the exact solver takes at most " +
        std::to_string(std::min(options.exact_max_blocks, 24)) + " blocks, the model has " +
        std::to_string(n));
  }
  // Validates the model (and throws naming its field) before anything is scored.
  simulate_weight_stream(model, WeightPlan{std::vector<bool>(n, false), options.min_slots}, cost);

  const Scheduler scheduler(model, options, cost);
  ResidentSetResult result;
  std::optional<Scored> best;
  auto run = [&](ResidentStrategy strategy, std::optional<Scored> found) {
    if (!found) return;
    result.candidates.emplace_back(std::string(to_string(strategy)), found->forecast);
    if (!best || better(*found, *best)) {
      best = std::move(found);
      result.strategy = std::string(to_string(strategy));
    }
  };
  const ResidentStrategy s = options.strategy;
  if (s == ResidentStrategy::kBest || s == ResidentStrategy::kNothing) {
    run(ResidentStrategy::kNothing, scheduler.nothing());
  }
  if (s == ResidentStrategy::kBest || s == ResidentStrategy::kGreedy) {
    run(ResidentStrategy::kGreedy, scheduler.greedy());
  }
  if (s == ResidentStrategy::kExact || (s == ResidentStrategy::kBest && exact_fits)) {
    run(ResidentStrategy::kExact, scheduler.exact());
  }
  if (!best) {
    bad("resident set: no plan fits a budget of " + std::to_string(options.budget_bytes) +
        " bytes with " + std::to_string(options.min_slots) + " to " +
        std::to_string(options.max_slots) + " slots; the smallest budget any plan fits is " +
        std::to_string(smallest_weight_budget(model, cost)) +
        " bytes (the weights outside the blocks plus the largest block's buffer, one slot)");
  }
  result.plan = std::move(best->plan);
  result.forecast = best->forecast;
  return result;
}

}  // namespace spillway
