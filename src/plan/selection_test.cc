#include "plan/selection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "plan/plan_test_util.h"

namespace spillway::plan::test {
namespace {

std::vector<NodeId> ids(const std::vector<SizedCandidate>& c) {
  std::vector<NodeId> out;
  for (const SizedCandidate& s : c) out.push_back(s.node);
  return out;
}

TEST(SelectionTest, LargestFirstSkippingWhatDoesNotFitAndGoingOn) {
  Selection s = select_within_budget({{1, 2 * kMiB}, {2, 4 * kMiB}, {3, 3 * kMiB}}, 6 * kMiB);
  EXPECT_THAT(ids(s.chosen), ::testing::ElementsAre(2, 1));      // 4 MiB, then 2 MiB fits
  EXPECT_THAT(ids(s.over_budget), ::testing::ElementsAre(3));    // 4 + 3 > 6
  EXPECT_EQ(s.total_bytes, 6 * kMiB);
}

TEST(SelectionTest, TiesKeepGraphOrder) {
  Selection s = select_within_budget({{7, kMiB}, {3, kMiB}, {5, kMiB}}, 2 * kMiB);
  EXPECT_THAT(ids(s.chosen), ::testing::ElementsAre(7, 3));
  EXPECT_THAT(ids(s.over_budget), ::testing::ElementsAre(5));
}

TEST(SelectionTest, ZeroBudgetTakesEverything) {
  Selection s = select_within_budget({{1, kMiB}, {2, 5 * kMiB}}, 0);
  EXPECT_THAT(ids(s.chosen), ::testing::ElementsAre(2, 1));
  EXPECT_TRUE(s.over_budget.empty());
}

TEST(SelectionTest, PlannerMarksBudgetSkipsOverBudget) {
  GraphBuilder b("budget");
  auto x = b.input("x", two_mib());
  b.within("m.layers.0.self_attn");
  auto four = b.call("aten.cat.default", {x, x}, GraphBuilder::tensor({2048, 1024}));
  auto three = b.call("aten.cat.default", {x, x}, GraphBuilder::tensor({1536, 1024}));
  auto two = b.call("aten.neg.default", {x}, two_mib());
  b.backward();
  auto g1 = b.call("aten.add.Tensor", {four, three}, two_mib());
  auto g2 = b.call("aten.add.Tensor", {g1, two}, two_mib());
  b.output({g2});
  Graph g = b.build();
  ActivationPlanOptions options;
  options.host_budget_bytes = 6 * kMiB;
  PlanResult r = plan_and_check(g, options);
  EXPECT_EQ(decision_for(r.plan, four.id).rule, Rule::kChosen);
  EXPECT_EQ(decision_for(r.plan, three.id).rule, Rule::kOverBudget);
  EXPECT_EQ(decision_for(r.plan, two.id).rule, Rule::kChosen);
  EXPECT_EQ(r.plan.candidate_count, 3);
  EXPECT_EQ(r.plan.bytes_offloaded, 6 * kMiB);
  ASSERT_EQ(r.plan.offloads.size(), 2u);
  EXPECT_EQ(r.plan.offloads[0].producer, four.id);
  EXPECT_EQ(r.plan.offloads[1].producer, two.id);
}

}  // namespace
}  // namespace spillway::plan::test
