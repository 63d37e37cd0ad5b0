#include "analysis/write_safety.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using spillway::testing::list;
using spillway::testing::mutable_schema;
using spillway::testing::pure_schema;
using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

TEST(WriteSafetyTest, InPlaceOpWritesItsSelfArgumentOnly) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8, 8}));
  auto y = b.input("y", b.tensor({8, 8}));
  auto add = b.inplace("aten.add_.Tensor", x, {y});
  Graph g = b.build();
  GraphIndex index(g);
  WrittenStorages w = written_storages(index, index.node(add.id));
  EXPECT_FALSE(w.conservative);
  EXPECT_THAT(w.storages, ElementsAre(*b.storage_of(x)));
}

TEST(WriteSafetyTest, ForeachWriteThroughTensorListWithNoReturn) {
  GraphBuilder b;
  b.op("aten._foreach_add_.List", mutable_schema("aten", {"self", "other"}, {"self"}));
  auto a = b.input("a", b.tensor({8}));
  auto c = b.input("c", b.tensor({8}));
  auto d = b.input("d", b.tensor({8}));
  auto foreach = b.call_value("aten._foreach_add_.List", {list({a, c}), list({d, d})}, Value::none());
  Graph g = b.build();
  GraphIndex index(g);
  WrittenStorages w = written_storages(index, index.node(foreach.id));
  EXPECT_FALSE(w.conservative);
  EXPECT_THAT(w.storages, ElementsAre(*b.storage_of(a), *b.storage_of(c)));
}

TEST(WriteSafetyTest, KwargOnlyArgumentsTakeNoPositionalSlot) {
  GraphBuilder b;
  // op(self, *, alpha, out!): positional index of `out` is 1, not 2.
  OpSchema s = mutable_schema("aten", {"self", "out"}, {"out"});
  s.arguments.insert(s.arguments.begin() + 1, OpArgument{"alpha", true, false});
  b.op("aten.weird_out.default", s);
  auto x = b.input("x", b.tensor({8}));
  auto out = b.input("out", b.tensor({8}));
  auto n = b.call("aten.weird_out.default", {x, out}, b.share(out, b.tensor({8})));
  Graph g = b.build();
  GraphIndex index(g);
  WrittenStorages w = written_storages(index, index.node(n.id));
  EXPECT_FALSE(w.conservative);
  EXPECT_THAT(w.storages, ElementsAre(*b.storage_of(out)));
}

TEST(WriteSafetyTest, WriteArgumentPassedByKeywordIsFoundByName) {
  GraphBuilder b;
  b.op("aten.mul.out", mutable_schema("aten", {"self", "other"}, {"out"}, {"out"}));
  b.graph().ops["aten.mul.out"].arguments.back().is_write = true;
  auto x = b.input("x", b.tensor({8}));
  auto out = b.input("out", b.tensor({8}));
  auto n = b.call("aten.mul.out", {x, x}, b.share(out, b.tensor({8})), {{"out", out}});
  Graph g = b.build();
  GraphIndex index(g);
  WrittenStorages w = written_storages(index, index.node(n.id));
  EXPECT_FALSE(w.conservative);
  EXPECT_THAT(w.storages, ElementsAre(*b.storage_of(out)));
}

TEST(WriteSafetyTest, UnresolvableWriteTargetIsConservative) {
  GraphBuilder b;
  b.op("aten.fill_out.default", mutable_schema("aten", {"self", "out"}, {"out"}));
  auto x = b.input("x", b.tensor({8}));
  auto y = b.input("y", b.tensor({8}));
  // `out` omitted (a positional default): every tensor argument counts.
  auto n = b.call("aten.fill_out.default", {x}, b.tensor({8}), {});
  auto m = b.call("aten.other.default", {y}, b.tensor({8}));
  Graph g = b.build();
  GraphIndex index(g);
  WrittenStorages w = written_storages(index, index.node(n.id));
  EXPECT_TRUE(w.conservative);
  EXPECT_THAT(w.storages, ElementsAre(*b.storage_of(x)));
  EXPECT_TRUE(written_storages(index, index.node(m.id)).storages.empty());
}

TEST(WriteSafetyTest, WrittenArgumentWithUnknownStorageIsConservative) {
  GraphBuilder b;
  b.op("aten.copy_.default", mutable_schema("aten", {"self", "src"}, {"self"}));
  auto dst = b.input("dst", GraphBuilder::unknown_storage(b.tensor({8})));
  auto src = b.input("src", b.tensor({8}));
  auto n = b.call("aten.copy_.default", {dst, src}, b.tensor({8}));
  Graph g = b.build();
  GraphIndex index(g);
  WrittenStorages w = written_storages(index, index.node(n.id));
  EXPECT_TRUE(w.conservative);
  EXPECT_THAT(w.storages, ElementsAre(*b.storage_of(src)));
}

TEST(WriteSafetyTest, NodesWithoutSchemaMayWriteEveryTensorArgument) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({8}));
  auto y = b.input("y", b.tensor({8}));
  auto method = b.call_method("add_", {x, y}, Value::of_tensor(b.tensor({8})));
  auto untyped = b.call_untyped("mylib.fn", {y}, Value::of_tensor(b.tensor({8})));
  Graph g = b.build();
  GraphIndex index(g);
  EXPECT_THAT(written_storages(index, index.node(method.id)).storages,
              ElementsAre(*b.storage_of(x), *b.storage_of(y)));
  EXPECT_TRUE(written_storages(index, index.node(untyped.id)).conservative);
  auto first = find_written_storages(index);
  EXPECT_EQ(first.at(*b.storage_of(y)), method.id);  // the first writer is kept
}

TEST(WriteSafetyTest, PureOpsWriteNothing) {
  GraphBuilder b;
  b.op("aten.mm.default", pure_schema("aten", {"self", "mat2"}));
  auto x = b.input("x", b.tensor({8, 8}));
  auto n = b.call("aten.mm.default", {x, x}, b.tensor({8, 8}));
  Graph g = b.build();
  GraphIndex index(g);
  EXPECT_TRUE(written_storages(index, index.node(n.id)).storages.empty());
  EXPECT_TRUE(find_written_storages(index).empty());
}

}  // namespace
}  // namespace spillway::analysis
