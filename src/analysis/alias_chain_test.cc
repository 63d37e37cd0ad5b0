#include "analysis/alias_chain.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
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

TEST(AliasChainTest, ForwardAliasesIncludeMembersReachedThroughATuple) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  Value parts = GraphBuilder::tuple({b.share(mm, b.tensor({4, 8})), b.share(mm, b.tensor({4, 8}))});
  auto split = b.call_value("aten.split.Tensor", {mm, spillway::testing::lit(4)}, parts);
  b.graph().ops["aten.split.Tensor"].is_view = true;
  auto part = b.call_untyped("operator.getitem", {split, spillway::testing::lit(0)},
                             Value::of_tensor(b.share(mm, b.tensor({4, 8}))));
  Graph g = b.build();
  GraphIndex index(g);
  StorageGroups groups(index);
  // The chain stops at the tuple (getitem is neither a view nor on a tensor's
  // storage as seen from the tuple), but the storage group knows better.
  EXPECT_THAT(trace_alias_chain(index, mm.id).lifetime_views, ElementsAre(split.id));
  EXPECT_THAT(forward_aliases(index, groups, mm.id), ElementsAre(split.id, part.id));
}

}  // namespace
}  // namespace spillway::analysis
