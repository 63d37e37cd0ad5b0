// simulate() on small hand-built graphs: step time, liveness, views,
// rounding, the offload/wait/reload/wait chain on the copy streams, duplex,
// the peak and its categories, and the errors of malformed chains.

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "spillway/error.h"
#include "spillway/plan.h"
#include "spillway/sim.h"
#include "testing/graph_builder.h"

namespace spillway {
namespace {

using testing::GraphBuilder;
using testing::NodeRef;
using testing::str;

constexpr std::int64_t kMiB = 1 << 20;
constexpr int kIn = static_cast<int>(MemoryCategory::kInputs);
constexpr int kAct = static_cast<int>(MemoryCategory::kActivations);
constexpr int kTmp = static_cast<int>(MemoryCategory::kTemporaries);
constexpr int kFly = static_cast<int>(MemoryCategory::kInFlight);
constexpr int kRel = static_cast<int>(MemoryCategory::kReloads);
constexpr int kRec = static_cast<int>(MemoryCategory::kRecomputed);

// Flat links (bytes per ms = gbs * 1e6) so expected times are plain divisions.
DeviceProfile flat_profile(double gbs = 10, double duplex_gbs = 5) {
  DeviceProfile p;
  p.name = "flat";
  p.matmul_tflops_bf16 = 1000;
  p.matmul_tflops_fp32 = 100;
  p.memory_gbs = 1000;
  p.launch_us = 0;
  p.d2h.points = {{1, gbs}};
  p.h2d.points = {{1, gbs}};
  p.d2h_duplex.points = {{1, duplex_gbs}};
  p.h2d_duplex.points = {{1, duplex_gbs}};
  return p;
}

// A bf16 tensor of `mib` MiB.
TensorInfo mib_tensor(std::int64_t mib) { return GraphBuilder::tensor({mib * 512, 1024}); }

NodeRef timed(GraphBuilder& b, NodeRef node, double ms) {
  b.node(node).time_ms = ms;
  return node;
}

const TimelinePoint& point_of(const SimResult& r, NodeRef node) {
  for (const TimelinePoint& p : r.timeline) {
    if (p.node == node.id) return p;
  }
  throw std::runtime_error("no timeline point for node " + std::to_string(node.id));
}

const StreamInterval& interval_of(const SimResult& r, Stream stream, NodeRef node) {
  for (const StreamInterval& i : r.intervals) {
    if (i.stream == stream && i.node == node.id) return i;
  }
  throw std::runtime_error("no interval for node " + std::to_string(node.id));
}

std::int64_t category_sum(const std::array<std::int64_t, kMemoryCategoryCount>& c) {
  return std::accumulate(c.begin(), c.end(), std::int64_t{0});
}

TEST(Simulate, ChainOfTimedNodesSumsToTheStepTime) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto a = timed(b, b.call("aten.relu.default", {x}, mib_tensor(1)), 1.5);
  auto c = timed(b, b.call("aten.relu.default", {a}, mib_tensor(1)), 2.0);
  b.backward();
  auto d = timed(b, b.call("aten.relu.default", {c}, mib_tensor(1)), 0.25);
  b.output({d});
  SimResult r = simulate(b.build(), CostModel(flat_profile()));
  EXPECT_DOUBLE_EQ(r.step_ms, 3.75);
  EXPECT_DOUBLE_EQ(r.compute_busy_ms, 3.75);
  EXPECT_EQ(r.compute_wait_ms, 0);
  ASSERT_EQ(r.timeline.size(), 5u);
  EXPECT_DOUBLE_EQ(point_of(r, c).start_ms, 1.5);
  EXPECT_DOUBLE_EQ(point_of(r, c).end_ms, 3.5);
  EXPECT_EQ(r.intervals.size(), 3u);  // the timed nodes only
}

// Execution model (12): a host that takes longer to issue a node than the
// device takes to run it holds the node's end back; the device runs ahead
// again where the host is ahead.
TEST(Simulate, ANodeEndsNoEarlierThanTheHostHasIssuedIt) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto a = timed(b, b.call("aten.relu.default", {x}, mib_tensor(1)), 1.0);
  auto c = timed(b, b.call("aten.relu.default", {a}, mib_tensor(1)), 1.0);
  auto d = timed(b, b.call("aten.relu.default", {c}, mib_tensor(1)), 4.0);
  b.output({d});
  Graph graph = b.build();
  const SimResult plain = simulate(graph, CostModel(flat_profile()));
  EXPECT_DOUBLE_EQ(plain.step_ms, 6.0);
  EXPECT_EQ(plain.host_ms, 0);
  b.node(a).cpu_ms = 0.5;  // ahead: no wait
  b.node(c).cpu_ms = 3.0;  // issued at 3.5, ready by 2.0: c ends at 3.5
  b.node(d).cpu_ms = 0.5;  // issued at 4.0, ready by 7.5
  graph = b.build();
  const SimResult r = simulate(graph, CostModel(flat_profile()));
  EXPECT_DOUBLE_EQ(r.host_ms, 4.0);
  EXPECT_DOUBLE_EQ(r.host_wait_ms, 1.5);
  EXPECT_DOUBLE_EQ(point_of(r, c).start_ms, 2.5);
  EXPECT_DOUBLE_EQ(point_of(r, c).end_ms, 3.5);
  EXPECT_DOUBLE_EQ(point_of(r, d).end_ms, 7.5);
  EXPECT_DOUBLE_EQ(r.step_ms, 7.5);
  // The host's track: what it spent issuing each node.
  const StreamInterval& issued = interval_of(r, Stream::kHost, c);
  EXPECT_DOUBLE_EQ(issued.start_ms, 0.5);
  EXPECT_DOUBLE_EQ(issued.end_ms, 3.5);
  EXPECT_EQ(std::count_if(r.intervals.begin(), r.intervals.end(),
                          [](const StreamInterval& i) { return i.stream == Stream::kHost; }),
            3);
  EXPECT_EQ(std::count_if(plain.intervals.begin(), plain.intervals.end(),
                          [](const StreamInterval& i) { return i.stream == Stream::kHost; }),
            0);
}

TEST(Simulate, StorageIsFreedAfterItsLastReader) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto a = b.call("aten.relu.default", {x}, mib_tensor(2));
  auto c = b.call("aten.relu.default", {a}, mib_tensor(4));
  auto d = b.call("aten.relu.default", {c}, mib_tensor(8));
  b.output({d});
  SimResult r = simulate(b.build(), CostModel(flat_profile()));
  // While c runs, a (its input) and c are live; while d runs, a is gone.
  EXPECT_EQ(point_of(r, c).live_bytes, (1 + 2 + 4) * kMiB);
  EXPECT_EQ(point_of(r, d).live_bytes, (1 + 4 + 8) * kMiB);
  // The output's storage lives to the end; the input's through the step.
  EXPECT_EQ(r.timeline.back().live_bytes, (1 + 8) * kMiB);
  EXPECT_EQ(r.peak_bytes, 13 * kMiB);
  EXPECT_EQ(r.peak_node, d.id);
}

TEST(Simulate, AViewAllocatesNothingAndKeepsItsBaseAlive) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto a = b.call("aten.relu.default", {x}, mib_tensor(2));
  auto v = b.view("aten.t.default", a, GraphBuilder::tensor({1024, 1024}, {1, 1024}));
  auto c = b.call("aten.relu.default", {x}, mib_tensor(4));
  auto d = b.call("aten.add.Tensor", {v, c}, mib_tensor(2));
  b.output({d});
  SimResult r = simulate(b.build(), CostModel(flat_profile()));
  EXPECT_EQ(point_of(r, v).live_bytes, point_of(r, a).live_bytes);
  // a lives until d reads its view.
  EXPECT_EQ(point_of(r, d).live_bytes, (1 + 2 + 4 + 2) * kMiB);
  // An expanded view reaches no further than its base: the storage stays 2 MiB.
  GraphBuilder e;
  auto y = e.input("y", mib_tensor(1));
  auto row = e.call("aten.relu.default", {y}, GraphBuilder::tensor({1, 1024 * 1024}));
  auto wide = e.view("aten.expand.default", row, GraphBuilder::tensor({64, 1024 * 1024}, {0, 1}));
  auto sum = e.call("aten.sum.default", {wide}, GraphBuilder::tensor({1024 * 1024}));
  e.output({sum});
  SimResult r2 = simulate(e.build(), CostModel(flat_profile()));
  EXPECT_EQ(point_of(r2, wide).live_bytes, (1 + 2) * kMiB);
}

TEST(Simulate, TupleElementsAreStoragesOfTheirOwnSharedByTheirGetitems) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto pair = b.call_value("aten.attention.default", {x},
                           GraphBuilder::tuple({mib_tensor(4), mib_tensor(2)}));
  TensorInfo first = mib_tensor(4);  // the getitem shares the element's storage
  first.storage = b.node(pair).value.elements[0].tensor.storage;
  auto out = b.call_untyped("operator.getitem", {pair, testing::lit(0)}, Value::of_tensor(first));
  auto y = b.call("aten.relu.default", {out}, mib_tensor(1));
  auto z = b.call("aten.relu.default", {y}, mib_tensor(1));
  b.output({z});
  SimResult r = simulate(b.build(), CostModel(flat_profile()));
  EXPECT_EQ(point_of(r, pair).live_bytes, (1 + 4 + 2) * kMiB);
  EXPECT_EQ(point_of(r, out).live_bytes, (1 + 4 + 2) * kMiB);  // the getitem allocates nothing
  // The unselected element goes after the tuple's last reader (the getitem);
  // the selected one after the getitem's last reader.
  EXPECT_EQ(point_of(r, y).live_bytes, (1 + 4 + 1) * kMiB);
  EXPECT_EQ(point_of(r, z).live_bytes, (1 + 1 + 1) * kMiB);
}

TEST(Simulate, AllocationsRoundUpTo512Bytes) {
  GraphBuilder b;
  auto x = b.input("x", GraphBuilder::tensor({50}));  // 100 bytes
  auto a = b.call("aten.relu.default", {x}, GraphBuilder::tensor({257}));  // 514 bytes
  b.output({a});
  SimResult r = simulate(b.build(), CostModel(flat_profile()));
  EXPECT_EQ(r.peak_bytes, 512 + 1024);
  EXPECT_EQ(r.peak_by_category[kIn], 512);
}

// x -> a (forward activation of `mib` MiB, offloaded) -> between (forward
// compute of `between_ms` after the offload) -> forward wait -> tail;
// backward: reload, `before_ms` of compute, backward wait, grad.
struct OffloadChain {
  Graph graph;
  NodeRef a, offload, between, forward_wait, tail, reload, before, backward_wait, grad;
};

OffloadChain offload_chain(std::int64_t mib, double between_ms, double before_ms) {
  GraphBuilder b;
  OffloadChain c;
  auto x = b.input("x", mib_tensor(1));
  c.a = timed(b, b.call("aten.relu.default", {x}, mib_tensor(mib)), 1.0);
  TensorInfo host = mib_tensor(mib);
  host.device = "cpu";
  c.offload = b.call(std::string(kOffloadTarget), {c.a}, host);
  c.between = timed(b, b.call("aten.relu.default", {c.a}, mib_tensor(1)), between_ms);
  c.forward_wait = b.call(std::string(kWaitTarget), {c.offload, c.a, c.between},
                          b.share(c.offload, host));
  c.tail = timed(b, b.call("aten.relu.default", {c.between}, mib_tensor(1)), 1.0);
  b.backward();
  c.reload = b.call(std::string(kReloadTarget), {c.forward_wait, str("cuda:0")}, mib_tensor(mib));
  c.before = timed(b, b.call("aten.relu.default", {c.tail}, mib_tensor(1)), before_ms);
  c.backward_wait = b.call(std::string(kWaitTarget), {c.reload, c.forward_wait},
                           b.share(c.reload, mib_tensor(mib)));
  c.grad = timed(b, b.call("aten.mul.Tensor", {c.backward_wait, c.before}, mib_tensor(1)), 1.0);
  b.output({c.grad});
  c.graph = b.build();
  return c;
}

TEST(Simulate, OffloadChainCopiesAtTheProfileRateAndStallsOnlyWhenTheCopyIsLonger) {
  const CostModel cost(flat_profile(10));
  const double copy_ms = 8.0 * kMiB / 1e7;  // 8 MiB at 10 GB/s: 0.8388608 ms
  for (double between : {0.5, 2.0}) {
    SCOPED_TRACE(between);
    OffloadChain c = offload_chain(8, between, 0.1);
    SimResult r = simulate(c.graph, cost);
    const StreamInterval& d2h = interval_of(r, Stream::kD2H, c.offload);
    EXPECT_DOUBLE_EQ(d2h.start_ms, 1.0);  // when the producer is done
    EXPECT_DOUBLE_EQ(d2h.end_ms - d2h.start_ms, copy_ms);
    EXPECT_EQ(d2h.bytes, 8 * kMiB);
    const double stall = std::max(0.0, copy_ms - between);
    const TimelinePoint& wait = point_of(r, c.forward_wait);
    EXPECT_DOUBLE_EQ(wait.start_ms, 1.0 + between + stall);
    EXPECT_NEAR(r.compute_wait_ms, stall + std::max(0.0, copy_ms - 0.1), 1e-12);
    // The H2D starts when compute reaches the reload and takes the same time.
    const StreamInterval& h2d = interval_of(r, Stream::kH2D, c.reload);
    EXPECT_DOUBLE_EQ(h2d.start_ms, point_of(r, c.reload).start_ms);
    EXPECT_DOUBLE_EQ(h2d.end_ms - h2d.start_ms, copy_ms);
    EXPECT_DOUBLE_EQ(point_of(r, c.grad).start_ms, h2d.end_ms);
    EXPECT_EQ(r.bytes_d2h, 8 * kMiB);
    EXPECT_EQ(r.bytes_h2d, 8 * kMiB);
    EXPECT_DOUBLE_EQ(r.d2h_busy_ms, copy_ms);
    EXPECT_EQ(r.host_peak_bytes, 8 * kMiB);
  }
}

TEST(Simulate, DeviceBytesDropAtTheForwardWaitAndReturnAtTheReload) {
  OffloadChain c = offload_chain(8, 1.0, 1.0);
  SimResult r = simulate(c.graph, CostModel(flat_profile()));
  const TimelinePoint& between = point_of(r, c.between);
  const TimelinePoint& wait = point_of(r, c.forward_wait);
  const TimelinePoint& tail = point_of(r, c.tail);
  const TimelinePoint& reload = point_of(r, c.reload);
  // x 1, a 8 (in flight), between 1.
  EXPECT_EQ(between.live_bytes, 10 * kMiB);
  EXPECT_EQ(between.by_category[kFly], 8 * kMiB);
  EXPECT_EQ(wait.live_bytes, 10 * kMiB);  // freed after the wait, not before
  EXPECT_EQ(tail.live_bytes, 3 * kMiB);   // x, between, tail
  EXPECT_EQ(tail.by_category[kFly], 0);
  EXPECT_EQ(reload.live_bytes - point_of(r, c.tail).live_bytes, 8 * kMiB - 1 * kMiB);
  EXPECT_EQ(reload.by_category[kRel], 8 * kMiB);
  EXPECT_EQ(point_of(r, c.grad).by_category[kRel], 8 * kMiB);
  for (const TimelinePoint& p : r.timeline) EXPECT_EQ(category_sum(p.by_category), p.live_bytes);
  // Not offloaded, a would be an activation held through to the backward.
  EXPECT_EQ(wait.by_category[kAct], 0);
}

TEST(Simulate, AForwardWaitsLastUseOrdersTheGraphButKeepsNothingAlive) {
  // The wait sits after `next` (a release lag), past the last reader of
  // `last`, the value's last forward use that it names: the runtime's wait
  // holds nothing of it, so `last` goes after `next` as if no wait named it.
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto a = b.call("aten.relu.default", {x}, mib_tensor(8));
  TensorInfo host = mib_tensor(8);
  host.device = "cpu";
  auto offload = b.call(std::string(kOffloadTarget), {a}, host);
  auto last = b.call("aten.relu.default", {a}, mib_tensor(2));
  auto next = b.call("aten.relu.default", {last}, mib_tensor(1));
  auto wait = b.call(std::string(kWaitTarget), {offload, a, last}, b.share(offload, host));
  auto tail = b.call("aten.relu.default", {next}, mib_tensor(1));
  b.output({tail});
  SimResult r = simulate(b.build(), CostModel(flat_profile()));
  EXPECT_EQ(point_of(r, next).live_bytes, (1 + 8 + 2 + 1) * kMiB);
  EXPECT_EQ(point_of(r, wait).live_bytes, (1 + 8 + 1) * kMiB);  // a until its wait; last gone
  EXPECT_EQ(point_of(r, tail).live_bytes, (1 + 1 + 1) * kMiB);
}

TEST(Simulate, DuplexSlowsACopyThatOverlapsTheOtherDirection) {
  // a's H2D is issued right after its forward wait; b's D2H starts 0.5 ms later
  // and overlaps it.
  auto build = [] {
    GraphBuilder b;
    auto x = b.input("x", mib_tensor(1));
    auto a = timed(b, b.call("aten.relu.default", {x}, mib_tensor(20)), 1.0);
    TensorInfo host = mib_tensor(20);
    host.device = "cpu";
    auto off_a = b.call(std::string(kOffloadTarget), {a}, host);
    auto fw_a = b.call(std::string(kWaitTarget), {off_a, a, a}, b.share(off_a, host));
    auto r_a = b.call(std::string(kReloadTarget), {fw_a, str("cuda:0")}, mib_tensor(20));
    auto c = timed(b, b.call("aten.relu.default", {x}, mib_tensor(20)), 0.5);
    auto off_c = b.call(std::string(kOffloadTarget), {c}, host);
    auto fw_c = b.call(std::string(kWaitTarget), {off_c, c, c}, b.share(off_c, host));
    auto bw_a = b.call(std::string(kWaitTarget), {r_a, fw_a}, b.share(r_a, mib_tensor(20)));
    auto r_c = b.call(std::string(kReloadTarget), {fw_c, str("cuda:0")}, mib_tensor(20));
    auto bw_c = b.call(std::string(kWaitTarget), {r_c, fw_c}, b.share(r_c, mib_tensor(20)));
    b.output({bw_a, bw_c});
    return std::make_pair(b.build(), std::make_pair(r_a, off_c));
  };
  auto [graph, copies] = build();
  const double bytes = 20.0 * kMiB;
  const double alone = bytes / 1e7;  // 10 GB/s
  SimResult slow = simulate(graph, CostModel(flat_profile(10, 5)));
  const StreamInterval& h2d = interval_of(slow, Stream::kH2D, copies.first);
  const StreamInterval& d2h = interval_of(slow, Stream::kD2H, copies.second);
  EXPECT_DOUBLE_EQ(h2d.end_ms - h2d.start_ms, alone);  // scheduled first: not slowed
  EXPECT_DOUBLE_EQ(d2h.start_ms, h2d.start_ms + 0.5);
  const double overlap = h2d.end_ms - d2h.start_ms;
  const double expected = overlap + (bytes - overlap * 5e6) / 1e7;
  EXPECT_NEAR(d2h.end_ms - d2h.start_ms, expected, 1e-9);
  EXPECT_GT(d2h.end_ms - d2h.start_ms, alone);
  SimResult fast = simulate(graph, CostModel(flat_profile(10, 10)));
  const StreamInterval& same = interval_of(fast, Stream::kD2H, copies.second);
  EXPECT_DOUBLE_EQ(same.end_ms - same.start_ms, alone);
  EXPECT_GT(slow.step_ms, fast.step_ms);
}

TEST(Simulate, PeakNodePhaseTimeAndCategories) {
  GraphBuilder b;
  auto w = b.input("w", mib_tensor(1));
  auto a = timed(b, b.call("aten.relu.default", {w}, mib_tensor(4)), 1.0);   // saved
  auto t = timed(b, b.call("aten.relu.default", {a}, mib_tensor(2)), 1.0);   // temporary
  auto loss = timed(b, b.call("aten.sum.default", {t}, mib_tensor(1)), 1.0);
  b.backward();
  auto big = timed(b, b.call("aten.relu.default", {loss}, mib_tensor(16)), 1.0);
  auto grad = timed(b, b.call("aten.mul.Tensor", {big, a}, mib_tensor(2)), 1.0);
  auto small = timed(b, b.call("aten.relu.default", {grad}, mib_tensor(1)), 1.0);
  b.output({small});
  SimOptions options;
  options.recomputed = {big.id};
  SimResult r = simulate(b.build(), CostModel(flat_profile()), options);
  // While grad runs: w 1, a 4, big 16, grad 2 (loss went after big: 22 there).
  EXPECT_EQ(r.peak_node, grad.id);
  EXPECT_EQ(r.peak_phase, Phase::kBackward);
  EXPECT_DOUBLE_EQ(r.peak_time_ms, 4.0);
  EXPECT_EQ(r.peak_bytes, 23 * kMiB);
  EXPECT_EQ(r.peak_by_category[kIn], 1 * kMiB);
  EXPECT_EQ(r.peak_by_category[kAct], 4 * kMiB);
  EXPECT_EQ(r.peak_by_category[kRec], 16 * kMiB);
  EXPECT_EQ(r.peak_by_category[kTmp], 2 * kMiB);
  EXPECT_DOUBLE_EQ(r.recompute_ms, 1.0);
  EXPECT_EQ(point_of(r, t).by_category[kTmp], 2 * kMiB);
}

TEST(Simulate, WithoutTimelineTheTotalsAreTheSame) {
  OffloadChain c = offload_chain(8, 0.3, 0.2);
  const CostModel cost(flat_profile());
  SimResult full = simulate(c.graph, cost);
  SimOptions without_timeline;
  without_timeline.record_timeline = false;
  SimResult lean = simulate(c.graph, cost, without_timeline);
  EXPECT_TRUE(lean.timeline.empty());
  EXPECT_TRUE(lean.intervals.empty());
  EXPECT_EQ(lean.peak_bytes, full.peak_bytes);
  EXPECT_EQ(lean.peak_node, full.peak_node);
  EXPECT_EQ(lean.step_ms, full.step_ms);
  EXPECT_EQ(lean.compute_wait_ms, full.compute_wait_ms);
  EXPECT_EQ(lean.host_peak_bytes, full.host_peak_bytes);
}

// ---- SimOptions::inductor_fusion (execution model (9)) ----------------------

SimOptions with_fusion() {
  SimOptions options;
  options.inductor_fusion = true;
  return options;
}

// An fp32 tensor with the elements of mib_tensor(mib): 2 * mib MiB.
TensorInfo fp32_of(std::int64_t mib) {
  return GraphBuilder::tensor({mib * 512, 1024}, {}, 4, "float32");
}

// Registers `target` as an op tagged torch.Tag.pointwise.
void pointwise_op(GraphBuilder& b, const std::string& target, std::vector<std::string> args) {
  OpSchema schema = testing::pure_schema("aten", std::move(args));
  schema.is_pointwise = true;
  b.op(target, schema);
}

TEST(SimulateFusion, APointwiseChainBetweenMatmulsIsNeverAllocatedAndCostsItsTraffic) {
  GraphBuilder b;
  pointwise_op(b, "aten.mul.Tensor", {"self", "other"});
  auto x = b.input("x", mib_tensor(1));
  auto w = b.input("w", mib_tensor(1));
  auto m = timed(b, b.call("aten.mm.default", {x, w}, mib_tensor(1)), 1.0);
  auto up = timed(b, b.call("aten._to_copy.default", {m}, fp32_of(1)), 0.3);    // reads 1, writes 2
  auto sq = timed(b, b.call("aten.mul.Tensor", {up, up}, fp32_of(1)), 0.3);     // reads 2, writes 2
  auto down = timed(b, b.call("aten._to_copy.default", {sq}, mib_tensor(1)), 0.3);  // reads 2, writes 1
  auto out = timed(b, b.call("aten.mm.default", {down, w}, mib_tensor(1)), 1.0);
  b.output({out});
  const Graph graph = b.build();
  const CostModel cost(flat_profile());

  const SimResult op_by_op = simulate(graph, cost);
  EXPECT_EQ(op_by_op.peak_bytes, 6 * kMiB);  // x, w, up, sq while sq runs
  EXPECT_EQ(op_by_op.peak_node, sq.id);
  EXPECT_DOUBLE_EQ(op_by_op.step_ms, 2.9);

  const SimResult fused = simulate(graph, cost, with_fusion());
  // up and sq live only inside the kernel; m (an mm's) and down (an mm reads
  // it) are allocated. The kernel that reads m is the one that writes down.
  EXPECT_EQ(point_of(fused, up).live_bytes, 3 * kMiB);  // x, w, m
  EXPECT_EQ(point_of(fused, sq).live_bytes, 3 * kMiB);
  EXPECT_EQ(point_of(fused, down).live_bytes, 4 * kMiB);  // m freed after down
  EXPECT_EQ(point_of(fused, out).live_bytes, 4 * kMiB);
  EXPECT_EQ(fused.peak_bytes, 4 * kMiB);
  EXPECT_EQ(fused.peak_node, down.id);
  // up keeps the third of its traffic it reads from m, down the third it
  // writes; sq reads and writes nothing in memory.
  EXPECT_NEAR(point_of(fused, up).end_ms - point_of(fused, up).start_ms, 0.1, 1e-12);
  EXPECT_EQ(point_of(fused, sq).end_ms, point_of(fused, sq).start_ms);
  EXPECT_NEAR(point_of(fused, down).end_ms - point_of(fused, down).start_ms, 0.1, 1e-12);
  EXPECT_NEAR(fused.step_ms, 2.2, 1e-12);
  EXPECT_NEAR(fused.compute_busy_ms, 2.2, 1e-12);
}

TEST(SimulateFusion, WithoutTheFlagNothingChanges) {
  GraphBuilder b;
  pointwise_op(b, "aten.mul.Tensor", {"self", "other"});
  auto x = b.input("x", mib_tensor(1));
  auto up = timed(b, b.call("aten._to_copy.default", {x}, fp32_of(1)), 0.5);
  auto sq = timed(b, b.call("aten.mul.Tensor", {up, up}, fp32_of(1)), 0.5);
  auto down = timed(b, b.call("aten._to_copy.default", {sq}, mib_tensor(1)), 0.5);
  b.output({down});
  const Graph graph = b.build();
  SimOptions off;
  off.inductor_fusion = false;
  const SimResult plain = simulate(graph, CostModel(flat_profile()));
  const SimResult explicit_off = simulate(graph, CostModel(flat_profile()), off);
  EXPECT_EQ(explicit_off.peak_bytes, plain.peak_bytes);
  EXPECT_EQ(explicit_off.step_ms, plain.step_ms);
  EXPECT_EQ(plain.peak_bytes, 5 * kMiB);
  EXPECT_DOUBLE_EQ(plain.step_ms, 1.5);
}

TEST(SimulateFusion, AValueSavedForBackwardIsAllocatedAsAnActivation) {
  GraphBuilder b;
  pointwise_op(b, "aten.mul.Tensor", {"self", "other"});
  auto x = b.input("x", mib_tensor(1));
  auto w = b.input("w", mib_tensor(1));
  auto up = b.call("aten._to_copy.default", {x}, fp32_of(1));  // read again in backward
  auto sq = b.call("aten.mul.Tensor", {up, up}, fp32_of(1));    // forward only
  auto down = b.call("aten._to_copy.default", {sq}, mib_tensor(1));
  auto m = b.call("aten.mm.default", {down, w}, mib_tensor(1));
  b.backward();
  auto grad = b.call("aten.mm.default", {up, m}, fp32_of(1));  // materialised in backward
  b.output({grad});
  const SimResult r = simulate(b.build(), CostModel(flat_profile()), with_fusion());
  EXPECT_EQ(point_of(r, sq).live_bytes, 4 * kMiB);  // x, w, up; not sq
  EXPECT_EQ(point_of(r, sq).by_category[kAct], 2 * kMiB);
  EXPECT_EQ(point_of(r, m).live_bytes, (1 + 1 + 2 + 1 + 1) * kMiB);
  EXPECT_EQ(point_of(r, grad).live_bytes, (1 + 1 + 2 + 1 + 2) * kMiB);  // the output is allocated
}

TEST(SimulateFusion, ViewsShareTheirBasesFate) {
  const CostModel cost(flat_profile());
  // Read through a view by a fused op only: never allocated.
  {
    GraphBuilder b;
    pointwise_op(b, "aten.neg.default", {"self"});
    auto x = b.input("x", mib_tensor(1));
    auto up = b.call("aten._to_copy.default", {x}, fp32_of(1));
    auto v = b.view("aten.view.default", up, fp32_of(1));
    auto n = b.call("aten.neg.default", {v}, fp32_of(1));
    auto down = b.call("aten._to_copy.default", {n}, mib_tensor(1));
    auto out = b.call("aten.mm.default", {down, x}, mib_tensor(1));
    b.output({out});
    const SimResult r = simulate(b.build(), cost, with_fusion());
    EXPECT_EQ(point_of(r, n).live_bytes, 1 * kMiB);
    EXPECT_EQ(r.peak_bytes, 3 * kMiB);
    EXPECT_EQ(simulate(b.build(), cost).peak_bytes, 5 * kMiB);
  }
  // Read through a view by a matmul: the base's storage is allocated.
  {
    GraphBuilder b;
    auto x = b.input("x", mib_tensor(1));
    auto up = b.call("aten._to_copy.default", {x}, fp32_of(1));
    auto v = b.view("aten.view.default", up, fp32_of(1));
    auto out = b.call("aten.mm.default", {v, x}, fp32_of(1));
    b.output({out});
    const SimResult r = simulate(b.build(), cost, with_fusion());
    EXPECT_EQ(point_of(r, up).live_bytes, 3 * kMiB);
    EXPECT_EQ(r.peak_bytes, 5 * kMiB);
  }
  // A view taken in backward and read by a matmul reads the forward value in
  // backward: saved.
  {
    GraphBuilder b;
    pointwise_op(b, "aten.neg.default", {"self"});
    auto x = b.input("x", mib_tensor(1));
    auto up = b.call("aten._to_copy.default", {x}, fp32_of(1));
    auto n = b.call("aten.neg.default", {up}, fp32_of(1));
    auto down = b.call("aten._to_copy.default", {n}, mib_tensor(1));
    auto m = b.call("aten.mm.default", {down, x}, mib_tensor(1));
    b.backward();
    auto d = b.view("aten.detach.default", up, fp32_of(1));
    auto g = b.call("aten.mm.default", {d, x}, fp32_of(1));
    b.output({g, m});
    const SimResult r = simulate(b.build(), cost, with_fusion());
    EXPECT_EQ(point_of(r, n).live_bytes, 3 * kMiB);  // x and up; n is not
    EXPECT_EQ(point_of(r, n).by_category[kAct], 2 * kMiB);
  }
}

TEST(SimulateFusion, OutputsAndStoragesWrittenInPlaceAreAllocated) {
  const CostModel cost(flat_profile());
  {
    GraphBuilder b;
    auto x = b.input("x", mib_tensor(1));
    b.output({b.call("aten._to_copy.default", {x}, fp32_of(1))});
    EXPECT_EQ(simulate(b.build(), cost, with_fusion()).peak_bytes, 3 * kMiB);
  }
  {
    GraphBuilder b;
    pointwise_op(b, "aten.neg.default", {"self"});
    auto x = b.input("x", mib_tensor(1));
    auto up = b.call("aten._to_copy.default", {x}, fp32_of(1));
    auto written = b.inplace("aten.add_.Tensor", up, {x});
    auto n = b.call("aten.neg.default", {written}, fp32_of(1));
    auto down = b.call("aten._to_copy.default", {n}, mib_tensor(1));
    b.output({b.call("aten.mm.default", {down, x}, mib_tensor(1))});
    const SimResult r = simulate(b.build(), cost, with_fusion());
    EXPECT_EQ(point_of(r, written).live_bytes, 3 * kMiB);  // x and up
    EXPECT_EQ(point_of(r, n).live_bytes, 3 * kMiB);        // not n
  }
}

TEST(SimulateFusion, TheLossChainKeepsOnlyWhatBackwardReadsAndTheMatmulsRead) {
  // bf16 logits -> fp32 -> log_softmax -> nll_loss, and back: Inductor
  // computes the fp32 copy, the loss gradient and the log_softmax gradient
  // inside its kernels (Note [What Inductor fuses]).
  GraphBuilder b;
  auto h = b.input("h", mib_tensor(1));
  auto w = b.input("w", mib_tensor(1));
  auto labels = b.input("labels", GraphBuilder::tensor({512}, {}, 8, "int64"));
  auto logits = b.call("aten.mm.default", {h, w}, mib_tensor(1));
  auto up = b.call("aten._to_copy.default", {logits}, fp32_of(1));
  auto lsm = b.call("aten._log_softmax.default", {up}, fp32_of(1));
  auto loss = b.call_value("aten.nll_loss_forward.default", {lsm, labels},
                           GraphBuilder::tuple({GraphBuilder::tensor({}, {}, 4, "float32"),
                                                GraphBuilder::tensor({}, {}, 4, "float32")}));
  b.backward();
  auto tangent = b.input("tangent", GraphBuilder::tensor({}, {}, 4, "float32"));
  auto grad_lsm = b.call("aten.nll_loss_backward.default", {tangent, lsm, labels}, fp32_of(1));
  auto grad_up = b.call("aten._log_softmax_backward_data.default", {grad_lsm, lsm}, fp32_of(1));
  auto grad_logits = b.call("aten._to_copy.default", {grad_up}, mib_tensor(1));
  auto grad_w = b.call("aten.mm.default", {grad_logits, h}, mib_tensor(1));
  b.output({loss, grad_w});
  const Graph graph = b.build();
  const CostModel cost(flat_profile());
  const SimResult op_by_op = simulate(graph, cost);
  const SimResult fused = simulate(graph, cost, with_fusion());
  // At lsm the fused step holds no fp32 copy but still the logits (the
  // kernel computing lsm reads them) and not yet the tangent (512 B).
  EXPECT_EQ(point_of(op_by_op, lsm).live_bytes - point_of(fused, lsm).live_bytes,
            2 * kMiB - 1 * kMiB + 512);
  EXPECT_EQ(point_of(op_by_op, grad_up).live_bytes - point_of(fused, grad_up).live_bytes,
            4 * kMiB);
  // Saved: lsm, and the loss's two scalars (the output node, in backward, reads them).
  EXPECT_EQ(point_of(fused, grad_up).by_category[kAct], 2 * kMiB + 2 * 512);
  EXPECT_EQ(op_by_op.peak_node, grad_up.id);
  EXPECT_EQ(op_by_op.peak_bytes - fused.peak_bytes, 3 * kMiB);
}

// ---- execution model (11): the partitioner's own recomputes ----------------

// logits = mm(x, w); up = fp32(logits); peak = amax(up); shifted = up - peak,
// read by the forward's next matmul (as bf16) and by a fused backward op.
struct ShiftedLogits {
  GraphBuilder b;
  NodeRef x, w, logits, up, peak, shifted, down, out, grad, grad_w;
  ShiftedLogits() {
    pointwise_op(b, "aten.sub.Tensor", {"self", "other"});
    pointwise_op(b, "aten.mul.Tensor", {"self", "other"});
    x = b.input("x", mib_tensor(1));
    w = b.input("w", mib_tensor(1));
    logits = b.call("aten.mm.default", {x, w}, mib_tensor(1));
    up = b.call("aten._to_copy.default", {logits}, fp32_of(1));
    peak = b.call("aten.amax.default", {up}, GraphBuilder::tensor({512, 1}, {}, 4, "float32"));
    shifted = b.call("aten.sub.Tensor", {up, peak}, fp32_of(1));
    down = b.call("aten._to_copy.default", {shifted}, mib_tensor(1));
    out = b.call("aten.mm.default", {down, w}, mib_tensor(1));
    b.backward();
    grad = b.call("aten.mul.Tensor", {shifted, shifted}, fp32_of(1));
    auto grad_down = b.call("aten._to_copy.default", {grad}, mib_tensor(1));
    grad_w = b.call("aten.mm.default", {grad_down, x}, mib_tensor(1));
    b.output({out, grad_w});
  }
};

TEST(SimulateFusion, ThePartitionerRecomputesAPointwiseValueFromTheBf16InputAndTheReduction) {
  ShiftedLogits g;
  const Graph graph = g.b.build();
  const CostModel cost(flat_profile());
  const SimResult r = simulate(graph, cost, with_fusion());
  // Saved for backward: the bf16 logits and amax's 512 floats, not the fp32
  // shifted logits (out counts too: the output node, in backward, reads it).
  EXPECT_EQ(point_of(r, g.out).by_category[kAct], 2 * kMiB + 2048);
  EXPECT_EQ(point_of(r, g.out).live_bytes, (2 + 1) * kMiB + 2048 + 2 * kMiB);  // + down, out
  // Both live until the last backward reader of what they rebuild.
  EXPECT_EQ(point_of(r, g.grad).by_category[kAct], 2 * kMiB + 2048);
  EXPECT_EQ(point_of(r, g.grad_w).by_category[kAct], 1 * kMiB);

  // A planned value (a budget candidate) is the plan's: saved as it is.
  SimOptions planned = with_fusion();
  planned.planned = {g.shifted.id};
  const SimResult kept = simulate(graph, cost, planned);
  EXPECT_EQ(point_of(kept, g.out).by_category[kAct], 3 * kMiB);
  EXPECT_EQ(kept.peak_bytes - r.peak_bytes, 1 * kMiB - 2048);
}

// ---- execution model (10): lifetimes under torch.compile -------------------

TEST(SimulateFusion, ATangentLivesFromItsFirstReaderToTheEndAndTheReturnedLogitsToTheirLastReader) {
  // Exported joint graphs list the tangents among the first placeholders, in
  // phase backward; logits are returned and read again by backward.
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto w = b.input("w", mib_tensor(1));
  b.backward();
  auto tangent = b.input("tangents_2", mib_tensor(1));
  b.forward();
  auto logits = b.call("aten.mm.default", {x, w}, mib_tensor(1));
  auto h = b.call("aten.mm.default", {logits, w}, mib_tensor(1));
  b.backward();
  auto g = b.call("aten.mm.default", {tangent, w}, mib_tensor(1));
  auto gw = b.call("aten.mm.default", {logits, g}, mib_tensor(1));
  auto gx = b.call("aten.mm.default", {gw, w}, mib_tensor(1));
  b.output({logits, h, gx});
  const Graph graph = b.build();
  const CostModel cost(flat_profile());

  const SimResult compiled = simulate(graph, cost, with_fusion());
  EXPECT_EQ(point_of(compiled, h).live_bytes, 4 * kMiB);  // x, w, logits, h; no tangent
  EXPECT_EQ(point_of(compiled, g).live_bytes, 6 * kMiB);  // and the tangent, and g
  EXPECT_EQ(point_of(compiled, g).by_category[kIn], 3 * kMiB);
  // Logits go after gw; h, returned and not read by backward, stays, and so
  // does the tangent: autograd holds the gradients it passed to the compiled
  // backward until it returns (T1 on the H200: the logits' 1000 MiB zero
  // gradient was live in the middle of the backward).
  EXPECT_EQ(point_of(compiled, gw).live_bytes, 7 * kMiB);
  EXPECT_EQ(point_of(compiled, gx).live_bytes, 6 * kMiB);  // x, w, h, tangent, gw, gx
  EXPECT_EQ(compiled.peak_bytes, 7 * kMiB);

  // Op by op (eager, and the runtime's own test) the caller holds both.
  const SimResult eager = simulate(graph, cost);
  EXPECT_EQ(point_of(eager, h).live_bytes, 5 * kMiB);
  EXPECT_EQ(point_of(eager, gx).live_bytes, 7 * kMiB);
}

TEST(Simulate, AnAttentionBackwardsFp32ScratchCountsTowardThePeakWhileItRuns) {
  // T1's layer on the H200: the cuDNN attention backward allocated 129 MiB
  // beyond its three 64 MiB gradients at the step's measured peak (an fp32
  // query gradient of 4 x 16 x 4096 x 128 and fp32 row sums of 4 x 16 x 4096).
  GraphBuilder b;
  auto q = b.input("q", b.tensor({4, 16, 4096, 128}));
  auto lse = b.input("lse", b.tensor({4, 16, 4096}, {}, 4));
  b.backward();
  auto grads = b.call_value(
      "aten._scaled_dot_product_cudnn_attention_backward.default", {q, q, q, q, q, lse},
      GraphBuilder::tuple({b.tensor({4, 16, 4096, 128}), b.tensor({4, 16, 4096, 128}),
                           b.tensor({4, 16, 4096, 128})}));
  auto after = b.call("aten.relu.default", {q}, b.tensor({4, 16, 4096, 128}));
  b.output({grads, after});
  const SimResult r = simulate(b.build(), CostModel(flat_profile()));

  const TimelinePoint& attention = point_of(r, grads);
  EXPECT_EQ(attention.live_bytes, (64 + 1 + 3 * 64) * kMiB);  // storages only
  EXPECT_EQ(attention.scratch_bytes, (128 + 1) * kMiB);
  EXPECT_EQ(point_of(r, after).scratch_bytes, 0);
  EXPECT_EQ(r.peak_bytes, (64 + 1 + 3 * 64 + 129) * kMiB);
  EXPECT_EQ(r.peak_node, grads.id);
  EXPECT_EQ(r.peak_by_category[kTmp], 3 * 64 * kMiB + 129 * kMiB);
  EXPECT_EQ(category_sum(r.peak_by_category), r.peak_bytes);
}

std::string invalid_graph_error(const Graph& graph) {
  try {
    simulate(graph, CostModel(flat_profile()));
  } catch (const InvalidGraph& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Simulate, AWaitOnANonCopyIsInvalidGraphNamingTheNode) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto a = b.call("aten.relu.default", {x}, mib_tensor(1));
  b.named("bad_wait").call(std::string(kWaitTarget), {a}, b.share(a, mib_tensor(1)));
  const std::string error = invalid_graph_error(b.build());
  EXPECT_EQ(error.rfind("[sim] node 2 (bad_wait): ", 0), 0u) << error;
  EXPECT_NE(error.find("relu_0"), std::string::npos) << error;
}

TEST(Simulate, AReloadOfSomethingNeverOffloadedIsInvalidGraph) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  b.named("orphan").call(std::string(kReloadTarget), {x, str("cuda:0")}, mib_tensor(1));
  EXPECT_NE(invalid_graph_error(b.build()).find("node 1 (orphan)"), std::string::npos);
}

TEST(Simulate, AReferenceToALaterNodeIsInvalidGraph) {
  GraphBuilder b;
  auto x = b.input("x", mib_tensor(1));
  auto a = b.call("aten.relu.default", {x}, mib_tensor(1));
  b.node(a).args[0] = Arg::of_node(7);
  EXPECT_NE(invalid_graph_error(b.build()).find("reads node 7"), std::string::npos);
  Graph twice = b.build();
  twice.nodes[1].args[0] = Arg::of_node(0);
  twice.nodes[1].id = 0;
  EXPECT_NE(invalid_graph_error(twice).find("node 0 (relu_0): field 'id' repeats"),
            std::string::npos);
}

TEST(Simulate, UnknownRecomputedNodeIsInvalidArgument) {
  GraphBuilder b;
  b.input("x", mib_tensor(1));
  SimOptions options;
  options.recomputed = {42};
  EXPECT_THROW(simulate(b.build(), CostModel(flat_profile()), options), InvalidArgument);
}

}  // namespace
}  // namespace spillway
