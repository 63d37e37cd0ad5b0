// CostModel: measured times win; the roofline estimate picks the bf16 or
// fp32 peak, charges memory traffic and the launch floor; views and plumbing
// cost nothing; copies follow the link curves.

#include <gtest/gtest.h>

#include "spillway/sim.h"
#include "testing/graph_builder.h"

namespace spillway {
namespace {

using testing::GraphBuilder;
using testing::lit;

constexpr std::int64_t kMiB = 1 << 20;

DeviceProfile roofline_profile() {
  DeviceProfile p;
  p.name = "roofline";
  p.matmul_tflops_bf16 = 1000;  // 1e12 FLOP per ms
  p.matmul_tflops_fp32 = 100;
  p.memory_gbs = 1000;  // 1e9 bytes per ms
  p.launch_us = 5;
  p.d2h.points = {{1, 10.0}};
  p.h2d.points = {{1, 20.0}};
  p.d2h_duplex.points = {{1, 5.0}};
  p.h2d_duplex.points = {{1, 8.0}};
  return p;
}

TEST(CostModel, MeasuredTimeWinsOverTheEstimate) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({64, 64}));
  auto y = b.call("aten.mm.default", {x, x}, b.tensor({64, 64}));
  b.node(y).time_ms = 3.25;
  Graph g = b.build();
  CostModel cost(roofline_profile());
  EXPECT_DOUBLE_EQ(cost.node_ms(g, g.nodes[1]), 3.25);
  EXPECT_LT(cost.estimate_ms(g, g.nodes[1]), 3.25);
}

TEST(CostModel, MatmulIsComputeBoundAtThePeakOfItsElementSize) {
  GraphBuilder b;
  auto x16 = b.input("x16", b.tensor({4096, 4096}));
  auto x32 = b.input("x32", b.tensor({4096, 4096}, {}, 4, "float32"));
  auto w32 = b.input("w32", b.tensor({4096, 8192}, {}, 4, "float32"));
  b.call("aten.mm.default", {x16, x16}, b.tensor({4096, 4096}));
  b.call("aten.mm.default", {x32, w32}, b.tensor({4096, 8192}, {}, 4, "float32"));
  Graph g = b.build();
  CostModel cost(roofline_profile());
  const double mm16 = 2.0 * 4096 * 4096 * 4096;
  EXPECT_DOUBLE_EQ(cost.flops(g, g.nodes[3]), mm16);
  EXPECT_NEAR(cost.estimate_ms(g, g.nodes[3]), mm16 / 1e12 + 0.005, 1e-12);
  const double mm32 = 2.0 * 4096 * 8192 * 4096;
  EXPECT_DOUBLE_EQ(cost.flops(g, g.nodes[4]), mm32);
  EXPECT_NEAR(cost.estimate_ms(g, g.nodes[4]), mm32 / 1e11 + 0.005, 1e-12);
}

TEST(CostModel, MatmulFamilyReadsTheContractedDimension) {
  GraphBuilder b;
  auto bias = b.input("bias", b.tensor({32}));
  auto a = b.input("a", b.tensor({16, 64}));
  auto w = b.input("w", b.tensor({64, 32}));
  auto wt = b.input("wt", b.tensor({32, 64}));
  auto b1 = b.input("b1", b.tensor({4, 16, 64}));
  auto b2 = b.input("b2", b.tensor({4, 64, 32}));
  auto addmm = b.call("aten.addmm.default", {bias, a, w}, b.tensor({16, 32}));
  auto bmm = b.call("aten.bmm.default", {b1, b2}, b.tensor({4, 16, 32}));
  auto linear = b.call("aten.linear.default", {a, wt, bias}, b.tensor({16, 32}));
  Graph g = b.build();
  CostModel cost(roofline_profile());
  const auto& node = [&](testing::NodeRef r) -> const Node& { return b.node(r); };
  EXPECT_DOUBLE_EQ(cost.flops(g, node(addmm)), 2.0 * 16 * 32 * 64);
  EXPECT_DOUBLE_EQ(cost.flops(g, node(bmm)), 2.0 * 4 * 16 * 32 * 64);
  EXPECT_DOUBLE_EQ(cost.flops(g, node(linear)), 2.0 * 16 * 32 * 64);
}

TEST(CostModel, AttentionCountsBothProductsCausalHalvesBackwardIsTwoAndAHalf) {
  GraphBuilder b;
  // The schemas the exported graphs carry (argument names matter).
  b.op("aten._scaled_dot_product_flash_attention.default",
       testing::pure_schema("aten", {"query", "key", "value", "dropout_p", "is_causal"}));
  b.op("aten._scaled_dot_product_flash_attention_backward.default",
       testing::pure_schema("aten", {"grad_out", "query", "key", "value", "out", "logsumexp",
                                     "dropout_p", "is_causal"}));
  auto q = b.input("q", b.tensor({2, 32, 1024, 128}));
  auto k = b.input("k", b.tensor({2, 32, 2048, 128}));
  auto v = b.input("v", b.tensor({2, 32, 2048, 64}));
  auto out = GraphBuilder::tuple({b.tensor({2, 32, 1024, 64}), b.tensor({2, 32, 1024}, {}, 4)});
  Arg yes;
  yes.kind = Arg::Kind::kBool;
  yes.b = true;
  Arg zero;
  zero.kind = Arg::Kind::kDouble;
  auto full =
      b.call_value("aten._scaled_dot_product_flash_attention.default", {q, k, v, zero}, out);
  auto causal = b.call_value("aten._scaled_dot_product_flash_attention.default",
                             {q, k, v, zero, yes}, out);
  auto grad = b.input("g", b.tensor({2, 32, 1024, 64}));
  auto lse = b.input("lse", b.tensor({2, 32, 1024}, {}, 4));
  auto backward = b.call_value("aten._scaled_dot_product_flash_attention_backward.default",
                               {grad, q, k, v, grad, lse, zero, yes},
                               GraphBuilder::tuple({b.tensor({2, 32, 1024, 128})}));
  Graph g = b.build();
  DeviceProfile fast_memory = roofline_profile();
  fast_memory.memory_gbs = 1e9;  // compute-bound
  CostModel cost(fast_memory);
  const double forward = 2.0 * (2 * 32 * 1024) * 2048 * (128 + 64);
  EXPECT_DOUBLE_EQ(cost.flops(g, b.node(full)), forward);
  EXPECT_DOUBLE_EQ(cost.flops(g, b.node(causal)), forward / 2);
  EXPECT_DOUBLE_EQ(cost.flops(g, b.node(backward)), 2.5 * forward / 2);
  EXPECT_NEAR(cost.node_ms(g, b.node(full)), forward / 1e12 + 0.005, 1e-12);

  // Measured attention rates replace the matmul peak, forward and backward
  // apart; a 32-bit attention keeps the fp32 matmul peak.
  DeviceProfile calibrated = fast_memory;
  calibrated.attention_tflops_bf16 = 0.25;
  calibrated.attention_backward_tflops_bf16 = 0.2;
  CostModel measured(calibrated);
  EXPECT_NEAR(measured.node_ms(g, b.node(causal)), forward / 2 / 0.25e9 + 0.005, 1e-9);
  EXPECT_NEAR(measured.node_ms(g, b.node(backward)), 2.5 * forward / 2 / 0.2e9 + 0.005, 1e-9);
}

TEST(CostModel, PointwiseIsMemoryBoundOnInputAndOutputBytes) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({1024, 1024}));
  auto y = b.call("aten.add.Tensor", {x, x}, b.tensor({1024, 1024}));
  Graph g = b.build();
  CostModel cost(roofline_profile());
  EXPECT_DOUBLE_EQ(cost.flops(g, b.node(y)), 0);
  EXPECT_NEAR(cost.node_ms(g, b.node(y)), 3.0 * 2 * kMiB / 1e9 + 0.005, 1e-12);
}

TEST(CostModel, ViewsGetitemPlumbingAndAliasesTakeNoTime) {
  GraphBuilder b;
  auto x = b.input("x", b.tensor({1024, 1024}));
  auto t = b.view("aten.t.default", x, b.tensor({1024, 1024}, {1, 1024}));
  auto y = b.call("aten.clone.default", {t}, b.tensor({1024, 1024}));
  auto alias = b.call("aten._unsafe_view.default", {y}, b.share(y, b.tensor({1, 1024, 1024})));
  auto pair = b.call_value("aten.split.Tensor", {y, lit(512)},
                           GraphBuilder::tuple({b.tensor({512, 1024}), b.tensor({512, 1024})}));
  auto half = b.call_untyped("operator.getitem", {pair, lit(0)},
                             Value::of_tensor(b.tensor({512, 1024})));
  auto offload = b.call("spillway.offload.default", {y}, b.tensor({1024, 1024}));
  b.node(y).time_ms.reset();
  Graph g = b.build();
  CostModel cost(roofline_profile());
  EXPECT_EQ(cost.node_ms(g, b.node(x)), 0);
  EXPECT_EQ(cost.node_ms(g, b.node(t)), 0);
  EXPECT_GT(cost.node_ms(g, b.node(y)), 0);
  EXPECT_EQ(cost.node_ms(g, b.node(alias)), 0);
  EXPECT_EQ(cost.node_ms(g, b.node(half)), 0);
  EXPECT_EQ(cost.node_ms(g, b.node(offload)), 0);
}

TEST(CostModel, CopiesFollowTheLinkCurves) {
  CostModel cost(roofline_profile());
  EXPECT_DOUBLE_EQ(cost.d2h_ms(10'000'000), 1.0);  // 10 GB/s
  EXPECT_DOUBLE_EQ(cost.h2d_ms(10'000'000), 0.5);
  EXPECT_DOUBLE_EQ(cost.d2h_ms(10'000'000, /*duplex=*/true), 2.0);
  EXPECT_DOUBLE_EQ(cost.h2d_ms(8'000'000, /*duplex=*/true), 1.0);
  EXPECT_EQ(cost.d2h_ms(0), 0);
}

}  // namespace
}  // namespace spillway
