#pragma once
// The stream and memory simulator, and the cost model it runs on.
//
// simulate() replays one training step of a graph (an original joint graph, or
// one rewritten by a plan: spillway.offload / reload / wait_tensor nodes and
// recomputed copies of forward nodes) on three streams, compute, D2H and H2D,
// and tracks the device bytes live at every node as PyTorch's caching
// allocator would count them. It predicts the step time, the peak and where it
// occurs, and the whole memory timeline; the writers turn a result into a
// Chrome trace (Perfetto-readable JSON) and an SVG memory picture.
//
// Execution model (the contract the planners and the runtime share):
//   (1) Nodes run on the compute stream in graph order, one at a time. A node
//       starts when the compute stream is free and every wait it implies has
//       completed; it takes CostModel::node_ms.
//   (2) A spillway.offload node issues a D2H copy of its input's bytes; the
//       copy starts when the D2H stream is free and the compute stream has
//       reached the offload node (stream order: the producer has finished).
//       Its result is host memory: it never counts as device bytes.
//   (3) A spillway.reload node issues an H2D copy; it starts when the H2D
//       stream is free, the compute stream has reached the reload node and the
//       value's D2H has completed. Its device bytes are allocated when the
//       reload is issued (the allocator hands the block out in stream order).
//   (4) A spillway.wait_tensor node makes the compute stream wait until the
//       copy of its first argument has completed; it takes no compute time.
//   (5) A copy running while the other direction's stream is busy moves at the
//       profile's duplex rate for the overlapping part. Copies are scheduled
//       in graph order and a copy looks only at the other direction's copies
//       already scheduled: an earlier copy is not slowed down again by a
//       later one that overlaps its tail (an approximation; both directions
//       are rarely busy for long in a step).
//   (6) Device bytes: every tensor value owns its storage; values that share a
//       storage id share one allocation (a view allocates nothing), and each
//       element of a tuple/list value is a tensor value of its own. A storage
//       is sized by the furthest byte any value in it reaches from the
//       storage's start (1 + sum of (size - 1) * stride elements when the
//       strides are known, numel otherwise, times the element size; hints
//       only, an unbacked size counts 0): an expanded view reaches no further
//       than its base. A tensor value without a storage id is an allocation
//       of its own. A storage is allocated when its first value is produced
//       (before the producing node runs, as torch allocates an output before
//       the kernel writes it) and freed after the last node that produces or
//       reads any value in it (a node that reads a tuple/list reads every
//       element; a wait_tensor's last_use argument only orders the graph and
//       is not a read, as the runtime's wait holds nothing of it: the wait may
//       sit regions after the last use, ActivationPlanOptions::release_lag);
//       a storage that the graph's output node reads lives to the end of the
//       step. Storages of placeholders and get_attr nodes
//       (weights, buffers, inputs, tangents: the caller owns them) are
//       allocated before the step starts and live through it. Each allocation
//       is rounded as the caching allocator rounds it (round_allocation).
//       Storages of offload results, and so of forward waits and reloads'
//       host arguments, which share them, are host memory (counted unrounded
//       in host_peak_bytes); every other storage is device memory whatever
//       its TensorInfo::device says (graphs traced on cpu simulate as if on
//       the device).
//   (7) A node's live bytes are counted while it runs: everything allocated
//       before it, plus its outputs, before anything it frees. Some kernels
//       also take scratch from the caching allocator while they run and give
//       it back before they return: an attention backward
//       (*scaled_dot_product*attention*_backward: flash, cuDNN, memory-
//       efficient, and the CPU kernel standing in for them) accumulates the
//       query's gradient in fp32 and keeps fp32 per-row sums, two allocations
//       of batch x heads x query length x (head dim + 1) x 4 bytes in all
//       (129 MiB on T1's layers, seen at the H200's measured peak). A node's
//       scratch counts toward the peak while it runs (TimelinePoint::
//       scratch_bytes, in the peak's kTemporaries) and is no storage: it is
//       not in live_bytes.
//   (8) Memory categories (MemoryCategory): placeholders' and get_attr
//       storages are kInputs; reload results (and the backward waits and
//       views sharing them) kReloads; storages first produced by a
//       SimOptions::recomputed node kRecomputed; forward storages that a
//       backward node reads (through any value sharing the storage)
//       kActivations; everything else kTemporaries. An offloaded storage is
//       kInFlight from its offload node until its forward wait, where it is
//       freed unless something later reads it (then it takes its own category
//       again).
//   (9) With SimOptions::inductor_fusion (graphs torch.compile runs: Inductor
//       fuses pointwise chains into generated kernels), a node is fused when
//       its op is one Inductor computes inside a fused kernel (pointwise ops,
//       dtype casts, where, clone, and the reductions and layout ops listed
//       by analysis::is_inductor_fused, src/analysis/inductor_fusion.h, with
//       the generated code that shows it). A storage is not materialised when
//       its first producer is a fused node, every other node producing a
//       value in it is an alias (a non-mutating node whose outputs all live
//       in storages that already exist: views, getitem), and every node
//       reading any value in it runs in the first producer's phase and is a
//       fused node or an alias; a storage the output node reads is
//       materialised. A storage that is not materialised is never allocated
//       (its values, views included, cost no device bytes: Inductor computes
//       them in registers inside its readers' kernel), so a value read by a
//       matmul, attention or a copy, saved for backward (read in the other
//       phase) or returned stays. A fused node whose outputs are not
//       materialised runs inside the kernels of its readers, through such
//       nodes, that write a materialised storage: the storages it reads are
//       freed after the last of them, not after it (the logits the loss's
//       backward recomputes from stay while the kernel writing their
//       gradient runs). A fused node's compute time is its time
//       (time_ms, or the roofline) times the share of its memory traffic
//       that remains: the bytes of its distinct tensor inputs and of its
//       outputs that live in materialised storages, over the bytes of all of
//       them; a fused node that reads and writes no bytes keeps its time.
//       Fused kernels are memory bound and an op's measured time is mostly
//       its traffic, so a chain fused into one kernel costs about one pass
//       over the bytes it reads and writes in memory.
//  (10) Also with SimOptions::inductor_fusion, lifetimes as torch.compile's
//       compiled autograd function has them: a placeholder of the backward
//       phase (a tangent) is allocated before the first backward node that
//       is no placeholder runs and lives to the end of the step (autograd
//       builds the gradients of all the outputs when backward starts, zeros
//       for one that gets none, such as a training step's logits and the
//       attention's key/value cache: 2 GiB of them at T1's peak, measured
//       on the H200 with the allocator's history, bench/torch/
//       peak_snapshot.py; the compiled backward drops its other arguments
//       as it goes, but autograd holds the gradients it passed until the
//       call returns: T1's 1000 MiB logits gradient was live in the middle
//       of the backward, H200, 2026-12-02), never if nothing reads it;
//       and a storage first produced in forward that the output node reads
//       and a backward node other than the output reads (the logits the
//       loss's backward needs) is freed after its last reader that is not
//       the output node (the caller keeps only the loss). A storage the
//       output node reads and no backward node reads lives to the end of
//       the step, as in (6).
//  (11) Also with SimOptions::inductor_fusion, torch's min-cut partitioner
//       recomputes in backward, inside the kernels that read them, the
//       forward values that are cheap to rebuild, and saves what they are
//       rebuilt from (min_cut_rematerialization_partition,
//       torch/_functorch/partitioners.py). A forward storage that a backward
//       node reads is recomputed when it and every storage on its chain are
//       recomputable: first produced by a pointwise node (analysis::
//       is_inductor_pointwise) and read and written, in both phases, only by
//       fused nodes and aliases (a storage a matmul, a copy or an offload
//       reads is "materialized in backward" or forward, and saved as it is),
//       neither returned nor an input, and not a storage of a
//       SimOptions::planned node that backward reads. The chain walks back
//       from the storage's first producer through the storages its inputs
//       live in while they are recomputable (views followed by storage); the
//       first storage that is not (a reduction such as amax, sum or mean, a
//       matmul's output, a storage a matmul reads) is what the forward
//       saves: it lives to the last backward reader of any recomputed
//       storage that needs it and is materialised; inputs are read as they
//       are. The recomputed storages are never materialised (9) and the
//       recompute takes no time. A chain that would keep an offloaded
//       storage, or that passes more than 256 storages, is left saved.
//       torch's own cut weighs sizes and bans more (a node used far apart,
//       long fusible chains, nodes far from backward); this is its common
//       case: the fp32 upcasts of the residual stream, the fp32 log-softmax,
//       rotary cos/sin and the final norm's output are rebuilt from the bf16 residuals,
//       logits and the saved reductions.
//  (12) The host (Note [The host lane] in src/plan/budget_problem.cc): where
//       some node has cpu_ms, one host thread issues the nodes in graph order,
//       spending each one's cpu_ms (0 where absent) and never waiting for the
//       device. A compute node's kernels are issued while earlier ones run:
//       it ends no earlier than node_ms after the compute stream is free and
//       no earlier than the host has issued it; the difference is
//       SimResult::host_wait_ms. Without cpu_ms anywhere, the host is not
//       modelled (it is always ahead).
//
// Thread-safety: every function here is pure; a CostModel is immutable after
// construction and may be shared between threads.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "spillway/graph.h"

namespace spillway {

// Bandwidth of one kind of transfer as a function of its size: points
// (bytes, GB/s) sorted by bytes; interpolated linearly in log(bytes) between
// points, constant beyond the ends.
struct LinkCurve {
  std::vector<std::pair<std::int64_t, double>> points;
  // GB/s (1 GB = 1e9 bytes) for a transfer of `bytes` (> 0; bytes <= 0 is
  // read as the first point). Throws InvalidArgument when empty.
  double gbs(std::int64_t bytes) const;
  friend bool operator==(const LinkCurve&, const LinkCurve&) = default;
};

// What one device can do, measured (bench/gpu, `spillway calibrate`) or taken
// from its data sheet. Loaded from JSON (docs/device-profile.md).
struct DeviceProfile {
  std::string name;  // "NVIDIA H200"
  std::string source;  // how the numbers were obtained, with the date
  std::int64_t memory_bytes = 0;  // device memory, for reports
  // Roofline for nodes without a measured time_ms: a node takes
  // max(flops / peak, bytes / bandwidth) + launch overhead.
  double matmul_tflops_bf16 = 0;   // dense matmul peak, 16-bit inputs
  double matmul_tflops_fp32 = 0;   // with TF32 off
  // Fused attention (scaled_dot_product_*_attention) with 16-bit inputs, in
  // the FLOPs CostModel counts (is_causal halves them, backward is 2.5x the
  // forward), as spillway.calibrate measures it: with an additive causal mask,
  // as Hugging Face models call it. 0: absent, the bf16 matmul peak stands in
  // (optional fields; with a mask attention runs far below that peak).
  double attention_tflops_bf16 = 0;
  double attention_backward_tflops_bf16 = 0;
  double memory_gbs = 0;           // device memory bandwidth
  double launch_us = 0;            // per-node floor (kernel launch + tail)
  LinkCurve d2h;                   // device -> pinned host, alone
  LinkCurve h2d;                   // pinned host -> device, alone
  LinkCurve d2h_duplex;            // D2H while an H2D runs (per direction)
  LinkCurve h2d_duplex;            // H2D while a D2H runs (per direction)
  // The caching allocator's rounding (round_allocation).
  std::int64_t allocation_granularity = 512;
  friend bool operator==(const DeviceProfile&, const DeviceProfile&) = default;
};

// Parse / read / write the device-profile JSON. Parsing throws
// InvalidArgument("[sim] device profile: field 'd2h[1].gbs': ...") naming the
// field on malformed input (syntax, a missing or unknown field, a wrong type,
// a non-positive number, curve points not sorted by bytes); reading throws
// Error("[sim] ...") when the file cannot be read.
// parse_device_profile(write_device_profile(p)) == p for every valid p.
DeviceProfile parse_device_profile(std::string_view json_text);
DeviceProfile load_device_profile(const std::string& path);
std::string write_device_profile(const DeviceProfile& profile);
// The profile shipped with the project for one NVIDIA H200 (PCIe Gen5 x16):
// src/sim/profiles/nvidia-h200.json, compiled into the library. The link
// curves are measured (bench/results, the runtime's own link benchmark); the
// roofline numbers are the data sheet's.
const DeviceProfile& h200_profile();

// Bytes the caching allocator hands out for a request of `bytes`: rounded up
// to the profile's granularity (512 B), at least one granule; 0 stays 0.
std::int64_t round_allocation(std::int64_t bytes, const DeviceProfile& profile);

// Per-node compute time and per-transfer copy time.
class CostModel {
 public:
  explicit CostModel(DeviceProfile profile);

  // Milliseconds the node occupies the compute stream: its time_ms when the
  // graph carries one, otherwise the roofline estimate (estimate_ms). Views
  // (OpSchema::is_view, or a non-mutating op whose result shares an input's
  // storage such as _unsafe_view), getitem, placeholders, get_attr, outputs,
  // spillway.* nodes and nodes that read and produce no tensor take 0.
  // `node` must be an element of graph.nodes. Inputs are found by id: O(1)
  // when ids equal positions (exported graphs), O(nodes) otherwise;
  // simulate() resolves them once per graph instead.
  double node_ms(const Graph& graph, const Node& node) const;
  // The roofline estimate alone, ignoring time_ms: max(flops / peak, bytes /
  // memory_gbs) + launch_us, where bytes sums the hinted bytes of every
  // tensor the node reads (one per reference) and produces, and the peak is
  // the bf16 one when the matmul's operand has elements of at most 2 bytes.
  double estimate_ms(const Graph& graph, const Node& node) const;
  // FLOPs the node performs, from size hints: 2*M*N*K for mm, addmm, bmm,
  // baddbmm, matmul, linear (linear_backward 2x that); attention
  // (*scaled_dot_product*attention*) 2*B*H*Lq*Lk*(D + Dv), halved when
  // is_causal, 2.5x for its _backward; convolution 2 * output numel * (weight
  // numel / weight.size(0)), convolution_backward 2x; 0 for others.
  double flops(const Graph& graph, const Node& node) const;
  // Milliseconds a copy of `bytes` takes alone / while the other direction
  // runs.
  double d2h_ms(std::int64_t bytes, bool duplex = false) const;
  double h2d_ms(std::int64_t bytes, bool duplex = false) const;

  const DeviceProfile& profile() const { return profile_; }

 private:
  DeviceProfile profile_;
};

// What live device bytes are, for the timeline and the picture.
enum class MemoryCategory {
  kInputs,        // placeholders: weights, buffers, inputs, tangents
  kActivations,   // forward values backward reads (kept for backward)
  kTemporaries,   // everything else computed: forward temporaries, gradients
  kInFlight,      // offloaded values between their offload and forward wait
  kReloads,       // reloaded values, from reload until their last use
  kRecomputed,    // values recomputed in backward (SimOptions::recomputed)
};
inline constexpr int kMemoryCategoryCount = 6;
std::string_view to_string(MemoryCategory category);

// kHost: the thread that issues the step (execution model (12)); its intervals
// are the host's time to issue each node, where the graph has cpu_ms.
enum class Stream { kCompute, kD2H, kH2D, kHost };
std::string_view to_string(Stream stream);

struct SimOptions {
  // Nodes of the graph that recompute a forward value in backward (their
  // memory is kRecomputed, their time counts as recompute_ms).
  std::vector<NodeId> recomputed;
  // Keep the per-node timeline and stream intervals (the writers need them).
  // Off, simulate() returns only the totals and the peak: the planners' mode.
  bool record_timeline = true;
  // Simulate as torch.compile runs the graph: Inductor fuses pointwise chains
  // (execution model (9)), the compiled function's lifetimes (10) and the
  // partitioner's own recomputes (11). Off, every node's output is allocated
  // and every node takes its own time, as when the graph runs op by op
  // (eager).
  bool inductor_fusion = false;
  // With inductor_fusion: forward nodes whose fate a plan decides (the budget
  // planner's candidates); the partitioner model (11) never recomputes a
  // storage of one that backward reads. Unknown ids are ignored.
  std::vector<NodeId> planned;
};

// One node's interval on a stream.
struct StreamInterval {
  Stream stream = Stream::kCompute;
  NodeId node = -1;
  double start_ms = 0;
  double end_ms = 0;
  std::int64_t bytes = 0;  // copies: bytes moved; compute and host: 0
};

// Live device bytes while one node runs (execution model (7)).
struct TimelinePoint {
  NodeId node = -1;
  double start_ms = 0;  // when the node starts on the compute stream
  double end_ms = 0;
  std::int64_t live_bytes = 0;
  std::array<std::int64_t, kMemoryCategoryCount> by_category{};
  // The kernel's scratch while it runs (execution model (7)), rounded; the
  // bytes the allocator holds during the node are live_bytes + scratch_bytes.
  std::int64_t scratch_bytes = 0;
};

struct SimResult {
  double step_ms = 0;       // when the last stream finishes
  std::int64_t peak_bytes = 0;  // live plus scratch bytes, at their largest
  NodeId peak_node = -1;    // the node during which the peak occurs (first)
  Phase peak_phase = Phase::kForward;
  double peak_time_ms = 0;
  std::array<std::int64_t, kMemoryCategoryCount> peak_by_category{};
  double compute_busy_ms = 0;  // sum of node times
  double compute_wait_ms = 0;  // compute stream idle at wait_tensor nodes
  double host_ms = 0;          // execution model (12): the host's issue time
  double host_wait_ms = 0;     // compute stream idle waiting for the host
  double recompute_ms = 0;     // time of SimOptions::recomputed nodes
  double d2h_busy_ms = 0;
  double h2d_busy_ms = 0;
  std::int64_t bytes_d2h = 0;
  std::int64_t bytes_h2d = 0;
  std::int64_t host_peak_bytes = 0;  // pinned host bytes held at once
  // With record_timeline: one point per node in graph order, and every
  // stream interval (compute nodes with nonzero time, every copy, and with
  // host times each node the host spent time issuing).
  std::vector<TimelinePoint> timeline;
  std::vector<StreamInterval> intervals;
};

// Simulate one step of `graph` (execution model above). Runs in O(nodes +
// edges) and does not run verify_graph (planners call it thousands of times
// on graphs already verified). Throws InvalidGraph("[sim] node 12 (name):
// ...") naming the node when a node refers to an unknown or later node, two
// nodes share an id, or a spillway node's arguments do not chain (an offload
// of no tensor, a reload whose first argument is not an offload's wait, a
// wait on something that is not a copy); InvalidArgument when
// SimOptions::recomputed names a node the graph does not have.
SimResult simulate(const Graph& graph, const CostModel& cost, const SimOptions& options = {});

// Chrome trace JSON (Perfetto-readable): one track per stream with a slice per
// interval named after the node, and a counter track of live device bytes per
// category. Needs a result simulated with record_timeline.
std::string chrome_trace(const Graph& graph, const SimResult& result);
// An SVG picture of live device bytes over time, stacked by category, with
// the peak marked and the forward/backward boundary drawn; `title` is shown on
// top. Needs a result simulated with record_timeline.
std::string memory_svg(const Graph& graph, const SimResult& result, std::string_view title);

}  // namespace spillway
