#pragma once
// The memory-budget planner: for every saved activation of a joint
// forward+backward graph, keep it, offload it to pinned host memory, or
// recompute it in backward, so that the simulated step (spillway/sim.h) is as
// fast as possible while its simulated peak device memory fits a budget at
// every point of the step.
//
// How it decides (src/plan/budget_planner.cc):
//   1. The candidates are the forward values backward reads that the
//      activation rules accept (plan.h, with both relaxations on), inside the
//      model's repeated blocks (the children of its largest module list, e.g.
//      model.layers.N), optionally restricted to `scope`. A candidate may be
//      offloaded; it may be recomputed when its op is deterministic, not
//      mutating, not a view or collective, and it can be rebuilt from kept,
//      offloaded or recomputed values and parameters (through forward
//      intermediates of the same kind, at most 16 per value).
//   2. A fast model of the step (the simulator's baseline timeline plus each
//      decision's interval of freed bytes, its copies on the two copy streams
//      and its recompute time) scores plans. A greedy pass applies the action
//      with the least added time per byte taken off the peak until the peak
//      fits; a local search then undoes or swaps decisions that are no longer
//      needed.
//   3. The chosen plan is materialised as graph edits (offload, wait, reload,
//      wait nodes; copies of recomputed nodes before their first backward
//      reader) and simulated in full; when the full simulation exceeds the
//      budget, the search is repeated with the overshoot taken off.
//
// Thread-safety: pure functions.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "spillway/graph.h"
#include "spillway/plan.h"
#include "spillway/sim.h"

namespace spillway {

enum class Decision { kKeep, kOffload, kRecompute };
std::string_view to_string(Decision decision);

// What a decision other than keep on a value costs the host at its producer (Note
// [The host lane]): offload_ms where it is offloaded, recompute_ms where it is
// recomputed (< 0: the producer's launch gets cheaper, e.g. a checkpointed
// block runs without the hooks that sort its saves). While the value named
// `unless_recomputed` is recomputed, the entry adds nothing: its work is not
// done (a block whose saves a checkpoint replaces binds no recipes).
struct HostCost {
  std::string value;              // a node's name
  double offload_ms = 0;
  double recompute_ms = 0;
  std::string unless_recomputed;  // a node's name, or empty
};

struct BudgetOptions {
  // Peak device bytes the step may use (weights and everything the simulator
  // counts included). > 0, unless budget_fraction is set.
  std::int64_t budget_bytes = 0;
  // When in (0, 1]: the budget is this fraction of the baseline's simulated
  // peak (the graph as given, or with the partitioner's recomputes), and
  // budget_bytes is ignored (plan_memory_budget only).
  double budget_fraction = 0;
  // Restrict candidates to the modules whose last path component is `scope`
  // ("self_attn", "mlp"); empty: every repeated block.
  std::string scope;
  bool allow_offload = true;
  bool allow_recompute = true;
  // As in ActivationPlanOptions.
  int prefetch_regions = 1;
  int release_lag = 1;
  // Eager mode (the offload store waits per block call): an offloaded value's
  // device copy is let go at the end of the first forward region, release_lag
  // regions after its producer's or later, by which the fast model expects
  // its D2H to have finished, or the end of the last forward region, or the
  // end of forward (before the first backward node; the wait stalls there if
  // the copy is still running). The lag chosen per value is
  // BudgetChoice::release_lag. Off: every value waits
  // release_lag regions later, as ActivationPlanOptions::release_lag.
  bool release_when_copied = false;
  std::int64_t min_bytes = 1 << 20;
  // torch.compile mode: the min-cut partitioner recomputes cheap pointwise
  // values on its own and Inductor fuses the recompute into backward kernels.
  // Every candidate whose recompute is pointwise throughout (its op and the
  // intermediates it needs) is then recomputed at no time cost from the
  // start, and that state is the baseline: the plan a budget at or above its
  // peak returns (with no edits: the partitioner does it).
  bool partitioner_recomputes_pointwise = false;
  // torch.compile mode: a pointwise value that a backward node outside
  // Inductor's kernels reads (a weight-gradient matmul: SiLU(gate) * up, the
  // projections' normalised inputs) may be offloaded. Off (the default),
  // no pointwise value is offloaded in that mode, and a plan that recomputes
  // nothing is bit-equal to plain torch.compile: with it on, a bf16 tiny Llama
  // on the H200 differed by 4.8e-7 (2026-12-01), as the partitioner of the
  // plain compile rebuilds some of those values in backward in other kernels.
  bool offload_materialised = false;
  // Search from both ends (plan/budget_search.h: relax from everything taken
  // off, beside greedy from nothing), the faster plan, on models of at most
  // 1024 candidates. The eager memory_budget turns it on (T1's eager curve was
  // measured with it: bench/results/2026-12-07-t1-eager-budget-v15-h100.md);
  // off by default here (the CLI, the compiled path) until the compiled curve
  // is. On v14's T1 eager graphs (H100, each at its recorded prefetch distance)
  // it found 316.6 ms at 11 GiB where greedy found 318.2, and, with linear
  // recipes, 324.4 ms at 7.1 GiB where greedy found 344.6.
  bool relax = false;
  // The last this many backward regions (by scope: the backward's last
  // layers) reload their offloaded values right before their first reader
  // instead of prefetch_regions regions early, so that a prefetched layer's
  // reloads are not live beside the layer computing there (Note [A just-in-
  // time tail] in budget_planner.cc). >= 0. With
  // partitioner_recomputes_pointwise, plan_memory_budget and
  // sweep_memory_budget raise it themselves, up to kMaxJustInTimeRegions,
  // for a budget no plan fits without; the plan's options say what it used.
  int just_in_time_regions = 0;
  // Note [The host lane] (budget_problem.cc): what a decision costs the
  // thread that launches the step, beside the graph's per-node cpu_ms. The
  // host lane runs where some node has cpu_ms; without, these are ignored.
  std::vector<HostCost> host_costs;
};

inline constexpr int kMaxJustInTimeRegions = 4;


// The verdict on one candidate.
struct BudgetChoice {
  NodeId node = -1;
  std::string name;
  std::string block;          // the repeated block holding it ("model.layers.3")
  std::int64_t bytes = 0;     // as the allocator rounds it
  Decision decision = Decision::kKeep;
  bool can_offload = false;
  bool can_recompute = false;
  double recompute_ms = 0;    // its node and the intermediates it needs
  // partitioner_recomputes_pointwise: recomputed for free by the partitioner
  // (decision kRecompute from the start; a plan leaves it to the partitioner
  // when it changes nothing else).
  bool by_partitioner = false;
  // Offloaded: the forward regions after its producer's at whose start its
  // device copy is let go (BudgetOptions::release_lag, or the lag chosen with
  // release_when_copied; one past the last region: at the end of the last
  // forward region; two past: at the end of forward). -1 otherwise.
  int release_lag = -1;
};

// What a plan is predicted to cost, by the full simulator.
struct Forecast {
  double step_ms = 0;
  std::int64_t peak_bytes = 0;
  std::string peak_node;
  Phase peak_phase = Phase::kForward;
  std::int64_t bytes_offloaded = 0;   // moved each way
  std::int64_t bytes_recomputed = 0;  // of values rebuilt in backward
  double recompute_ms = 0;
  double compute_wait_ms = 0;         // compute stream idle waiting for copies
  // Note [The host lane]: the host's time to issue the step's nodes, and the
  // compute stream's idle time waiting for it (0 without cpu_ms).
  double host_ms = 0;
  double host_wait_ms = 0;
};

struct BudgetPlan {
  BudgetOptions options;
  std::vector<BudgetChoice> choices;  // every candidate, graph order
  Forecast baseline;                  // the graph as given (with the partitioner's
                                      // pointwise recomputes in that mode)
  Forecast forecast;                  // the rewritten graph
  // The input with the decisions applied (passes verify_offload_graph), and
  // the nodes in it that recompute values (for SimOptions::recomputed).
  Graph graph;
  std::vector<NodeId> recomputed_nodes;
  std::vector<Edit> edits;
  // The full simulation of `graph` (with its timeline, for the writers).
  SimResult simulation;
  // The smallest peak the planner found reachable (every candidate offloaded
  // or recomputed, whichever takes more off), by the full simulator; with
  // partitioner_recomputes_pointwise, with the largest just-in-time tail the
  // planner would try.
  std::int64_t min_reachable_bytes = 0;
};

// Plan a budget. A budget at or above the graph's simulated peak returns the
// graph unchanged (every choice kKeep). Throws InvalidArgument for a budget
// <= 0 or other options out of range, and OutOfMemory("[plan] ...") naming the
// smallest reachable peak when no plan fits. The input is never modified.
BudgetPlan plan_memory_budget(const Graph& graph, const BudgetOptions& options,
                              const CostModel& cost);

// One plan per budget, monotone: over the returned plans, a smaller budget
// never has a smaller forecast step time or a larger forecast peak. Budgets
// below the smallest reachable peak are left out (the caller sees fewer plans
// than budgets; each plan's options.budget_bytes says which budget it is).
// Empty `budgets`: ten budgets evenly spaced between the smallest reachable
// peak and the baseline peak.
std::vector<BudgetPlan> sweep_memory_budget(const Graph& graph, const BudgetOptions& options,
                                            const CostModel& cost,
                                            std::vector<std::int64_t> budgets = {});

}  // namespace spillway
