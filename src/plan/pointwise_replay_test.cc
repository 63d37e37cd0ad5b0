// ActivationPlanOptions::replay_pointwise: which values are recomputed in
// backward instead of moved, and the rewrite that recomputes them.

#include <gtest/gtest.h>

#include "plan/plan_test_util.h"

namespace spillway::plan::test {
namespace {

ActivationPlanOptions replaying(std::int64_t budget = 0) {
  ActivationPlanOptions options;
  options.scope = "mlp";
  options.replay_pointwise = true;
  options.host_budget_bytes = budget;
  return options;
}

OpSchema pointwise(std::vector<std::string> names, bool random = false) {
  OpSchema schema;
  schema.ns = "aten";
  for (std::string& name : names) schema.arguments.push_back({std::move(name), false, false});
  schema.is_pointwise = true;
  schema.is_random = random;
  return schema;
}

// A gated MLP, each value 2 MiB, in model.layers.0.mlp:
//   gate = mm(x, wg); up = mm(x, wu); act = silu(gate); prod = mul(act, up);
//   out = mm(prod, wd)
// and its backward, in the order autograd runs it:
//   d_wd = mm(prod, g)        first backward reader of prod
//   g_prod = mm(g, wd)
//   g_act = mul(g_prod, up)   first backward reader of up
//   g_up = mul(g_prod, act)   first backward reader of act
//   g_gate = silu_backward(g_act, gate)   first backward reader of gate
// Mlp(Mlp::Fused{}) computes gate and up in one projection chunked in two, as
// Phi3 does: gate_up = mm(x, w) [1024, 2048]; split = split(gate_up); gate,
// up = the split's getitems (non-contiguous halves on gate_up's storage).
struct Mlp {
  struct Fused {};  // selects the fused constructor
  GraphBuilder b{"mlp"};
  NodeRef x, wg, wu, wd, g, gate, up, act, prod, out;
  NodeRef w, gate_up, halves;  // Fused only
  NodeRef d_wd, g_prod, g_act, g_up, g_gate;

  explicit Mlp(OpSchema silu = pointwise({"self"})) {
    inputs(std::move(silu));
    gate = b.named("gate").call("aten.mm.default", {x, wg}, two_mib());
    up = b.named("up").call("aten.mm.default", {x, wu}, two_mib());
  }
  explicit Mlp(Fused) {
    b.op("aten.split.Tensor",
         spillway::testing::pure_schema("aten", {"self", "split_size", "dim"}));
    b.graph().ops["aten.split.Tensor"].is_view = true;
    w = b.input("w", GraphBuilder::tensor({1024, 2048}));
    inputs(pointwise({"self"}));
    gate_up =
        b.named("gate_up").call("aten.mm.default", {x, w}, GraphBuilder::tensor({1024, 2048}));
    const TensorInfo half = b.share(gate_up, GraphBuilder::tensor({1024, 1024}, {2048, 1}));
    halves = b.named("split").call_value(
        "aten.split.Tensor", {gate_up, Arg::of_int(1024), Arg::of_int(-1)},
        GraphBuilder::tuple({half, half}));
    gate = b.named("gate").call_untyped("operator.getitem", {halves, Arg::of_int(0)},
                                        Value::of_tensor(half));
    up = b.named("up").call_untyped("operator.getitem", {halves, Arg::of_int(1)},
                                    Value::of_tensor(half));
  }
  void inputs(OpSchema silu) {
    b.op("aten.silu.default", std::move(silu));
    b.op("aten.mul.Tensor", pointwise({"self", "other"}));
    x = b.input("x", two_mib());
    wg = b.input("wg", two_mib());
    wu = b.input("wu", two_mib());
    wd = b.input("wd", two_mib());
    g = b.input("tangent", two_mib());
    b.within("model.layers.0.mlp");
  }
  // act = silu(gate) unless the test built its own act.
  void forward_rest() {
    if (act.id < 0) act = b.named("act").call("aten.silu.default", {gate}, two_mib());
    prod = b.named("prod").call("aten.mul.Tensor", {act, up}, two_mib());
    out = b.named("out").call("aten.mm.default", {prod, wd}, two_mib());
  }
  Graph finish() {
    forward_rest();
    b.backward();
    d_wd = b.named("d_wd").call("aten.mm.default", {prod, g}, two_mib());
    g_prod = b.named("g_prod").call("aten.mm.default", {g, wd}, two_mib());
    g_act = b.named("g_act").call("aten.mul.Tensor", {g_prod, up}, two_mib());
    g_up = b.named("g_up").call("aten.mul.Tensor", {g_prod, act}, two_mib());
    g_gate = b.named("g_gate").call("aten.silu_backward.default", {g_act, gate}, two_mib());
    b.module({});
    b.output({out, d_wd, g_up, g_gate});
    return b.build();
  }
};

const Offload& offload_of(const Plan& plan, NodeId producer) {
  for (const Offload& offload : plan.offloads) {
    if (offload.producer == producer) return offload;
  }
  ADD_FAILURE() << "node " << producer << " is not offloaded";
  return plan.offloads.front();
}

const Replay* replay_of(const Plan& plan, NodeId producer) {
  for (const Replay& replay : plan.replays) {
    if (replay.producer == producer) return &replay;
  }
  return nullptr;
}

// SiLU is replayed from gate, the product from SiLU and up: 2 x 2 MiB.
void expect_silu_and_product_replayed(const Plan& plan, const Mlp& m) {
  EXPECT_EQ(decision_for(plan, m.act.id).rule, Rule::kReplayed);
  EXPECT_EQ(decision_for(plan, m.act.id).detail, "from gate");
  EXPECT_EQ(decision_for(plan, m.prod.id).rule, Rule::kReplayed);
  EXPECT_EQ(decision_for(plan, m.prod.id).detail, "from act up");
  EXPECT_EQ(plan.bytes_replayed, 2 * 2 * kMiB);
}

// No backward node of the rewritten graph reads one of `values` directly.
void expect_backward_never_reads(const Graph& rewritten, std::vector<NodeRef> values) {
  for (const Node& node : rewritten.nodes) {
    if (node.phase != Phase::kBackward || node.kind == NodeKind::kOutput) continue;
    for (NodeRef value : values) {
      EXPECT_FALSE(reads(node, value.id)) << node.name << " reads node " << value.id;
    }
  }
}

TEST(PointwiseReplayTest, OffByDefaultEveryValueMoves) {
  Mlp m;
  const Graph g = m.finish();
  EXPECT_FALSE(ActivationPlanOptions{}.replay_pointwise);
  ActivationPlanOptions options = replaying();
  options.replay_pointwise = false;
  const PlanResult r = plan_and_check(g, options);
  EXPECT_EQ(r.plan.offloads.size(), 4u);
  EXPECT_TRUE(r.plan.replays.empty());
  EXPECT_EQ(r.plan.bytes_replayed, 0);
  EXPECT_EQ(r.plan.bytes_offloaded, 4 * 2 * kMiB);
  for (const Edit& edit : r.plan.edits) EXPECT_NE(edit.kind, EditKind::kReplayOp);
}

TEST(PointwiseReplayTest, SiluAndProductAreReplayedFromTheMovedProjections) {
  Mlp m;
  const Graph g = m.finish();
  const PlanResult r = plan_and_check(g, replaying());
  const Plan& plan = r.plan;

  ASSERT_EQ(plan.offloads.size(), 2u);
  EXPECT_EQ(plan.bytes_offloaded, 2 * 2 * kMiB);
  EXPECT_EQ(decision_for(plan, m.gate.id).rule, Rule::kChosen);
  EXPECT_EQ(decision_for(plan, m.up.id).rule, Rule::kChosen);
  expect_silu_and_product_replayed(plan, m);
  EXPECT_EQ(plan.candidate_count, 4);

  ASSERT_EQ(plan.replays.size(), 2u);
  const Replay& act = *replay_of(plan, m.act.id);
  const Replay& prod = *replay_of(plan, m.prod.id);
  EXPECT_EQ(act.first_backward_reader, m.g_up.id);
  // The product's replay reads act's, so act's comes before d_wd too.
  EXPECT_EQ(act.needed_before, m.d_wd.id);
  EXPECT_EQ(prod.needed_before, m.d_wd.id);

  const Node& act_copy = node_with_id(r.graph, act.replay_node);
  const Node& prod_copy = node_with_id(r.graph, prod.replay_node);
  EXPECT_EQ(act_copy.name, "spillway_replay_act");
  EXPECT_EQ(act_copy.target, "aten.silu.default");
  EXPECT_EQ(act_copy.phase, Phase::kBackward);
  EXPECT_EQ(act_copy.value.tensor.sizes, node_named(g, "act").value.tensor.sizes);
  EXPECT_NE(act_copy.value.tensor.storage, node_named(g, "act").value.tensor.storage);
  EXPECT_EQ(prod_copy.target, "aten.mul.Tensor");

  // Copies read only what the backward holds again: reloads and replays.
  const Offload& gate = offload_of(plan, m.gate.id);
  const Offload& up = offload_of(plan, m.up.id);
  ASSERT_EQ(act_copy.args.size(), 1u);
  EXPECT_EQ(act_copy.args[0].node, gate.backward_wait_node);
  ASSERT_EQ(prod_copy.args.size(), 2u);
  EXPECT_EQ(prod_copy.args[0].node, act.replay_node);
  EXPECT_EQ(prod_copy.args[1].node, up.backward_wait_node);

  // In order: gate's reload (moved up to the replay that needs it), the
  // replays, then the first backward reader.
  EXPECT_EQ(gate.first_backward_reader, m.d_wd.id);
  EXPECT_LT(position_of(r.graph, gate.backward_wait_node), position_of(r.graph, act.replay_node));
  EXPECT_LT(position_of(r.graph, up.backward_wait_node), position_of(r.graph, prod.replay_node));
  EXPECT_LT(position_of(r.graph, act.replay_node), position_of(r.graph, prod.replay_node));
  EXPECT_LT(position_of(r.graph, prod.replay_node), position_of(r.graph, m.d_wd.id));

  // Backward reads none of the forward values; it reads the copies.
  expect_backward_never_reads(r.graph, {m.gate, m.up, m.act, m.prod});
  EXPECT_TRUE(reads(node_with_id(r.graph, m.d_wd.id), prod.replay_node));
  EXPECT_TRUE(reads(node_with_id(r.graph, m.g_up.id), act.replay_node));
  // The forward saves no replayed value: no offload moves it.
  for (const Node& node : r.graph.nodes) {
    if (node.target == kOffloadTarget) {
      EXPECT_FALSE(reads(node, m.act.id) || reads(node, m.prod.id)) << node.name;
    }
  }
  EXPECT_EQ(to_string(EditKind::kReplayOp), "replay_op");
  EXPECT_EQ(to_string(Rule::kReplayed), "replayed");
}

TEST(PointwiseReplayTest, ValuesOverTheBudgetAreReplayedWhenTheirInputsMove) {
  Mlp m;
  const Graph g = m.finish();
  // Ties keep graph order: gate and up fill the budget; act and prod do not fit.
  const PlanResult r = plan_and_check(g, replaying(2 * 2 * kMiB));
  EXPECT_EQ(r.plan.offloads.size(), 2u);
  EXPECT_EQ(r.plan.bytes_offloaded, 2 * 2 * kMiB);
  EXPECT_EQ(decision_for(r.plan, m.act.id).rule, Rule::kReplayed);
  EXPECT_EQ(decision_for(r.plan, m.prod.id).rule, Rule::kReplayed);
}

TEST(PointwiseReplayTest, RandomOpsAreMovedNotReplayed) {
  Mlp m(pointwise({"self"}, /*random=*/true));  // "silu" draws from the RNG here
  const Graph g = m.finish();
  const PlanResult r = plan_and_check(g, replaying());
  EXPECT_EQ(decision_for(r.plan, m.act.id).rule, Rule::kChosen);
  // The product's inputs both move: it is still replayed.
  EXPECT_EQ(decision_for(r.plan, m.prod.id).rule, Rule::kReplayed);
}

TEST(PointwiseReplayTest, OpsWithoutThePointwiseTagAreMoved) {
  OpSchema plain = pointwise({"self"});
  plain.is_pointwise = false;
  Mlp m(plain);
  const Graph g = m.finish();
  const PlanResult r = plan_and_check(g, replaying());
  EXPECT_EQ(decision_for(r.plan, m.act.id).rule, Rule::kChosen);
  EXPECT_EQ(r.plan.replays.size(), 1u);
}

TEST(PointwiseReplayTest, AValueReadingAnUnmovedTensorIsMoved) {
  Mlp m;
  // act = mul(gate, x): x is a graph input, which backward would need itself.
  m.act = m.b.named("act").call("aten.mul.Tensor", {m.gate, m.x}, two_mib());
  const Graph g = m.finish();
  const PlanResult r = plan_and_check(g, replaying());
  EXPECT_EQ(decision_for(r.plan, m.act.id).rule, Rule::kChosen);
  EXPECT_EQ(decision_for(r.plan, m.prod.id).rule, Rule::kReplayed);
}

TEST(PointwiseReplayTest, DecomposedSiluIsRecomputedThroughItsIntermediates) {
  Mlp m;
  // Inductor's joint graph: act = gate / (1 + exp(-gate)). Backward reads
  // none of neg, exp, add, so no rule makes them candidates.
  m.b.op("aten.neg.default", pointwise({"self"}));
  m.b.op("aten.exp.default", pointwise({"self"}));
  m.b.op("aten.add.Tensor", pointwise({"self", "other"}));
  m.b.op("aten.div.Tensor", pointwise({"self", "other"}));
  NodeRef neg = m.b.named("neg").call("aten.neg.default", {m.gate}, two_mib());
  NodeRef exp = m.b.named("exp").call("aten.exp.default", {neg}, two_mib());
  NodeRef add = m.b.named("add").call("aten.add.Tensor", {exp, Arg::of_int(1)}, two_mib());
  m.act = m.b.named("act").call("aten.div.Tensor", {m.gate, add}, two_mib());
  const Graph g = m.finish();
  const PlanResult r = plan_and_check(g, replaying());

  EXPECT_EQ(decision_for(r.plan, neg.id).rule, Rule::kNoBackwardReader);
  EXPECT_EQ(decision_for(r.plan, m.act.id).rule, Rule::kReplayed);
  EXPECT_EQ(decision_for(r.plan, m.prod.id).rule, Rule::kReplayed);
  EXPECT_EQ(r.plan.replays.size(), 2u);  // intermediates are not values of the plan
  EXPECT_EQ(r.plan.bytes_replayed, 2 * 2 * kMiB);
  std::vector<std::string> copies;
  for (const Edit& edit : r.plan.edits) {
    if (edit.kind == EditKind::kReplayOp) copies.push_back(edit.node.name);
  }
  EXPECT_EQ(copies, (std::vector<std::string>{"spillway_replay_neg", "spillway_replay_exp",
                                              "spillway_replay_add", "spillway_replay_act",
                                              "spillway_replay_prod"}));
  const Node& add_copy = node_named(r.graph, "spillway_replay_add");
  EXPECT_EQ(add_copy.args[0].node, node_named(r.graph, "spillway_replay_exp").id);
  EXPECT_EQ(add_copy.args[1], Arg::of_int(1));
  expect_backward_never_reads(r.graph, {m.gate, m.up, m.act, m.prod, neg, exp, add});
}

TEST(PointwiseReplayTest, AnIntermediateWrittenInPlaceIsNotRecomputed) {
  Mlp m;
  m.b.op("aten.neg.default", pointwise({"self"}));
  m.b.op("aten.add.Tensor", pointwise({"self", "other"}));
  NodeRef neg = m.b.named("neg").call("aten.neg.default", {m.gate}, two_mib());
  m.b.inplace("aten.add_.Tensor", neg, {Arg::of_int(1)});  // the copy would miss this
  m.act = m.b.named("act").call("aten.add.Tensor", {m.gate, neg}, two_mib());
  const Graph g = m.finish();
  const PlanResult r = plan_and_check(g, replaying());
  EXPECT_EQ(decision_for(r.plan, m.act.id).rule, Rule::kChosen);
}

TEST(PointwiseReplayTest, HalvesOfAChunkedProjectionAreReplayedViewsOfItsReload) {
  Mlp m(Mlp::Fused{});
  const Graph g = m.finish();
  const PlanResult r = plan_and_check(g, replaying());
  const Plan& plan = r.plan;

  // One value moves, the fused projection; the halves are views of it, and
  // SiLU and the product are recomputed from them.
  ASSERT_EQ(plan.offloads.size(), 1u);
  EXPECT_EQ(plan.offloads[0].producer, m.gate_up.id);
  EXPECT_EQ(plan.bytes_offloaded, 4 * kMiB);
  EXPECT_EQ(decision_for(plan, m.halves.id).rule, Rule::kView);
  EXPECT_EQ(decision_for(plan, m.gate.id).rule, Rule::kNotContiguous);
  expect_silu_and_product_replayed(plan, m);

  // In backward: the reload, split and both getitems replayed on it, then the
  // copies of SiLU and the product reading the replayed halves.
  std::vector<std::string> replays;
  for (const Edit& edit : plan.edits) {
    if (edit.kind == EditKind::kReplayView || edit.kind == EditKind::kReplayOp) {
      replays.push_back(edit.node.name);
    }
  }
  EXPECT_EQ(replays, (std::vector<std::string>{"spillway_replay_split", "spillway_replay_gate",
                                               "spillway_replay_up", "spillway_replay_act",
                                               "spillway_replay_prod"}));
  const Node& split_copy = node_named(r.graph, "spillway_replay_split");
  const Node& gate_copy = node_named(r.graph, "spillway_replay_gate");
  const Node& up_copy = node_named(r.graph, "spillway_replay_up");
  EXPECT_EQ(split_copy.args[0].node, plan.offloads[0].backward_wait_node);
  EXPECT_EQ(gate_copy.args[0].node, split_copy.id);
  EXPECT_EQ(up_copy.args[1], Arg::of_int(1));
  EXPECT_EQ(node_named(r.graph, "spillway_replay_act").args[0].node, gate_copy.id);
  EXPECT_EQ(node_named(r.graph, "spillway_replay_prod").args[1].node, up_copy.id);
  EXPECT_TRUE(reads(node_with_id(r.graph, m.g_act.id), up_copy.id));
  EXPECT_TRUE(reads(node_with_id(r.graph, m.g_gate.id), gate_copy.id));
  EXPECT_LT(position_of(r.graph, plan.offloads[0].backward_wait_node),
            position_of(r.graph, split_copy.id));
  EXPECT_LT(position_of(r.graph, node_named(r.graph, "spillway_replay_prod").id),
            position_of(r.graph, m.d_wd.id));
  expect_backward_never_reads(r.graph, {m.gate_up, m.halves, m.gate, m.up, m.act, m.prod});
}

}  // namespace
}  // namespace spillway::plan::test
