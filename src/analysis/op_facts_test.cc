#include "analysis/op_facts.h"

#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using spillway::testing::lit;
using spillway::testing::NodeRef;

// mm, split(mm) -> ([8, 4] on mm's storage, [8, 4] on mm's storage), and a
// getitem `pick` of it whose index and value each test sets.
struct Pick {
  GraphBuilder b;
  NodeRef mm, split, other;
  Pick() {
    auto x = b.input("x", b.tensor({8, 8}));
    mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
    split = b.call_value("aten.split.Tensor", {mm, lit(4)},
                         GraphBuilder::tuple({b.share(mm, b.tensor({8, 4}, {8, 1})),
                                              b.share(mm, b.tensor({8, 4}, {8, 1}))}));
    other = b.call_value("aten.split.Tensor", {mm, lit(4)},
                         GraphBuilder::tuple({b.share(mm, b.tensor({8, 4}, {8, 1}))}));
  }
  // Adds getitem(split, index) with `value`; whether it selects an element of
  // `tuple` that it aliases.
  bool selects(Arg index, NodeRef tuple, TensorInfo value) {
    NodeRef pick = b.call_untyped("operator.getitem", {split, index}, Value::of_tensor(value));
    Graph g = b.build();
    return selects_aliased_element(g.nodes[static_cast<std::size_t>(pick.id)],
                                   g.nodes[static_cast<std::size_t>(tuple.id)]);
  }
};

TEST(OpFactsTest, AGetitemOfAnElementOnItsStorageSelectsAnAlias) {
  Pick p;
  EXPECT_TRUE(p.selects(lit(1), p.split, p.b.share(p.mm, GraphBuilder::tensor({8, 4}, {8, 1}))));
}

TEST(OpFactsTest, NegativeIndicesCountFromTheEnd) {
  Pick p;
  EXPECT_TRUE(p.selects(lit(-2), p.split, p.b.share(p.mm, GraphBuilder::tensor({8, 4}, {8, 1}))));
}

TEST(OpFactsTest, IndicesOutOfRangeSelectNothing) {
  Pick a;
  EXPECT_FALSE(a.selects(lit(2), a.split, a.b.share(a.mm, GraphBuilder::tensor({8, 4}, {8, 1}))));
  Pick b;
  EXPECT_FALSE(b.selects(lit(-3), b.split, b.b.share(b.mm, GraphBuilder::tensor({8, 4}, {8, 1}))));
}

TEST(OpFactsTest, AValueOnAnotherStorageIsNotTheElement) {
  Pick p;
  EXPECT_FALSE(p.selects(lit(0), p.split, GraphBuilder::tensor({8, 4}, {8, 1})));
  Pick unknown;
  EXPECT_FALSE(unknown.selects(lit(0), unknown.split,
                               GraphBuilder::unknown_storage(GraphBuilder::tensor({8, 4}))));
}

TEST(OpFactsTest, OnlyTheTupleTheGetitemReadsCounts) {
  Pick p;  // the getitem reads `split`, not `other`, though `other` holds mm's storage too
  EXPECT_FALSE(p.selects(lit(0), p.other, p.b.share(p.mm, GraphBuilder::tensor({8, 4}, {8, 1}))));
}

TEST(OpFactsTest, ASymbolicIndexSelectsNothingProvably) {
  Pick p;
  EXPECT_FALSE(p.selects(spillway::testing::sym("s0", 0), p.split,
                         p.b.share(p.mm, GraphBuilder::tensor({8, 4}, {8, 1}))));
}

}  // namespace
}  // namespace spillway::analysis
