#include "cli/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <vector>

namespace spillway::cli {
namespace {

using NodeIndex = std::unordered_map<NodeId, const Node*>;

NodeIndex index_nodes(const Graph& graph) {
  NodeIndex index;
  index.reserve(graph.nodes.size());
  for (const Node& node : graph.nodes) index.emplace(node.id, &node);
  return index;
}

const Node* find_node(const NodeIndex& index, NodeId id) {
  auto it = index.find(id);
  return it == index.end() ? nullptr : it->second;
}

std::string node_name(const NodeIndex& index, NodeId id) {
  if (id < 0) return "-";
  const Node* node = find_node(index, id);
  if (node) return node->name;
  std::string unknown = "#";
  return unknown.append(std::to_string(id));
}

std::string format_dim(const SymSize& size) {
  if (size.is_concrete()) return size.hint ? std::to_string(*size.hint) : "?";
  return size.symbol + "=" + (size.hint ? std::to_string(*size.hint) : "?");
}

struct PhaseCounts {
  std::int64_t forward = 0;
  std::int64_t backward = 0;
};

PhaseCounts count_phases(const Graph& graph) {
  PhaseCounts counts;
  for (const Node& node : graph.nodes) {
    (node.phase == Phase::kForward ? counts.forward : counts.backward) += 1;
  }
  return counts;
}

std::string budget_text(std::int64_t budget) {
  return budget == 0 ? "unlimited" : human_bytes(budget);
}

// A forward value a user would have expected to move: large enough to matter,
// and neither moved nor replayed.
bool is_large_skip(const ValueDecision& decision, std::int64_t min_bytes) {
  return decision.rule != Rule::kChosen && decision.rule != Rule::kReplayed && decision.bytes &&
         *decision.bytes >= min_bytes;
}

struct SkipGroup {
  Rule rule = Rule::kOutOfScope;
  std::int64_t count = 0;
  std::int64_t bytes = 0;
  std::vector<const ValueDecision*> examples;
};

// Groups the large skipped values by rule, most frequent first (ties by rule order).
std::vector<SkipGroup> group_large_skips(const Plan& plan) {
  std::map<int, SkipGroup> by_rule;
  for (const ValueDecision& decision : plan.decisions) {
    if (!is_large_skip(decision, plan.options.min_bytes)) continue;
    SkipGroup& group = by_rule[static_cast<int>(decision.rule)];
    group.rule = decision.rule;
    group.count += 1;
    group.bytes += *decision.bytes;
    if (static_cast<int>(group.examples.size()) < kSkipExamplesPerRule) {
      group.examples.push_back(&decision);
    }
  }
  std::vector<SkipGroup> groups;
  groups.reserve(by_rule.size());
  for (auto& [rule, group] : by_rule) groups.push_back(std::move(group));
  std::stable_sort(groups.begin(), groups.end(),
                   [](const SkipGroup& a, const SkipGroup& b) { return a.count > b.count; });
  return groups;
}

std::string pad(const std::string& text, std::size_t width) {
  return text.size() >= width ? text : text + std::string(width - text.size(), ' ');
}

nlohmann::json sim_json(const NodeIndex& index, const SimResult& result) {
  return {
      {"step_ms", result.step_ms},
      {"peak_bytes", result.peak_bytes},
      {"peak_node", result.peak_node},
      {"peak_node_name", node_name(index, result.peak_node)},
      {"peak_phase", std::string(to_string(result.peak_phase))},
      {"peak_time_ms", result.peak_time_ms},
      {"compute_wait_ms", result.compute_wait_ms},
      {"recompute_ms", result.recompute_ms},
      {"bytes_d2h", result.bytes_d2h},
      {"bytes_h2d", result.bytes_h2d},
      {"host_peak_bytes", result.host_peak_bytes},
  };
}

nlohmann::json forecast_json(const Graph& original, const Graph& rewritten,
                             const PlanForecast& forecast) {
  return {
      {"device", forecast.device},
      {"original", sim_json(index_nodes(original), forecast.original)},
      {"rewritten", sim_json(index_nodes(rewritten), forecast.rewritten)},
      {"step_ms_change", forecast.rewritten.step_ms - forecast.original.step_ms},
      {"peak_bytes_change", forecast.rewritten.peak_bytes - forecast.original.peak_bytes},
  };
}

}  // namespace

std::string human_bytes(std::int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024 && bytes > -1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  int unit = -1;
  while ((value >= 1024.0 || value <= -1024.0) && unit < 3) {
    value /= 1024.0;
    ++unit;
  }
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.2f %s", value, kUnits[unit]);
  return buffer;
}

std::string format_shape(const TensorInfo& tensor) {
  std::string out = "[";
  for (std::size_t i = 0; i < tensor.sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += format_dim(tensor.sizes[i]);
  }
  return out + "]";
}

std::string format_plan_text(const Graph& original, const PlanResult& result,
                             std::string_view scope_note) {
  const Plan& plan = result.plan;
  const NodeIndex index = index_nodes(result.graph);
  const PhaseCounts phases = count_phases(original);
  std::ostringstream out;

  out << "graph:              " << (original.name.empty() ? "(unnamed)" : original.name) << "\n";
  out << "nodes:              " << original.nodes.size() << " (" << phases.forward << " forward, "
      << phases.backward << " backward)\n";
  if (plan.options.mode == ActivationMode::kNone) {
    out << "mode:               none (nothing planned; the graph is unchanged)\n";
    return out.str();
  }
  out << "scope:              " << plan.options.scope;
  if (!scope_note.empty()) out << " " << scope_note;
  out << "\n";
  out << "min bytes:          " << human_bytes(plan.options.min_bytes) << "\n";
  if (plan.options.offload_tuple_outputs || plan.options.dense_storages) {
    out << "relaxations:        "
        << (plan.options.offload_tuple_outputs ? "offload-tuple-outputs " : "")
        << (plan.options.dense_storages ? "dense-storages" : "") << "\n";
  }
  if (plan.options.replay_pointwise) {
    out << "replayed:           " << plan.replays.size() << " values, "
        << human_bytes(plan.bytes_replayed) << " (recomputed in backward, not moved)\n";
  }
  out << "candidates:         " << plan.candidate_count << "\n";
  out << "chosen:             " << plan.offloads.size() << " values, "
      << human_bytes(plan.bytes_offloaded) << "\n";
  out << "host budget:        " << budget_text(plan.options.host_budget_bytes) << "\n";
  out << "reloads prefetched: " << plan.reloads_prefetched << " of " << plan.offloads.size() << " ("
      << plan.options.prefetch_regions << " region(s) early"
      << (plan.options.prefetch_anchor == ActivationPlanOptions::PrefetchAnchor::kRegionEnd
              ? ", after the region's end"
              : "")
      << ")\n";
  out << "nodes after edits:  " << result.graph.nodes.size() << " (+" << plan.edits.size()
      << " edits)\n";

  if (!plan.offloads.empty()) {
    struct Row {
      std::string name, shape, dtype, bytes, last_use, first_reader;
    };
    std::vector<Row> rows;
    Row header{"value", "shape", "dtype", "bytes", "last forward use", "first backward reader"};
    for (const Offload& offload : plan.offloads) {
      const Node* producer = find_node(index, offload.producer);
      Row row;
      row.name = node_name(index, offload.producer);
      row.shape =
          producer && producer->value.is_tensor() ? format_shape(producer->value.tensor) : "?";
      row.dtype = producer && producer->value.is_tensor() ? producer->value.tensor.dtype : "?";
      row.bytes = human_bytes(offload.bytes);
      row.last_use = node_name(index, offload.last_forward_use);
      row.first_reader = node_name(index, offload.first_backward_reader) +
                         (offload.prefetched ? " (prefetched)" : "");
      rows.push_back(std::move(row));
    }
    std::size_t widths[5] = {header.name.size(), header.shape.size(), header.dtype.size(),
                             header.bytes.size(), header.last_use.size()};
    for (const Row& row : rows) {
      widths[0] = std::max(widths[0], row.name.size());
      widths[1] = std::max(widths[1], row.shape.size());
      widths[2] = std::max(widths[2], row.dtype.size());
      widths[3] = std::max(widths[3], row.bytes.size());
      widths[4] = std::max(widths[4], row.last_use.size());
    }
    auto print_row = [&](const Row& row) {
      out << "  " << pad(row.name, widths[0]) << "  " << pad(row.shape, widths[1]) << "  "
          << pad(row.dtype, widths[2]) << "  " << pad(row.bytes, widths[3]) << "  "
          << pad(row.last_use, widths[4]) << "  " << row.first_reader << "\n";
    };
    out << "\nchosen values (largest first):\n";
    print_row(header);
    for (const Row& row : rows) print_row(row);
  }

  const std::vector<SkipGroup> groups = group_large_skips(plan);
  std::int64_t skipped = 0;
  for (const SkipGroup& group : groups) skipped += group.count;
  out << "\nforward values >= " << human_bytes(plan.options.min_bytes) << " not chosen: " << skipped
      << "\n";
  for (const SkipGroup& group : groups) {
    out << "  " << group.count << " x " << to_string(group.rule) << " (" << human_bytes(group.bytes)
        << "): " << describe(group.rule) << "\n";
    for (const ValueDecision* decision : group.examples) {
      out << "      e.g. " << decision->name << " (" << human_bytes(*decision->bytes) << ")";
      if (!decision->detail.empty()) out << ": " << decision->detail;
      out << "\n";
    }
    if (group.count > static_cast<std::int64_t>(group.examples.size())) {
      out << "      ... and " << group.count - static_cast<std::int64_t>(group.examples.size())
          << " more\n";
    }
  }
  return out.str();
}

std::string format_plan_json(const Graph& original, const PlanResult& result,
                             const PlanForecast* forecast) {
  using nlohmann::json;
  const Plan& plan = result.plan;
  const NodeIndex index = index_nodes(result.graph);
  const PhaseCounts phases = count_phases(original);

  json offloads = json::array();
  for (const Offload& offload : plan.offloads) {
    const Node* producer = find_node(index, offload.producer);
    json entry = {
        {"producer", offload.producer},
        {"name", node_name(index, offload.producer)},
        {"bytes", offload.bytes},
        {"last_forward_use", offload.last_forward_use},
        {"last_forward_use_name", node_name(index, offload.last_forward_use)},
        {"first_backward_reader", offload.first_backward_reader},
        {"first_backward_reader_name", node_name(index, offload.first_backward_reader)},
        {"offload_node", offload.offload_node},
        {"forward_wait_node", offload.forward_wait_node},
        {"reload_node", offload.reload_node},
        {"backward_wait_node", offload.backward_wait_node},
        {"prefetched", offload.prefetched},
    };
    if (offload.dense_permute_node >= 0) {
      entry["dense_permute_node"] = offload.dense_permute_node;
      entry["restore_permute_node"] = offload.restore_permute_node;
    }
    if (producer && producer->value.is_tensor()) {
      entry["shape"] = format_shape(producer->value.tensor);
      entry["dtype"] = producer->value.tensor.dtype;
    }
    offloads.push_back(std::move(entry));
  }

  json replays = json::array();
  for (const Replay& replay : plan.replays) {
    replays.push_back({
        {"producer", replay.producer},
        {"name", node_name(index, replay.producer)},
        {"bytes", replay.bytes},
        {"first_backward_reader", replay.first_backward_reader},
        {"first_backward_reader_name", node_name(index, replay.first_backward_reader)},
        {"needed_before", replay.needed_before},
        {"needed_before_name", node_name(index, replay.needed_before)},
        {"replay_node", replay.replay_node},
    });
  }

  json decisions = json::array();
  json skipped_large = json::object();
  for (const ValueDecision& decision : plan.decisions) {
    json entry = {{"node", decision.node},
                  {"name", decision.name},
                  {"bytes", decision.bytes ? json(*decision.bytes) : json(nullptr)},
                  {"rule", std::string(to_string(decision.rule))}};
    if (!decision.detail.empty()) entry["detail"] = decision.detail;
    decisions.push_back(std::move(entry));
  }
  for (const SkipGroup& group : group_large_skips(plan)) {
    skipped_large[std::string(to_string(group.rule))] = group.count;
  }

  json out = {
      {"graph", original.name},
      {"nodes", original.nodes.size()},
      {"forward_nodes", phases.forward},
      {"backward_nodes", phases.backward},
      {"mode", plan.options.mode == ActivationMode::kNone ? "none" : "scope"},
      {"scope", plan.options.scope},
      {"host_budget_bytes", plan.options.host_budget_bytes},
      {"min_bytes", plan.options.min_bytes},
      {"prefetch_regions", plan.options.prefetch_regions},
      {"prefetch_anchor",
       plan.options.prefetch_anchor == ActivationPlanOptions::PrefetchAnchor::kRegionEnd ? "end"
                                                                                         : "start"},
      {"release_lag", plan.options.release_lag},
      {"offload_tuple_outputs", plan.options.offload_tuple_outputs},
      {"dense_storages", plan.options.dense_storages},
      {"replay_pointwise", plan.options.replay_pointwise},
      {"candidates", plan.candidate_count},
      {"chosen", plan.offloads.size()},
      {"bytes_offloaded", plan.bytes_offloaded},
      {"reloads_prefetched", plan.reloads_prefetched},
      {"replayed", plan.replays.size()},
      {"bytes_replayed", plan.bytes_replayed},
      {"edits", plan.edits.size()},
      {"rewritten_nodes", result.graph.nodes.size()},
      {"offloads", std::move(offloads)},
      {"replays", std::move(replays)},
      {"skipped_large", std::move(skipped_large)},
      {"decisions", std::move(decisions)},
  };
  if (forecast != nullptr) out["forecast"] = forecast_json(original, result.graph, *forecast);
  return out.dump(2);
}

}  // namespace spillway::cli
