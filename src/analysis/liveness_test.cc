#include "analysis/liveness.h"

#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using spillway::testing::lit;

TEST(LivenessTest, LastForwardUseSpansViewsAndIgnoresBackward) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto t = b.view("aten.t.default", mm, b.tensor({8, 8}, {1, 8}));
  b.call("aten.neg.default", {mm}, b.tensor({8, 8}));
  auto late = b.call("aten.relu.default", {t}, b.tensor({8, 8}));
  b.backward();
  auto bwd2 = b.call("aten.neg.default", {t}, b.tensor({8, 8}));
  auto bwd1 = b.call("aten.mul.Tensor", {mm, mm}, b.tensor({8, 8}));
  Graph g = b.build();
  GraphIndex index(g);
  AliasChain chain = trace_alias_chain(index, mm.id);
  ForwardLifetime life = find_last_forward_use(index, chain);
  EXPECT_EQ(life.last_forward_use, late.id);
  EXPECT_EQ(life.last_use_arg, late.id);
  EXPECT_EQ(find_first_backward_reader(index, chain), bwd2.id);
  (void)bwd1;
}

TEST(LivenessTest, ProducerWithoutForwardReadersIsItsOwnLastUse) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  b.backward();
  b.call("aten.neg.default", {mm}, b.tensor({8, 8}));
  Graph g = b.build();
  GraphIndex index(g);
  ForwardLifetime life = find_last_forward_use(index, trace_alias_chain(index, mm.id));
  EXPECT_EQ(life.last_forward_use, mm.id);
  EXPECT_EQ(life.last_use_arg, mm.id);
}

TEST(LivenessTest, TupleLastUseHasNoTensorToPin) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto split = b.call_value("aten.split.Tensor", {mm, lit(4)},
                            GraphBuilder::tuple({b.tensor({4, 8}), b.tensor({4, 8})}));
  Graph g = b.build();
  GraphIndex index(g);
  ForwardLifetime life = find_last_forward_use(index, trace_alias_chain(index, mm.id));
  EXPECT_EQ(life.last_forward_use, split.id);
  EXPECT_FALSE(life.last_use_arg.has_value());
}

}  // namespace
}  // namespace spillway::analysis
