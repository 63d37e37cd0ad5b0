#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "plan/plan_test_util.h"
#include "spillway/error.h"

namespace spillway::plan::test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

Edit insertion(NodeId id, std::string name, NodeId anchor, Placement placement,
               std::string target = "aten.neg.default") {
  Edit e;
  e.kind = EditKind::kReplayView;
  e.node.id = id;
  e.node.name = std::move(name);
  e.node.target = std::move(target);
  e.anchor = anchor;
  e.placement = placement;
  return e;
}

std::vector<std::string> names(const Graph& g) {
  std::vector<std::string> out;
  for (const Node& n : g.nodes) out.push_back(n.name);
  return out;
}

TEST(ApplyEditsTest, PlacementsFollowPlanRules) {
  AttentionGraph a;
  Graph g = a.finish();  // x w q relu grad output
  std::vector<Edit> edits{
      insertion(10, "a1", a.q.id, Placement::kAfter),
      insertion(11, "a2", a.q.id, Placement::kAfter),   // after q and a1
      insertion(12, "b1", a.grad.id, Placement::kBefore),
      insertion(13, "b2", a.grad.id, Placement::kBefore),  // after b1, before grad
      insertion(14, "c1", 10, Placement::kAfter),        // anchored on a new node
  };
  Graph out = apply_edits(g, edits);
  EXPECT_THAT(names(out), ElementsAre("x", "w", "q", "a1", "c1", "a2", "relu", "b1", "b2", "grad",
                                      "output"));
}

TEST(ApplyEditsTest, RedirectsReplaceEveryReferenceIncludingInLists) {
  AttentionGraph a;
  Graph g = a.finish();
  Edit redirect;
  redirect.kind = EditKind::kRedirect;
  redirect.reader = 5;  // output reads [relu, grad]
  redirect.from = a.grad.id;
  redirect.to = a.x.id;
  Graph out = apply_edits(g, {redirect});
  EXPECT_EQ(out.nodes[5].args[0], spillway::testing::list({a.relu, a.x}));
}

std::optional<std::int64_t> storage_of(const Graph& g, NodeRef node) {
  return node_with_id(g, node.id).value.tensor.storage;
}

// Note [Aliases follow a redirect].
TEST(ApplyEditsTest, ViewsOfARedirectedReaderTakeTheNewStorage) {
  GraphBuilder b;
  auto x = b.input("x", two_mib());
  auto q = b.named("q").call("aten.relu.default", {x}, two_mib());
  b.backward();
  auto qt = b.named("qt").view("aten.t.default", q, GraphBuilder::tensor({1024, 1024}, {1, 1024}));
  auto flat = b.named("flat").view("aten.view.default", qt, GraphBuilder::tensor({1 << 20}));
  auto other = b.named("other").view("aten.view.default", q, GraphBuilder::tensor({1 << 20}));
  auto neg = b.named("neg").call("aten.neg.default", {q}, two_mib());
  auto grad = b.named("grad").call("aten.add.Tensor", {flat, other, neg}, two_mib());
  b.output({grad});
  Graph g = b.build();
  // A backward node on a storage of its own stands in for the reload.
  Edit reload = insertion(100, "reload", qt.id, Placement::kBefore, "aten.clone.default");
  reload.node.phase = Phase::kBackward;
  reload.node.args = {Arg::of_node(q.id)};
  reload.node.value = Value::of_tensor(two_mib());
  reload.node.value.tensor.storage = 1000;
  std::vector<Edit> edits{reload};
  for (NodeRef reader : {qt, neg}) {
    Edit redirect;
    redirect.kind = EditKind::kRedirect;
    redirect.reader = reader.id;
    redirect.from = q.id;
    redirect.to = reload.node.id;
    edits.push_back(redirect);
  }
  Graph out = apply_edits(g, edits);
  // The redirected view and its own view now live in the reload's storage.
  EXPECT_EQ(storage_of(out, qt), 1000);
  EXPECT_EQ(storage_of(out, flat), 1000);
  // A view still reading q, q itself, and a redirected reader that is no view
  // keep theirs.
  EXPECT_EQ(storage_of(out, other), storage_of(g, q));
  EXPECT_EQ(storage_of(out, q), storage_of(g, q));
  EXPECT_EQ(storage_of(out, neg), storage_of(g, neg));
  EXPECT_EQ(storage_of(out, grad), storage_of(g, grad));
}

TEST(ApplyEditsTest, SpillwaySchemasAreAdded) {
  AttentionGraph a;
  Graph g = a.finish();
  Graph out = apply_edits(g, {insertion(10, "o", a.q.id, Placement::kAfter,
                                        std::string(kOffloadTarget))});
  ASSERT_TRUE(out.ops.count(std::string(kOffloadTarget)));
  EXPECT_EQ(out.ops.at(std::string(kOffloadTarget)).ns, "spillway");
  EXPECT_FALSE(out.ops.count(std::string(kReloadTarget)));
}

TEST(ApplyEditsTest, BadEditsAreRejected) {
  AttentionGraph a;
  Graph g = a.finish();
  try {
    apply_edits(g, {insertion(10, "n", 77, Placement::kAfter)});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("[plan] edit 0 (replay_view) anchors on node 77"));
  }
  try {
    apply_edits(g, {insertion(a.q.id, "n", a.x.id, Placement::kAfter)});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("inserts node 2 (n), but that id is negative or already taken"));
  }
  Edit redirect;
  redirect.kind = EditKind::kRedirect;
  redirect.reader = a.grad.id;
  redirect.from = a.q.id;
  redirect.to = 500;
  EXPECT_THROW(apply_edits(g, {redirect}), InvalidArgument);
}

}  // namespace
}  // namespace spillway::plan::test
