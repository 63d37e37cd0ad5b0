#include "analysis/alias_chain.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using spillway::testing::NodeRef;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using Redirect = std::pair<NodeId, NodeId>;

TEST(AliasChainTest, BackwardReaderOfATransposeIsReplayed) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto t = b.view("aten.t.default", mm, b.tensor({8, 8}, {1, 8}));
  auto fwd_only = b.view("aten.view.default", mm, b.tensor({64}));
  b.call("aten.sum.default", {fwd_only}, b.tensor({}));
  b.backward();
  auto direct = b.call("aten.mul.Tensor", {mm, x}, b.tensor({8, 8}));
  auto via_view = b.call("aten.mm.default", {t, x}, b.tensor({8, 8}));
  Graph g = b.build();
  GraphIndex index(g);
  AliasChain chain = trace_alias_chain(index, mm.id);
  EXPECT_THAT(chain.lifetime_views, ElementsAre(t.id, fwd_only.id));
  EXPECT_THAT(chain.replay_views, ElementsAre(t.id));
  EXPECT_THAT(chain.view_backward_redirects, ElementsAre(Redirect{t.id, via_view.id}));
  EXPECT_THAT(chain.direct_backward_readers, ElementsAre(direct.id));
  EXPECT_THAT(chain.all_backward_readers(), ElementsAre(direct.id, via_view.id));
}

TEST(AliasChainTest, StorageSharingOpWithoutViewSchemaJoinsTheChain) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto uv = b.call("aten._unsafe_view.default", {mm}, b.share(mm, b.tensor({64})));
  auto copy = b.call("aten.clone.default", {mm}, b.tensor({8, 8}));  // not an alias
  b.backward();
  auto reader = b.call("aten.neg.default", {uv}, b.tensor({64}));
  Graph g = b.build();
  GraphIndex index(g);
  AliasChain chain = trace_alias_chain(index, mm.id);
  EXPECT_THAT(chain.lifetime_views, ElementsAre(uv.id));
  EXPECT_THAT(chain.view_backward_redirects, ElementsAre(Redirect{uv.id, reader.id}));
  EXPECT_THAT(chain.direct_backward_readers, IsEmpty());
  (void)copy;
}

TEST(AliasChainTest, NestedViewsAreReplayedParentFirstAndVisitedOnce) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto v1 = b.view("aten.view.default", mm, b.tensor({64}));
  auto v2 = b.view("aten.unsqueeze.default", v1, b.tensor({1, 64}));
  // Reads both mm and v1 and aliases them: reached first through mm.
  auto both = b.call("aten.alias2.default", {mm, v1}, b.share(mm, b.tensor({8, 8})));
  b.backward();
  auto r2 = b.call("aten.neg.default", {v2}, b.tensor({1, 64}));
  Graph g = b.build();
  GraphIndex index(g);
  AliasChain chain = trace_alias_chain(index, mm.id);
  // Depth first: v1's subtree (v2) before mm's next reader (both).
  EXPECT_THAT(chain.lifetime_views, ElementsAre(v1.id, v2.id, both.id));
  EXPECT_THAT(chain.replay_views, ElementsAre(v1.id, v2.id));
  EXPECT_THAT(chain.view_backward_redirects, ElementsAre(Redirect{v2.id, r2.id}));
}

// mm -> split (a view returning a list) -> getitem halves, as Phi3's MLP
// chunks its fused gate_up projection: backward reads each half.
struct SplitGraph {
  GraphBuilder b;
  NodeRef x, mm, split, first, last, forward_reader, first_reader, last_reader;
  explicit SplitGraph(std::int64_t last_index = 1) {
    x = b.input("x", b.tensor({8, 8}));
    mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
    b.op("aten.split.Tensor", spillway::testing::pure_schema("aten", {"self", "split_size"}));
    b.graph().ops["aten.split.Tensor"].is_view = true;
    Value halves = GraphBuilder::tuple({b.share(mm, b.tensor({8, 4}, {8, 1})),
                                        b.share(mm, b.tensor({8, 4}, {8, 1}))});
    split = b.call_value("aten.split.Tensor", {mm, spillway::testing::lit(4)}, halves);
    first = b.call_untyped("operator.getitem", {split, spillway::testing::lit(0)},
                           Value::of_tensor(b.share(mm, b.tensor({8, 4}, {8, 1}))));
    last = b.call_untyped("operator.getitem", {split, spillway::testing::lit(last_index)},
                          Value::of_tensor(b.share(mm, b.tensor({8, 4}, {8, 1}))));
    forward_reader = b.call("aten.mul.Tensor", {first, last}, b.tensor({8, 4}));
    b.backward();
    first_reader = b.call("aten.neg.default", {first}, b.tensor({8, 4}));
    last_reader = b.call("aten.neg.default", {last}, b.tensor({8, 4}));
  }
};

TEST(AliasChainTest, TheChainRunsThroughTheGetitemsOfAMultiOutputView) {
  SplitGraph s;
  Graph g = s.b.build();
  GraphIndex index(g);
  StorageGroups groups(index);
  AliasChain chain = trace_alias_chain(index, s.mm.id);
  EXPECT_THAT(chain.lifetime_views, ElementsAre(s.split.id, s.first.id, s.last.id));
  EXPECT_THAT(chain.replay_views, ElementsAre(s.split.id, s.first.id, s.last.id));
  EXPECT_THAT(chain.view_backward_redirects,
              ElementsAre(Redirect{s.first.id, s.first_reader.id},
                          Redirect{s.last.id, s.last_reader.id}));
  EXPECT_THAT(chain.direct_backward_readers, IsEmpty());
  EXPECT_THAT(forward_aliases(index, groups, s.mm.id),
              ElementsAre(s.split.id, s.first.id, s.last.id));
  EXPECT_TRUE(is_alias(index, index.node(s.first.id), index.node(s.split.id)));
}

TEST(AliasChainTest, ANegativeIndexSelectsFromTheEnd) {
  SplitGraph s(/*last_index=*/-1);
  Graph g = s.b.build();
  GraphIndex index(g);
  EXPECT_THAT(trace_alias_chain(index, s.mm.id).replay_views,
              ElementsAre(s.split.id, s.first.id, s.last.id));
}

TEST(AliasChainTest, OnlyTheGetitemsOfAReadHalfAreReplayed) {
  SplitGraph s;
  Graph g = s.b.build();
  // Backward reads only the first half.
  g.nodes[static_cast<std::size_t>(s.last_reader.id)].args[0] = Arg::of_node(s.x.id);
  GraphIndex index(g);
  AliasChain chain = trace_alias_chain(index, s.mm.id);
  EXPECT_THAT(chain.lifetime_views, ElementsAre(s.split.id, s.first.id, s.last.id));
  EXPECT_THAT(chain.replay_views, ElementsAre(s.split.id, s.first.id));
}

TEST(AliasChainTest, GetitemsOfATupleThatIsNotAnAliasStayOutOfTheChain) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  // A tuple op that computes new tensors (native_layer_norm): its getitems are
  // on the elements' own storages, not mm's.
  auto ln = b.call_value("aten.native_layer_norm.default", {mm},
                         GraphBuilder::tuple({b.tensor({8, 8}), b.tensor({8, 1})}));
  auto normed = b.call_untyped("operator.getitem", {ln, spillway::testing::lit(0)},
                               Value::of_tensor(b.tensor({8, 8})));
  b.backward();
  b.call("aten.neg.default", {normed}, b.tensor({8, 8}));
  Graph g = b.build();
  g.nodes[static_cast<std::size_t>(normed.id)].value.tensor.storage =
      g.nodes[static_cast<std::size_t>(ln.id)].value.elements[0].tensor.storage;
  GraphIndex index(g);
  StorageGroups groups(index);
  EXPECT_TRUE(is_alias(index, index.node(normed.id), index.node(ln.id)));  // its element
  EXPECT_THAT(trace_alias_chain(index, mm.id).lifetime_views, IsEmpty());
  EXPECT_THAT(forward_aliases(index, groups, mm.id), IsEmpty());
}

}  // namespace
}  // namespace spillway::analysis
