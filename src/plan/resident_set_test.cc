// The weight-stream simulator and the resident-set scheduler
// (include/spillway/weights.h), on a link that moves 1e6 bytes per ms.

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "spillway/error.h"
#include "spillway/weights.h"
#include "testing/test_link.h"

namespace spillway {
namespace {

constexpr std::int64_t kMs = testing::kLinkBytesPerMs;  // bytes the test link moves per ms

CostModel link() { return testing::test_link(); }

// n blocks of `bytes` each computing `ms`, with `outside_ms` of compute before
// the first block (embedding) and after the last (head).
WeightModel stack(int n, std::int64_t bytes, double ms, double outside_ms = 0,
                  std::int64_t fixed = 0) {
  WeightModel model;
  model.fixed_bytes = fixed;
  if (outside_ms > 0) model.steps.push_back({-1, outside_ms});
  for (int b = 0; b < n; ++b) {
    model.block_bytes.push_back(bytes);
    model.steps.push_back({b, ms});
  }
  if (outside_ms > 0) model.steps.push_back({-1, outside_ms});
  return model;
}

WeightPlan streamed(int n, int slots) { return WeightPlan{std::vector<bool>(n, false), slots}; }

TEST(WeightStream, ALinkBoundStackRunsAtTheLinksPace) {
  // 4 blocks, each 4 ms of copy and 1 ms of compute, two slots: the link never
  // idles, across the calls' boundary too, so a call is its 16 ms of copies,
  // and the compute stream waits the rest.
  const WeightForecast f = simulate_weight_stream(stack(4, 4 * kMs, 1.0), streamed(4, 2), link());
  EXPECT_DOUBLE_EQ(f.call_ms, 16.0);
  EXPECT_DOUBLE_EQ(f.link_ms, 16.0);
  EXPECT_DOUBLE_EQ(f.compute_ms, 4.0);
  EXPECT_DOUBLE_EQ(f.stall_ms, 12.0);
  EXPECT_EQ(f.bytes_moved, 16 * kMs);
  EXPECT_EQ(f.peak_bytes, 2 * 4 * kMs);
}

TEST(WeightStream, AComputeBoundStackHidesEveryCopyAcrossTheRingsHandover) {
  // The first block's copy for the next call runs behind the last block.
  const WeightForecast f = simulate_weight_stream(stack(4, 1 * kMs, 3.0, 0.5), streamed(4, 2), link());
  EXPECT_DOUBLE_EQ(f.call_ms, 13.0);
  EXPECT_DOUBLE_EQ(f.stall_ms, 0.0);
}

TEST(WeightStream, OneSlotSerialisesEachCopyBehindTheBlockBefore) {
  // One buffer: block b+1's copy starts after block b freed its buffer.
  const WeightForecast f = simulate_weight_stream(stack(3, 2 * kMs, 1.0), streamed(3, 1), link());
  EXPECT_DOUBLE_EQ(f.call_ms, 9.0);
  EXPECT_EQ(f.peak_bytes, 2 * kMs);
}

TEST(WeightStream, ResidentBlocksMoveNothingAndCoverTheNextCopy) {
  WeightModel model = stack(4, 3 * kMs, 1.0, 0, 5);
  WeightPlan plan = streamed(4, 1);
  plan.resident = {false, true, true, true};
  // Only block 0 streams: its copy for the next call starts after it ran and
  // hides behind the three resident blocks (3 ms of compute, 3 ms of copy).
  const WeightForecast f = simulate_weight_stream(model, plan, link());
  EXPECT_DOUBLE_EQ(f.call_ms, 4.0);
  EXPECT_EQ(f.bytes_moved, 3 * kMs);
  EXPECT_EQ(f.resident_bytes, 5 + 9 * kMs);
  EXPECT_EQ(f.peak_bytes, 5 + 12 * kMs);
}

TEST(WeightStream, ABlockRunTwiceOrSkippedStillGivesAFiniteForecast) {
  WeightModel model = stack(3, kMs, 1.0);
  model.steps = {{0, 1.0}, {2, 1.0}, {0, 1.0}, {2, 1.0}};  // block 1 skipped, the others twice
  const WeightForecast f = simulate_weight_stream(model, streamed(3, 2), link());
  EXPECT_GT(f.call_ms, 4.0 - 1e-9);
  EXPECT_EQ(f.bytes_moved, 4 * kMs);
}

TEST(WeightStream, RejectsAMalformedModelOrPlanNamingTheField) {
  WeightModel model = stack(2, kMs, 1.0);
  model.steps.push_back({7, 1.0});
  try {
    simulate_weight_stream(model, streamed(2, 2), link());
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("steps[2].block is 7"), std::string::npos) << e.what();
  }
  EXPECT_THROW(simulate_weight_stream(stack(2, kMs, 1.0), streamed(2, 0), link()), InvalidArgument);
  EXPECT_THROW(simulate_weight_stream(stack(2, kMs, 1.0), streamed(3, 1), link()), InvalidArgument);
  EXPECT_THROW(simulate_weight_stream(stack(2, -1, 1.0), streamed(2, 1), link()), InvalidArgument);
}

TEST(ResidentSet, AnAmpleBudgetKeepsEveryBlockAndMovesNothing) {
  const WeightModel model = stack(4, 2 * kMs, 1.0, 0.5, 10);
  const ResidentSetResult r = plan_resident_set(model, {.budget_bytes = 100 * kMs}, link());
  EXPECT_EQ(r.plan.resident, std::vector<bool>(4, true));
  EXPECT_EQ(r.forecast.bytes_moved, 0);
  EXPECT_DOUBLE_EQ(r.forecast.call_ms, 5.0);
}

TEST(ResidentSet, ABudgetBelowTheSmallestNamesTheSmallest) {
  const WeightModel model = stack(4, 2 * kMs, 1.0, 0, 10);
  EXPECT_EQ(smallest_weight_budget(model, link()), 10 + 2 * kMs);
  try {
    plan_resident_set(model, {.budget_bytes = 2 * kMs}, link());
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(10 + 2 * kMs)), std::string::npos)
        << e.what();
  }
  // The smallest itself fits: one slot, nothing resident.
  const ResidentSetResult r = plan_resident_set(model, {.budget_bytes = 10 + 2 * kMs}, link());
  EXPECT_EQ(r.plan.slots, 1);
  EXPECT_EQ(r.forecast.peak_bytes, 10 + 2 * kMs);
  EXPECT_THROW(plan_resident_set(model, {.budget_bytes = 0}, link()), InvalidArgument);
  EXPECT_THROW(plan_resident_set(model, {.budget_bytes = kMs * 100, .min_slots = 3, .max_slots = 2},
                                 link()),
               InvalidArgument);
}

TEST(ResidentSet, TheExactSolverRefusesTooManyBlocks) {
  EXPECT_THROW(plan_resident_set(stack(30, kMs, 1.0),
                                 {.budget_bytes = 100 * kMs, .strategy = ResidentStrategy::kExact},
                                 link()),
               InvalidArgument);
  // kBest skips it there and still plans.
  EXPECT_NO_THROW(plan_resident_set(stack(30, kMs, 1.0), {.budget_bytes = 10 * kMs}, link()));
}

TEST(ResidentSet, AMixedStackSpreadsTheResidentBlocksSoEachCopyHides) {
  // 6 blocks of 3 ms copy, 1 ms compute, a budget of four blocks: r resident
  // and 4 - r slots. Three resident, one slot, every other block streamed:
  // each streamed block costs its copy (3 ms, the resident block after the
  // one before hides 1 ms of it) and its compute, 12 ms a call; two resident
  // stream 12 ms of copies, no faster, and lose the tie on resident bytes.
  const WeightModel model = stack(6, 3 * kMs, 1.0);
  const ResidentSetResult best = plan_resident_set(model, {.budget_bytes = 12 * kMs}, link());
  ASSERT_GE(best.candidates.size(), 3U);
  EXPECT_LE(best.forecast.peak_bytes, 12 * kMs);
  for (const auto& [name, forecast] : best.candidates) {
    EXPECT_LE(best.forecast.call_ms, forecast.call_ms + 1e-9) << name;
    EXPECT_LE(forecast.peak_bytes, 12 * kMs) << name;
  }
  EXPECT_EQ(best.forecast.bytes_moved, 3 * 3 * kMs);
}

// Random small models: every strategy's plan fits; best is the least of them;
// the exact optimum never gets slower as the budget grows.
TEST(ResidentSet, RandomModelsFitAndTheExactOptimumIsMonotoneInTheBudget) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 7);
    WeightModel model;
    model.fixed_bytes = static_cast<std::int64_t>(rng() % 1000);
    if (rng() % 2) model.steps.push_back({-1, (rng() % 30) / 10.0});
    for (int b = 0; b < n; ++b) {
      model.block_bytes.push_back(static_cast<std::int64_t>(1 + rng() % 5) * kMs / 2);
      model.steps.push_back({b, (rng() % 40) / 10.0});
    }
    if (rng() % 3 == 0 && n > 2) std::swap(model.steps[model.steps.size() - 1], model.steps[model.steps.size() - 2]);
    const std::int64_t smallest = smallest_weight_budget(model, link());
    double previous = 1e300;
    for (int step = 0; step < 8; ++step) {
      const std::int64_t budget = smallest + step * kMs;
      const ResidentSetResult r = plan_resident_set(model, {.budget_bytes = budget}, link());
      EXPECT_LE(r.forecast.peak_bytes, budget);
      for (const auto& [name, forecast] : r.candidates) {
        EXPECT_LE(r.forecast.call_ms, forecast.call_ms + 1e-9) << name;
      }
      const ResidentSetResult exact = plan_resident_set(
          model, {.budget_bytes = budget, .strategy = ResidentStrategy::kExact}, link());
      EXPECT_LE(exact.forecast.call_ms, previous + 1e-9) << "trial " << trial << " step " << step;
      EXPECT_DOUBLE_EQ(exact.forecast.call_ms, r.forecast.call_ms);
      previous = exact.forecast.call_ms;
    }
  }
}

}  // namespace
}  // namespace spillway
