// Python access to the memory-budget planner (spillway/budget.h), the
// simulator (spillway/sim.h) and the weight-stream simulator and resident-set
// scheduler (spillway/weights.h): a graph in as Spillway graph JSON (or a
// model's blocks as lists), results out as JSON text. The planner and the simulator run without the GIL.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "cli/budget_report.h"
#include "cli/residency_report.h"
#include "spillway/budget.h"
#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/residency.h"
#include "spillway/sim.h"
#include "spillway/weights.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

using nlohmann::json;

// What a call asks for: the planner's options, and beside them the device
// profile and the outputs the Python side wants.
struct Knobs {
  BudgetOptions options;
  std::string device_profile_json;
  bool trace = false;
  std::string svg_title;
  bool timeline = false;
};

// The keyword arguments every planner function here shares
// (SPILLWAY_BUDGET_KNOB_ARGS, in this order).
Knobs knobs_of(const std::string& scope, bool allow_offload, bool allow_recompute,
               int prefetch_regions, int release_lag, std::int64_t min_bytes,
               const std::string& profile, bool trace, const std::string& svg_title,
               bool partitioner) {
  Knobs knobs;
  knobs.options.scope = scope;
  knobs.options.allow_offload = allow_offload;
  knobs.options.allow_recompute = allow_recompute;
  knobs.options.prefetch_regions = prefetch_regions;
  knobs.options.release_lag = release_lag;
  knobs.options.min_bytes = min_bytes;
  knobs.options.partitioner_recomputes_pointwise = partitioner;
  knobs.device_profile_json = profile;
  knobs.trace = trace;
  knobs.svg_title = svg_title;
  return knobs;
}

// BudgetOptions::host_costs from JSON text (empty: none); InvalidArgument
// naming what is wrong.
std::vector<HostCost> host_costs_of(const std::string& text) {
  std::vector<HostCost> out;
  if (text.empty()) return out;
  const json list = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!list.is_array()) throw InvalidArgument("plan", "host_costs_json: expected a JSON list");
  for (const json& item : list) {
    if (!item.is_object() || !item.contains("value") || !item["value"].is_string()) {
      throw InvalidArgument("plan", "host_costs_json: every entry needs a 'value' (a node name)");
    }
    HostCost cost;
    cost.value = item["value"].get<std::string>();
    auto number = [&](const char* key, double& out) {
      if (!item.contains(key)) return;
      if (!item[key].is_number()) {
        throw InvalidArgument("plan", "host_costs_json: '" + cost.value + "': " + key +
                                          " must be a number");
      }
      out = item[key].get<double>();
    };
    number("offload_ms", cost.offload_ms);
    number("recompute_ms", cost.recompute_ms);
    if (item.contains("unless_recomputed") && !item["unless_recomputed"].is_null()) {
      if (!item["unless_recomputed"].is_string()) {
        throw InvalidArgument("plan", "host_costs_json: '" + cost.value +
                                          "': unless_recomputed must be a node name");
      }
      cost.unless_recomputed = item["unless_recomputed"].get<std::string>();
    }
    out.push_back(std::move(cost));
  }
  return out;
}

CostModel cost_of(const Knobs& knobs) {
  return CostModel(knobs.device_profile_json.empty() ? h200_profile()
                                                     : parse_device_profile(knobs.device_profile_json));
}

// The simulation's device bytes live at each node (its points are in graph
// order, one per node): name, live_bytes, scratch_bytes, by_category.
json timeline_json(const Graph& graph, const SimResult& simulation) {
  json points = json::array();
  for (std::size_t i = 0; i < simulation.timeline.size(); ++i) {
    const TimelinePoint& point = simulation.timeline[i];
    json by_category = json::object();
    for (int c = 0; c < kMemoryCategoryCount; ++c) {
      by_category[std::string(to_string(static_cast<MemoryCategory>(c)))] = point.by_category[c];
    }
    points.push_back({{"name", graph.nodes[i].name},
                      {"live_bytes", point.live_bytes},
                      {"scratch_bytes", point.scratch_bytes},
                      {"by_category", std::move(by_category)}});
  }
  return points;
}

// budget_report's object (choices, forecast, baseline, blocks), plus the
// recomputed nodes, the edits, the timeline and the pictures the Python side
// asks for.
json plan_json(const BudgetPlan& plan, const Knobs& knobs, bool with_edits) {
  json out = cli::budget_plan_json(plan, true);
  out["recomputed_nodes"] = plan.recomputed_nodes;
  if (with_edits) out["edit_list"] = edit_list(plan.graph, plan.edits);
  if (knobs.timeline) out["timeline"] = timeline_json(plan.graph, plan.simulation);
  if (knobs.trace) out["chrome_trace"] = chrome_trace(plan.graph, plan.simulation);
  if (!knobs.svg_title.empty()) {
    out["memory_svg"] = memory_svg(plan.graph, plan.simulation, knobs.svg_title);
  }
  return out;
}

// Runs `fn` without the GIL and maps Spillway's errors to Python's.
template <typename Fn>
std::string guarded(Fn&& fn) {
  try {
    py::gil_scoped_release release;
    return fn();
  } catch (const InvalidArgument& e) {
    throw py::value_error(e.what());
  } catch (const InvalidGraph& e) {
    throw py::value_error(e.what());
  } catch (const OutOfMemory& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
    throw py::error_already_set();
  } catch (const Error& e) {
    throw std::runtime_error(e.what());
  }
}

// The keyword arguments every function here shares, in this order.
#define SPILLWAY_BUDGET_KNOB_ARGS                                                             \
  py::arg("scope") = "", py::arg("allow_offload") = true, py::arg("allow_recompute") = true, \
      py::arg("prefetch_regions") = 1, py::arg("release_lag") = 1,                           \
      py::arg("min_bytes") = std::int64_t{1} << 20, py::arg("device_profile_json") = "",     \
      py::arg("trace") = false, py::arg("svg_title") = "", py::arg("partitioner") = false


WeightModel weight_model_of(const std::vector<std::int64_t>& block_bytes,
                            const std::vector<std::pair<int, double>>& steps,
                            std::int64_t fixed_bytes) {
  WeightModel model;
  model.block_bytes = block_bytes;
  model.fixed_bytes = fixed_bytes;
  for (const auto& [block, ms] : steps) model.steps.push_back({block, ms});
  return model;
}

json forecast_json(const WeightForecast& f) {
  return {{"call_ms", f.call_ms},         {"compute_ms", f.compute_ms},
          {"stall_ms", f.stall_ms},       {"link_ms", f.link_ms},
          {"bytes_moved", f.bytes_moved}, {"peak_bytes", f.peak_bytes},
          {"resident_bytes", f.resident_bytes}};
}

ResidentStrategy strategy_of(const std::string& name) {
  for (ResidentStrategy s : {ResidentStrategy::kBest, ResidentStrategy::kNothing,
                             ResidentStrategy::kGreedy, ResidentStrategy::kExact}) {
    if (to_string(s) == name) return s;
  }
  throw InvalidArgument("plan", "resident set: strategy must be best, nothing, greedy or exact, "
                                "not '" + name + "'");
}

}  // namespace

void init_budget(py::module_& m) {
  m.def(
      "plan_resident_set",
      [](const std::vector<std::int64_t>& block_bytes,
         const std::vector<std::pair<int, double>>& steps, std::int64_t fixed_bytes,
         std::int64_t budget_bytes, const std::string& strategy, int min_slots, int max_slots,
         const std::string& profile) {
        Knobs knobs;
        knobs.device_profile_json = profile;
        return guarded([&] {
          const WeightModel model = weight_model_of(block_bytes, steps, fixed_bytes);
          ResidentSetOptions options;
          options.budget_bytes = budget_bytes;
          options.strategy = strategy_of(strategy);
          options.min_slots = min_slots;
          options.max_slots = max_slots;
          const ResidentSetResult result = plan_resident_set(model, options, cost_of(knobs));
          json candidates = json::object();
          for (const auto& [name, forecast] : result.candidates) {
            candidates[name] = forecast_json(forecast);
          }
          return json{{"resident", result.plan.resident},
                      {"slots", result.plan.slots},
                      {"strategy", result.strategy},
                      {"forecast", forecast_json(result.forecast)},
                      {"candidates", std::move(candidates)},
                      {"smallest_budget", smallest_weight_budget(model, cost_of(knobs))}}
              .dump();
        });
      },
      py::arg("block_bytes"), py::arg("steps"), py::arg("fixed_bytes"), py::arg("budget_bytes"),
      py::kw_only(), py::arg("strategy") = "best", py::arg("min_slots") = 1,
      py::arg("max_slots") = 4, py::arg("device_profile_json") = "",
      "Which blocks' weights stay on the device under budget_bytes, and how many buffers the "
      "others stream through (include/spillway/weights.h). steps: the call in order, (block "
      "index or -1, compute ms). Returns JSON text: resident (per block), slots, strategy, "
      "forecast and candidates (per strategy run: call_ms, compute_ms, stall_ms, link_ms, "
      "bytes_moved, peak_bytes, resident_bytes), smallest_budget. Raises ValueError for a "
      "malformed model, a bad option, or a budget no plan fits (naming the smallest).");
  m.def(
      "simulate_weight_stream",
      [](const std::vector<std::int64_t>& block_bytes,
         const std::vector<std::pair<int, double>>& steps, std::int64_t fixed_bytes,
         const std::vector<bool>& resident, int slots, const std::string& profile) {
        Knobs knobs;
        knobs.device_profile_json = profile;
        return guarded([&] {
          const WeightModel model = weight_model_of(block_bytes, steps, fixed_bytes);
          return forecast_json(simulate_weight_stream(model, WeightPlan{resident, slots},
                                                      cost_of(knobs)))
              .dump();
        });
      },
      py::arg("block_bytes"), py::arg("steps"), py::arg("fixed_bytes"), py::arg("resident"),
      py::arg("slots"), py::kw_only(), py::arg("device_profile_json") = "",
      "The steady-state forecast of one call under a plan (Note [Weight stream]): JSON text "
      "with call_ms, compute_ms, stall_ms, link_ms, bytes_moved, peak_bytes, resident_bytes.");
  m.def(
      "plan_memory_budget",
      [](const std::string& graph_json, std::int64_t budget_bytes, const std::string& scope,
         bool allow_offload, bool allow_recompute, int prefetch_regions, int release_lag,
         std::int64_t min_bytes, const std::string& profile, bool trace,
         const std::string& svg_title, bool partitioner, double budget_fraction,
         bool release_when_copied, bool timeline, bool offload_materialised, bool relax,
         const std::string& host_costs_json, bool planned_graph) {
        Knobs knobs = knobs_of(scope, allow_offload, allow_recompute, prefetch_regions,
                               release_lag, min_bytes, profile, trace, svg_title, partitioner);
        knobs.options.budget_bytes = budget_bytes;
        knobs.options.budget_fraction = budget_fraction;
        knobs.options.release_when_copied = release_when_copied;
        knobs.options.offload_materialised = offload_materialised;
        knobs.options.relax = relax;
        knobs.timeline = timeline;
        return guarded([&] {
          knobs.options.host_costs = host_costs_of(host_costs_json);
          const Graph graph = parse_graph(graph_json);
          const CostModel cost = cost_of(knobs);
          const BudgetPlan plan = plan_memory_budget(graph, knobs.options, cost);
          json out = plan_json(plan, knobs, true);
          if (planned_graph) out["graph"] = json::parse(write_graph(plan.graph));
          return out.dump();
        });
      },
      py::arg("graph_json"), py::arg("budget_bytes"), py::kw_only(), SPILLWAY_BUDGET_KNOB_ARGS,
      py::arg("budget_fraction") = 0.0, py::arg("release_when_copied") = false,
      py::arg("timeline") = false, py::arg("offload_materialised") = false,
      py::arg("relax") = false, py::arg("host_costs_json") = "", py::arg("planned_graph") = false,
      "Plans keep / offload / recompute for every saved activation of a joint graph (Spillway "
      "graph JSON) so that the simulated peak fits budget_bytes, the fastest such plan "
      "(include/spillway/budget.h). Returns JSON text: budget_bytes, choices (node, name, block, "
      "bytes, decision, can_offload, can_recompute, recompute_ms, by_partitioner, and for an "
      "offload its release_lag), forecast and baseline "
      "(step_ms, peak_bytes, peak_node, peak_phase, bytes_offloaded, bytes_recomputed, "
      "recompute_ms, compute_wait_ms), min_reachable_bytes, recomputed_nodes, edit_list (as "
      "plan_activation_offload's), and with trace / svg_title the simulator's Chrome trace and "
      "memory picture of the plan. device_profile_json empty: the shipped H200 profile. "
      "partitioner: BudgetOptions::partitioner_recomputes_pointwise (torch.compile). "
      "budget_fraction in (0, 1]: the budget is that fraction of the baseline's peak and "
      "budget_bytes is ignored. release_when_copied: BudgetOptions::release_when_copied (the "
      "eager store's per-block release). timeline: also the simulated device bytes live at "
      "each node of the planned graph, in graph order (timeline: name, live_bytes, "
      "scratch_bytes, by_category; execution model (7) of include/spillway/sim.h). relax: "
      "BudgetOptions::relax (search from both ends). host_costs_json: BudgetOptions::host_costs "
      "as a JSON list of {value, offload_ms, recompute_ms, unless_recomputed} (Note [The host "
      "lane]; a graph with cpu_ms on its nodes turns the host lane on; the forecasts then "
      "also give host_ms and host_wait_ms). planned_graph: also the rewritten graph (graph; "
      "simulate_graph runs it with recomputed=recomputed_nodes). Raises "
      "ValueError for bad options or an invalid graph, MemoryError naming the smallest "
      "reachable peak when no plan fits.");
  m.def(
      "sweep_memory_budget",
      [](const std::string& graph_json, const std::vector<std::int64_t>& budgets,
         const std::string& scope, bool allow_offload, bool allow_recompute, int prefetch_regions,
         int release_lag, std::int64_t min_bytes, const std::string& profile, bool trace,
         const std::string& svg_title, bool partitioner) {
        Knobs knobs = knobs_of(scope, allow_offload, allow_recompute, prefetch_regions,
                               release_lag, min_bytes, profile, trace, svg_title, partitioner);
        knobs.options.budget_bytes = 1;  // sweep_memory_budget sets each budget
        return guarded([&] {
          const Graph graph = parse_graph(graph_json);
          const CostModel cost = cost_of(knobs);
          json out = json::array();
          for (const BudgetPlan& plan :
               sweep_memory_budget(graph, knobs.options, cost, budgets)) {
            out.push_back(plan_json(plan, knobs, false));
          }
          return out.dump();
        });
      },
      py::arg("graph_json"), py::arg("budgets") = std::vector<std::int64_t>{}, py::kw_only(),
      SPILLWAY_BUDGET_KNOB_ARGS,
      "One plan per budget (largest first), monotone (a smaller budget never has a faster "
      "forecast or a larger forecast peak); budgets below the smallest reachable peak are left "
      "out. Empty budgets: ten between the smallest reachable peak and the graph's own. Returns "
      "a JSON list of plan_memory_budget's objects without edit_list.");
  m.def(
      "plan_residency",
      [](const std::string& graph_json, const std::string& budget, const std::string& profile,
         std::int64_t min_bytes, const std::string& strategy, bool live_bytes, double host_adamw_gbs,
         double replay_op_us, double replay_copy_us) {
        Knobs knobs;
        knobs.device_profile_json = profile;
        return guarded([&] {
          const Graph graph = parse_graph(graph_json);
          const CostModel cost = cost_of(knobs);
          ResidencyModel model = residency_model(graph, cost);
          if (host_adamw_gbs != 0) add_host_update_candidates(graph, model, host_adamw_gbs);
          model.replay_op_ms = replay_op_us / 1e3;
          model.replay_copy_ms = replay_copy_us / 1e3;
          ResidencyOptions options;
          options.min_bytes = min_bytes;
          if (strategy == "exact") {
            options.strategy = ResidencyStrategy::kExact;
          } else if (strategy != "greedy") {
            throw InvalidArgument("residency", "strategy must be 'greedy' or 'exact', got '" + strategy + "'");
          }
          options.budget_bytes =
              cli::parse_budget(budget, simulate_residency(model, {}, cost).peak_bytes);
          const ResidencyResult result = plan_residency(model, options, cost);
          json out = cli::residency_json(model, result, options.budget_bytes);
          if (live_bytes) {
            out["forecast"]["live_bytes"] = result.forecast.live_bytes;
            out["unplanned"]["live_bytes"] = result.unplanned.live_bytes;
          }
          return out.dump();
        });
      },
      py::arg("graph_json"), py::arg("budget"), py::kw_only(), py::arg("device_profile_json") = "",
      py::arg("min_bytes") = std::int64_t{1} << 20, py::arg("strategy") = "greedy",
      py::arg("live_bytes") = false, py::arg("host_adamw_gbs") = 0.0, py::arg("replay_op_us") = 0.0,
      py::arg("replay_copy_us") = 0.0,
      "Plans residency for a recorded step (include/spillway/residency.h) under `budget` (12GiB, "
      "800MiB, bytes, or 60% of the step's own simulated peak); returns JSON text: budget_bytes, "
      "candidates, unplanned and forecast (step_ms, compute_ms, stall_ms, peak_bytes, peak_op, "
      "bytes_d2h, bytes_h2d, host_bytes, host_busy_ms; with live_bytes the bytes live at each "
      "node), gaps, host_updates. host_adamw_gbs > 0: the step's AdamW(fused=True) ops may run "
      "on the host at that bandwidth (28 bytes per element) when the plan is faster. "
      "replay_op_us, replay_copy_us: the replay's own host time per op and per copy, for a trace "
      "with host times (cpu_ms): the forecast then runs the host thread too (host_issue_ms, host_blocked_ms, host_late_ms).");
  m.def(
      "simulate_graph",
      [](const std::string& graph_json, const std::string& profile,
         const std::vector<NodeId>& recomputed, bool trace, const std::string& svg_title,
         bool timeline) {
        Knobs knobs;
        knobs.device_profile_json = profile;
        return guarded([&] {
          const Graph graph = parse_graph(graph_json);
          const CostModel cost = cost_of(knobs);
          SimOptions options;
          options.recomputed = recomputed;
          const SimResult r = simulate(graph, cost, options);
          std::string peak_node;
          for (const Node& node : graph.nodes) {
            if (node.id == r.peak_node) peak_node = node.name;
          }
          json out = {{"step_ms", r.step_ms},
                      {"peak_bytes", r.peak_bytes},
                      {"peak_node", peak_node},
                      {"peak_phase", std::string(to_string(r.peak_phase))},
                      {"compute_busy_ms", r.compute_busy_ms},
                      {"compute_wait_ms", r.compute_wait_ms},
                      {"recompute_ms", r.recompute_ms},
                      {"bytes_d2h", r.bytes_d2h},
                      {"bytes_h2d", r.bytes_h2d},
                      {"host_peak_bytes", r.host_peak_bytes},
                      {"host_ms", r.host_ms},
                      {"host_wait_ms", r.host_wait_ms}};
          if (trace) out["chrome_trace"] = chrome_trace(graph, r);
          if (!svg_title.empty()) out["memory_svg"] = memory_svg(graph, r, svg_title);
          if (timeline) out["timeline"] = timeline_json(graph, r);
          return out.dump();
        });
      },
      py::arg("graph_json"), py::kw_only(), py::arg("device_profile_json") = "",
      py::arg("recomputed") = std::vector<NodeId>{}, py::arg("trace") = false,
      py::arg("svg_title") = "", py::arg("timeline") = false,
      "Simulates one step of a graph (include/spillway/sim.h) and returns JSON text: step_ms, "
      "peak_bytes, peak_node, peak_phase, compute_busy_ms, compute_wait_ms, recompute_ms, "
      "bytes_d2h, bytes_h2d, host_peak_bytes, and with trace / svg_title the Chrome trace and "
      "the memory picture, with timeline the device bytes live at each node in graph order "
      "(name, live_bytes, scratch_bytes, by_category, as plan_memory_budget's).");
}

}  // namespace spillway::python
