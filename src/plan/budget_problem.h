#pragma once
// One budget-planning problem: a graph's candidates (activation rules over its
// repeated blocks), their recompute probes, the simulator's baseline, the
// fast model built from them (budget_model.h), and the materialisation of a
// decision vector as graph edits simulated in full.
//
// In torch.compile mode with BudgetOptions::offload_materialised it plans on
// the graph with the upcast sources made explicit (upcast_sources.h, Note
// [Upcast sources]); every plan that changes anything carries those edits
// first.
//
// Ownership: keeps references to the graph and the cost model, which must
// outlive it. Thread-safety: immutable after construction.

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "analysis/graph_index.h"
#include "analysis/group_safety.h"
#include "analysis/regions.h"
#include "analysis/scope.h"
#include "analysis/storage_groups.h"
#include "plan/activation_rules.h"
#include "plan/budget_model.h"
#include "spillway/budget.h"

namespace spillway::plan {

class BudgetProblem {
 public:
  // Throws InvalidArgument for a scope that matches nothing or a graph
  // without repeated blocks (and no scope).
  BudgetProblem(const Graph& graph, const BudgetOptions& options, const CostModel& cost);

  // The graph planned on: the one given, or it with preparation() applied.
  const Graph& graph() const { return graph_; }
  // Note [Upcast sources]: edits of the graph given that every plan with
  // edits starts with; empty outside torch.compile's offload_materialised.
  const std::vector<Edit>& preparation() const { return preparation_; }
  const BudgetOptions& options() const { return options_; }
  const BudgetModel& model() const { return *model_; }
  // model() without the offloads only Note [Exact pointwise values] allows
  // (budget_problem.cc; same candidates, those offloads not allowed), tried
  // first: the greedy search takes a mask's 128 MiB before two 64 MiB values
  // that cost less to move. nullptr when no candidate has such an offload.
  const BudgetModel* narrow_model() const { return narrow_model_.get(); }
  // The full simulation of the graph as given.
  const SimResult& baseline() const { return baseline_; }
  // What the plan leaves as it is: every candidate kept, but those the
  // partitioner recomputes for free in that mode; its forecast and peak.
  const std::vector<Decision>& initial() const { return initial_; }
  const Forecast& baseline_forecast() const { return baseline_forecast_; }
  std::int64_t baseline_peak() const { return baseline_forecast_.peak_bytes; }
  // The plan of initial(): the graph unchanged, no edits, the baseline forecast.
  BudgetPlan unchanged() const;
  // The choice per model candidate under `decisions` (with the release lags
  // BudgetModel::evaluate chose, when given).
  std::vector<BudgetChoice> choices(const std::vector<Decision>& decisions,
                                    const std::vector<int>* release_lags = nullptr) const;
  // The decisions as graph edits, applied and simulated in full.
  BudgetPlan materialise(const std::vector<Decision>& decisions) const;

 private:
  // The simulator's options for this problem's graphs (fused in
  // torch.compile mode).
  SimOptions sim_options(std::vector<NodeId> recomputed) const;
  std::unique_ptr<analysis::ScopeRoots> make_scope() const;
  ActivationPlanOptions make_rule_options() const;
  std::string block_of(NodeId id) const;
  void collect_candidates();
  // What each candidate allows (offload, recompute and from what), without
  // times; drops the candidates that allow nothing.
  void probe_candidates();
  void build_model();
  // Note [The host lane]: each position's cpu_ms (0 where absent), or empty
  // when no node has one; host_costs onto the model's candidates (throws
  // InvalidArgument for a name that is no node, or named twice); and a
  // plan's graph with its decisions' host costs added to their producers (and
  // none on its recomputed copies).
  std::vector<double> host_ms() const;
  void apply_host_costs(std::vector<ModelCandidate>& model) const;
  void charge_host(const std::vector<Decision>& decisions, Graph& graph,
                   const std::vector<NodeId>& recomputed_nodes) const;
  // BudgetOptions::release_when_copied: c's release positions and lags, for a
  // value produced in forward region `region`; forward_end is the position of
  // the last forward node before backward.
  void release_choices(const analysis::Regions& forward, std::size_t region,
                       std::size_t forward_end, const std::vector<double>& prefix_ms,
                       ModelCandidate& c) const;

  const Graph& original_;
  std::vector<Edit> preparation_;
  std::unordered_set<NodeId> upcast_sources_;  // X of each prepared S = cast(X)
  std::vector<NodeId> prepared_copies_;        // the S' of preparation_
  Graph prepared_;                             // original_ with preparation_; empty without
  const Graph& graph_;
  BudgetOptions options_;
  const CostModel& cost_;
  analysis::GraphIndex index_;
  analysis::StorageGroups groups_;
  analysis::StorageSafety safety_;
  std::vector<std::string> layers_;
  std::unique_ptr<analysis::ScopeRoots> regions_scope_;
  ActivationPlanOptions rule_options_;
  RuleContext ctx_;
  struct Probe {
    bool can_offload = false;
    bool can_recompute = false;
    bool free_recompute = false;  // BudgetOptions::partitioner_recomputes_pointwise
    bool exact_offload = false;   // offloadable by Note [Exact pointwise values] alone
    std::vector<std::size_t> producers;  // positions the recompute runs
    std::vector<std::size_t> reads;      // candidates it reads, as indices into candidates_
  };
  std::vector<NodeId> candidates_;  // graph order; each allows offload or recompute
  std::vector<Probe> probes_;       // per candidate
  std::unordered_map<NodeId, CandidateFacts> facts_;
  std::unordered_set<NodeId> saved_;  // forward tensor values backward reads
  SimResult baseline_;
  std::unique_ptr<BudgetModel> model_;
  std::unique_ptr<BudgetModel> narrow_model_;
  std::vector<Decision> initial_;
  Forecast baseline_forecast_;
  SimResult baseline_simulation_;  // of initial(), with its timeline
};

// The forecast part of a full simulation.
Forecast forecast_of(const Graph& graph, const SimResult& sim);

}  // namespace spillway::plan
