#pragma once
// Helpers shared by the planner tests (test-only).

#include <gtest/gtest.h>

#include <string>

#include "spillway/plan.h"
#include "testing/graph_builder.h"

namespace spillway::plan::test {

using spillway::testing::GraphBuilder;
using spillway::testing::NodeRef;

inline constexpr std::int64_t kMiB = 1 << 20;

// A [rows, 512] bf16 tensor: rows KiB.
inline TensorInfo kib(std::int64_t rows) { return GraphBuilder::tensor({rows, 512}); }
// A [1024, 1024] bf16 tensor: 2 MiB.
inline TensorInfo two_mib() { return GraphBuilder::tensor({1024, 1024}); }

inline const ValueDecision& decision_for(const Plan& plan, NodeId id) {
  for (const ValueDecision& d : plan.decisions) {
    if (d.node == id) return d;
  }
  static const ValueDecision kMissing{-1, "<no decision>", std::nullopt, Rule::kChosen, "missing"};
  ADD_FAILURE() << "no decision for node " << id;
  return kMissing;
}

inline const Node& node_named(const Graph& g, const std::string& name) {
  for (const Node& n : g.nodes) {
    if (n.name == name) return n;
  }
  ADD_FAILURE() << "no node named " << name;
  return g.nodes.front();
}

inline const Node& node_with_id(const Graph& g, NodeId id) {
  for (const Node& n : g.nodes) {
    if (n.id == id) return n;
  }
  ADD_FAILURE() << "no node " << id;
  return g.nodes.front();
}

inline std::size_t position_of(const Graph& g, NodeId id) {
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].id == id) return i;
  }
  ADD_FAILURE() << "no node " << id;
  return 0;
}

inline bool reads(const Node& reader, NodeId id) {
  bool found = false;
  reader.for_each_input([&](NodeId input) { found = found || input == id; });
  return found;
}

// The canonical one-candidate graph: x, w inputs; q = mm(x, w) in
// model.layers.0.self_attn (2 MiB) read by a forward relu and by a backward mm
// `grad`. The constructor leaves the builder in forward after relu, so tests
// can add forward nodes; add_grad() (called by finish() if not yet) adds the
// backward reader and leaves the builder in backward.
struct AttentionGraph {
  GraphBuilder b{"attn"};
  NodeRef x, w, q, relu, grad;
  AttentionGraph() {
    x = b.input("x", two_mib());
    w = b.input("w", two_mib());
    b.within("model.layers.0.self_attn");
    q = b.named("q").call("aten.mm.default", {x, w}, two_mib());
    relu = b.named("relu").call("aten.relu.default", {q}, two_mib());
    b.module({});
  }
  void add_grad() {
    if (grad.id >= 0) return;
    b.backward().within("model.layers.0.self_attn");
    grad = b.named("grad").call("aten.mm.default", {q, w}, two_mib());
    b.module({});
  }
  Graph finish() {
    add_grad();
    b.output({relu, grad});
    return b.build();
  }
};

// Plans `g` and checks the properties every result must have.
inline PlanResult plan_and_check(const Graph& g, ActivationPlanOptions options = {}) {
  PlanResult result = plan_activation_offload(g, options);
  EXPECT_NO_THROW(verify_offload_graph(g, result.graph));
  EXPECT_EQ(apply_edits(g, result.plan.edits), result.graph);
  return result;
}

}  // namespace spillway::plan::test
