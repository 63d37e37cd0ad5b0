#include "analysis/graph_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spillway/error.h"
#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using ::testing::ElementsAre;

TEST(GraphIndexTest, UsersAreDistinctAndInGraphOrder) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({4, 4}));
  auto y = b.call("aten.mul.Tensor", {x, x}, b.tensor({4, 4}));  // reads x twice
  auto z = b.call("aten.add.Tensor", {y, x}, b.tensor({4, 4}));
  b.output({z});
  Graph g = b.build();
  GraphIndex index(g);
  EXPECT_THAT(index.users(x.id), ElementsAre(y.id, z.id));
  EXPECT_THAT(index.users(z.id), ElementsAre(3));  // the output node
  EXPECT_EQ(index.position(z.id), 2u);
  EXPECT_EQ(index.max_id(), 3);
}

TEST(GraphIndexTest, ReferenceToLaterNodeIsRejectedNamingTheNode) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({4}));
  auto y = b.call("aten.neg.default", {x}, b.tensor({4}));
  Graph g = b.build();
  g.nodes[1].args[0] = Arg::of_node(7);
  try {
    GraphIndex index(g);
    FAIL() << "expected InvalidGraph";
  } catch (const InvalidGraph& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("[analysis] node 1 (neg_0) refers to node 7"));
  }
  (void)y;
}

TEST(GraphIndexTest, UnknownIdThrows) {
  GraphBuilder b;
  b.input("x", b.tensor({4}));
  Graph g = b.build();
  GraphIndex index(g);
  EXPECT_FALSE(index.contains(42));
  EXPECT_THROW(index.position(42), InvalidGraph);
}

}  // namespace
}  // namespace spillway::analysis
