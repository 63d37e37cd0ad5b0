#include "cli/residency_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace spillway::cli {
namespace {

using nlohmann::json;

std::string residency_gib(std::int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1LL << 30));
  return text;
}

json residency_forecast_json(const ResidencyModel& model, const ResidencyForecast& f) {
  return {{"step_ms", f.step_ms},
          {"compute_ms", f.compute_ms},
          {"stall_ms", f.stall_ms},
          {"peak_bytes", f.peak_bytes},
          {"peak_op", f.peak_op >= 0 ? model.op_names[f.peak_op] : std::string()},
          {"bytes_d2h", f.bytes_d2h},
          {"bytes_h2d", f.bytes_h2d},
          {"host_bytes", f.host_bytes},
          {"host_busy_ms", f.host_busy_ms},
          {"host_modelled", !model.op_cpu_ms.empty()},
          {"host_issue_ms", f.host_issue_ms},
          {"host_blocked_ms", f.host_blocked_ms},
          {"host_late_ms", f.host_late_ms}};
}

}  // namespace

json residency_json(const ResidencyModel& original, const ResidencyResult& result, std::int64_t budget_bytes) {
  // The gaps refer to the model the plan's host updates leave.
  const ResidencyModel model = apply_host_updates(original, result.plan.host_updated);
  const auto n = static_cast<std::int32_t>(model.op_ms.size());
  json host_updates = json::array();
  for (const std::int32_t k : result.plan.host_updated) {
    const HostUpdate& u = original.host_updates[k];
    auto ids = [&](const std::vector<std::int32_t>& storages) {
      json out = json::array();
      for (const std::int32_t s : storages) out.push_back(original.storages[s].id);
      return out;
    };
    json ops = json::array();
    for (const std::int32_t p : u.ops) ops.push_back(original.op_names[p]);
    // Where each gradient is complete: its last write in the model the updates leave.
    json complete = json::array();
    for (const std::int32_t g : u.grads) complete.push_back(gradient_complete_position(original, u, g));
    host_updates.push_back({{"params", ids(u.params)}, {"grads", ids(u.grads)}, {"states", ids(u.states)},
                            {"ops", ops}, {"op_positions", u.ops}, {"grad_complete_pos", complete},
                            {"elements", u.elements}, {"host_ms", u.host_ms}});
  }
  json gaps = json::array();
  for (const HostGap& gap : result.plan.gaps) {
    const ResidencyStorage& st = model.storages[gap.storage];
    const bool wrap = gap.after + 1 == static_cast<std::int32_t>(st.uses.size());
    const std::int32_t next = wrap ? st.uses.front() + n : st.uses[gap.after + 1];
    gaps.push_back({{"storage", st.id},
                    {"name", st.name},
                    {"bytes", st.bytes},
                    {"leaves_after", model.op_names[st.uses[gap.after]]},
                    {"back_before", model.op_names[next % n]},
                    {"issued_at", model.op_names[(next - gap.lead) % n]},
                    {"wrap", wrap},
                    {"after_pos", st.uses[gap.after]},
                    {"back_pos", next % n},
                    {"issue_pos", (next - gap.lead) % n},
                    {"wait_pos", gap.wait > 0 ? (st.uses[gap.after] + gap.wait) % n : -1},
                    {"write_back_pos", write_back_position(model, gap)}});
  }
  // What the executor needs of each moved storage: where it is used and written.
  json storages = json::object();
  for (const HostGap& gap : result.plan.gaps) {
    const ResidencyStorage& st = model.storages[gap.storage];
    json writes = json::array();
    for (std::size_t k = 0; k < st.uses.size(); ++k) {
      if (st.writes[k]) writes.push_back(st.uses[k]);
    }
    storages[std::to_string(st.id)] = {{"name", st.name}, {"bytes", st.bytes}, {"uses", st.uses},
                                       {"writes", writes}, {"across_steps", st.across_steps}};
  }
  // Where the forecast frees a storage whose write-back landed: the replay waits there
  // for a copy still under way (ResidencyForecast::landed).
  json landed = json::array();
  for (const auto& [s, p] : result.forecast.landed) landed.push_back({model.storages[s].id, p});
  return {{"budget_bytes", budget_bytes},
          {"candidates", result.candidates},
          {"landed", landed},
          {"host_update_candidates", original.host_updates.size()},
          {"host_updates", host_updates},
          {"unplanned", residency_forecast_json(model, result.unplanned)},
          {"forecast", residency_forecast_json(model, result.forecast)},
          {"gaps", gaps},
          {"storages", storages}};
}

std::string format_residency_text(const ResidencyModel& model, const ResidencyResult& result,
                                  std::int64_t budget_bytes, const std::string& device) {
  const ResidencyForecast& f = result.forecast;
  const ResidencyForecast& u = result.unplanned;
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof line, "budget:             %s on %s\n", residency_gib(budget_bytes).c_str(), device.c_str());
  out << line;
  std::snprintf(line, sizeof line, "predicted step:     %.2f ms (everything on the device: %.2f ms, %.3fx)\n",
                f.step_ms, u.step_ms, u.step_ms > 0 ? f.step_ms / u.step_ms : 0.0);
  out << line;
  std::snprintf(line, sizeof line, "predicted peak:     %s at %s (everything on the device: %s)\n",
                residency_gib(f.peak_bytes).c_str(), f.peak_op >= 0 ? model.op_names[f.peak_op].c_str() : "-",
                residency_gib(u.peak_bytes).c_str());
  out << line;
  std::snprintf(line, sizeof line, "moved per step:     %s to the host, %s back; %s pinned; %.2f ms waiting\n",
                residency_gib(f.bytes_d2h).c_str(), residency_gib(f.bytes_h2d).c_str(), residency_gib(f.host_bytes).c_str(), f.stall_ms);
  out << line;
  if (!model.op_cpu_ms.empty()) {
    std::snprintf(line, sizeof line,
                  "host thread:        %.2f ms issuing (the replay's own: %.1f us an op, %.1f us a copy), "
                  "%.2f ms blocked; the GPU waited %.2f ms for it\n",
                  f.host_issue_ms, model.replay_op_ms * 1e3, model.replay_copy_ms * 1e3, f.host_blocked_ms,
                  f.host_late_ms);
    out << line;
  }
  if (!model.host_updates.empty()) {
    std::int64_t elements = 0;
    for (const std::int32_t k : result.plan.host_updated) elements += model.host_updates[k].elements;
    std::snprintf(line, sizeof line, "optimizer on host:  %zu of %zu AdamW steps (%.3g M elements), host busy %.2f ms\n",
                  result.plan.host_updated.size(), model.host_updates.size(), static_cast<double>(elements) / 1e6,
                  f.host_busy_ms);
    out << line;
  }
  // Storages that move, largest first, with how many gaps each spends on the host.
  std::map<std::int32_t, int> gaps_of;
  for (const HostGap& gap : result.plan.gaps) ++gaps_of[gap.storage];
  std::vector<std::pair<std::int32_t, int>> moved(gaps_of.begin(), gaps_of.end());
  std::sort(moved.begin(), moved.end(), [&](const auto& a, const auto& b) {
    return model.storages[a.first].bytes > model.storages[b.first].bytes;
  });
  const auto waits = std::count_if(result.plan.gaps.begin(), result.plan.gaps.end(),
                                   [](const HostGap& gap) { return gap.wait > 0; });
  if (waits > 0) {
    std::snprintf(line, sizeof line, "write-back waits:   %td gap%s (the compute stream waits where the storage must be gone)\n",
                  waits, waits == 1 ? "" : "s");
    out << line;
  }
  std::snprintf(line, sizeof line, "storages moved:     %zu of %d candidate gaps' storages\n", moved.size(),
                result.candidates);
  out << line;

  const std::size_t shown = std::min<std::size_t>(moved.size(), 12);
  for (std::size_t i = 0; i < shown; ++i) {
    const ResidencyStorage& st = model.storages[moved[i].first];
    std::snprintf(line, sizeof line, "  %-48s %10s  %d gap%s%s\n", st.name.c_str(), residency_gib(st.bytes).c_str(),
                  moved[i].second, moved[i].second == 1 ? "" : "s", st.across_steps ? " (kept across steps)" : "");
    out << line;
  }
  if (moved.size() > shown) out << "  ... and " << moved.size() - shown << " more\n";
  return out.str();
}

}  // namespace spillway::cli
