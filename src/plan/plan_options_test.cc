// Options, modes and bad input of plan_activation_offload.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "plan/plan_test_util.h"
#include "spillway/error.h"

namespace spillway::plan::test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string error_of(const Graph& g, const ActivationPlanOptions& options) {
  try {
    plan_activation_offload(g, options);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

TEST(PlanOptionsTest, NegativeOptionsAreRejectedByName) {
  AttentionGraph a;
  Graph g = a.finish();
  ActivationPlanOptions options;
  options.host_budget_bytes = -1;
  EXPECT_EQ(error_of(g, options),
            "[plan] option host_budget_bytes is -1; it must be >= 0 (0 = unlimited)");
  options = {};
  options.min_bytes = -5;
  EXPECT_THAT(error_of(g, options), HasSubstr("[plan] option min_bytes is -5"));
  options = {};
  options.prefetch_regions = -2;
  EXPECT_THAT(error_of(g, options), HasSubstr("[plan] option prefetch_regions is -2"));
  options = {};
  options.release_lag = -1;
  EXPECT_EQ(error_of(g, options), "[plan] option release_lag is -1; it must be >= 0");
  options = {};
  options.scope = "";
  EXPECT_THAT(error_of(g, options), HasSubstr("[plan] option scope is ''"));
  options = {};
  options.prefetch_anchor = static_cast<ActivationPlanOptions::PrefetchAnchor>(7);
  EXPECT_THAT(error_of(g, options), HasSubstr("[plan] option prefetch_anchor is 7"));
}

TEST(PlanOptionsTest, ScopeThatMatchesNothingNamesScopeGraphAndTheScopesThatWould) {
  AttentionGraph a;
  Graph g = a.finish();
  ActivationPlanOptions options;
  options.scope = "cross_attn";
  EXPECT_EQ(error_of(g, options),
            "[plan] scope 'cross_attn' matches no module in graph 'attn'; its module names are: "
            "model, layers, self_attn");
  EXPECT_THAT(scope_names(g), ElementsAre("model", "layers", "self_attn"));
}

TEST(PlanOptionsTest, ScopeInAGraphWithoutModuleStacksSaysSo) {
  GraphBuilder b{"loss only"};
  auto x = b.input("x", two_mib());
  b.output({b.call("aten.relu.default", {x}, two_mib())});
  ActivationPlanOptions options;
  EXPECT_EQ(error_of(b.build(), options),
            "[plan] scope 'self_attn' matches no module in graph 'loss only'; no node of it "
            "carries a module stack");
}

TEST(PlanOptionsTest, ModeNoneReturnsTheGraphUnchangedAndAnEmptyPlan) {
  AttentionGraph a;
  Graph g = a.finish();
  ActivationPlanOptions options;
  options.mode = ActivationMode::kNone;
  options.scope = "matches_nothing";  // not consulted
  PlanResult r = plan_activation_offload(g, options);
  EXPECT_EQ(r.graph, g);
  EXPECT_TRUE(r.plan.decisions.empty());
  EXPECT_TRUE(r.plan.edits.empty());
  EXPECT_TRUE(r.plan.offloads.empty());
  EXPECT_EQ(r.plan.options.mode, ActivationMode::kNone);
}

TEST(PlanOptionsTest, NothingSelectedLeavesTheGraphUnchanged) {
  AttentionGraph a;
  Graph g = a.finish();
  ActivationPlanOptions options;
  options.min_bytes = 1LL << 40;
  PlanResult r = plan_activation_offload(g, options);
  EXPECT_EQ(r.graph, g);
  EXPECT_TRUE(r.plan.edits.empty());
  EXPECT_FALSE(r.plan.decisions.empty());
}

TEST(PlanOptionsTest, InvalidGraphIsRejectedNotPlanned) {
  AttentionGraph a;
  Graph g = a.finish();
  g.nodes[3].args[0] = Arg::of_node(99);
  EXPECT_THROW(plan_activation_offload(g, {}), InvalidGraph);
}

TEST(PlanOptionsTest, PlanningIsDeterministicAndLeavesTheInputAlone) {
  AttentionGraph a;
  Graph g = a.finish();
  const Graph copy = g;
  PlanResult first = plan_activation_offload(g, {});
  PlanResult second = plan_activation_offload(g, {});
  EXPECT_EQ(g, copy);
  EXPECT_EQ(first.graph, second.graph);
}

}  // namespace
}  // namespace spillway::plan::test
