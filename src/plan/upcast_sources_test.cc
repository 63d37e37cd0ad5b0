// upcast_source_edits (Note [Upcast sources]): backward's read of a widening
// cast becomes a read of a backward copy of the cast over its 2-byte source.

#include "plan/upcast_sources.h"

#include <gtest/gtest.h>

#include "spillway/plan.h"
#include "testing/graph_builder.h"

namespace spillway {
namespace {

using testing::GraphBuilder;

struct Residual {
  Graph graph;
  NodeId sum = -1, wide = -1, grad = -1, other = -1;
};

// sum = mm + x in bf16 (a residual), wide = cast(sum) to fp32 (RMSNorm's
// upcast), read by a backward multiply; `other` is a second cast, of the mm,
// whose source backward reads as well.
Residual residual(std::string wide_dtype = "float32") {
  GraphBuilder b("residual");
  OpSchema add = testing::pure_schema("aten", {"self", "other"});
  add.is_pointwise = true;
  OpSchema cast = testing::pure_schema("prims", {"a"}, {"dtype"});
  cast.is_pointwise = true;
  b.op("aten.add.Tensor", add);
  b.op("aten.mul.Tensor", add);
  b.op("prims.convert_element_type.default", cast);
  const TensorInfo t = GraphBuilder::tensor({1024, 1024});
  const TensorInfo wide_t = GraphBuilder::tensor({1024, 1024}, {}, wide_dtype == "float32" ? 4 : 2,
                                                 wide_dtype);
  Residual r;
  auto x = b.input("x", t);
  auto w = b.input("w", t);
  b.within("model.layers.0");
  auto m = b.named("m").call("aten.mm.default", {x, w}, t);
  auto sum = b.named("sum").call("aten.add.Tensor", {m, x}, t);
  auto wide = b.named("wide").call("prims.convert_element_type.default", {sum}, wide_t);
  auto other = b.named("other").call("prims.convert_element_type.default", {m}, wide_t);
  auto y = b.named("y").call("aten.mm.default", {sum, w}, t);
  b.backward();
  auto grad = b.named("grad").call("aten.mul.Tensor", {wide, other}, wide_t);
  auto grad_m = b.named("grad_m").call("aten.mm.default", {m, w}, t);
  b.module({});
  b.output({y, grad, grad_m});
  r.graph = b.build();
  for (const Node& node : r.graph.nodes) {
    if (node.name == "sum") r.sum = node.id;
    if (node.name == "wide") r.wide = node.id;
    if (node.name == "grad") r.grad = node.id;
    if (node.name == "other") r.other = node.id;
  }
  return r;
}

TEST(UpcastSources, BackwardReadsACopyOfTheCastOverItsSource) {
  const Residual r = residual();
  const std::vector<Edit> edits = plan::upcast_source_edits(r.graph, {"model.layers.0"});
  // `other` is a cast of m, which backward reads itself: left alone.
  ASSERT_EQ(edits.size(), 2u);
  const Edit& copy = edits[0];
  EXPECT_EQ(copy.kind, EditKind::kReplayOp);
  EXPECT_EQ(copy.source, r.wide);
  EXPECT_EQ(copy.node.name, "spillway_replay_wide_upcast");
  EXPECT_EQ(copy.node.phase, Phase::kBackward);
  EXPECT_EQ(copy.node.args[0].node, r.sum);
  EXPECT_EQ(copy.node.time_ms, 0.0);
  EXPECT_EQ(copy.anchor, r.grad);
  EXPECT_EQ(copy.placement, Placement::kBefore);
  const Edit& redirect = edits[1];
  EXPECT_EQ(redirect.kind, EditKind::kRedirect);
  EXPECT_EQ(redirect.reader, r.grad);
  EXPECT_EQ(redirect.from, r.wide);
  EXPECT_EQ(redirect.to, copy.node.id);

  // Applied: backward reads sum (through the copy), and the cast no more.
  const Graph prepared = apply_edits(r.graph, edits);
  for (const Node& node : prepared.nodes) {
    if (node.name != "grad") continue;
    EXPECT_EQ(node.args[0].node, copy.node.id);
  }
}

TEST(UpcastSources, ANarrowingOrSameWidthCastIsLeftAlone) {
  EXPECT_TRUE(plan::upcast_source_edits(residual("bfloat16").graph, {"model.layers.0"}).empty());
  EXPECT_TRUE(plan::upcast_source_edits(residual("float16").graph, {"model.layers.0"}).empty());
}

TEST(UpcastSources, ACastOutsideTheBlocksIsLeftAlone) {
  EXPECT_TRUE(plan::upcast_source_edits(residual().graph, {"model.layers.1"}).empty());
}

}  // namespace
}  // namespace spillway
