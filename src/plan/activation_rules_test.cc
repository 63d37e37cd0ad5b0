// One test per selection rule: each builds the smallest graph whose candidate
// that rule (and no earlier one) must reject, and checks the plan's decision.
// Removing a rule makes its test fail: the value would be chosen or rejected by
// a later rule instead.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "plan/plan_test_util.h"

namespace spillway::plan::test {
namespace {

using spillway::testing::list;
using spillway::testing::lit;
using spillway::testing::mutable_schema;
using spillway::testing::str;

Rule rule_of(const Graph& g, NodeRef ref, ActivationPlanOptions options = {}) {
  return decision_for(plan_and_check(g, options).plan, ref.id).rule;
}

TEST(ActivationRulesTest, BaselineCandidateIsChosen) {
  AttentionGraph a;
  Graph g = a.finish();
  PlanResult r = plan_and_check(g);
  EXPECT_EQ(decision_for(r.plan, a.q.id).rule, Rule::kChosen);
  EXPECT_EQ(r.plan.candidate_count, 1);
  EXPECT_EQ(r.plan.bytes_offloaded, 2 * kMiB);
  // Every forward tensor-valued node has a decision; backward ones have none.
  EXPECT_EQ(decision_for(r.plan, a.x.id).rule, Rule::kOutOfScope);
  EXPECT_EQ(decision_for(r.plan, a.relu.id).rule, Rule::kStorageIsOutput);
  for (const ValueDecision& d : r.plan.decisions) EXPECT_NE(d.node, a.grad.id);
}

TEST(ActivationRulesTest, OutOfScope) {
  AttentionGraph a;
  a.b.node(a.q).module_stack = {"model.layers.0", "model.layers.0.mlp"};
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kOutOfScope);
}

TEST(ActivationRulesTest, ScopeOptionNamesTheLeaf) {
  AttentionGraph a;
  a.b.node(a.q).module_stack = {"model.layers.0", "model.layers.0.mlp"};
  ActivationPlanOptions options;
  options.scope = "mlp";
  EXPECT_EQ(rule_of(a.finish(), a.q, options), Rule::kChosen);
}

TEST(ActivationRulesTest, NotCallFunction) {
  AttentionGraph a;
  a.b.forward().within("model.layers.0.self_attn");
  auto p = a.b.param("model.layers.0.self_attn.weight", two_mib());
  auto m = a.b.call_method("contiguous", {a.q}, Value::of_tensor(two_mib()));
  a.b.backward();
  a.b.call("aten.mm.default", {p, m}, two_mib());
  Graph g = a.finish();
  EXPECT_EQ(rule_of(g, p), Rule::kNotCallFunction);
  EXPECT_EQ(rule_of(g, m), Rule::kNotCallFunction);
}

TEST(ActivationRulesTest, OffloadOpsAreNeverCandidates) {
  AttentionGraph a;
  a.b.forward().within("model.layers.0.self_attn");
  auto ao = a.b.call("ao.offload.default", {a.x}, two_mib());
  auto ours = a.b.call(std::string(kReloadTarget), {a.x, str("cuda:0")}, two_mib());
  a.b.backward();
  a.b.call("aten.add.Tensor", {ao, ours}, two_mib());
  Graph g = a.finish();
  EXPECT_EQ(rule_of(g, ao), Rule::kOffloadOp);
  EXPECT_EQ(rule_of(g, ours), Rule::kOffloadOp);
}

TEST(ActivationRulesTest, ViewsAreSkipped) {
  AttentionGraph a;
  a.b.forward().within("model.layers.0.self_attn");
  auto t = a.b.view("aten.t.default", a.q, two_mib());
  a.b.backward();
  a.b.call("aten.neg.default", {t}, two_mib());
  EXPECT_EQ(rule_of(a.finish(), t), Rule::kView);
}

TEST(ActivationRulesTest, CollectivesAndTheirWaitsAreSkipped) {
  AttentionGraph a;
  a.b.op("_c10d_functional.all_reduce.default",
         spillway::testing::pure_schema("_c10d_functional", {"input", "op", "group"}));
  a.b.forward().within("model.layers.0.self_attn");
  auto reduced = a.b.call("_c10d_functional.all_reduce.default", {a.q, str("sum"), str("0")},
                          two_mib());
  // No schema recorded: the target's namespace still counts.
  auto waited = a.b.call_untyped("_c10d_functional_autograd.wait_tensor.default", {reduced},
                                 Value::of_tensor(two_mib()));
  a.b.backward();
  a.b.call("aten.add.Tensor", {reduced, waited}, two_mib());
  Graph g = a.finish();
  EXPECT_EQ(rule_of(g, reduced), Rule::kCollective);
  EXPECT_EQ(rule_of(g, waited), Rule::kCollective);
}

TEST(ActivationRulesTest, TupleProducerIsNotATensor) {
  AttentionGraph a;
  a.b.forward().within("model.layers.0.self_attn");
  auto pair = a.b.call_value("aten.var_mean.correction", {a.q},
                             GraphBuilder::tuple({two_mib(), two_mib()}));
  a.b.backward();
  a.b.call_untyped("operator.getitem", {pair, lit(0)}, Value::of_tensor(two_mib()));
  EXPECT_EQ(rule_of(a.finish(), pair), Rule::kNotTensor);
}

TEST(ActivationRulesTest, DTensorLikeValuesAreSkipped) {
  AttentionGraph a;
  a.b.node(a.q).value.tensor.dtensor_like = true;
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kDTensor);
}

TEST(ActivationRulesTest, RankBelowTwo) {
  AttentionGraph a;
  a.b.node(a.q).value.tensor = a.b.share(a.q, GraphBuilder::tensor({1 << 21}));
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kRankBelowTwo);
}

TEST(ActivationRulesTest, NotContiguous) {
  AttentionGraph a;
  a.b.node(a.q).value.tensor =
      a.b.share(a.q, GraphBuilder::tensor({1024, 1024}, {1, 1024}));
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kNotContiguous);
}

TEST(ActivationRulesTest, UnbackedSizeIsUnknown) {
  AttentionGraph a;
  a.b.node(a.q).value.tensor = a.b.share(
      a.q, GraphBuilder::sym_tensor({SymSize::symbolic("u0", std::nullopt),
                                     SymSize::concrete(1024)}));
  Graph g = a.finish();
  PlanResult r = plan_and_check(g);
  EXPECT_EQ(decision_for(r.plan, a.q.id).rule, Rule::kUnknownSize);
  EXPECT_EQ(decision_for(r.plan, a.q.id).bytes, std::nullopt);
}

TEST(ActivationRulesTest, SymbolicSizeWithHintIsChosenWithoutTouchingTheGraph) {
  AttentionGraph a;
  a.b.node(a.q).value.tensor = a.b.share(
      a.q, GraphBuilder::sym_tensor({SymSize::symbolic("s0", 1024), SymSize::concrete(1024)}));
  Graph g = a.finish();
  PlanResult r = plan_and_check(g);
  EXPECT_EQ(decision_for(r.plan, a.q.id).rule, Rule::kChosen);
  EXPECT_EQ(r.plan.bytes_offloaded, 2 * kMiB);
  // Original nodes keep their values (the symbol is not specialised) and the
  // transfer nodes carry no size arguments.
  for (const Node& original : g.nodes) {
    EXPECT_EQ(node_with_id(r.graph, original.id).value, original.value) << original.name;
  }
  for (const Edit& e : r.plan.edits) {
    if (e.kind == EditKind::kRedirect) continue;
    for (const Arg& arg : e.node.args) EXPECT_NE(arg.kind, Arg::Kind::kSymInt);
    EXPECT_EQ(e.node.value.tensor.sizes[0], SymSize::symbolic("s0", 1024));
  }
}

TEST(ActivationRulesTest, TooSmallAndTheThresholdIsInclusive) {
  AttentionGraph a;
  ActivationPlanOptions options;
  options.min_bytes = 2 * kMiB + 1;
  Graph g = a.finish();
  EXPECT_EQ(rule_of(g, a.q, options), Rule::kTooSmall);
  options.min_bytes = 2 * kMiB;
  EXPECT_EQ(rule_of(g, a.q, options), Rule::kChosen);
}

TEST(ActivationRulesTest, UnknownStorage) {
  AttentionGraph a;
  a.b.node(a.q).value.tensor = GraphBuilder::unknown_storage(two_mib());
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kUnknownStorage);
}

TEST(ActivationRulesTest, WrittenInPlaceBySelfArgument) {
  AttentionGraph a;
  a.b.forward().within("model.layers.0.self_attn");
  a.b.inplace("aten.mul_.Tensor", a.q, {a.x});
  PlanResult r = plan_and_check(a.finish());
  EXPECT_EQ(decision_for(r.plan, a.q.id).rule, Rule::kStorageWrittenInPlace);
  EXPECT_THAT(decision_for(r.plan, a.q.id).detail, ::testing::HasSubstr("mul__0"));
}

TEST(ActivationRulesTest, WrittenThroughTensorListByForeachWithNoReturn) {
  AttentionGraph a;
  a.b.op("aten._foreach_add_.Scalar", mutable_schema("aten", {"self", "scalar"}, {"self"}));
  a.b.forward();
  a.b.call_value("aten._foreach_add_.Scalar", {list({a.x, a.q}), lit(1)}, Value::none());
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kStorageWrittenInPlace);
}

TEST(ActivationRulesTest, WrittenThroughKwargOnlyArgument) {
  AttentionGraph a;
  a.b.op("aten.sum.IntList_out",
         mutable_schema("aten", {"self", "dim"}, {"out"}, {"out"}));
  a.b.forward();
  a.b.call("aten.sum.IntList_out", {a.x, lit(0)}, a.b.share(a.q, two_mib()), {{"out", a.q}});
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kStorageWrittenInPlace);
}

TEST(ActivationRulesTest, UnresolvableWriteIsConservative) {
  AttentionGraph a;
  // Writes `out`, which this call omits: every tensor argument may be written.
  a.b.op("aten.odd_out.default", mutable_schema("aten", {"self", "out"}, {"out"}));
  a.b.forward();
  a.b.call("aten.odd_out.default", {a.q}, two_mib());
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kStorageWrittenInPlace);
}

TEST(ActivationRulesTest, CallMethodMayWriteItsArguments) {
  AttentionGraph a;
  a.b.forward();
  a.b.call_method("add_", {a.q, a.x}, Value::of_tensor(a.b.share(a.q, two_mib())));
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kStorageWrittenInPlace);
}

TEST(ActivationRulesTest, PlaceholderSharingTheStorage) {
  AttentionGraph a;
  a.b.forward().within("model.layers.0.self_attn");
  // Same storage as input x, but no view schema (an _unsafe_view-like op).
  auto alias = a.b.call("aten._unsafe_view.default", {a.x}, a.b.share(a.x, two_mib()));
  a.b.backward();
  a.b.call("aten.neg.default", {alias}, two_mib());
  EXPECT_EQ(rule_of(a.finish(), alias), Rule::kStorageSharedExternally);
}

TEST(ActivationRulesTest, MutatingSharer) {
  AttentionGraph a;
  // Writes `other` and returns an alias of `self`.
  a.b.op("aten.odd_.default", mutable_schema("aten", {"self", "other"}, {"other"}));
  a.b.forward();
  auto scratch = a.b.call("aten.empty.memory_format", {}, two_mib());
  a.b.call("aten.odd_.default", {a.q, scratch}, a.b.share(a.q, two_mib()));
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kStorageMutatingSharer);
}

TEST(ActivationRulesTest, OutputReadsTheStorage) {
  AttentionGraph a;
  a.b.forward();
  auto t = a.b.view("aten.t.default", a.q, two_mib());
  a.add_grad();
  a.b.output({a.relu, a.grad, t});
  EXPECT_EQ(rule_of(a.b.build(), a.q), Rule::kStorageIsOutput);
}

TEST(ActivationRulesTest, NonOwnerAliasByStorageOnlyFollowsItsOwner) {
  AttentionGraph a;
  a.b.forward().within("model.layers.0.self_attn");
  auto alias = a.b.call("aten._unsafe_view.default", {a.q}, a.b.share(a.q, two_mib()));
  a.b.backward();
  auto reader = a.b.call("aten.neg.default", {alias}, two_mib());
  Graph g = a.finish();
  PlanResult r = plan_and_check(g);
  EXPECT_EQ(decision_for(r.plan, a.q.id).rule, Rule::kChosen) << decision_for(r.plan, a.q.id).detail;
  EXPECT_EQ(decision_for(r.plan, alias.id).rule, Rule::kNotStorageOwner);
  EXPECT_THAT(decision_for(r.plan, alias.id).detail, ::testing::HasSubstr("(q)"));
  // The owner is offloaded once, and the alias is replayed for its reader.
  ASSERT_EQ(r.plan.offloads.size(), 1u);
  EXPECT_EQ(r.plan.offloads[0].producer, a.q.id);
  const Node& redirected = node_with_id(r.graph, reader.id);
  const Node& replay = node_with_id(r.graph, redirected.args[0].node);
  EXPECT_EQ(replay.target, "aten._unsafe_view.default");
  EXPECT_TRUE(reads(replay, r.plan.offloads[0].backward_wait_node));
}

TEST(ActivationRulesTest, NoBackwardReader) {
  AttentionGraph a;
  Graph g = a.finish();
  g.nodes[static_cast<std::size_t>(a.grad.id)].args[0] = Arg::of_node(a.x.id);
  EXPECT_EQ(rule_of(g, a.q), Rule::kNoBackwardReader);
}

TEST(ActivationRulesTest, TupleLastUse) {
  AttentionGraph a;
  a.b.forward();
  auto halves = a.b.call_value("aten.split.Tensor", {a.q, lit(512)},
                               GraphBuilder::tuple({kib(1024), kib(1024)}));
  Graph g = a.finish();
  PlanResult r = plan_and_check(g);
  EXPECT_EQ(decision_for(r.plan, a.q.id).rule, Rule::kTupleLastUse);
  EXPECT_THAT(decision_for(r.plan, a.q.id).detail, ::testing::HasSubstr(std::to_string(halves.id)));
}

// q -> split (a view returning a list) -> getitem `half`, read in backward;
// the getitem's index is `index`.
struct SplitHalf {
  AttentionGraph a;
  NodeRef halves, half, reader;
  explicit SplitHalf(Arg index) {
    a.b.op("aten.split.Tensor", spillway::testing::pure_schema("aten", {"self", "size"}));
    a.b.graph().ops["aten.split.Tensor"].is_view = true;
    a.b.forward();
    halves = a.b.call_value("aten.split.Tensor", {a.q, lit(512)},
                            GraphBuilder::tuple({a.b.share(a.q, kib(1024)),
                                                 a.b.share(a.q, kib(1024))}));
    half = a.b.named("half").call_untyped("operator.getitem", {halves, index},
                                          Value::of_tensor(a.b.share(a.q, kib(1024))));
    a.b.call("aten.relu.default", {a.q}, two_mib());  // tensor last use
    a.b.backward();
    reader = a.b.call("aten.neg.default", {half}, kib(1024));
  }
};

TEST(ActivationRulesTest, AliasReachedThroughATupleIsReplayedOnTheReload) {
  SplitHalf s(lit(0));
  const Graph g = s.a.finish();
  const PlanResult r = plan_and_check(g);
  ASSERT_EQ(decision_for(r.plan, s.a.q.id).rule, Rule::kChosen);
  // The backward reader of the half reads a getitem of a split replayed on
  // the reload, never the forward half.
  const Node& reader = node_with_id(r.graph, s.reader.id);
  const Node& half = node_with_id(r.graph, reader.args[0].node);
  EXPECT_EQ(half.name, "spillway_replay_half");
  EXPECT_EQ(half.target, "operator.getitem");
  EXPECT_EQ(half.args[1], lit(0));
  const Node& halves = node_with_id(r.graph, half.args[0].node);
  EXPECT_EQ(halves.target, "aten.split.Tensor");
  EXPECT_EQ(halves.phase, Phase::kBackward);
  EXPECT_EQ(halves.args[0].node, r.plan.offloads[0].backward_wait_node);
  // The replayed tuple's elements and the half live on the reload's storage.
  const auto reloaded =
      node_with_id(r.graph, r.plan.offloads[0].backward_wait_node).value.tensor.storage;
  for (const Value& element : halves.value.elements) EXPECT_EQ(element.tensor.storage, reloaded);
  EXPECT_EQ(half.value.tensor.storage, reloaded);
}

TEST(ActivationRulesTest, AnAliasReachedThroughAGetitemOfUnknownIndexIsUntracked) {
  SplitHalf s(spillway::testing::sym("s0", 0));  // which element it selects is unproven
  EXPECT_EQ(rule_of(s.a.finish(), s.a.q), Rule::kUntrackedReader);
}

TEST(ActivationRulesTest, BackwardReaderBeforeTheLastForwardUse) {
  AttentionGraph a;
  a.add_grad();
  a.b.forward();
  a.b.call("aten.sigmoid.default", {a.q}, two_mib());  // after the backward reader
  EXPECT_EQ(rule_of(a.finish(), a.q), Rule::kBackwardBeforeForwardUse);
}

TEST(ActivationRulesTest, TaggedForRecomputeIsLeftToTheRecomputation) {
  AttentionGraph a;
  a.b.node(a.q).recompute = true;  // a checkpoint's MUST/PREFER_RECOMPUTE
  const Graph g = a.finish();
  EXPECT_EQ(rule_of(g, a.q), Rule::kTaggedForRecompute);
  EXPECT_EQ(to_string(Rule::kTaggedForRecompute), "tagged_for_recompute");
  const PlanResult r = plan_and_check(g);
  EXPECT_TRUE(r.plan.offloads.empty());
  EXPECT_EQ(r.graph, g);
}

TEST(ActivationRulesTest, RuleNamesAndDescriptionsAreDistinct) {
  std::set<std::string_view> names;
  for (int r = 0; r <= static_cast<int>(Rule::kReplayed); ++r) {
    EXPECT_TRUE(names.insert(to_string(static_cast<Rule>(r))).second);
    EXPECT_NE(describe(static_cast<Rule>(r)), "unknown rule");
  }
}

}  // namespace
}  // namespace spillway::plan::test
