#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ir/test_graphs.h"
#include "spillway/error.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

using ir::testing::make_node;
using ir::testing::rich_graph;

TEST(JsonWriter, RoundTripsEveryArgAndValueKind) {
  Graph g = rich_graph();
  verify_graph(g);
  EXPECT_EQ(parse_graph(write_graph(g)), g);
  EXPECT_EQ(parse_graph(write_graph(g, /*pretty=*/true)), g);
}

TEST(JsonWriter, KeepsKwargsInSourceOrder) {
  Graph g = rich_graph();
  Graph back = parse_graph(write_graph(g));
  const Node& full = back.nodes[6];
  ASSERT_EQ(full.kwargs.size(), 4u);
  EXPECT_EQ(full.kwargs[0].first, "pin_memory");
  EXPECT_EQ(full.kwargs[1].first, "dtype");
  EXPECT_EQ(full.kwargs[2].first, "layout");
  EXPECT_EQ(full.kwargs[3].first, "device");
}

TEST(JsonWriter, KeepsIntsAndFloatsApart) {
  Graph g;
  Node n = make_node(0, "c", NodeKind::kPlaceholder, "c");
  Arg one_float;
  one_float.kind = Arg::Kind::kDouble;
  one_float.d = 1.0;
  Arg neg_zero = one_float;
  neg_zero.d = -0.0;
  Arg tiny = one_float;
  tiny.d = 5e-324;
  n.args = {Arg::of_int(1), one_float, neg_zero, tiny,
            Arg::of_int(std::numeric_limits<std::int64_t>::min()),
            Arg::of_int(std::numeric_limits<std::int64_t>::max())};
  g.nodes = {n};
  Graph back = parse_graph(write_graph(g));
  EXPECT_EQ(back, g);
  EXPECT_EQ(back.nodes[0].args[0].kind, Arg::Kind::kInt);
  EXPECT_EQ(back.nodes[0].args[1].kind, Arg::Kind::kDouble);
  EXPECT_TRUE(std::signbit(back.nodes[0].args[2].d));
}

TEST(JsonWriter, WritesNonFiniteFloatsInTaggedForm) {
  Graph g;
  Node n = make_node(0, "c", NodeKind::kPlaceholder, "c");
  for (double d : {std::numeric_limits<double>::infinity(),
                   -std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::quiet_NaN()}) {
    Arg a;
    a.kind = Arg::Kind::kDouble;
    a.d = d;
    n.args.push_back(a);
  }
  g.nodes = {n};
  std::string text = write_graph(g);
  EXPECT_NE(text.find(R"({"float":"-inf"})"), std::string::npos) << text;
  Graph back = parse_graph(text);
  EXPECT_EQ(back.nodes[0].args[0].d, std::numeric_limits<double>::infinity());
  EXPECT_EQ(back.nodes[0].args[1].d, -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(back.nodes[0].args[2].d));
}

TEST(JsonWriter, IsDeterministic) {
  Graph g = rich_graph();
  EXPECT_EQ(write_graph(g), write_graph(parse_graph(write_graph(g))));
}

TEST(JsonWriter, PrettyPutsOneNodePerLine) {
  Graph g = rich_graph();
  std::string text = write_graph(g, /*pretty=*/true);
  std::size_t lines = 0;
  for (char c : text) lines += c == '\n';
  // {, format, version, name, metadata, ops:{, 4 ops, }, nodes:[, 12 nodes, ], }
  EXPECT_EQ(lines, 1 + 4 + 1 + g.ops.size() + 1 + 1 + g.nodes.size() + 1 + 1);
}

TEST(JsonWriter, RefusesAnInvalidGraph) {
  Graph g = rich_graph();
  g.nodes[2].args[0] = Arg::of_node(999);
  try {
    write_graph(g);
    FAIL() << "write_graph accepted a dangling reference";
  } catch (const InvalidGraph& e) {
    EXPECT_STREQ(e.what(), "[graph] node 11 (mm): field 'args[0]' refers to unknown node 999");
  }
}

// The appended optional fields: written only when true, so a graph without
// them writes the text it always did, and text without them reads as false.
TEST(JsonWriter, WritesOpTagsAndRecomputeOnlyWhenSet) {
  Graph g = rich_graph();
  const std::string plain = write_graph(g);
  EXPECT_EQ(plain.find("\"pointwise\""), std::string::npos);
  EXPECT_EQ(plain.find("\"random\""), std::string::npos);
  EXPECT_EQ(plain.find("\"recompute\""), std::string::npos);
  EXPECT_EQ(plain.find("\"cpu_ms\""), std::string::npos);
  for (const auto& [target, schema] : parse_graph(plain).ops) {
    EXPECT_FALSE(schema.is_pointwise || schema.is_random) << target;
  }

  ASSERT_FALSE(g.ops.empty());
  OpSchema& first = g.ops.begin()->second;
  first.is_pointwise = true;
  first.is_random = true;
  g.nodes[1].recompute = true;
  g.nodes[1].cpu_ms = 0.025;
  const std::string tagged = write_graph(g);
  EXPECT_NE(tagged.find("\"pointwise\":true"), std::string::npos);
  EXPECT_NE(tagged.find("\"random\":true"), std::string::npos);
  EXPECT_NE(tagged.find("\"recompute\":true"), std::string::npos);
  const Graph back = parse_graph(tagged);
  EXPECT_EQ(back, g);
  EXPECT_TRUE(back.ops.begin()->second.is_pointwise);
  EXPECT_TRUE(back.nodes[1].recompute);
  EXPECT_FALSE(back.nodes[0].recompute);
  EXPECT_EQ(back.nodes[1].cpu_ms, 0.025);
  EXPECT_FALSE(back.nodes[0].cpu_ms.has_value());
  EXPECT_EQ(parse_graph(write_graph(g, /*pretty=*/true)), g);
}

TEST(JsonWriter, EmptyGraphRoundTrips) {
  Graph g;
  EXPECT_EQ(parse_graph(write_graph(g)), g);
  EXPECT_EQ(parse_graph(write_graph(g, true)), g);
}

}  // namespace
}  // namespace spillway
