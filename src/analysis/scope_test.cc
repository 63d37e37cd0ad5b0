#include "analysis/scope.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using ::testing::ElementsAre;

TEST(ScopeTest, RootsAreModulesWithTheLeafNameAndContainTheirChildren) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8}));
  b.within("model.layers.0.self_attn.q_proj");
  auto q = b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("model.layers.0.mlp");
  auto m = b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("model.layers.1.self_attn");
  auto k = b.call("aten.neg.default", {x}, b.tensor({8}));
  Graph g = b.build();
  ScopeRoots scope(g, "self_attn");
  EXPECT_THAT(scope.roots(), ElementsAre("model.layers.0.self_attn", "model.layers.1.self_attn"));
  EXPECT_TRUE(scope.in_scope(g.nodes[q.id]));
  EXPECT_FALSE(scope.in_scope(g.nodes[m.id]));
  EXPECT_FALSE(scope.in_scope(g.nodes[x.id]));
  ASSERT_NE(scope.root_of(g.nodes[q.id]), nullptr);
  EXPECT_EQ(*scope.root_of(g.nodes[q.id]), "model.layers.0.self_attn");
  EXPECT_EQ(*scope.root_of(g.nodes[k.id]), "model.layers.1.self_attn");
  EXPECT_EQ(scope.root_of(g.nodes[m.id]), nullptr);
}

TEST(ScopeTest, LeafIsAWholePathComponent) {
  GraphBuilder b;
  b.within("model.my_self_attn");
  b.input("x", b.tensor({8}));
  Graph g = b.build();
  EXPECT_TRUE(ScopeRoots(g, "self_attn").empty());
  EXPECT_FALSE(ScopeRoots(g, "my_self_attn").empty());
}

TEST(ScopeTest, NestedRootsResolveToTheInnermost) {
  GraphBuilder b;
  b.within("a.self_attn.inner.self_attn.proj");
  auto x = b.input("x", b.tensor({8}));
  Graph g = b.build();
  ScopeRoots scope(g, "self_attn");
  EXPECT_EQ(*scope.root_of(g.nodes[x.id]), "a.self_attn.inner.self_attn");
}

TEST(ScopeTest, ModuleLeafNamesAreDistinctInFirstAppearanceOrderWithoutListIndices) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8}));
  b.within("transformer.h.0.attn.c_attn");
  b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("transformer.h.0.mlp.c_proj");
  b.call("aten.neg.default", {x}, b.tensor({8}));
  b.within("transformer.h.1.attn.c_proj");
  b.call("aten.neg.default", {x}, b.tensor({8}));
  Graph g = b.build();
  EXPECT_THAT(module_leaf_names(g),
              ElementsAre("transformer", "h", "attn", "c_attn", "mlp", "c_proj"));
  // Every name listed is a scope that matches.
  for (const std::string& name : module_leaf_names(g)) EXPECT_FALSE(ScopeRoots(g, name).empty());
}

TEST(ScopeTest, ModuleLeafNamesOfAGraphWithoutStacksAreEmpty) {
  GraphBuilder b;
  b.input("x", b.tensor({8}));
  EXPECT_TRUE(module_leaf_names(b.build()).empty());
}

}  // namespace
}  // namespace spillway::analysis
