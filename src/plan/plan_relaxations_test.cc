// ActivationPlanOptions::offload_tuple_outputs and dense_storages: what each
// relaxation lets through, what stays refused, and the rewrite it produces.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "plan/dense_layout.h"
#include "plan/plan_test_util.h"

namespace spillway::plan::test {
namespace {

using spillway::testing::list;
using spillway::testing::lit;

ActivationPlanOptions relaxed(bool tuple_outputs, bool dense) {
  ActivationPlanOptions options;
  options.offload_tuple_outputs = tuple_outputs;
  options.dense_storages = dense;
  return options;
}

const Node* wait_of(const Graph& g, const Offload& offload) {
  return &node_with_id(g, offload.forward_wait_node);
}

// q = mm(x, w) (2 MiB) whose last forward use is an SDPA-like op returning a
// tuple, read through getitems; backward reads q.
struct TupleLastUse {
  AttentionGraph a;
  NodeRef sdpa, out, lse;
  explicit TupleLastUse(int getitems) {
    a.b.forward().within("model.layers.0.self_attn");
    sdpa = a.b.named("sdpa").call_value("aten._scaled_dot_product_flash_attention.default",
                                        {a.q, a.q, a.q}, GraphBuilder::tuple({two_mib(), kib(16)}));
    if (getitems >= 1) {
      out = a.b.named("out").call_untyped("operator.getitem", {sdpa, lit(0)},
                                          Value::of_tensor(two_mib()));
    }
    if (getitems >= 2) {
      lse = a.b.named("lse").call_untyped("operator.getitem", {sdpa, lit(1)},
                                          Value::of_tensor(kib(16)));
    }
    a.b.module({});
  }
};

TEST(TupleOutputsTest, OffByDefault) {
  TupleLastUse t(2);
  const Graph g = t.a.finish();
  EXPECT_FALSE(ActivationPlanOptions{}.offload_tuple_outputs);
  EXPECT_EQ(decision_for(plan_and_check(g).plan, t.a.q.id).rule, Rule::kTupleLastUse);
}

TEST(TupleOutputsTest, WaitFollowsTheLastGetitemAndDependsOnIt) {
  TupleLastUse t(2);
  const Graph g = t.a.finish();
  const PlanResult r = plan_and_check(g, relaxed(true, false));
  ASSERT_EQ(decision_for(r.plan, t.a.q.id).rule, Rule::kChosen);
  ASSERT_EQ(r.plan.offloads.size(), 1u);
  const Offload& offload = r.plan.offloads.front();
  EXPECT_EQ(offload.last_forward_use, t.sdpa.id);
  const Node& wait = *wait_of(r.graph, offload);
  ASSERT_EQ(wait.args.size(), 3u);
  EXPECT_EQ(wait.args[2].node, t.lse.id);  // the data edge: the last getitem
  EXPECT_EQ(position_of(r.graph, wait.id), position_of(r.graph, t.lse.id) + 1);
  EXPECT_GT(position_of(r.graph, wait.id), position_of(r.graph, t.sdpa.id));
  // Backward reads the reloaded value only.
  EXPECT_FALSE(reads(node_with_id(r.graph, t.a.grad.id), t.a.q.id));
  EXPECT_TRUE(reads(node_with_id(r.graph, t.a.grad.id), offload.backward_wait_node));
}

TEST(TupleOutputsTest, WithoutAGetitemStaysRefused) {
  // Nothing ties a wait to the tuple node: a scheduler could run the wait
  // (and free the storage) before the node that reads it.
  TupleLastUse t(0);
  const Graph g = t.a.finish();
  const PlanResult r = plan_and_check(g, relaxed(true, true));
  const ValueDecision& d = decision_for(r.plan, t.a.q.id);
  EXPECT_EQ(d.rule, Rule::kTupleLastUse);
  EXPECT_THAT(d.detail, ::testing::HasSubstr("no forward tensor getitem"));
}

TEST(TupleOutputsTest, BackwardGetitemDoesNotPinTheWait) {
  TupleLastUse t(0);
  t.a.b.backward();
  t.a.b.call_untyped("operator.getitem", {t.sdpa, lit(0)}, Value::of_tensor(two_mib()));
  const Graph g = t.a.finish();
  EXPECT_EQ(decision_for(plan_and_check(g, relaxed(true, false)).plan, t.a.q.id).rule,
            Rule::kTupleLastUse);
}

// A [64, 8, 2048] bf16 value laid out as the transpose of a contiguous
// [8, 64, 2048] one: strides (2048, 131072, 1). 2 MiB, dense.
TensorInfo transposed() { return GraphBuilder::tensor({64, 8, 2048}, {2048, 131072, 1}); }

struct DenseGraph {
  AttentionGraph a;
  NodeRef k, flat;
  explicit DenseGraph(TensorInfo value, bool with_view = false) {
    a.b.forward().within("model.layers.0.self_attn");
    k = a.b.named("k").call("aten.add.Tensor", {a.q, a.q}, std::move(value));
    a.b.call("aten.relu.default", {k}, two_mib());
    if (with_view) {  // a forward view of k read only by backward
      flat =
          a.b.view("aten.transpose.int", k, GraphBuilder::tensor({8, 64, 2048}), {lit(0), lit(1)});
      a.b.backward();
      a.b.named("flat_grad").call("aten.neg.default", {flat}, two_mib());
    }
    a.b.backward().within("model.layers.0.self_attn");
    a.b.named("k_grad").call("aten.mul.Tensor", {k, a.q}, two_mib());
    a.b.module({});
  }
};

TEST(DenseStoragesTest, OffByDefault) {
  DenseGraph d(transposed());
  const Graph g = d.a.finish();
  EXPECT_FALSE(ActivationPlanOptions{}.dense_storages);
  EXPECT_EQ(decision_for(plan_and_check(g).plan, d.k.id).rule, Rule::kNotContiguous);
}

TEST(DenseStoragesTest, MovesAContiguousPermuteAndRestoresSizesAndStrides) {
  DenseGraph d(transposed());
  const Graph g = d.a.finish();
  const PlanResult r = plan_and_check(g, relaxed(false, true));
  ASSERT_EQ(decision_for(r.plan, d.k.id).rule, Rule::kChosen);
  const Offload* offload = nullptr;
  for (const Offload& o : r.plan.offloads) {
    if (o.producer == d.k.id) offload = &o;
  }
  ASSERT_NE(offload, nullptr);
  EXPECT_EQ(offload->bytes, 2 * kMiB);

  // Forward: k -> permute(k, [1, 0, 2]) (contiguous view of k) -> offload.
  const Node& dense = node_with_id(r.graph, offload->dense_permute_node);
  EXPECT_EQ(dense.target, "aten.permute.default");
  EXPECT_EQ(dense.phase, Phase::kForward);
  EXPECT_EQ(dense.args[0].node, d.k.id);
  EXPECT_EQ(dense.args[1], list({lit(1), lit(0), lit(2)}));
  EXPECT_TRUE(dense.value.tensor.contiguous);
  EXPECT_EQ(dense.value.tensor.sizes, GraphBuilder::tensor({8, 64, 2048}).sizes);
  EXPECT_EQ(dense.value.tensor.strides, GraphBuilder::tensor({8, 64, 2048}).strides);
  EXPECT_EQ(dense.value.tensor.storage, node_with_id(g, d.k.id).value.tensor.storage);
  EXPECT_EQ(node_with_id(r.graph, offload->offload_node).args[0].node, dense.id);
  EXPECT_LT(position_of(r.graph, dense.id), position_of(r.graph, offload->offload_node));
  // The forward wait still keeps k itself alive.
  EXPECT_EQ(wait_of(r.graph, *offload)->args[1].node, d.k.id);

  // Backward: the reader sees permute(wait, [1, 0, 2]) with k's sizes and strides.
  const Node& restore = node_with_id(r.graph, offload->restore_permute_node);
  EXPECT_EQ(restore.target, "aten.permute.default");
  EXPECT_EQ(restore.phase, Phase::kBackward);
  EXPECT_EQ(restore.args[0].node, offload->backward_wait_node);
  EXPECT_EQ(restore.args[1], list({lit(1), lit(0), lit(2)}));
  EXPECT_EQ(restore.value.tensor.sizes, transposed().sizes);
  EXPECT_EQ(restore.value.tensor.strides, transposed().strides);
  EXPECT_FALSE(restore.value.tensor.contiguous);
  const Node& reader = node_named(r.graph, "k_grad");
  EXPECT_TRUE(reads(reader, restore.id));
  EXPECT_FALSE(reads(reader, d.k.id));
  EXPECT_LT(position_of(r.graph, restore.id), position_of(r.graph, reader.id));
  // The permute schema (a view) is recorded for the new nodes.
  ASSERT_TRUE(r.graph.ops.count("aten.permute.default"));
  EXPECT_TRUE(r.graph.ops.at("aten.permute.default").is_view);
}

TEST(DenseStoragesTest, ReplayedViewsReadTheRestoredValue) {
  DenseGraph d(transposed(), /*with_view=*/true);
  const Graph g = d.a.finish();
  const PlanResult r = plan_and_check(g, relaxed(false, true));
  ASSERT_EQ(decision_for(r.plan, d.k.id).rule, Rule::kChosen);
  const Node& replay = node_named(r.graph, "spillway_replay_transpose_0");
  for (const Offload& o : r.plan.offloads) {
    if (o.producer == d.k.id) {
      EXPECT_EQ(replay.args[0].node, o.restore_permute_node);
    }
  }
  EXPECT_TRUE(reads(node_named(r.graph, "flat_grad"), replay.id));
}

TEST(DenseStoragesTest, OverlappingOrGappyLayoutsStayRefused) {
  // Overlapping: a stride 0 (an expand).
  {
    DenseGraph d(GraphBuilder::tensor({64, 8, 2048}, {2048, 0, 1}));
    const PlanResult r = plan_and_check(d.a.finish(), relaxed(true, true));
    const ValueDecision& v = decision_for(r.plan, d.k.id);
    EXPECT_EQ(v.rule, Rule::kNotContiguous);
    EXPECT_THAT(v.detail, ::testing::HasSubstr("not a permutation of a contiguous layout"));
  }
  // Gaps: every other row of a larger buffer.
  {
    DenseGraph d(GraphBuilder::tensor({64, 8, 2048}, {2048, 262144, 1}));
    EXPECT_EQ(decision_for(plan_and_check(d.a.finish(), relaxed(true, true)).plan, d.k.id).rule,
              Rule::kNotContiguous);
  }
  // Unknown strides.
  {
    TensorInfo t = transposed();
    t.strides.clear();
    DenseGraph d(t);
    EXPECT_EQ(decision_for(plan_and_check(d.a.finish(), relaxed(true, true)).plan, d.k.id).rule,
              Rule::kNotContiguous);
  }
}

TEST(DenseStoragesTest, StorageLargerThanTheValueIsRefused) {
  // Graph format v1 records no storage_offset; the planner sees a storage
  // larger than the value through a member that reaches further (here an
  // as_strided over 4 MiB of k's storage).
  DenseGraph d(transposed());
  d.a.b.forward().within("model.layers.0.self_attn");
  d.a.b.view("aten.as_strided.default", d.k, GraphBuilder::tensor({2048, 1024}));
  const PlanResult r = plan_and_check(d.a.finish(), relaxed(true, true));
  const ValueDecision& v = decision_for(r.plan, d.k.id);
  EXPECT_EQ(v.rule, Rule::kNotContiguous);
  EXPECT_THAT(v.detail, ::testing::HasSubstr("reaches 4194304 > 2097152 bytes"));
}

TEST(DenseStoragesTest, SizeOneDimensionMustCarryTheReproducedStride) {
  // [1, 64, 8, 2048] with the size-1 dim's stride as a permute would give it
  // is accepted; the same with an arbitrary stride there is not (the restored
  // value would differ stride for stride).
  EXPECT_TRUE(dense_order(GraphBuilder::tensor({1, 64, 8, 2048}, {1048576, 2048, 131072, 1})));
  EXPECT_FALSE(dense_order(GraphBuilder::tensor({1, 64, 8, 2048}, {7, 2048, 131072, 1})));
  const std::vector<int> order =
      *dense_order(GraphBuilder::tensor({1, 64, 8, 2048}, {1048576, 2048, 131072, 1}));
  EXPECT_EQ(order, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(inverse_order(order), (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(inverse_order({2, 0, 1}), (std::vector<int>{1, 2, 0}));
}

TEST(DenseStoragesTest, EditKindsHaveNames) {
  EXPECT_EQ(to_string(EditKind::kDensePermute), "dense_permute");
  EXPECT_EQ(to_string(EditKind::kRestorePermute), "restore_permute");
}

}  // namespace
}  // namespace spillway::plan::test
