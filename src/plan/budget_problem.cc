#include "plan/budget_problem.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "analysis/inductor_fusion.h"
#include "analysis/op_facts.h"
#include "analysis/regions.h"
#include "plan/offload_rewrite.h"
#include "plan/pointwise_replay.h"
#include "plan/upcast_sources.h"
#include "spillway/error.h"

namespace spillway::plan {
namespace {

// What the partitioner recomputes for free and Inductor fuses into its
// readers (partitioner_recomputes_pointwise).
bool fusible(const Graph& graph, const Node& node) {
  return analysis::is_inductor_pointwise(node, graph.schema_of(node));
}

// Note [Materialised in backward]
// torch's partitioner never recomputes a value that a backward node outside
// Inductor's fused kernels reads, through any view of it
// (should_ban_recomputation, "materialized in backward",
// torch/_functorch/partitioners.py): recomputing it would cost a buffer and a
// kernel of its own. SiLU(gate) * up and the normalised inputs of the
// projections, read by the weight-gradient matmuls through views, are saved
// as they are. Such a value lands in memory in bf16 in any case, so it may
// be offloaded too (the fusible() ban below is about values Inductor never
// writes out).
bool materialised_in_backward(const analysis::GraphIndex& index,
                              const analysis::StorageGroups& groups, const Node& node) {
  const std::optional<std::int64_t> storage = analysis::storage_of(node);
  const analysis::StorageGroup* group = storage ? groups.find(*storage) : nullptr;
  if (group == nullptr) return false;
  for (NodeId member : group->members) {
    for (NodeId user : index.users(member)) {
      const Node& reader = index.node(user);
      if (reader.phase != Phase::kBackward) continue;
      if (analysis::storage_of(reader) == storage) continue;  // a view: its readers count
      if (!analysis::is_inductor_fused(reader, index.schema_of(reader))) return true;
    }
  }
  return false;
}

// Note [Exact pointwise values]
// A pointwise value each of whose elements is an input element unchanged has
// the same bits wherever it is computed: offloading it, once the partitioner
// writes it out anyway (Note [Materialised in backward]), changes no result.
// Not so for an add or a SiLU: Inductor keeps those in fp32 inside the
// kernels that recompute them, and rounds them only where it writes them
// (BudgetOptions::offload_materialised). Exact: where.self choosing between
// tensors of its own dtype (the attention mask torch.compile builds in each
// layer, where(causal, 0, min) in bf16, which SDPA's backward reads: 128 MiB
// a layer on T1), a cast to a float dtype that holds every value of the
// input's, clone.
bool exact_when_written(const analysis::GraphIndex& index, const Node& node) {
  if (!node.value.is_tensor()) return false;
  const std::string& out = node.value.tensor.dtype;
  auto dtype_of = [&](const Arg& arg) -> std::string {
    if (arg.kind != Arg::Kind::kNode) return {};
    const Node& input = index.node(arg.node);
    return input.value.is_tensor() ? input.value.tensor.dtype : std::string{};
  };
  if (node.target == "aten.clone.default") return true;
  if (node.target == "aten.where.self") {
    return node.args.size() == 3 && dtype_of(node.args[1]) == out && dtype_of(node.args[2]) == out;
  }
  if (node.target == "aten._to_copy.default" && !node.args.empty()) {
    const std::string in = dtype_of(node.args[0]);
    if (in == out) return !in.empty();
    const bool half = in == "bfloat16" || in == "float16";
    return (half && (out == "float32" || out == "float64")) || (in == "float32" && out == "float64");
  }
  return false;
}

}  // namespace

Forecast forecast_of(const Graph& graph, const SimResult& sim) {
  Forecast f;
  f.step_ms = sim.step_ms;
  f.peak_bytes = sim.peak_bytes;
  f.peak_phase = sim.peak_phase;
  for (const Node& node : graph.nodes) {
    if (node.id == sim.peak_node) f.peak_node = node.name;
  }
  f.bytes_offloaded = sim.bytes_d2h;
  f.recompute_ms = sim.recompute_ms;
  f.compute_wait_ms = sim.compute_wait_ms;
  f.host_ms = sim.host_ms;
  f.host_wait_ms = sim.host_wait_ms;
  return f;
}

namespace {

std::vector<Edit> preparation_for(const Graph& graph, const BudgetOptions& options) {
  if (!options.partitioner_recomputes_pointwise || !options.offload_materialised ||
      !options.allow_offload || !options.allow_recompute) {
    return {};
  }
  return upcast_source_edits(graph, analysis::layer_roots(graph));
}

}  // namespace

BudgetProblem::BudgetProblem(const Graph& graph, const BudgetOptions& options, const CostModel& cost)
    : original_(graph),
      preparation_(preparation_for(graph, options)),
      prepared_(preparation_.empty() ? Graph{} : apply_edits(graph, preparation_)),
      graph_(preparation_.empty() ? graph : prepared_),
      options_(options),
      cost_(cost),
      index_(graph_),
      groups_(index_),
      safety_(index_, groups_),
      layers_(analysis::layer_roots(graph_)),
      regions_scope_(make_scope()),
      rule_options_(make_rule_options()),
      ctx_{index_, *regions_scope_, safety_, rule_options_} {
  for (const Edit& edit : preparation_) {
    if (edit.kind != EditKind::kReplayOp) continue;
    prepared_copies_.push_back(edit.node.id);
    upcast_sources_.insert(edit.node.args[0].node);
  }
  collect_candidates();
  probe_candidates();
  baseline_ = simulate(graph_, cost_, sim_options(prepared_copies_));  // with its timeline: build_model reads it
  build_model();
  initial_.assign(model_->size(), Decision::kKeep);
  for (std::size_t i = 0; i < model_->size(); ++i) {
    if (model_->candidates()[i].free_recompute) initial_[i] = Decision::kRecompute;
  }
  baseline_forecast_ = forecast_of(graph_, baseline_);
  baseline_simulation_ = baseline_;
  if (std::find(initial_.begin(), initial_.end(), Decision::kRecompute) != initial_.end()) {
    const BudgetPlan start = materialise(initial_);
    baseline_forecast_ = start.forecast;
    baseline_simulation_ = start.simulation;
  }
}

BudgetPlan BudgetProblem::unchanged() const {
  BudgetPlan plan;
  plan.options = options_;
  plan.choices = choices(initial_);
  plan.baseline = baseline_forecast_;
  plan.forecast = baseline_forecast_;
  plan.graph = original_;
  plan.simulation = baseline_simulation_;
  return plan;
}

std::vector<BudgetChoice> BudgetProblem::choices(const std::vector<Decision>& decisions,
                                                 const std::vector<int>* release_lags) const {
  std::vector<BudgetChoice> out;
  for (std::size_t i = 0; i < model_->size(); ++i) {
    const ModelCandidate& c = model_->candidates()[i];
    BudgetChoice choice;
    choice.node = c.node;
    choice.name = index_.node(c.node).name;
    choice.block = block_of(c.node);
    choice.bytes = c.bytes;
    choice.decision = decisions[i];
    choice.can_offload = c.can_offload;
    choice.can_recompute = c.can_recompute;
    choice.recompute_ms = c.recompute_ms;
    choice.by_partitioner = c.free_recompute;
    if (decisions[i] == Decision::kOffload) {
      choice.release_lag = release_lags != nullptr ? (*release_lags)[i] : c.release_lag;
    }
    out.push_back(std::move(choice));
  }
  return out;
}

BudgetPlan BudgetProblem::materialise(const std::vector<Decision>& decisions) const {
  BudgetPlan plan;
  plan.options = options_;
  std::vector<int> release_lags;
  model_->evaluate(decisions, nullptr, &release_lags);
  plan.choices = choices(decisions, &release_lags);
  plan.baseline = baseline_forecast_;
  std::unordered_set<NodeId> offloaded, recomputed;
  std::vector<std::pair<NodeId, std::int64_t>> in_order;
  for (std::size_t i = 0; i < decisions.size(); ++i) {
    const ModelCandidate& c = model_->candidates()[i];
    in_order.emplace_back(c.node, c.bytes);
    if (decisions[i] == Decision::kOffload) offloaded.insert(c.node);
    if (decisions[i] == Decision::kRecompute) recomputed.insert(c.node);
  }
  std::unordered_set<NodeId> kept = saved_;
  for (NodeId id : offloaded) kept.erase(id);
  for (NodeId id : recomputed) kept.erase(id);
  const ReplayPolicy policy{false, &recomputed, &kept};
  ReplaySelection replay =
      select_replays(ctx_, in_order, offloaded, facts_, policy);
  std::unordered_set<NodeId> replayed;
  for (const ReplayChoice& choice : replay.replays) {
    if (choice.facts != nullptr) replayed.insert(choice.producer);
  }
  for (NodeId id : recomputed) {
    if (!replayed.count(id)) {
      throw Error("plan", "internal error: " + index_.node(id).name +
                              " was chosen for recompute but cannot be rebuilt");
    }
  }
  std::vector<ChosenValue> chosen;
  for (std::size_t i = 0; i < decisions.size(); ++i) {
    if (decisions[i] != Decision::kOffload) continue;
    const ModelCandidate& c = model_->candidates()[i];
    auto before = replay.reload_before.find(c.node);
    chosen.push_back({c.node, c.bytes, &facts_.at(c.node),
                      before == replay.reload_before.end() ? -1 : before->second,
                      c.release_positions.empty() ? -1 : release_lags[i]});
  }
  std::stable_sort(chosen.begin(), chosen.end(),
                   [](const ChosenValue& a, const ChosenValue& b) {
                     return a.bytes > b.bytes;
                   });
  if (chosen.empty() && replay.replays.empty()) {
    plan.graph = original_;
  } else {
    OffloadRewrite rewrite = build_offload_rewrite(
        index_, *regions_scope_, chosen, options_.prefetch_regions, replay,
        ActivationPlanOptions::PrefetchAnchor::kRegionStart, options_.release_lag,
        options_.just_in_time_regions);
    plan.graph = apply_edits(graph_, rewrite.edits);
    plan.edits = preparation_;
    plan.edits.insert(plan.edits.end(), std::make_move_iterator(rewrite.edits.begin()),
                      std::make_move_iterator(rewrite.edits.end()));
    for (const Edit& edit : plan.edits) {
      if (edit.kind == EditKind::kReplayOp) plan.recomputed_nodes.push_back(edit.node.id);
    }
    if (options_.partitioner_recomputes_pointwise) {
      // Inductor fuses a pointwise recompute into the backward kernel that
      // reads it: the copy takes no time of its own.
      const std::unordered_set<NodeId> copies(plan.recomputed_nodes.begin(),
                                              plan.recomputed_nodes.end());
      for (Node& node : plan.graph.nodes) {
        if (copies.count(node.id) && fusible(plan.graph, node)) node.time_ms = 0.0;
      }
    }
  }
  charge_host(decisions, plan.graph, plan.recomputed_nodes);
  plan.simulation = simulate(plan.graph, cost_, sim_options(plan.recomputed_nodes));
  plan.forecast = forecast_of(plan.graph, plan.simulation);
  for (std::size_t i = 0; i < decisions.size(); ++i) {
    if (decisions[i] == Decision::kRecompute) {
      plan.forecast.bytes_recomputed += model_->candidates()[i].bytes;
    }
  }
  return plan;
}

SimOptions BudgetProblem::sim_options(std::vector<NodeId> recomputed) const {
  SimOptions sim;
  sim.recomputed = std::move(recomputed);
  // torch.compile mode: the step as Inductor runs it, pointwise chains fused
  // into their readers' kernels (neither allocated nor timed on their own).
  sim.inductor_fusion = options_.partitioner_recomputes_pointwise;
  // The candidates are the plan's to keep, offload or recompute; the
  // partitioner model (execution model (11)) recomputes the other values
  // backward reads, in the baseline and in every plan alike.
  if (sim.inductor_fusion) sim.planned = candidates_;
  return sim;
}

std::unique_ptr<analysis::ScopeRoots> BudgetProblem::make_scope() const {
  if (!options_.scope.empty()) {
    auto scope = std::make_unique<analysis::ScopeRoots>(graph_, options_.scope);
    if (scope->empty()) {
      std::string message = "scope '" + options_.scope + "' matches no module in graph '" +
                            graph_.name + "'";
      const std::vector<std::string> names = analysis::module_leaf_names(graph_);
      if (!names.empty()) {
        message += "; its module names are:";
        for (const std::string& name : names) message += " " + name;
      }
      throw InvalidArgument("plan", message);
    }
    return scope;
  }
  if (layers_.empty()) {
    throw InvalidArgument(
        "plan", "graph '" + graph_.name +
                    "' has no repeated blocks (no module path ends in a list index, such as "
                    "model.layers.0): nothing to plan per block; pass a scope");
  }
  return std::make_unique<analysis::ScopeRoots>(
      analysis::ScopeRoots::of_roots(graph_, layers_));
}

ActivationPlanOptions BudgetProblem::make_rule_options() const {
  ActivationPlanOptions rules;
  rules.scope = options_.scope.empty() ? "*" : options_.scope;
  rules.min_bytes = options_.min_bytes;
  rules.offload_tuple_outputs = true;
  rules.dense_storages = true;
  rules.prefetch_regions = options_.prefetch_regions;
  rules.release_lag = options_.release_lag;
  return rules;
}

std::string BudgetProblem::block_of(NodeId id) const {
  const Node& node = index_.node(id);
  for (const std::string& path : node.module_stack) {
    if (std::find(layers_.begin(), layers_.end(), path) != layers_.end()) return path;
  }
  return node.module_stack.empty() ? std::string() : node.module_stack.back();
}

void BudgetProblem::collect_candidates() {
  for (const Node& node : graph_.nodes) {
    if (node.phase != Phase::kForward || node.kind == NodeKind::kOutput) continue;
    bool backward_reads = false;
    for (NodeId user : index_.users(node.id)) {
      if (index_.node(user).phase == Phase::kBackward) backward_reads = true;
    }
    if (backward_reads && analysis::holds_tensor(node.value)) saved_.insert(node.id);
    if (!analysis::holds_tensor(node.value)) continue;
    std::string detail;
    Rule rule = kPass;
    for (ValueRule value_rule : value_rules()) {
      rule = value_rule(ctx_, node, detail);
      if (rule != kPass) break;
    }
    if (rule != kPass) continue;
    CandidateFacts facts = gather_candidate_facts(ctx_, node);
    for (ChainRule chain_rule : chain_rules()) {
      rule = chain_rule(ctx_, facts, detail);
      if (rule != kPass) break;
    }
    if (rule != kPass) continue;
    candidates_.push_back(node.id);
    facts_.emplace(node.id, std::move(facts));
  }
  // A candidate's views read by backward keep its storage: the saved set
  // holds storage owners and views alike; select_replays reads by storage.
}

void BudgetProblem::release_choices(const analysis::Regions& forward, std::size_t region,
                                    std::size_t forward_end,
                                    const std::vector<double>& prefix_ms,
                                    ModelCandidate& c) const {
  // Region starts `lag` regions later (the wait sits right before them), then
  // the end of the last region, then the end of forward (before the first
  // backward node); only those at or after the last forward use.
  const std::size_t regions = forward.anchors.size();
  const std::size_t first_lag = static_cast<std::size_t>(std::max(1, options_.release_lag));
  for (std::size_t lag = first_lag; region + lag <= regions + 1; ++lag) {
    const std::size_t later = region + lag;
    const std::size_t position = later < regions    ? forward.anchors[later] - 1
                                 : later == regions ? forward.ends.back()
                                                    : forward_end;
    if (position < c.last_forward ||
        (!c.release_positions.empty() && position <= c.release_positions.back())) {
      continue;
    }
    c.release_positions.push_back(position);
    c.release_lags.push_back(static_cast<int>(lag));
  }
  if (c.release_positions.empty()) return;
  // The search's estimate: the first position by which the copy, alone on
  // the link, has finished.
  const double copied = prefix_ms[c.position + 1] + cost_.d2h_ms(c.bytes);
  std::size_t k = 0;
  while (k + 1 < c.release_positions.size() && prefix_ms[c.release_positions[k] + 1] < copied) ++k;
  c.offload_release = c.release_positions[k];
  c.release_lag = c.release_lags[k];
}

void BudgetProblem::probe_candidates() {
  // Recompute probes: each candidate alone, every saved value kept.
  std::unordered_map<std::int64_t, std::size_t> candidate_of_storage;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    if (auto storage = analysis::storage_of(index_.node(candidates_[i]))) {
      candidate_of_storage.emplace(*storage, i);
    }
  }
  std::vector<std::pair<NodeId, std::int64_t>> in_order;
  for (NodeId id : candidates_) in_order.emplace_back(id, 0);
  const std::unordered_set<NodeId> none;

  std::vector<Probe> probes(candidates_.size());
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const NodeId id = candidates_[i];
    const Node& node = index_.node(id);
    Probe& probe = probes[i];
    probe.can_offload = options_.allow_offload;
    const bool partitioner = options_.partitioner_recomputes_pointwise;
    const bool materialised = partitioner && materialised_in_backward(index_, groups_, node);
    // Under Inductor a fusible value is computed inside its readers' kernels
    // and never lands in memory of its own. Offloading it would make it: bytes
    // a fused kernel rebuilds for free, and, in 16-bit, a rounding the fused
    // kernel (which keeps such intermediates in fp32) never does. A bf16 tiny
    // Llama on the H200 lost bit-exactness that way (2026-12-01). A value
    // materialised in backward is written out in its own dtype all the same
    // (Note [Materialised in backward]), and may be offloaded on request
    // (BudgetOptions::offload_materialised: not bit-exact), and always where
    // no kernel can round it (Note [Exact pointwise values]).
    // An upcast source (Note [Upcast sources]) lands in memory in forward, in
    // its own dtype; the preparation exists only with offload_materialised.
    const bool written = materialised || upcast_sources_.count(id) > 0;
    if (partitioner && fusible(graph_, node) && !(options_.offload_materialised && written)) {
      probe.can_offload = false;
      if (materialised && options_.allow_offload && exact_when_written(index_, node)) {
        probe.can_offload = probe.exact_offload = true;
      }
    }
    if (!options_.allow_recompute) continue;
    const std::unordered_set<NodeId> only{id};
    const ReplayPolicy policy{false, &only, &saved_};
    const ReplaySelection replays = select_replays(ctx_, in_order, none, facts_, policy);
    bool pointwise = true;
    for (const ReplayChoice& choice : replays.replays) {
      probe.can_recompute = probe.can_recompute || choice.producer == id;
      probe.producers.push_back(index_.position(choice.producer));
      pointwise = pointwise && fusible(graph_, index_.node(choice.producer));
      for (NodeId input : choice.kept_inputs) {
        const auto storage = analysis::storage_of(index_.node(input));
        if (!storage) continue;
        auto it = candidate_of_storage.find(*storage);
        if (it != candidate_of_storage.end() && it->second != i &&
            std::find(probe.reads.begin(), probe.reads.end(), it->second) == probe.reads.end()) {
          probe.reads.push_back(it->second);
        }
      }
    }
    if (!probe.can_recompute) probe.producers.clear();
    probe.free_recompute = probe.can_recompute && pointwise && partitioner && !materialised;
  }

  // A candidate the plan can neither offload nor recompute is no candidate:
  // in torch.compile mode it is the partitioner's (execution model (11)),
  // which rebuilds a fusible value from whatever its chain reads, saved by
  // backward or not (the fp32 upcast of a bf16 residual that backward never
  // reads). Left as a candidate, the simulation would keep it whole.
  std::vector<NodeId> kept;
  std::vector<int> index_of(candidates_.size(), -1);  // old index -> new, -1: dropped
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    if (!probes[i].can_offload && !probes[i].can_recompute) continue;
    index_of[i] = static_cast<int>(kept.size());
    kept.push_back(candidates_[i]);
    probes_.push_back(std::move(probes[i]));
  }
  for (Probe& probe : probes_) {
    std::vector<std::size_t> reads;
    for (std::size_t old : probe.reads) {
      if (index_of[old] >= 0) reads.push_back(static_cast<std::size_t>(index_of[old]));
    }
    probe.reads = std::move(reads);
  }
  candidates_ = std::move(kept);
}

// Note [The host lane]
// ~~~~~~~~~~~~~~~~~~~~
// The simulator replays the device's streams; a step also needs a thread to
// launch it, and where that thread does Python work per saved tensor (the
// eager path's hooks: Note [The host's share] in
// python/spillway/activations/_eager_budget.py), it can take longer to issue
// a block than the device takes to run it, and the device waits. A graph
// whose nodes carry cpu_ms (the host's time to issue each) turns on a host
// lane in the fast model and the full simulation alike (execution model
// (12) of spillway/sim.h): the host issues nodes in order without waiting for
// the device, and a node cannot end before the host has issued it. What a
// decision costs the host comes as BudgetOptions::host_costs, per value: ms
// added at its producer when offloaded or recomputed, void while another value
// (the block's whole saved set) is recomputed. A plan's graph carries them in
// its producers' cpu_ms, so the full simulation charges what the search did.
// Backward's host work is not charged: there the device's work per block is
// twice the forward's and the host, which has no saves to sort, stays ahead.

std::vector<double> BudgetProblem::host_ms() const {
  const bool modelled = std::any_of(graph_.nodes.begin(), graph_.nodes.end(),
                                    [](const Node& node) { return node.cpu_ms.has_value(); });
  std::vector<double> out;
  if (!modelled) return out;
  out.reserve(graph_.nodes.size());
  for (const Node& node : graph_.nodes) out.push_back(node.cpu_ms.value_or(0.0));
  return out;
}

void BudgetProblem::apply_host_costs(std::vector<ModelCandidate>& model) const {
  std::unordered_map<NodeId, int> candidate_of;
  for (std::size_t i = 0; i < model.size(); ++i) candidate_of[model[i].node] = static_cast<int>(i);
  std::unordered_map<std::string, NodeId> by_name;
  for (const Node& node : graph_.nodes) by_name.emplace(node.name, node.id);
  auto named = [&](const std::string& name, const char* field) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) {
      throw InvalidArgument("plan", std::string("host_costs: ") + field + " names '" + name +
                                        "', which is no node of the graph");
    }
    return it->second;
  };
  std::unordered_set<std::string> seen;
  for (const HostCost& cost : options_.host_costs) {
    const NodeId id = named(cost.value, "value");
    if (!seen.insert(cost.value).second) {
      throw InvalidArgument("plan", "host_costs: '" + cost.value + "' is named twice");
    }
    if (!std::isfinite(cost.offload_ms) || !std::isfinite(cost.recompute_ms)) {
      throw InvalidArgument("plan",
                            "host_costs: '" + cost.value + "' has a cost that is not finite");
    }
    int unless = -1;  // a value that is no candidate is never recomputed
    if (!cost.unless_recomputed.empty()) {
      const auto other = candidate_of.find(named(cost.unless_recomputed, "unless_recomputed"));
      if (other != candidate_of.end()) unless = other->second;
    }
    const auto it = candidate_of.find(id);
    if (it == candidate_of.end()) continue;  // not a candidate: always kept
    ModelCandidate& c = model[static_cast<std::size_t>(it->second)];
    c.host_offload_ms = cost.offload_ms;
    c.host_recompute_ms = cost.recompute_ms;
    c.host_unless = unless;
  }
}

void BudgetProblem::charge_host(const std::vector<Decision>& decisions, Graph& graph,
                                const std::vector<NodeId>& recomputed_nodes) const {
  if (model_->host_ms().empty()) return;
  // Backward's host work is not charged (above): a recomputed copy of a forward node
  // does not carry the host time of the node it copies.
  const std::unordered_set<NodeId> copies(recomputed_nodes.begin(), recomputed_nodes.end());
  std::unordered_map<NodeId, double> added;
  for (std::size_t i = 0; i < decisions.size(); ++i) {
    const ModelCandidate& c = model_->candidates()[i];
    if (c.host_unless >= 0 &&
        decisions[static_cast<std::size_t>(c.host_unless)] == Decision::kRecompute) {
      continue;
    }
    if (decisions[i] == Decision::kOffload) added[c.node] += c.host_offload_ms;
    if (decisions[i] == Decision::kRecompute) added[c.node] += c.host_recompute_ms;
  }
  for (Node& node : graph.nodes) {
    if (copies.count(node.id)) {
      node.cpu_ms.reset();
      continue;
    }
    const auto it = added.find(node.id);
    if (it == added.end()) continue;
    node.cpu_ms = std::max(0.0, node.cpu_ms.value_or(0.0) + it->second);
  }
}

void BudgetProblem::build_model() {
  const std::size_t n = graph_.nodes.size();
  const SimResult& timeline = baseline_;
  // Fused nodes take a share of their time (execution model (9)): in
  // torch.compile mode each node's compute time as the baseline simulation
  // charged it.
  const bool fused = options_.partitioner_recomputes_pointwise;
  std::vector<double> node_ms(n, 0.0);
  for (std::size_t p = 0; p < n; ++p) {
    node_ms[p] = fused && p < timeline.timeline.size()
                     ? timeline.timeline[p].end_ms - timeline.timeline[p].start_ms
                     : cost_.node_ms(graph_, graph_.nodes[p]);
  }
  std::vector<std::int64_t> live(n, 0);
  for (std::size_t p = 0; p < n && p < timeline.timeline.size(); ++p) {
    live[p] = timeline.timeline[p].live_bytes + timeline.timeline[p].scratch_bytes;
  }

  std::vector<const Node*> nodes;
  nodes.reserve(n);
  for (const Node& node : graph_.nodes) nodes.push_back(&node);
  const analysis::Regions forward = analysis::find_regions(nodes, *regions_scope_, Phase::kForward);
  const analysis::Regions backward =
      analysis::find_regions(nodes, *regions_scope_, Phase::kBackward);
  std::vector<std::size_t> reload_anchor(n);
  for (std::size_t p = 0; p < n; ++p) {
    reload_anchor[p] = p;
    const Node& node = graph_.nodes[p];
    if (node.phase != Phase::kBackward || options_.prefetch_regions == 0) continue;
    const std::string* root = regions_scope_->root_of(node);
    if (root == nullptr) continue;
    const std::optional<std::size_t> k = analysis::region_of(backward, *root, p);
    if (!k) continue;
    const std::optional<std::size_t> target = analysis::prefetch_region(
        backward, *k, options_.prefetch_regions, options_.just_in_time_regions);
    if (target) reload_anchor[p] = std::min(p, backward.anchors[*target]);
  }

  std::vector<double> prefix_ms(n + 1, 0.0);
  for (std::size_t p = 0; p < n; ++p) prefix_ms[p + 1] = prefix_ms[p] + node_ms[p];
  std::size_t forward_end = 0;  // the last node of the leading forward run
  while (forward_end + 1 < n && graph_.nodes[forward_end + 1].phase == Phase::kForward) {
    ++forward_end;
  }

  std::vector<ModelCandidate> model;
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const NodeId id = candidates_[i];
    const Node& node = index_.node(id);
    const CandidateFacts& facts = facts_.at(id);
    ModelCandidate c;
    c.node = id;
    c.position = index_.position(id);
    c.bytes = round_allocation(analysis::hinted_nbytes(node.value.tensor).value_or(0),
                               cost_.profile());
    const Probe& probe = probes_[i];
    c.can_offload = probe.can_offload;
    c.can_recompute = probe.can_recompute;
    c.free_recompute = probe.free_recompute;
    c.recompute_reads.assign(probe.reads.begin(), probe.reads.end());
    c.last_forward = forward_wait_position(index_, facts.lifetime);
    c.offload_release = c.last_forward;
    c.release_lag = options_.release_lag;
    const std::string* root = regions_scope_->root_of(node);
    std::optional<std::size_t> region;
    if (root != nullptr) region = analysis::region_of(forward, *root, c.position);
    if (options_.release_lag > 0 && region) {
      const std::size_t later = *region + static_cast<std::size_t>(options_.release_lag);
      if (later < forward.anchors.size() && forward.anchors[later] > 0) {
        c.offload_release = std::max(c.offload_release, forward.anchors[later] - 1);
      }
    }
    if (options_.release_when_copied && c.can_offload && region &&
        forward.anchors[*region] <= c.position) {
      release_choices(forward, *region, forward_end, prefix_ms, c);
    }
    c.first_backward = index_.position(facts.first_backward_reader);
    if (c.can_recompute && !c.free_recompute) {
      for (std::size_t p : probe.producers) c.recompute_ms += node_ms[p];
    }
    model.push_back(std::move(c));
  }
  if (std::any_of(probes_.begin(), probes_.end(), [](const Probe& p) { return p.exact_offload; })) {
    std::vector<ModelCandidate> narrow = model;
    for (std::size_t i = 0; i < narrow.size(); ++i) {
      if (probes_[i].exact_offload) narrow[i].can_offload = false;
    }
    apply_host_costs(narrow);
    narrow_model_ = std::make_unique<BudgetModel>(std::move(narrow), node_ms, live, reload_anchor,
                                                  cost_, host_ms());
  }
  apply_host_costs(model);
  model_ = std::make_unique<BudgetModel>(std::move(model), std::move(node_ms), std::move(live),
                                         std::move(reload_anchor), cost_, host_ms());
}

}  // namespace spillway::plan
