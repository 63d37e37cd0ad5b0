// verify_graph on in-memory graphs: one test per invariant of graph.h, each
// asserting the message a user would read.

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>

#include "ir/field_path.h"
#include "ir/test_graphs.h"
#include "spillway/error.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

using ir::testing::make_node;
using ir::testing::rich_graph;

std::string verify_error(const Graph& g) {
  try {
    verify_graph(g);
  } catch (const InvalidGraph& e) {
    return e.what();
  }
  return "";
}

// rich_graph() node indices used below.
constexpr std::size_t kX = 0, kW = 1, kMm = 2, kSplit = 3, kFull = 6, kAdd = 7, kOut = 11;

TEST(Verify, AcceptsTheRichGraph) { EXPECT_EQ(verify_error(rich_graph()), ""); }

TEST(Verify, Invariant1IdsUniqueAndNonNegative) {
  Graph g = rich_graph();
  g.nodes[kAdd].id = 11;
  EXPECT_EQ(verify_error(g),
            "[graph] node 11 (add_): field 'id': duplicate id 11, also used by nodes[2] (mm)");
  g = rich_graph();
  g.nodes[kW].id = -7;
  EXPECT_EQ(verify_error(g), "[graph] node -7 (w): field 'id': must be non-negative, got -7");
}

TEST(Verify, Invariant2ReferencesPointBackwards) {
  Graph g = rich_graph();
  g.nodes[kMm].args[1] = Arg::of_node(404);
  EXPECT_EQ(verify_error(g), "[graph] node 11 (mm): field 'args[1]' refers to unknown node 404");
  g = rich_graph();
  g.nodes[kFull].kwargs[2].second = Arg::of_list({Arg::none(), Arg::of_node(16)});
  EXPECT_EQ(verify_error(g),
            "[graph] node 15 (full): field 'kwargs.layout[1]' refers to node 16 (add_), which "
            "does not come earlier (a forward reference or a cycle)");
}

TEST(Verify, Invariant2HoldsWhenIdsAreNotInOrder) {
  // Ids need not increase; only positions matter (w has id 3, after x's 10).
  Graph g = rich_graph();
  EXPECT_LT(g.nodes[kW].id, g.nodes[kX].id);
  EXPECT_EQ(verify_error(g), "");
}

TEST(Verify, Invariant3NamesUniqueAndNonEmpty) {
  Graph g = rich_graph();
  g.nodes[kAdd].name = "x";
  EXPECT_EQ(verify_error(g),
            "[graph] node 16 (x): field 'name': duplicate name 'x', also used by node 10 (x)");
  g.nodes[kAdd].name.clear();
  EXPECT_EQ(verify_error(g), "[graph] node 16: field 'name' is empty");
}

TEST(Verify, Invariant4PlaceholdersTakeNoNodeInputs) {
  Graph g = rich_graph();
  g.nodes[kW].kwargs = {{"src", Arg::of_node(10)}};
  EXPECT_EQ(verify_error(g),
            "[graph] node 3 (w): field 'kwargs.src': a get_attr node takes no node inputs, got a "
            "reference to node 10");
}

TEST(Verify, Invariant5OneOutputNodeAndLast) {
  Graph g = rich_graph();
  std::swap(g.nodes[kOut], g.nodes[kOut - 1]);
  EXPECT_EQ(verify_error(g),
            "[graph] node 20 (output): an output node must be the last node, but 1 node(s) "
            "follow it");
  g = rich_graph();
  Node second = make_node(21, "output_1", NodeKind::kOutput, "output");
  g.nodes.push_back(second);
  EXPECT_EQ(verify_error(g),
            "[graph] node 20 (output): an output node must be the last node, but 1 node(s) "
            "follow it");
  g = rich_graph();
  g.nodes.pop_back();  // no output node at all is fine (a recorded op trace)
  EXPECT_EQ(verify_error(g), "");
}

TEST(Verify, Invariant6CallsRespectTheirSchema) {
  Graph g = rich_graph();
  g.nodes[kAdd].kwargs.emplace_back("beta", Arg::of_int(1));
  EXPECT_EQ(verify_error(g),
            "[graph] node 16 (add_): field 'kwargs.beta': the schema of 'aten.add_.Tensor' has no "
            "argument 'beta'");
  g = rich_graph();
  g.nodes[kAdd].args.push_back(Arg::of_int(2));  // alpha is kwarg-only
  EXPECT_EQ(verify_error(g),
            "[graph] node 16 (add_): field 'args': 3 positional arguments, but the schema of "
            "'aten.add_.Tensor' takes at most 2");
  // A call_method with the same target as an op is not bound by the schema.
  g.nodes[kAdd].kind = NodeKind::kCallMethod;
  EXPECT_EQ(verify_error(g), "");
}

TEST(Verify, Invariant7TensorFacts) {
  Graph g = rich_graph();
  g.nodes[kMm].value.tensor.element_size = 0;
  EXPECT_EQ(verify_error(g), "[graph] node 11 (mm): field 'value.element_size': must be > 0, got 0");
  g = rich_graph();
  g.nodes[kX].value.tensor.strides.pop_back();
  EXPECT_EQ(verify_error(g),
            "[graph] node 10 (x): field 'value.strides': has 1 entries for a tensor of rank 2");
  g = rich_graph();
  g.nodes[kSplit].value.elements[1].tensor.sizes[1] = SymSize::concrete(-4);
  EXPECT_EQ(verify_error(g),
            "[graph] node 12 (split): field 'value.elements[1].sizes[1]': negative size -4");
}

TEST(Verify, Invariant8Representable) {
  Graph g = rich_graph();
  g.nodes[kX].value.tensor.sizes[1].hint.reset();  // concrete, but no value
  EXPECT_EQ(verify_error(g), "[graph] node 10 (x): field 'value.sizes[1]': a concrete dim has no value");

  g = rich_graph();
  g.nodes[kFull].args[0].list[0].sym.symbol.clear();
  EXPECT_EQ(verify_error(g),
            "[graph] node 15 (full): field 'args[0][0].sym': a sym_int argument needs a symbol name");

  g = rich_graph();
  g.nodes[kX].value.tensor.storage = -1;
  EXPECT_EQ(verify_error(g), "[graph] node 10 (x): field 'value.storage': must be >= 0 or null, got -1");

  g = rich_graph();
  g.nodes[kMm].time_ms = std::nan("");
  EXPECT_EQ(verify_error(g).rfind("[graph] node 11 (mm): field 'time_ms': must be a finite number", 0), 0u);

  g = rich_graph();
  g.nodes[kFull].kwargs.emplace_back("dtype", Arg::none());
  EXPECT_EQ(verify_error(g), "[graph] node 15 (full): field 'kwargs.dtype': duplicate keyword argument");

  g = rich_graph();
  g.nodes[kMm].module_stack[1] = "model.\xc3";  // a truncated two-byte sequence
  EXPECT_EQ(verify_error(g), "[graph] node 11 (mm): field 'module_stack[1]' is not valid UTF-8");

  g = rich_graph();
  g.nodes[kMm].kind = static_cast<NodeKind>(42);
  EXPECT_EQ(verify_error(g), "[graph] node 11 (mm): field 'kind': undeclared NodeKind 42");

  g = rich_graph();
  g.nodes[kMm].value.kind = static_cast<ValueKind>(9);
  EXPECT_EQ(verify_error(g), "[graph] node 11 (mm): field 'value.type': undeclared ValueKind 9");

  g = rich_graph();
  g.ops["aten.mm.default"].arguments[1].name = "self";
  EXPECT_EQ(verify_error(g),
            "[graph] op 'aten.mm.default': field 'arguments[1].name': duplicate argument name "
            "'self' (also arguments[0])");

  g = rich_graph();
  Arg deep = Arg::of_int(1);
  for (int i = 0; i < 65; ++i) deep = Arg::of_list({deep});
  g.nodes[kFull].kwargs[2].second = deep;
  EXPECT_NE(verify_error(g).find("nest deeper than 64"), std::string::npos);
}

TEST(Verify, AcceptsEveryValidUtf8String) {
  EXPECT_TRUE(ir::is_valid_utf8(""));
  EXPECT_TRUE(ir::is_valid_utf8("plain ascii"));
  EXPECT_TRUE(ir::is_valid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"));  // é € 😀
  EXPECT_FALSE(ir::is_valid_utf8("\xc0\x80"));          // overlong NUL
  EXPECT_FALSE(ir::is_valid_utf8("\xed\xa0\x80"));      // a surrogate
  EXPECT_FALSE(ir::is_valid_utf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_FALSE(ir::is_valid_utf8("\x80"));
  EXPECT_FALSE(ir::is_valid_utf8("\xe2\x82"));
}

// A transformer-shaped graph: `layers` blocks of ~12 ops each with schemas,
// symbolic batch dims and module stacks, forward then backward.
Graph large_graph(int layers) {
  Graph g;
  g.ops["aten.mm.default"] = {"aten", false, false, {{"self"}, {"mat2"}}};
  g.ops["aten.add.Tensor"] = {"aten", false, false, {{"self"}, {"other"}, {"alpha", true}}};
  NodeId next = 0;
  auto tensor = [&](NodeId storage) {
    return Value::of_tensor(ir::testing::bf16_tensor(
        {SymSize::symbolic("s0", 4), SymSize::concrete(4096), SymSize::concrete(4096)}, storage));
  };
  Node input = make_node(next++, "x", NodeKind::kPlaceholder, "x");
  input.value = tensor(0);
  g.nodes.push_back(input);
  NodeId last = 0;
  for (int phase = 0; phase < 2; ++phase) {
    for (int layer = 0; layer < layers; ++layer) {
      std::string scope = "model.layers." + std::to_string(layer);
      for (int op = 0; op < 12; ++op) {
        NodeId id = next++;
        Node n = make_node(id, "op_" + std::to_string(id), NodeKind::kCallFunction,
                           op % 2 ? "aten.mm.default" : "aten.add.Tensor");
        n.args = {Arg::of_node(last), Arg::of_node(last > 0 ? last - 1 : 0)};
        if (op % 2 == 0) n.kwargs = {{"alpha", Arg::of_int(1)}};
        n.module_stack = {"model", scope, scope + ".mlp"};
        n.phase = phase ? Phase::kBackward : Phase::kForward;
        n.value = tensor(id);
        n.time_ms = 0.01 * op;
        g.nodes.push_back(std::move(n));
        last = id;
      }
    }
  }
  Node out = make_node(next++, "output", NodeKind::kOutput, "output");
  out.args = {Arg::of_list({Arg::of_node(last)})};
  g.nodes.push_back(out);
  return g;
}

TEST(Verify, LargeGraphRoundTripsAndStaysLinear) {
  // 32 layers * 2 phases * 12 ops: ~770 nodes; 16x that must cost about 16x,
  // not 256x (a quadratic check would show). Generous bound for a shared CI box.
  Graph small = large_graph(32), big = large_graph(512);
  auto time = [](const Graph& g) {
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 3; ++i) verify_graph(g);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double t_small = time(small), t_big = time(big);
  EXPECT_LT(t_big, 64 * t_small + 0.05) << t_small << " s vs " << t_big << " s";
  EXPECT_EQ(parse_graph(write_graph(big)), big);
}

}  // namespace
}  // namespace spillway
