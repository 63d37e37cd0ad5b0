// verify_offload_graph catches each broken invariant and names the value.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "plan/plan_test_util.h"
#include "spillway/error.h"

namespace spillway::plan::test {
namespace {

using ::testing::HasSubstr;

std::string verify_error(const Graph& original, const Graph& rewritten) {
  try {
    verify_offload_graph(original, rewritten);
  } catch (const InvalidGraph& e) {
    return e.what();
  }
  return "<valid>";
}

struct Planned {
  AttentionGraph a;
  Graph g;
  PlanResult r;
  Planned() {
    g = a.finish();
    r = plan_activation_offload(g, {});
  }
  std::vector<Edit> edits_without(EditKind kind) const {
    std::vector<Edit> out;
    for (const Edit& e : r.plan.edits) {
      if (e.kind != kind) out.push_back(e);
    }
    return out;
  }
};

TEST(VerifyOffloadTest, PlannedGraphIsValid) {
  Planned p;
  EXPECT_EQ(verify_error(p.g, p.r.graph), "<valid>");
}

TEST(VerifyOffloadTest, MissingRedirectLeavesABackwardReaderOnTheValue) {
  Planned p;
  Graph broken = apply_edits(p.g, p.edits_without(EditKind::kRedirect));
  EXPECT_EQ(verify_error(p.g, broken),
            "[plan] offloaded value node 2 (q): invariant (c) broken: backward node 4 (grad) "
            "reads node 2 (q) directly");
}

TEST(VerifyOffloadTest, MissingReloadBreaksTheChain) {
  Planned p;
  std::vector<Edit> edits;
  for (const Edit& e : p.r.plan.edits) {
    if (e.kind == EditKind::kOffload || e.kind == EditKind::kForwardWait) edits.push_back(e);
  }
  EXPECT_THAT(verify_error(p.g, apply_edits(p.g, edits)),
              HasSubstr("node 2 (q): invariant (a) broken: node 7 (spillway_wait_offload_q) has 0 "
                        "reloads"));
}

TEST(VerifyOffloadTest, ForwardWaitBeforeALaterForwardReader) {
  Planned p;
  std::vector<Edit> edits = p.r.plan.edits;
  edits[1].anchor = edits[0].node.id;  // wait right after the offload, before relu
  edits[1].node.args[2] = Arg::of_node(p.a.q.id);
  EXPECT_THAT(verify_error(p.g, apply_edits(p.g, edits)),
              HasSubstr("invariant (b) broken: forward node 3 (relu) reads node 2 (q) after"));
}

TEST(VerifyOffloadTest, InPlaceWriteOfTheOffloadedStorage) {
  Planned p;
  Graph broken = p.r.graph;
  broken.ops["aten.relu.default"].is_mutable = true;
  broken.ops["aten.relu.default"].arguments[0].is_write = true;
  EXPECT_THAT(verify_error(p.g, broken),
              HasSubstr("invariant (d) broken: storage " +
                        std::to_string(*p.g.nodes[2].value.tensor.storage) +
                        " is written in place by node 3 (relu)"));
}

}  // namespace
}  // namespace spillway::plan::test
