#include "analysis/group_safety.h"

#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using spillway::testing::mutable_schema;

struct Analysed {
  Graph graph;
  GraphIndex index{graph};
  StorageGroups groups{index};
  StorageSafety safety{index, groups};
  explicit Analysed(Graph g) : graph(std::move(g)) {}
};

TEST(GroupSafetyTest, CleanGroupIsOwnedByItsFirstMember) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto v = b.call("aten._unsafe_view.default", {mm}, b.share(mm, b.tensor({64})));
  b.output({b.call("aten.sum.default", {v}, b.tensor({}))});
  Analysed a(b.build());
  const StorageGroup* group = a.groups.find(*b.storage_of(mm));
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->members, (std::vector<NodeId>{mm.id, v.id}));
  EXPECT_EQ(a.safety.verdict(*b.storage_of(mm)).hazard, GroupHazard::kNone);
  EXPECT_EQ(a.safety.owner(*b.storage_of(mm)), mm.id);
}

TEST(GroupSafetyTest, WriteComesFirstAndNamesTheWriter) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto relu = b.inplace("aten.relu_.default", mm);
  b.output({relu});  // also an output reader: the write still wins
  Analysed a(b.build());
  GroupVerdict v = a.safety.verdict(*b.storage_of(mm));
  EXPECT_EQ(v.hazard, GroupHazard::kWrittenInPlace);
  EXPECT_EQ(v.witness, relu.id);
  EXPECT_EQ(a.safety.owner(*b.storage_of(mm)), -1);
}

TEST(GroupSafetyTest, PlaceholderSharingTheStorageIsExternal) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto v = b.view("aten.view.default", x, b.tensor({64}));
  Analysed a(b.build());
  GroupVerdict verdict = a.safety.verdict(*b.storage_of(v));
  EXPECT_EQ(verdict.hazard, GroupHazard::kSharedExternally);
  EXPECT_EQ(verdict.witness, x.id);
}

TEST(GroupSafetyTest, MemberProducedByMutatingOpPoisonsTheGroup) {
  GraphBuilder b;
  // Writes `other`, returns an alias of `self`: self's storage is not written,
  // but a mutating op produced a member of its group.
  b.op("aten.odd_.default", mutable_schema("aten", {"self", "other"}, {"other"}));
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto scratch = b.call("aten.empty.default", {}, b.tensor({8, 8}));
  auto odd = b.call("aten.odd_.default", {mm, scratch}, b.share(mm, b.tensor({8, 8})));
  Analysed a(b.build());
  GroupVerdict verdict = a.safety.verdict(*b.storage_of(mm));
  EXPECT_EQ(verdict.hazard, GroupHazard::kMutatingSharer);
  EXPECT_EQ(verdict.witness, odd.id);
  EXPECT_EQ(a.safety.verdict(*b.storage_of(scratch)).hazard, GroupHazard::kWrittenInPlace);
}

TEST(GroupSafetyTest, OutputReaderOfAnyMember) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto mm = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  auto t = b.view("aten.t.default", mm, b.tensor({8, 8}, {1, 8}));
  b.output({t});
  Analysed a(b.build());
  GroupVerdict verdict = a.safety.verdict(*b.storage_of(mm));
  EXPECT_EQ(verdict.hazard, GroupHazard::kOutputReader);
  EXPECT_EQ(verdict.witness, t.id);
}

}  // namespace
}  // namespace spillway::analysis
