#pragma once
// The budget planner's fast model of one step: what a set of keep / offload /
// recompute decisions does to the step time and the peak, in O(nodes +
// decisions), without rewriting the graph.
//
// It starts from the simulator's timeline of the unchanged graph (per node:
// compute time and live device bytes) and applies each decision as the
// rewrite will place it (offload_rewrite.h, pointwise_replay.h):
//   offload v:   the bytes leave after `offload_release` (the forward wait,
//                release lag applied; with release_positions, after the
//                first of them by which its D2H has finished) and come back at `reload_at` (the
//                prefetched reload); a D2H after the producer and an H2D at
//                reload_at run on their own streams, in issue order, and the
//                compute stream waits for each at the forward wait and at the
//                first backward reader (or an earlier recompute reading v);
//   recompute v: the bytes leave after the last forward use and come back
//                when the recompute runs, right before the first backward
//                reader or before an earlier recompute that reads v; the
//                recompute adds its time to the compute stream there.
// Transient bytes of a recompute's intermediates and the duplex slowdown are
// left to the full simulation, which checks every plan the search returns.
// With host times (Note [The host lane] in budget_problem.cc), a node ends no
// earlier than the host has issued it (execution model (12) of
// spillway/sim.h), the host spending each node's time plus what the
// decisions on the values it produces add.
//
// Thread-safety: immutable after construction; evaluate() is const and may run
// concurrently.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "spillway/budget.h"

namespace spillway::plan {

struct ModelCandidate {
  NodeId node = -1;
  std::size_t position = 0;        // of the producer
  std::int64_t bytes = 0;          // rounded as the allocator rounds it
  bool can_offload = false;
  bool can_recompute = false;
  double recompute_ms = 0;         // the node and its intermediates
  // Recomputed for free by torch.compile's partitioner (pointwise throughout;
  // BudgetOptions::partitioner_recomputes_pointwise): recompute_ms is 0.
  bool free_recompute = false;
  std::size_t last_forward = 0;    // a recomputed value is freed after it
  std::size_t offload_release = 0; // an offloaded value is freed after it
  // BudgetOptions::release_when_copied: the positions an offloaded value may
  // be freed after, earliest first (offload_release, the estimate the search
  // reads, is one of them), with the release lag each stands for. evaluate()
  // frees it after the first one its D2H has finished by, else the last
  // (whose wait stalls). Empty: always offload_release, lag release_lag.
  std::vector<std::size_t> release_positions;
  std::vector<int> release_lags;
  int release_lag = -1;            // of offload_release
  std::size_t first_backward = 0;  // position of its first backward reader
  // Candidates (indices) a recompute of this one reads, directly, through
  // views or intermediates: they must be present when it runs.
  std::vector<int> recompute_reads;
  // Note [The host lane]: host ms added at `position` when offloaded or
  // recomputed; nothing while candidate host_unless (>= 0) is recomputed.
  double host_offload_ms = 0;
  double host_recompute_ms = 0;
  int host_unless = -1;
};

struct ModelScore {
  double step_ms = 0;
  std::int64_t peak = 0;
  std::size_t peak_position = 0;
  double wait_ms = 0;  // compute stream idle waiting for copies
  double host_wait_ms = 0;  // compute stream idle waiting for the host
};

class BudgetModel {
 public:
  // `node_ms` and `baseline_live` per graph position (the simulator's
  // timeline of the unchanged graph); `reload_anchor[p]` is where a reload
  // needed before position p is issued (p itself without prefetch).
  // `host_ms`: the host's time to issue each position, or empty (the host is
  // not modelled). Candidates must be in graph order.
  BudgetModel(std::vector<ModelCandidate> candidates, std::vector<double> node_ms,
              std::vector<std::int64_t> baseline_live, std::vector<std::size_t> reload_anchor,
              const CostModel& cost, std::vector<double> host_ms = {});

  const std::vector<ModelCandidate>& candidates() const { return candidates_; }
  std::size_t size() const { return candidates_.size(); }
  const std::vector<double>& host_ms() const { return host_ms_; }
  // Scores a decision per candidate (decisions.size() == size()); a decision
  // a candidate does not allow is a logic error (Error "[plan] internal").
  // With `live`, also the live bytes while each node runs (one per position).
  // With `release_lags`, the release lag of each offloaded candidate (-1
  // for the others).
  ModelScore evaluate(const std::vector<Decision>& decisions,
                      std::vector<std::int64_t>* live = nullptr,
                      std::vector<int>* release_lags = nullptr) const;
  // The freed interval of candidate i under `decision`: positions
  // [first, last] where its bytes are not live (first > last: none), given
  // the other decisions (a recompute reading i pulls it back earlier).
  std::pair<std::size_t, std::size_t> freed_interval(const std::vector<Decision>& decisions,
                                                     std::size_t i) const;
  // The same with needed_before(decisions) computed by the caller, for
  // candidate i taking `decision` (the others as in the vector it came from).
  std::pair<std::size_t, std::size_t> freed_interval(const std::vector<std::size_t>& before,
                                                     std::size_t i, Decision decision) const;
  // Position before which each candidate must be present under `decisions`:
  // its first backward reader, or an earlier recompute that reads it.
  std::vector<std::size_t> needed_before(const std::vector<Decision>& decisions) const;

 private:

  std::vector<ModelCandidate> candidates_;
  std::vector<double> node_ms_;
  std::vector<double> prefix_ms_;  // prefix_ms_[p] = sum of node_ms_[0..p)
  std::vector<std::int64_t> baseline_live_;
  std::vector<std::size_t> reload_anchor_;
  std::vector<double> host_ms_;   // per position; empty: the host is not modelled
  std::vector<double> d2h_ms_;  // per candidate
  std::vector<double> h2d_ms_;
};

}  // namespace spillway::plan
