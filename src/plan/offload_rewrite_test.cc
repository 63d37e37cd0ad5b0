// The edits of the offload rewrite, one test per edit kind and placement rule.
// Every test also checks (in plan_and_check) that the rewritten graph passes
// verify_offload_graph and that apply_edits(graph, edits) reproduces it.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "plan/plan_test_util.h"

namespace spillway::plan::test {
namespace {

using ::testing::ElementsAre;

std::vector<EditKind> kinds(const Plan& plan) {
  std::vector<EditKind> out;
  for (const Edit& e : plan.edits) out.push_back(e.kind);
  return out;
}

std::vector<NodeId> node_args(const Node& n) {
  std::vector<NodeId> out;
  n.for_each_input([&](NodeId id) { out.push_back(id); });
  return out;
}


// The offload of `producer` in `plan`; fails the test when there is none.
const Offload& offload_of(const Plan& plan, NodeId producer) {
  for (const Offload& o : plan.offloads) {
    if (o.producer == producer) return o;
  }
  ADD_FAILURE() << "no offload of node " << producer;
  static const Offload kNone;
  return kNone;
}
TEST(OffloadRewriteTest, OffloadWaitReloadWaitAndRedirect) {
  AttentionGraph a;
  Graph g = a.finish();
  const TensorInfo q_info = g.nodes[2].value.tensor;
  PlanResult r = plan_and_check(g);
  const Plan& plan = r.plan;
  ASSERT_THAT(kinds(plan), ElementsAre(EditKind::kOffload, EditKind::kForwardWait,
                                       EditKind::kReload, EditKind::kBackwardWait,
                                       EditKind::kRedirect));
  const Edit& offload = plan.edits[0];
  EXPECT_EQ(offload.anchor, a.q.id);
  EXPECT_EQ(offload.placement, Placement::kAfter);
  EXPECT_EQ(offload.node.id, 6);  // above every existing id
  EXPECT_EQ(offload.node.name, "spillway_offload_q");
  EXPECT_EQ(offload.node.target, kOffloadTarget);
  EXPECT_EQ(offload.node.phase, Phase::kForward);
  EXPECT_EQ(offload.node.module_stack, g.nodes[2].module_stack);
  EXPECT_THAT(node_args(offload.node), ElementsAre(a.q.id));
  EXPECT_EQ(offload.node.value.tensor.device, "cpu");
  EXPECT_EQ(offload.node.value.tensor.sizes, q_info.sizes);
  EXPECT_NE(offload.node.value.tensor.storage, q_info.storage);

  const Edit& forward_wait = plan.edits[1];
  EXPECT_EQ(forward_wait.anchor, a.relu.id);  // the last forward use
  EXPECT_EQ(forward_wait.placement, Placement::kAfter);
  EXPECT_EQ(forward_wait.node.target, kWaitTarget);
  EXPECT_THAT(node_args(forward_wait.node), ElementsAre(offload.node.id, a.q.id, a.relu.id));
  EXPECT_EQ(forward_wait.node.value, offload.node.value);

  const Edit& reload = plan.edits[2];
  EXPECT_EQ(reload.anchor, a.grad.id);
  EXPECT_EQ(reload.placement, Placement::kBefore);
  EXPECT_EQ(reload.node.target, kReloadTarget);
  EXPECT_EQ(reload.node.phase, Phase::kBackward);
  ASSERT_EQ(reload.node.args.size(), 2u);
  EXPECT_EQ(reload.node.args[0], Arg::of_node(forward_wait.node.id));
  EXPECT_EQ(reload.node.args[1], Arg::of_string("cuda:0"));
  EXPECT_EQ(reload.node.value.tensor.device, "cuda:0");
  EXPECT_NE(reload.node.value.tensor.storage, q_info.storage);
  EXPECT_NE(reload.node.value.tensor.storage, offload.node.value.tensor.storage);

  const Edit& backward_wait = plan.edits[3];
  EXPECT_EQ(backward_wait.anchor, a.grad.id);
  EXPECT_THAT(node_args(backward_wait.node), ElementsAre(reload.node.id, forward_wait.node.id));
  EXPECT_EQ(backward_wait.node.value, reload.node.value);

  const Edit& redirect = plan.edits[4];
  EXPECT_EQ(redirect.reader, a.grad.id);
  EXPECT_EQ(redirect.from, a.q.id);
  EXPECT_EQ(redirect.to, backward_wait.node.id);

  std::vector<std::string> names;
  for (const Node& n : r.graph.nodes) names.push_back(n.name);
  EXPECT_THAT(names, ElementsAre("x", "w", "q", "spillway_offload_q", "relu",
                                 "spillway_wait_offload_q", "spillway_reload_q",
                                 "spillway_wait_reload_q", "grad", "output"));
  EXPECT_THAT(node_args(node_named(r.graph, "grad")), ElementsAre(backward_wait.node.id, a.w.id));
  EXPECT_EQ(r.graph.ops.at(std::string(kWaitTarget)).ns, "spillway");
  EXPECT_FALSE(r.graph.ops.at(std::string(kReloadTarget)).is_mutable);
  EXPECT_FALSE(r.graph.ops.at(std::string(kOffloadTarget)).is_view);

  ASSERT_EQ(plan.offloads.size(), 1u);
  const Offload& o = plan.offloads[0];
  EXPECT_EQ(o.producer, a.q.id);
  EXPECT_EQ(o.bytes, 2 * kMiB);
  EXPECT_EQ(o.last_forward_use, a.relu.id);
  EXPECT_EQ(o.first_backward_reader, a.grad.id);
  EXPECT_EQ(o.offload_node, offload.node.id);
  EXPECT_EQ(o.forward_wait_node, forward_wait.node.id);
  EXPECT_EQ(o.reload_node, reload.node.id);
  EXPECT_EQ(o.backward_wait_node, backward_wait.node.id);
  EXPECT_FALSE(o.prefetched);
}

TEST(OffloadRewriteTest, ProducerThatIsItsOwnLastUseWaitsAfterTheOffload) {
  AttentionGraph a;
  Graph g = a.finish();
  g.nodes[static_cast<std::size_t>(a.relu.id)].args[0] = Arg::of_node(a.x.id);
  PlanResult r = plan_and_check(g);
  const Edit& forward_wait = r.plan.edits[1];
  EXPECT_EQ(forward_wait.anchor, r.plan.edits[0].node.id);
  EXPECT_THAT(node_args(forward_wait.node),
              ElementsAre(r.plan.edits[0].node.id, a.q.id, a.q.id));
  EXPECT_EQ(position_of(r.graph, forward_wait.node.id), position_of(r.graph, a.q.id) + 2);
}

// Two candidates last used by the same node and first read by the same
// backward node. FX inserts "after L" right after L, so the second forward wait
// lands before the first; all forward waits precede every reload.
TEST(OffloadRewriteTest, SharedAnchorsFollowTheReferenceInsertionOrder) {
  GraphBuilder b("two");
  auto x = b.input("x", two_mib());
  b.within("model.layers.0.self_attn");
  auto small = b.named("small").call("aten.neg.default", {x}, two_mib());
  auto big = b.named("big").call("aten.cat.default", {x, x}, GraphBuilder::tensor({2048, 1024}));
  auto last = b.named("last").call("aten.add.Tensor", {small, big}, two_mib());
  b.backward();
  auto grad = b.named("grad").call("aten.mul.Tensor", {big, small}, two_mib());
  b.output({last, grad});
  Graph g = b.build();
  PlanResult r = plan_and_check(g);
  ASSERT_EQ(r.plan.offloads.size(), 2u);
  EXPECT_EQ(r.plan.offloads[0].producer, big.id);  // largest first
  EXPECT_EQ(r.plan.offloads[1].producer, small.id);
  EXPECT_THAT(kinds(r.plan),
              ElementsAre(EditKind::kOffload, EditKind::kForwardWait, EditKind::kOffload,
                          EditKind::kForwardWait, EditKind::kReload, EditKind::kBackwardWait,
                          EditKind::kRedirect, EditKind::kReload, EditKind::kBackwardWait,
                          EditKind::kRedirect));
  std::vector<std::string> names;
  for (const Node& n : r.graph.nodes) names.push_back(n.name);
  EXPECT_THAT(names, ElementsAre("x", "small", "spillway_offload_small", "big",
                                 "spillway_offload_big", "last", "spillway_wait_offload_small",
                                 "spillway_wait_offload_big", "spillway_reload_big",
                                 "spillway_wait_reload_big", "spillway_reload_small",
                                 "spillway_wait_reload_small", "grad", "output"));
  EXPECT_THAT(node_args(node_named(r.graph, "grad")),
              ElementsAre(r.plan.offloads[0].backward_wait_node,
                          r.plan.offloads[1].backward_wait_node));
}

TEST(OffloadRewriteTest, BackwardReaderOfATransposeReadsAReplayedView) {
  AttentionGraph a;
  a.b.within("model.layers.0.self_attn.inner");
  auto t = a.b.named("qt").view("aten.t.default", a.q, GraphBuilder::tensor({1024, 1024}, {1, 1024}));
  auto tt = a.b.named("qtu").view("aten.unsqueeze.default", t,
                                  GraphBuilder::tensor({1, 1024, 1024}, {1024 * 1024, 1, 1024}),
                                  {spillway::testing::lit(0)});
  auto flat = a.b.named("flat").view("aten.view.default", a.q, GraphBuilder::tensor({1 << 20}));
  a.b.module({});
  a.b.call("aten.sum.default", {flat}, GraphBuilder::tensor({}));  // forward only
  a.add_grad();
  auto via_t = a.b.named("via_t").call("aten.mm.default", {t, a.w}, two_mib());
  auto via_tt = a.b.named("via_tt").call("aten.neg.default", {tt}, GraphBuilder::tensor({1, 1024, 1024}));
  Graph g = a.finish();
  PlanResult r = plan_and_check(g);
  ASSERT_EQ(r.plan.offloads.size(), 1u);
  const Offload& o = r.plan.offloads[0];
  std::vector<const Edit*> replays;
  for (const Edit& e : r.plan.edits) {
    if (e.kind == EditKind::kReplayView) replays.push_back(&e);
  }
  ASSERT_EQ(replays.size(), 2u);  // qt and qtu; the forward-only view is not replayed
  const Node& replay_t = replays[0]->node;
  EXPECT_EQ(replay_t.target, "aten.t.default");
  EXPECT_EQ(replay_t.phase, Phase::kBackward);
  EXPECT_EQ(replay_t.module_stack, g.nodes[static_cast<std::size_t>(t.id)].module_stack);
  EXPECT_THAT(node_args(replay_t), ElementsAre(o.backward_wait_node));
  EXPECT_EQ(replays[0]->anchor, a.grad.id);  // before the first backward reader
  EXPECT_EQ(replays[0]->placement, Placement::kBefore);
  const Node& reload = node_with_id(r.graph, o.reload_node);
  EXPECT_EQ(replay_t.value.tensor.storage, reload.value.tensor.storage);
  EXPECT_EQ(replay_t.value.tensor.strides, g.nodes[static_cast<std::size_t>(t.id)].value.tensor.strides);
  const Node& replay_tt = replays[1]->node;
  EXPECT_EQ(replay_tt.target, "aten.unsqueeze.default");
  EXPECT_EQ(replay_tt.args[0], Arg::of_node(replay_t.id));
  EXPECT_EQ(replay_tt.args[1], spillway::testing::lit(0));
  EXPECT_THAT(node_args(node_with_id(r.graph, via_t.id)), ElementsAre(replay_t.id, a.w.id));
  EXPECT_THAT(node_args(node_with_id(r.graph, via_tt.id)), ElementsAre(replay_tt.id));
  // The forward views are untouched and still read the producer.
  EXPECT_THAT(node_args(node_with_id(r.graph, t.id)), ElementsAre(a.q.id));
  (void)flat;
}

// Layers in forward, backward in reverse order with an MLP node between
// regions. With `reader_opens_region` the saved value's reader is the first
// node of its backward region; otherwise another node opens the region.
// `last` is each layer's last in-scope backward node (its region's end);
// without `mlp_gaps` the regions follow each other with no node between them.
struct LayeredGraph {
  GraphBuilder b{"layers"};
  std::vector<NodeRef> q, grad, opener, last;
  explicit LayeredGraph(std::vector<std::string> roots, bool reader_opens_region = true,
                        bool mlp_gaps = true) {
    auto x = b.input("x", two_mib());
    for (std::size_t i = 0; i < roots.size(); ++i) {
      b.within(roots[i]);
      q.push_back(b.named("q" + std::to_string(i)).call("aten.mm.default", {x, x}, two_mib()));
      b.named("use" + std::to_string(i)).call("aten.relu.default", {q.back()}, two_mib());
    }
    b.backward();
    grad.resize(roots.size());
    opener.resize(roots.size());
    last.resize(roots.size());
    for (std::size_t i = roots.size(); i-- > 0;) {
      b.within(roots[i]);
      if (!reader_opens_region) opener[i] = b.call("aten.neg.default", {x}, two_mib());
      grad[i] = b.named("grad" + std::to_string(i)).call("aten.mm.default", {q[i], x}, two_mib());
      last[i] = b.call("aten.neg.default", {grad[i]}, two_mib());
      if (!mlp_gaps) continue;
      b.within("model.mlp");
      b.call("aten.neg.default", {grad[i]}, two_mib());
    }
    b.module({});
    b.output({grad[0]});
  }
};

TEST(OffloadRewriteTest, ReloadsArePrefetchedRegionsEarlier) {
  LayeredGraph l({"m.layers.0.self_attn", "m.layers.1.self_attn", "m.layers.2.self_attn"});
  Graph g = l.b.build();
  for (int regions : {0, 1, 2}) {
    ActivationPlanOptions options;
    options.prefetch_regions = regions;
    PlanResult r = plan_and_check(g, options);
    ASSERT_EQ(r.plan.offloads.size(), 3u);
    auto reload_at = [&](int layer) {
      return position_of(r.graph,
                         offload_of(r.plan, l.q[static_cast<std::size_t>(layer)].id).reload_node);
    };
    auto grad_at = [&](int layer) { return position_of(r.graph, l.grad[static_cast<std::size_t>(layer)].id); };
    // Backward regions run layer 2, 1, 0; region k starts at grad of layer 2-k.
    for (int layer = 0; layer < 3; ++layer) {
      const int region = 2 - layer;
      const int target = std::max(0, region - regions);
      const int target_layer = 2 - target;
      const bool moved = target != region;
      SCOPED_TRACE("prefetch " + std::to_string(regions) + ", layer " + std::to_string(layer));
      EXPECT_EQ(offload_of(r.plan, l.q[static_cast<std::size_t>(layer)].id).prefetched, moved);
      EXPECT_LT(reload_at(layer), grad_at(target_layer));
      if (moved) {
        EXPECT_GT(reload_at(layer), grad_at(target_layer) - 4);  // just before it
      }
    }
    EXPECT_EQ(r.plan.reloads_prefetched, regions == 0 ? 0 : 2);  // layer 2 has no region before it
  }
}

// ActivationPlanOptions::release_lag: a forward wait goes before the first
// node of the forward region `lag` regions after its producer's; the last
// regions, with none that far after them, keep the wait after the last use.
TEST(OffloadRewriteTest, ReleaseLagHoldsTheForwardWaitUntilALaterRegion) {
  LayeredGraph l({"m.layers.0.self_attn", "m.layers.1.self_attn", "m.layers.2.self_attn",
                  "m.layers.3.self_attn"});
  Graph g = l.b.build();
  for (int lag : {0, 2}) {
    SCOPED_TRACE("release_lag " + std::to_string(lag));
    ActivationPlanOptions options;
    options.release_lag = lag;
    PlanResult r = plan_and_check(g, options);
    ASSERT_EQ(r.plan.offloads.size(), 4u);
    for (std::size_t layer = 0; layer < 4; ++layer) {
      SCOPED_TRACE("layer " + std::to_string(layer));
      const NodeId wait = offload_of(r.plan, l.q[layer].id).forward_wait_node;
      const NodeId use = node_named(r.graph, "use" + std::to_string(layer)).id;
      if (lag == 0 || layer + 2 >= 4) {
        EXPECT_EQ(position_of(r.graph, wait), position_of(r.graph, use) + 1);
        continue;
      }
      // Right before the first node of layer + 2, after everything of layer + 1.
      const NodeId opener = l.q[layer + 2].id;
      EXPECT_EQ(position_of(r.graph, wait) + 1, position_of(r.graph, opener));
      EXPECT_GT(position_of(r.graph, wait),
                position_of(r.graph, node_named(r.graph, "use" + std::to_string(layer + 1)).id));
      for (const Edit& e : r.plan.edits) {
        if (e.kind != EditKind::kForwardWait || e.node.id != wait) continue;
        EXPECT_EQ(e.placement, Placement::kBefore);
        EXPECT_EQ(e.anchor, opener);
      }
    }
  }
}

TEST(OffloadRewriteTest, ReusedModuleMapsEachOccurrenceToItsOwnRegion) {
  // Layers 0 and 2 share one module path (tied weights); layer 1 is its own.
  // Backward regions: shared (layer 2), other (layer 1), shared (layer 0).
  LayeredGraph l({"m.shared.self_attn", "m.other.self_attn", "m.shared.self_attn"},
                 /*reader_opens_region=*/false);
  Graph g = l.b.build();
  PlanResult r = plan_and_check(g);
  // Layer 0's reload sits inside the last region (the second occurrence of the
  // shared module), so one region earlier is layer 1's region; mapping by name
  // to the first occurrence would have moved it before layer 2's region.
  const Offload& layer0 = offload_of(r.plan, l.q[0].id);
  const std::size_t reload0 = position_of(r.graph, layer0.reload_node);
  EXPECT_TRUE(layer0.prefetched);
  EXPECT_EQ(reload0 + 1, position_of(r.graph, l.opener[1].id));
}

// The reference locates a reload's region among the regions that start at or
// before it. A reload inserted just before its reader that opens the region
// is not yet inside it: for a reused module it counts from the previous
// occurrence (kept as the reference does it).
TEST(OffloadRewriteTest, ReloadBeforeItsRegionCountsFromThePreviousOccurrence) {
  LayeredGraph l({"m.shared.self_attn", "m.other.self_attn", "m.shared.self_attn"},
                 /*reader_opens_region=*/true);
  Graph g = l.b.build();
  PlanResult r = plan_and_check(g);
  const Offload& layer0 = offload_of(r.plan, l.q[0].id);
  EXPECT_TRUE(layer0.prefetched);
  // Region of the first occurrence (layer 2's), minus one, clamps to it.
  EXPECT_LT(position_of(r.graph, layer0.reload_node), position_of(r.graph, l.grad[2].id));
}

// The forward both tests below share: a0 (4 MiB, layer 0) then a1 (2 MiB,
// layer 1), whose backward reads a transpose v1 of it; r1 is the output.
struct TransposedLayers {
  explicit TransposedLayers(GraphBuilder& b) {
    auto x = b.input("x", GraphBuilder::tensor({1024, 2048}));
    auto w = b.input("w", GraphBuilder::tensor({2048, 2048}));
    b.within("model.layers.0.self_attn");
    a0 = b.named("a0").call("aten.mm.default", {x, w}, GraphBuilder::tensor({1024, 2048}));
    auto r0 = b.named("r0").call("aten.relu.default", {a0}, GraphBuilder::tensor({1024, 2048}));
    b.within("model.layers.1.self_attn");
    a1 = b.named("a1").call("aten.relu.default", {r0}, two_mib());
    v1 = b.named("v1").view("aten.t.default", a1, GraphBuilder::tensor({1024, 1024}, {1, 1024}));
    r1 = b.named("r1").call("aten.relu.default", {a1}, two_mib());
  }
  NodeRef a0, a1, v1, r1;
};

TEST(OffloadRewriteTest, ReloadPrefetchedOntoAReplayOfALaterOffload) {
  // a0 (4 MiB, layer 0) is planned first, a1 (2 MiB, layer 1) second. a1's
  // backward reads a transpose of it first thing in layer 1's backward region,
  // so the replayed transpose opens that region, and a0's reload, prefetched
  // one region early, lands just before it: on a node a later edit inserts.
  GraphBuilder b("prefetch onto a replay");
  const auto [a0, a1, v1, r1] = TransposedLayers(b);
  b.backward().within("model.layers.1.self_attn");
  auto g1 = b.named("g1").call("aten.neg.default", {v1}, two_mib());
  b.within("model.layers.0.self_attn");
  auto g0 = b.named("g0").call("aten.mul.Tensor", {a0, g1}, GraphBuilder::tensor({1024, 2048}));
  b.module({});
  b.output({r1, g0});
  const Graph g = b.build();

  const PlanResult r = plan_and_check(g);
  ASSERT_EQ(r.plan.offloads.size(), 2u);
  const Offload& first = offload_of(r.plan, a0.id);
  EXPECT_TRUE(first.prefetched);
  const std::size_t replay = position_of(r.graph, node_named(r.graph, "spillway_replay_v1").id);
  EXPECT_EQ(position_of(r.graph, first.reload_node) + 1, replay);
  EXPECT_TRUE(reads(node_with_id(r.graph, g1.id), node_named(r.graph, "spillway_replay_v1").id));
}

// ActivationPlanOptions::prefetch_anchor = kRegionEnd: a prefetched reload is
// issued right after the last in-scope node of the region `prefetch_regions`
// earlier, so it overlaps the out-of-scope gap (here an MLP node) but is not
// resident during that region.
TEST(OffloadRewriteTest, RegionEndAnchorIssuesTheReloadAfterTheEarlierRegion) {
  LayeredGraph l({"m.layers.0.self_attn", "m.layers.1.self_attn", "m.layers.2.self_attn"});
  Graph g = l.b.build();
  for (int regions : {1, 2}) {
    SCOPED_TRACE("prefetch " + std::to_string(regions));
    ActivationPlanOptions options;
    options.prefetch_regions = regions;
    options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionEnd;
    PlanResult r = plan_and_check(g, options);
    ASSERT_EQ(r.plan.offloads.size(), 3u);
    auto at = [&](NodeId id) { return position_of(r.graph, id); };
    auto reload_of = [&](int layer) {
      return offload_of(r.plan, l.q[static_cast<std::size_t>(layer)].id).reload_node;
    };
    // Backward regions run layer 2, 1, 0. Layer 2's value (region 0) has no
    // earlier region: it stays before its reader.
    EXPECT_FALSE(offload_of(r.plan, l.q[2].id).prefetched);
    EXPECT_EQ(at(reload_of(2)) + 2, at(l.grad[2].id));  // reload, wait, reader
    EXPECT_EQ(r.plan.reloads_prefetched, 2);
    if (regions == 1) {
      // Layer L's reload right after layer L+1's region: after its last node,
      // before the MLP gap, and after every node of that region.
      for (int layer : {0, 1}) {
        EXPECT_TRUE(offload_of(r.plan, l.q[static_cast<std::size_t>(layer)].id).prefetched);
        EXPECT_EQ(at(reload_of(layer)), at(l.last[static_cast<std::size_t>(layer) + 1].id) + 1);
        EXPECT_GT(at(reload_of(layer)), at(l.grad[static_cast<std::size_t>(layer) + 1].id));
      }
    } else {
      // Region 2 - 2 = 0 for layer 0; layer 1 clamps to region 0 too. Both
      // follow layer 2's region in graph order (layer 1's reload first).
      EXPECT_EQ(at(reload_of(1)), at(l.last[2].id) + 1);
      EXPECT_EQ(at(reload_of(0)), at(l.last[2].id) + 2);
    }
    // The edits say so: after the region's last node.
    for (int layer : {0, 1}) {
      if (regions != 1) break;
      for (const Edit& e : r.plan.edits) {
        if (e.kind != EditKind::kReload || e.node.id != reload_of(layer)) continue;
        EXPECT_EQ(e.placement, Placement::kAfter);
        EXPECT_EQ(e.anchor, l.last[static_cast<std::size_t>(layer) + 1].id);
      }
    }
  }
}

TEST(OffloadRewriteTest, RegionStartAnchorIsTheDefaultAndTheReference) {
  LayeredGraph l({"m.layers.0.self_attn", "m.layers.1.self_attn", "m.layers.2.self_attn"},
                 /*reader_opens_region=*/false);
  Graph g = l.b.build();
  ActivationPlanOptions options;
  EXPECT_EQ(options.prefetch_anchor, ActivationPlanOptions::PrefetchAnchor::kRegionStart);
  PlanResult by_default = plan_and_check(g, options);
  options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionStart;
  PlanResult start = plan_and_check(g, options);
  EXPECT_EQ(start.graph, by_default.graph);
  // Layer 0's reload before the first node of layer 1's region; end
  // anchoring puts it after that region's last node instead.
  const NodeId reload0 = offload_of(start.plan, l.q[0].id).reload_node;
  EXPECT_EQ(position_of(start.graph, reload0) + 1, position_of(start.graph, l.opener[1].id));
  options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionEnd;
  PlanResult end = plan_and_check(g, options);
  EXPECT_EQ(position_of(end.graph, offload_of(end.plan, l.q[0].id).reload_node),
            position_of(end.graph, l.last[1].id) + 1);
}

// With no gap between regions, the end of region k - 1 is where region k
// starts: prefetch 1 leaves a reload that already sits there in place (not
// prefetched), prefetch 2 gives one region of lead.
TEST(OffloadRewriteTest, RegionEndAnchorOnAdjacentRegionsGivesOneRegionLessLead) {
  LayeredGraph l({"m.layers.0.self_attn", "m.layers.1.self_attn", "m.layers.2.self_attn"},
                 /*reader_opens_region=*/true, /*mlp_gaps=*/false);
  Graph g = l.b.build();
  ActivationPlanOptions options;
  options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionEnd;
  options.prefetch_regions = 1;
  PlanResult one = plan_and_check(g, options);
  EXPECT_EQ(one.plan.reloads_prefetched, 0);
  for (std::size_t layer = 0; layer < 3; ++layer) {
    const Offload& o = offload_of(one.plan, l.q[layer].id);
    EXPECT_EQ(position_of(one.graph, o.reload_node) + 2, position_of(one.graph, l.grad[layer].id));
  }
  options.prefetch_regions = 2;
  PlanResult two = plan_and_check(g, options);
  // Layer 1's reload (region 1 clamps to region 0) already follows region 0:
  // not moved; layer 0's goes after it.
  EXPECT_EQ(two.plan.reloads_prefetched, 1);
  EXPECT_FALSE(offload_of(two.plan, l.q[1].id).prefetched);
  const Offload& layer0 = offload_of(two.plan, l.q[0].id);
  EXPECT_TRUE(layer0.prefetched);
  EXPECT_EQ(position_of(two.graph, layer0.reload_node), position_of(two.graph, l.last[2].id) + 2);
  EXPECT_LT(position_of(two.graph, layer0.reload_node), position_of(two.graph, l.grad[1].id));
}

TEST(OffloadRewriteTest, RegionEndOnAReplayOfALaterOffloadIsReanchored) {
  // a0 (4 MiB, layer 0) is planned first, a1 (2 MiB, layer 1) second. Layer
  // 1's region opens with h1; a1's first backward reader g1 is outside any
  // scope and reads a transpose of a1, so the replayed transpose (layer 1's
  // module stack) sits before g1 and is the last node of layer 1's region.
  // a0's reload, anchored after that region's end, lands right after the
  // replay: on a node a later edit inserts, so its edit anchors before g1.
  GraphBuilder b("end on a replay");
  const auto [a0, a1, v1, r1] = TransposedLayers(b);
  b.backward().within("model.layers.1.self_attn");
  b.named("h1").call("aten.neg.default", {r1}, two_mib());
  b.module({});
  auto g1 = b.named("g1").call("aten.neg.default", {v1}, two_mib());
  b.within("model.layers.0.self_attn");
  auto g0 = b.named("g0").call("aten.mul.Tensor", {a0, g1}, GraphBuilder::tensor({1024, 2048}));
  b.module({});
  b.output({r1, g0});
  const Graph g = b.build();

  ActivationPlanOptions options;
  options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionEnd;
  const PlanResult r = plan_and_check(g, options);
  ASSERT_EQ(r.plan.offloads.size(), 2u);
  const Offload& first = offload_of(r.plan, a0.id);
  EXPECT_TRUE(first.prefetched);
  EXPECT_FALSE(offload_of(r.plan, a1.id).prefetched);  // no region before its own
  const NodeId replay = node_named(r.graph, "spillway_replay_v1").id;
  EXPECT_EQ(position_of(r.graph, first.reload_node), position_of(r.graph, replay) + 1);
  EXPECT_LT(position_of(r.graph, first.reload_node), position_of(r.graph, g1.id));
  for (const Edit& e : r.plan.edits) {
    if (e.node.id != first.reload_node) continue;
    EXPECT_EQ(e.anchor, g1.id);
    EXPECT_EQ(e.placement, Placement::kBefore);
  }
}

}  // namespace
}  // namespace spillway::plan::test
