#include "analysis/regions.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spillway/plan.h"
#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using ::testing::ElementsAre;

std::vector<const Node*> nodes_of(const Graph& g) {
  std::vector<const Node*> nodes;
  for (const Node& n : g.nodes) nodes.push_back(&n);
  return nodes;
}

TEST(RegionsTest, ReusedModuleOpensOneRegionPerOccurrence) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8}));
  b.backward();
  auto step = [&](const char* path) {
    b.within(path);
    return b.call("aten.neg.default", {x}, b.tensor({8}));
  };
  auto a0 = step("m.shared.self_attn");
  step("m.shared.self_attn");
  auto b0 = step("m.other.self_attn");
  auto a1 = step("m.shared.self_attn");
  Graph g = b.build();
  ScopeRoots scope(g, "self_attn");
  Regions regions = find_regions(nodes_of(g), scope);
  EXPECT_THAT(regions.anchors, ElementsAre(a0.id, b0.id, a1.id));  // id == position here
  EXPECT_THAT(regions.ends, ElementsAre(a0.id + 1, b0.id, a1.id));
  EXPECT_THAT(regions.by_root.at("m.shared.self_attn"), ElementsAre(0, 2));
  // A node of the shared module maps to the latest occurrence at or before it.
  EXPECT_EQ(region_of(regions, "m.shared.self_attn", a1.id), 2u);
  EXPECT_EQ(region_of(regions, "m.shared.self_attn", b0.id), 0u);
  // Before any occurrence: the first one.
  EXPECT_EQ(region_of(regions, "m.shared.self_attn", 0), 0u);
  EXPECT_EQ(region_of(regions, "m.missing.self_attn", 3), std::nullopt);
}

TEST(RegionsTest, OutOfScopeGapDoesNotReopenARegionAndOffloadOpsAreSkipped) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8}));
  b.within("m.l0.self_attn");
  auto fwd = b.call("aten.neg.default", {x}, b.tensor({8}));  // forward: ignored
  b.backward();
  b.call(std::string(kReloadTarget), {x}, b.tensor({8}));      // offload op: ignored
  auto first = b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("m.l0.mlp");
  b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("m.l0.self_attn");
  auto resumed = b.call("aten.neg.default", {x}, b.tensor({8}));
  Graph g = b.build();
  ScopeRoots scope(g, "self_attn");
  Regions regions = find_regions(nodes_of(g), scope);
  EXPECT_THAT(regions.anchors, ElementsAre(first.id));
  // The gap sits inside the region: its root resumed after it.
  EXPECT_THAT(regions.ends, ElementsAre(resumed.id));
  (void)fwd;
}

TEST(RegionsTest, ARegionEndsAtItsLastInRootNodeNotAtTheGapAfterIt) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8}));
  b.backward();
  b.within("m.l1.mlp");
  auto open1 = b.call("aten.neg.default", {x}, b.tensor({8}));
  auto last1 = b.call("aten.neg.default", {x}, b.tensor({8}));
  b.call(std::string(kReloadTarget), {x}, b.tensor({8}));  // offload op: no end
  b.within("m.l1.self_attn");                              // out of scope: no end
  b.call("aten.neg.default", {x}, b.tensor({8}));
  b.module({});
  b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("m.l0.mlp");
  auto open0 = b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("m.l1.mlp");  // adjacent to the region before: no gap
  auto open2 = b.call("aten.neg.default", {x}, b.tensor({8}));
  b.module({});
  b.call("aten.neg.default", {x}, b.tensor({8}));  // trailing gap
  b.output({x});
  Graph g = b.build();
  ScopeRoots scope(g, "mlp");
  Regions regions = find_regions(nodes_of(g), scope);
  EXPECT_THAT(regions.anchors, ElementsAre(open1.id, open0.id, open2.id));
  EXPECT_THAT(regions.ends, ElementsAre(last1.id, open0.id, open2.id));
}

}  // namespace
}  // namespace spillway::analysis
