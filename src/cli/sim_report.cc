#include "cli/sim_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <vector>

#include "cli/plan_report.h"

namespace spillway::cli {
namespace {

std::string node_label(const Graph& graph, NodeId id) {
  if (id < 0) return "-";
  for (const Node& node : graph.nodes) {
    if (node.id == id) return node.name;
  }
  return "#" + std::to_string(id);
}

// "812.30 ms", "0.672 ms": small graphs' steps keep three digits.
std::string ms_text(double ms) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), ms != 0 && std::abs(ms) < 1 ? "%.3f ms" : "%.2f ms", ms);
  return buffer;
}

// "+17.80 ms (+2.2%)", "-18.80 GiB (-46.8%)", "none": `magnitude` is
// |after - before| as text; the percentage is left out when `before` is 0.
std::string change_text(double before, double after, const std::string& magnitude) {
  if (after == before) return "none";
  std::string text = (after < before ? "-" : "+") + magnitude;
  if (before > 0) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), " (%+.1f%%)", (after - before) / before * 100.0);
    text += buffer;
  }
  return text;
}

std::string padded(std::string text, std::size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

std::string peak_place(const Graph& graph, const SimResult& result) {
  return node_label(graph, result.peak_node) + ", " + std::string(to_string(result.peak_phase));
}

}  // namespace

std::string peak_categories_text(const SimResult& result) {
  std::string out;
  for (int c = 0; c < kMemoryCategoryCount; ++c) {
    if (result.peak_by_category[c] == 0) continue;
    if (!out.empty()) out += ", ";
    out += std::string(to_string(static_cast<MemoryCategory>(c))) + " " +
           human_bytes(result.peak_by_category[c]);
  }
  return out;
}

std::string format_sim_text(const Graph& graph, const SimResult& result,
                            const DeviceProfile& profile) {
  std::int64_t forward = 0;
  for (const Node& node : graph.nodes) forward += node.phase == Phase::kForward;
  std::ostringstream out;
  out << "graph:              " << (graph.name.empty() ? "(unnamed)" : graph.name) << "\n";
  out << "nodes:              " << graph.nodes.size() << " (" << forward << " forward, "
      << static_cast<std::int64_t>(graph.nodes.size()) - forward << " backward)\n";
  out << "device profile:     " << profile.name << "\n";
  out << "predicted step:     " << ms_text(result.step_ms) << " (compute busy "
      << ms_text(result.compute_busy_ms) << ", of which recompute "
      << ms_text(result.recompute_ms) << ")\n";
  out << "peak device memory: " << human_bytes(result.peak_bytes) << " (" << result.peak_bytes
      << " bytes) at node " << peak_place(graph, result) << ", " << ms_text(result.peak_time_ms)
      << " into the step\n";
  const std::string at_peak = peak_categories_text(result);
  if (!at_peak.empty()) out << "  at the peak:      " << at_peak << "\n";
  out << "moved D2H:          " << human_bytes(result.bytes_d2h) << " (D2H stream busy "
      << ms_text(result.d2h_busy_ms) << ")\n";
  out << "moved H2D:          " << human_bytes(result.bytes_h2d) << " (H2D stream busy "
      << ms_text(result.h2d_busy_ms) << ")\n";
  out << "compute wait:       " << ms_text(result.compute_wait_ms)
      << " (compute stream idle, waiting for copies)\n";
  if (result.host_ms > 0) {
    out << "host:               " << ms_text(result.host_ms) << " to issue the step, compute idle "
        << ms_text(result.host_wait_ms) << " waiting for it\n";
  }
  out << "pinned host peak:   " << human_bytes(result.host_peak_bytes) << "\n";
  return out.str();
}

std::string format_forecast_text(const Graph& original, const Graph& rewritten,
                                 const PlanForecast& forecast) {
  const SimResult& before = forecast.original;
  const SimResult& after = forecast.rewritten;
  constexpr std::size_t kLabel = 20;
  const std::string place_before = peak_place(original, before);
  // Wide enough for every cell of the original's column (a long peak node name).
  const std::size_t column = std::max<std::size_t>(20, place_before.size() + 2);
  std::ostringstream out;
  out << "forecast (simulated on " << forecast.device << "):\n";
  out << "  " << padded("", kLabel) << padded("original", column) << padded("rewritten", column)
      << "difference\n";
  out << "  " << padded("step time", kLabel) << padded(ms_text(before.step_ms), column)
      << padded(ms_text(after.step_ms), column)
      << change_text(before.step_ms, after.step_ms,
                     ms_text(std::abs(after.step_ms - before.step_ms)))
      << "\n";
  const std::int64_t peak_change = after.peak_bytes > before.peak_bytes
                                       ? after.peak_bytes - before.peak_bytes
                                       : before.peak_bytes - after.peak_bytes;
  out << "  " << padded("peak device memory", kLabel) << padded(human_bytes(before.peak_bytes), column)
      << padded(human_bytes(after.peak_bytes), column)
      << change_text(static_cast<double>(before.peak_bytes),
                     static_cast<double>(after.peak_bytes), human_bytes(peak_change))
      << "\n";
  out << "  " << padded("peak at", kLabel) << padded(place_before, column)
      << peak_place(rewritten, after) << "\n";
  return out.str();
}

}  // namespace spillway::cli
