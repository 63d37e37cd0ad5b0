#pragma once
// Residency of a recorded step: any storage may live in pinned host memory
// between two of its uses (issue 12; the trace comes from
// python/spillway/trace, Note [The op recorder]).
//
// residency_model() reduces a graph to what residency needs: each op's time
// and, per storage, its device bytes and the ops that read or write it. A
// storage of a placeholder (a parameter, an optimizer state) lives across
// steps, so its last use in one step and its first in the next enclose a gap
// too (the wrap). simulate_residency() replays steps under a plan on the
// compute, D2H and H2D streams (Note [Residency replay] in
// src/sim/residency.cc); plan_residency() chooses the gaps: the least
// simulated step time whose simulated peak fits a budget.
//
// Thread-safety: pure functions; a CostModel is immutable.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "spillway/graph.h"
#include "spillway/sim.h"

namespace spillway {

struct ResidencyStorage {
  std::int64_t id = -1;    // the graph's storage id
  std::string name;        // its placeholder's name, or the node that made it
  std::int64_t bytes = 0;  // device bytes, rounded as the caching allocator rounds
  bool across_steps = false;  // a placeholder's: on the device before the step starts
  bool kept = false;          // read by the output node: alive when the step ends
  // Op positions (indices into ResidencyModel::op_ms) that read or write it,
  // ascending, and for each whether it writes.
  std::vector<std::int32_t> uses;
  std::vector<bool> writes;
  // Made in the step: the position after which the recorded step freed it
  // (Node::frees), when later than its last use; -1: after its last use.
  std::int32_t freed_after = -1;
  friend bool operator==(const ResidencyStorage&, const ResidencyStorage&) = default;
};

// A device optimizer step that may run on the host instead (ZeRO-Offload's
// choice; spillway.optim.HostAdamW runs it, Note [Host AdamW]): its gradients
// go to the host once complete (after their last use before `ops`), the update
// runs on the host CPUs, and the new parameters come back by H2D; the state
// it updates (moments, step counts) lives on the host for good and the ops
// take no device time. A parameter so updated always has a valid host copy
// (the master the update writes), so it may leave the device in any gap
// without a write-back; when it spends its wrap on the device, the new value
// is copied into it in place.
struct HostUpdate {
  std::vector<std::int32_t> ops;     // positions of the device optimizer ops it replaces
  std::vector<std::int32_t> params;  // storages (indices) they update
  std::vector<std::int32_t> grads;   // the parameters' gradients, made in the step
  std::vector<std::int32_t> states;  // storages that move to the host for good (the moments)
  std::int64_t elements = 0;         // parameter elements updated
  double host_ms = 0;                // the update's time on the host CPUs
  friend bool operator==(const HostUpdate&, const HostUpdate&) = default;
};

struct ResidencyModel {
  std::vector<double> op_ms;              // every node of the graph, in order
  std::vector<NodeId> op_ids;             // the nodes' ids
  std::vector<std::string> op_names;      // the nodes' names
  std::vector<std::int64_t> op_scratch;   // bytes a node takes while it runs
  std::vector<ResidencyStorage> storages;
  // Optimizer steps that may run on the host (add_host_update_candidates).
  std::vector<HostUpdate> host_updates;
  // The host (Note [The host in residency replay]): each node's Node::cpu_ms,
  // -1 where unknown; empty when no node has one (the host is not modelled:
  // an op starts once the compute stream is free).
  std::vector<double> op_cpu_ms;
  // The replay's own host time for each op it dispatches (its dispatch mode's
  // numbering, checks and actions), added to every known op_cpu_ms.
  double replay_op_ms = 0;
  // The replay's own host time for each copy it issues (a write-back, a copy
  // back, a gradient to the host: its events, streams and views), when the
  // host is modelled.
  double replay_copy_ms = 0;
};

// Every node of `graph` is a position. A node uses the storages of the values
// its args name and those of the values it produces; it writes what its
// schema's write arguments name and every storage it produces values in that
// existed before (an in-place result or an out= argument); views are uses
// that write nothing. A storage's bytes are the furthest byte its values
// reach (execution model (6) of sim.h), rounded. Throws InvalidGraph through
// the graph's own checks.
ResidencyModel residency_model(const Graph& graph, const CostModel& cost);

// The host bandwidth of the update, counting the 28 bytes each fp32 element
// reads and writes (parameter, gradient and two moments in; parameter and
// moments out): bench/torch/host_adamw.py measures it.
inline constexpr double kHostAdamWBytesPerElement = 28;

// Adds a candidate to model.host_updates for each op of the graph's optimizer
// phase that runs AdamW on the device as PyTorch's fused kernel does
// (aten._fused_adamw_ with amsgrad off, on fp32 parameters whose gradients
// are made in the step): host_ms = elements * 28 bytes / host_gbs. Returns
// how many it added. Throws InvalidArgument for host_gbs <= 0.
int add_host_update_candidates(const Graph& graph, ResidencyModel& model, double host_gbs);

// The position after which gradient `grad` (a storage index) of host update
// `u` is complete and leaves for the host: its last use before the update's
// ops (its last write, then the views autograd takes of it; the same in the
// model and in the one apply_host_updates leaves), or -1 when it is never
// written before them.
std::int32_t gradient_complete_position(const ResidencyModel& model, const HostUpdate& u,
                                        std::int32_t grad);

// The model as the chosen host updates (indices into model.host_updates)
// leave it: their ops take no time and use nothing, their states have no
// uses (they live on the host), their gradients' uses after their last use
// before the ops are gone. Positions are unchanged. A gap's `after` in a plan
// with host updates counts the uses of this model. Throws InvalidArgument on
// an index out of range or the same update twice.
ResidencyModel apply_host_updates(const ResidencyModel& model,
                                  const std::vector<std::int32_t>& chosen);

// One storage on the host between two uses: after its use number `after`
// (an index into uses; the last use's gap is the wrap to the next step's
// first use, for storages that live across steps), copied back so that the
// compute stream reaches the next use once the copy has landed. The copy is
// issued when the compute stream reaches the op `lead` positions before the
// next use (1: right before it). The storage leaves the device once its
// write-back has landed; with `wait` > 0 the compute stream waits for that at
// the op `wait` positions after the gap's start, so that it is gone there
// whatever the copies queued ahead of it (0: nothing waits; it leaves when its
// copy lands). The wait comes before the copy back: wait + lead < the gap's
// length.
struct HostGap {
  std::int32_t storage = -1;  // index into ResidencyModel::storages
  std::int32_t after = -1;
  std::int32_t lead = 1;
  std::int32_t wait = 0;
  friend bool operator==(const HostGap&, const HostGap&) = default;
};

struct ResidencyPlan {
  std::vector<HostGap> gaps;
  // Indices into ResidencyModel::host_updates run on the host (the gaps then
  // refer to apply_host_updates(model, host_updated)).
  std::vector<std::int32_t> host_updated = {};
};

// The second of three steps in a row under the plan (a steady state).
struct ResidencyForecast {
  double step_ms = 0;     // compute stream end to end, waits included
  double compute_ms = 0;  // the ops' own time
  double stall_ms = 0;    // the compute stream waiting for copies
  std::int64_t peak_bytes = 0;  // device bytes live at most (allocations rounded)
  std::int32_t peak_op = -1;    // the position where the peak occurs
  // Storages still on the device at the peak only because their write-back has
  // not landed (their copies queued behind others), in index order.
  std::vector<std::int32_t> in_flight_at_peak;
  std::int64_t bytes_d2h = 0;   // per step
  std::int64_t bytes_h2d = 0;
  std::int64_t host_bytes = 0;  // pinned host memory the plan needs
  double host_busy_ms = 0;      // the host CPUs running optimizer updates
  // With the host modelled (ResidencyModel::op_cpu_ms): the host thread's time
  // issuing the step's ops and copies (their cpu_ms and the replay's own), the time it
  // blocked (at a read of a parameter whose host update still runs), and the
  // compute stream's idle time waiting for it to issue an op.
  double host_issue_ms = 0;
  double host_blocked_ms = 0;
  double host_late_ms = 0;
  std::vector<std::int64_t> live_bytes;  // per position, as at the peak
  // (storage index, position): a storage freed once its D2H landed, before the
  // op at that position allocates (step (1) of Note [Residency replay]), or
  // freed at once where it leaves because its D2H has landed by then (the
  // position after; one past the last: the next step's first op). The replay
  // waits for a copy still under way there, so memory stays within the
  // forecast even when the real copy is later than the forecast's.
  std::vector<std::pair<std::int32_t, std::int32_t>> landed;
  // (storage index, position): a copy back issued while the storage's write-back
  // was still under way, so it never left the device in that gap (its copies
  // moved nothing the peak gained from).
  std::vector<std::pair<std::int32_t, std::int32_t>> never_left;
  // With record_timeline: one point per position (node = the graph node's id,
  // times from the step's start; categories: a placeholder's storage on the
  // device is kInputs, one made in the step kTemporaries, one brought back
  // kReloads, one whose write-back has not landed kInFlight), and the step's
  // intervals on the three streams (a copy's node: where it was issued).
  std::vector<TimelinePoint> timeline;
  std::vector<StreamInterval> intervals;
};

// Throws InvalidArgument naming the gap on a plan that does not fit the model
// (a storage or use out of range, a wrap gap of a storage that does not live
// across steps, a gap with no op inside it, lead < 1 or beyond the gap, the
// same gap twice, a wait < 0 or not before the copy back, a host update out
// of range or twice). Host updates: Note
// [Residency replay] in src/sim/residency.cc.
ResidencyForecast simulate_residency(const ResidencyModel& model, const ResidencyPlan& plan,
                                     const CostModel& cost, bool record_timeline = false);

// simulate_residency for many plans with the same host updates: the model those
// updates leave, and what every replay of it indexes, are made once (the
// planner's search simulates thousands of plans per choice of host updates).
// `model` must outlive it (the cost model is copied). Throws InvalidArgument as
// apply_host_updates does, and from simulate() on a plan whose host_updated
// differs.
class ResidencySimulation {
 public:
  ResidencySimulation(const ResidencyModel& model, const std::vector<std::int32_t>& host_updated,
                      const CostModel& cost);
  ~ResidencySimulation();
  ResidencySimulation(const ResidencySimulation&) = delete;
  ResidencySimulation& operator=(const ResidencySimulation&) = delete;
  ResidencyForecast simulate(const ResidencyPlan& plan, bool record_timeline = false) const;
  // The model as the host updates leave it (apply_host_updates; `model` itself for none).
  const ResidencyModel& model() const;
  struct Basis;

 private:
  std::unique_ptr<Basis> basis_;
};

// A forecast recorded with its timeline as the simulator's result, for its
// writers (chrome_trace, memory_svg); `graph` is the one the model was made
// from. Throws InvalidArgument when the forecast has no timeline.
SimResult residency_sim_result(const Graph& graph, const ResidencyModel& model,
                               const ResidencyForecast& forecast);

// The position after which a gap's storage is written back to the host: its
// last writing use at or before the gap's start (for a storage that lives
// across steps, possibly in the step before: a position after the gap's
// start), or -1 when nothing ever writes it (its host copy is made once).
std::int32_t write_back_position(const ResidencyModel& model, const HostGap& gap);

enum class ResidencyStrategy {
  kGreedy,  // cover the peak with the gaps that hide best, then drop what is not needed
  kExact,   // every subset of the candidates (at most exact_max_gaps): the test oracle
};

struct ResidencyOptions {
  std::int64_t budget_bytes = 0;        // device bytes at most (> 0)
  std::int64_t min_bytes = 1 << 20;     // smaller storages stay on the device
  double prefetch_slack = 1.25;         // issue a copy this much ahead of its need
  ResidencyStrategy strategy = ResidencyStrategy::kGreedy;
  int exact_max_gaps = 14;
  // Greedy: when the plan stalls, issue copies back earlier (a gap's lead one
  // op longer or doubled, while the plan fits and gets faster). Off: every lead is the
  // slack rule's (what kExact enumerates with).
  bool tune_leads = true;
  // The model's host updates: none, all, or the fastest plan that fits of
  // none, all and the first 1/8, 1/4, 1/2 and 3/4 of them in the order their
  // gradients complete (kFastest).
  enum class HostUpdates { kNone, kAll, kFastest } host_updates = HostUpdates::kFastest;
};

struct ResidencyResult {
  ResidencyPlan plan;
  ResidencyForecast forecast;
  ResidencyForecast unplanned;  // the step with everything on the device
  std::int32_t candidates = 0;  // gaps the planner could choose from
};

// The least simulated step time whose simulated peak fits the budget (the
// strategy's answer: greedy is not always optimal). Throws InvalidArgument
// when no plan fits, naming the smallest peak it reached and the budget, or
// when kExact is asked for more than exact_max_gaps candidates.
ResidencyResult plan_residency(const ResidencyModel& model, const ResidencyOptions& options,
                               const CostModel& cost);

}  // namespace spillway
