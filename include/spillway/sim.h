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
//       profile's duplex rate for the overlapping part.
//   (6) Device bytes: every tensor value owns its storage; values that share a
//       storage id share one allocation (a view allocates nothing) sized by
//       the largest value in it. A storage is allocated when its first value
//       is produced (before the producing node runs, as torch allocates an
//       output before the kernel writes it) and freed after the last node that
//       reads any value in it; a storage that a graph output reads lives to the
//       end of the step. Placeholders are allocated before the step starts.
//       Each allocation is rounded as the caching allocator rounds it
//       (round_allocation). Storages of offload results, and of forward waits
//       and reloads' host arguments, are host memory.
//   (7) A node's live bytes are counted while it runs: everything allocated
//       before it, plus its outputs, before anything it frees.
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
  // GB/s for a transfer of `bytes` (> 0). Throws InvalidArgument when empty.
  double gbs(std::int64_t bytes) const;
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
  double memory_gbs = 0;           // device memory bandwidth
  double launch_us = 0;            // per-node floor (kernel launch + tail)
  LinkCurve d2h;                   // device -> pinned host, alone
  LinkCurve h2d;                   // pinned host -> device, alone
  LinkCurve d2h_duplex;            // D2H while an H2D runs (per direction)
  LinkCurve h2d_duplex;            // H2D while a D2H runs (per direction)
  // The caching allocator's rounding (round_allocation).
  std::int64_t allocation_granularity = 512;
};

// Parse / read / write the device-profile JSON. Parsing throws InvalidArgument
// naming the field on malformed input; reading throws Error("[sim] ...") when
// the file cannot be read.
DeviceProfile parse_device_profile(std::string_view json_text);
DeviceProfile load_device_profile(const std::string& path);
std::string write_device_profile(const DeviceProfile& profile);
// The profile shipped with the project for one NVIDIA H200 (PCIe Gen5 x16),
// from bench/results (the runtime's own link benchmark).
const DeviceProfile& h200_profile();

// Bytes the caching allocator hands out for a request of `bytes`: rounded up
// to the profile's granularity (512 B), at least one granule; 0 stays 0.
std::int64_t round_allocation(std::int64_t bytes, const DeviceProfile& profile);

// Per-node compute time and per-transfer copy time.
class CostModel {
 public:
  explicit CostModel(DeviceProfile profile);

  // Milliseconds the node occupies the compute stream: its time_ms when the
  // graph carries one, otherwise the roofline estimate (estimate_ms). Views,
  // getitem, placeholders, outputs and spillway.* nodes take 0.
  double node_ms(const Graph& graph, const Node& node) const;
  // The roofline estimate alone, ignoring time_ms.
  double estimate_ms(const Graph& graph, const Node& node) const;
  // FLOPs the node performs (matmul family, attention, convolution; 0 for
  // others), from size hints.
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

enum class Stream { kCompute, kD2H, kH2D };
std::string_view to_string(Stream stream);

struct SimOptions {
  // Nodes of the graph that recompute a forward value in backward (their
  // memory is kRecomputed, their time counts as recompute_ms).
  std::vector<NodeId> recomputed;
  // Keep the per-node timeline and stream intervals (the writers need them).
  // Off, simulate() returns only the totals and the peak: the planners' mode.
  bool record_timeline = true;
};

// One node's interval on a stream.
struct StreamInterval {
  Stream stream = Stream::kCompute;
  NodeId node = -1;
  double start_ms = 0;
  double end_ms = 0;
  std::int64_t bytes = 0;  // copies: bytes moved; compute: 0
};

// Live device bytes while one node runs (execution model (7)).
struct TimelinePoint {
  NodeId node = -1;
  double start_ms = 0;  // when the node starts on the compute stream
  double end_ms = 0;
  std::int64_t live_bytes = 0;
  std::array<std::int64_t, kMemoryCategoryCount> by_category{};
};

struct SimResult {
  double step_ms = 0;       // when the last stream finishes
  std::int64_t peak_bytes = 0;
  NodeId peak_node = -1;    // the node during which the peak occurs (first)
  Phase peak_phase = Phase::kForward;
  double peak_time_ms = 0;
  std::array<std::int64_t, kMemoryCategoryCount> peak_by_category{};
  double compute_busy_ms = 0;  // sum of node times
  double compute_wait_ms = 0;  // compute stream idle waiting for copies
  double recompute_ms = 0;     // time of SimOptions::recomputed nodes
  double d2h_busy_ms = 0;
  double h2d_busy_ms = 0;
  std::int64_t bytes_d2h = 0;
  std::int64_t bytes_h2d = 0;
  std::int64_t host_peak_bytes = 0;  // pinned host bytes held at once
  // With record_timeline: one point per node in graph order, and every
  // stream interval (compute nodes with nonzero time, and every copy).
  std::vector<TimelinePoint> timeline;
  std::vector<StreamInterval> intervals;
};

// Simulate one step of `graph` (execution model above). Throws InvalidGraph
// when the graph breaks verify_graph or a spillway node's arguments do not
// chain (a wait on something that is not a copy).
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
