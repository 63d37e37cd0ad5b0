// Python access to the activation-offload planner: a joint graph in (the JSON
// of docs/graph-format.md, as spillway.fx_export writes it), the plan out as
// JSON. The plan's JSON is the CLI's (`spillway plan --json`, written by
// cli/plan_report) plus the edits themselves, each inserted node complete as
// the rewritten graph carries it (written by the IR's own writer), so Python
// can replay them on an FX graph without a second serialiser.
//
// The planner runs without the GIL: it touches no Python object.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "bindings.h"
#include "cli/plan_report.h"
#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/plan.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

using nlohmann::json;

ActivationMode parse_mode(const std::string& mode) {
  if (mode == "scope") return ActivationMode::kScope;
  if (mode == "none") return ActivationMode::kNone;
  throw InvalidArgument("plan", "mode must be 'scope' or 'none', got '" + mode + "'");
}

ActivationPlanOptions::PrefetchAnchor parse_prefetch_anchor(const std::string& anchor) {
  if (anchor == "start") return ActivationPlanOptions::PrefetchAnchor::kRegionStart;
  if (anchor == "end") return ActivationPlanOptions::PrefetchAnchor::kRegionEnd;
  throw InvalidArgument("plan", "prefetch_anchor must be 'start' or 'end', got '" + anchor + "'");
}

}  // namespace

namespace {

// A node input in the rewritten graph that names a node no earlier edit has
// inserted takes the input the edit inserted the node with: the Python side
// replays the edits in order. The budget planner's preparation (Note [Upcast
// sources], src/plan/upcast_sources.h) inserts a backward cast of a value
// that a later offload redirects to its reload.
void inputs_as_inserted(json& arg, const Arg& inserted, const std::unordered_set<NodeId>& later) {
  if (arg.is_object() && arg.contains("node")) {
    if (later.count(arg.at("node").get<NodeId>()) && inserted.kind == Arg::Kind::kNode) {
      arg["node"] = inserted.node;
    }
  } else if (arg.is_array() && inserted.kind == Arg::Kind::kList &&
             arg.size() == inserted.list.size()) {
    for (std::size_t i = 0; i < arg.size(); ++i) inputs_as_inserted(arg[i], inserted.list[i], later);
  }
}

}  // namespace

json edit_list(const Graph& rewritten, const std::vector<Edit>& edits_in) {
  const json graph = json::parse(write_graph(rewritten));
  std::unordered_map<NodeId, const json*> node_by_id;
  for (const json& node : graph.at("nodes")) node_by_id.emplace(node.at("id").get<NodeId>(), &node);
  std::unordered_set<NodeId> later;  // inserted by an edit not yet listed
  for (const Edit& edit : edits_in) {
    if (edit.kind != EditKind::kRedirect) later.insert(edit.node.id);
  }

  json edits = json::array();
  for (const Edit& edit : edits_in) {
    json entry = {{"kind", std::string(to_string(edit.kind))}, {"source", edit.source}};
    if (edit.kind == EditKind::kRedirect) {
      entry["reader"] = edit.reader;
      entry["from"] = edit.from;
      entry["to"] = edit.to;
    } else {
      auto it = node_by_id.find(edit.node.id);
      if (it == node_by_id.end()) {
        throw Error("plan", "edit node " + std::to_string(edit.node.id) + " (" + edit.node.name +
                                ") is missing from the rewritten graph");
      }
      later.erase(edit.node.id);
      entry["node"] = *it->second;
      json& args = entry["node"]["args"];
      for (std::size_t i = 0; i < args.size() && i < edit.node.args.size(); ++i) {
        inputs_as_inserted(args[i], edit.node.args[i], later);
      }
      json& kwargs = entry["node"]["kwargs"];
      for (const auto& [key, arg] : edit.node.kwargs) {
        if (kwargs.is_object() && kwargs.contains(key)) inputs_as_inserted(kwargs[key], arg, later);
      }
      entry["anchor"] = edit.anchor;
      entry["placement"] = edit.placement == Placement::kAfter ? "after" : "before";
    }
    edits.push_back(std::move(entry));
  }
  return edits;
}

namespace {

std::string plan_to_json(const std::string& graph_json, const ActivationPlanOptions& options) {
  const Graph graph = parse_graph(graph_json);
  const PlanResult result = plan_activation_offload(graph, options);
  verify_offload_graph(graph, result.graph);
  json out = json::parse(cli::format_plan_json(graph, result));
  out["edit_list"] = edit_list(result.graph, result.plan.edits);
  return out.dump();
}

}  // namespace

void init_plan(py::module_& m) {
  m.def(
      "plan_activation_offload",
      [](const std::string& graph_json, const std::string& scope, std::int64_t host_budget_bytes,
         std::int64_t min_bytes, int prefetch_regions, const std::string& mode,
         bool offload_tuple_outputs, bool dense_storages, bool replay_pointwise,
         const std::string& prefetch_anchor, int release_lag) {
        ActivationPlanOptions options;
        options.scope = scope;
        options.host_budget_bytes = host_budget_bytes;
        options.min_bytes = min_bytes;
        options.prefetch_regions = prefetch_regions;
        options.offload_tuple_outputs = offload_tuple_outputs;
        options.dense_storages = dense_storages;
        options.replay_pointwise = replay_pointwise;
        options.release_lag = release_lag;
        try {
          options.mode = parse_mode(mode);
          options.prefetch_anchor = parse_prefetch_anchor(prefetch_anchor);
          py::gil_scoped_release release;
          return plan_to_json(graph_json, options);
        } catch (const InvalidArgument& e) {
          throw py::value_error(e.what());
        } catch (const InvalidGraph& e) {
          throw py::value_error(e.what());
        } catch (const Error& e) {
          throw std::runtime_error(e.what());
        }
      },
      py::arg("graph_json"), py::kw_only(), py::arg("scope") = ActivationPlanOptions{}.scope,
      py::arg("host_budget_bytes") = ActivationPlanOptions{}.host_budget_bytes,
      py::arg("min_bytes") = ActivationPlanOptions{}.min_bytes,
      py::arg("prefetch_regions") = ActivationPlanOptions{}.prefetch_regions,
      py::arg("mode") = "scope",
      py::arg("offload_tuple_outputs") = ActivationPlanOptions{}.offload_tuple_outputs,
      py::arg("dense_storages") = ActivationPlanOptions{}.dense_storages,
      py::arg("replay_pointwise") = ActivationPlanOptions{}.replay_pointwise,
      py::arg("prefetch_anchor") = "start",
      py::arg("release_lag") = ActivationPlanOptions{}.release_lag,
      "Plans activation offload for a joint forward+backward graph given as Spillway graph "
      "JSON (docs/graph-format.md) and returns the plan as JSON text: the fields of "
      "`spillway plan --json` (decisions with rule names, offloads, counts) plus 'edit_list', "
      "the edits in application order (kind, source; insertions: the new node as the "
      "rewritten graph holds it, anchor, placement 'after'/'before'; redirects: reader, from, "
      "to). mode 'none' plans nothing; offload_tuple_outputs, dense_storages, "
      "replay_pointwise and release_lag are the ActivationPlanOptions of those names "
      "(include/spillway/plan.h); "
      "prefetch_anchor 'start' (default, the reference) or 'end' is "
      "ActivationPlanOptions::prefetch_anchor kRegionStart / kRegionEnd. Raises ValueError for "
      "an option out of range, a scope that matches no module (the message names it) or an "
      "invalid graph (the message names the node), with the planner's own message.");
}

}  // namespace spillway::python
