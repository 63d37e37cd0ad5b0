#include "analysis/inductor_fusion.h"

#include <gtest/gtest.h>

#include "testing/graph_builder.h"

namespace spillway::analysis {
namespace {

using spillway::testing::GraphBuilder;
using spillway::testing::NodeRef;

struct Ops {
  GraphBuilder b;
  NodeRef x = b.input("x", GraphBuilder::tensor({8, 8}));

  // A node of `target` reading x; `pointwise` tags its schema.
  const Node& node(const std::string& target, bool pointwise = false) {
    if (pointwise) {
      OpSchema schema = spillway::testing::pure_schema("aten", {"self"});
      schema.is_pointwise = true;
      b.op(target, schema);
    }
    const NodeRef ref = b.call(target, {x}, GraphBuilder::tensor({8, 8}));
    graph = b.build();
    return graph.nodes[static_cast<std::size_t>(ref.id)];
  }
  const OpSchema* schema(const Node& n) const { return graph.schema_of(n); }
  Graph graph;
};

TEST(InductorFusion, PointwiseOpsCastsWhereAndCloneArePointwiseAndFused) {
  Ops ops;
  for (const char* target : {"aten._to_copy.default", "prims.convert_element_type.default",
                             "aten.where.self", "aten.clone.default"}) {
    const Node& n = ops.node(target);
    EXPECT_TRUE(is_inductor_pointwise(n, ops.schema(n))) << target;
    EXPECT_TRUE(is_inductor_fused(n, ops.schema(n))) << target;
  }
  const Node& mul = ops.node("aten.mul.Tensor", /*pointwise=*/true);
  EXPECT_TRUE(is_inductor_pointwise(mul, ops.schema(mul)));
  EXPECT_TRUE(is_inductor_fused(mul, ops.schema(mul)));
}

TEST(InductorFusion, SoftmaxLossAndNormReductionsAreFusedButNotPointwise) {
  // The partitioner does not recompute reductions for free; Inductor still
  // computes them inside the kernels of their neighbours.
  Ops ops;
  for (const char* target :
       {"aten._log_softmax.default", "aten._log_softmax_backward_data.default",
        "aten._softmax.default", "aten._softmax_backward_data.default",
        "aten.nll_loss_forward.default", "aten.nll_loss_backward.default", "aten.gather.default",
        "aten.sum.dim_IntList",
        "aten.mean.dim", "aten.cat.default", "aten.slice_backward.default"}) {
    const Node& n = ops.node(target);
    EXPECT_FALSE(is_inductor_pointwise(n, ops.schema(n))) << target;
    EXPECT_TRUE(is_inductor_fused(n, ops.schema(n))) << target;
  }
}

TEST(InductorFusion, ExternKernelsAndNonCallsAreNeither) {
  Ops ops;
  for (const char* target :
       {"aten.mm.default", "aten._scaled_dot_product_cudnn_attention.default",
        "aten.embedding_dense_backward.default", "aten.index_put_.default"}) {
    const Node& n = ops.node(target);
    EXPECT_FALSE(is_inductor_fused(n, ops.schema(n))) << target;
  }
  const Node& placeholder = ops.graph.nodes.front();
  EXPECT_FALSE(is_inductor_fused(placeholder, ops.schema(placeholder)));
}

}  // namespace
}  // namespace spillway::analysis
