#include "cli/budget_report.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "cli/plan_report.h"
#include "cli/sim_report.h"
#include "spillway/error.h"

namespace spillway::cli {
namespace {

using nlohmann::json;

struct BlockMix {
  int counts[3] = {0, 0, 0};  // by Decision
  std::int64_t bytes[3] = {0, 0, 0};
};

// Blocks in order of first appearance, with their decision mix.
std::vector<std::pair<std::string, BlockMix>> blocks_of(const BudgetPlan& plan) {
  std::vector<std::pair<std::string, BlockMix>> blocks;
  for (const BudgetChoice& c : plan.choices) {
    auto it = std::find_if(blocks.begin(), blocks.end(),
                           [&](const auto& b) { return b.first == c.block; });
    if (it == blocks.end()) {
      blocks.emplace_back(c.block, BlockMix{});
      it = std::prev(blocks.end());
    }
    const int d = static_cast<int>(c.decision);
    ++it->second.counts[d];
    it->second.bytes[d] += c.bytes;
  }
  return blocks;
}

std::string ms(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f ms", value);
  return text;
}

std::string ratio(double value, double base) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3fx", base > 0 ? value / base : 0.0);
  return text;
}

json forecast_json(const Forecast& f) {
  json out = {{"step_ms", f.step_ms},
              {"peak_bytes", f.peak_bytes},
              {"peak_node", f.peak_node},
              {"peak_phase", std::string(to_string(f.peak_phase))},
              {"bytes_offloaded", f.bytes_offloaded},
              {"bytes_recomputed", f.bytes_recomputed},
              {"recompute_ms", f.recompute_ms},
              {"compute_wait_ms", f.compute_wait_ms}};
  if (f.host_ms > 0) {  // Note [The host lane]: only where the graph has host times
    out["host_ms"] = f.host_ms;
    out["host_wait_ms"] = f.host_wait_ms;
  }
  return out;
}

}  // namespace

json budget_plan_json(const BudgetPlan& plan, bool with_choices) {
  json blocks = json::array();
  for (const auto& [name, mix] : blocks_of(plan)) {
    blocks.push_back({{"block", name},
                      {"keep", mix.counts[0]},
                      {"offload", mix.counts[1]},
                      {"recompute", mix.counts[2]},
                      {"offload_bytes", mix.bytes[1]},
                      {"recompute_bytes", mix.bytes[2]}});
  }
  json out = {{"budget_bytes", plan.options.budget_bytes},
              {"forecast", forecast_json(plan.forecast)},
              {"baseline", forecast_json(plan.baseline)},
              {"min_reachable_bytes", plan.min_reachable_bytes},
              {"just_in_time_regions", plan.options.just_in_time_regions},
              {"blocks", std::move(blocks)}};
  if (with_choices) {
    json choices = json::array();
    for (const BudgetChoice& c : plan.choices) {
      choices.push_back({{"node", c.node},
                         {"name", c.name},
                         {"block", c.block},
                         {"bytes", c.bytes},
                         {"decision", std::string(to_string(c.decision))},
                         {"can_offload", c.can_offload},
                         {"can_recompute", c.can_recompute},
                         {"recompute_ms", c.recompute_ms},
                         {"by_partitioner", c.by_partitioner}});
      if (c.release_lag >= 0) choices.back()["release_lag"] = c.release_lag;
    }
    out["choices"] = std::move(choices);
  }
  return out;
}

std::int64_t parse_budget(std::string_view text, std::int64_t graph_peak) {
  const std::string original(text);
  auto reject = [&](const std::string& why) -> std::int64_t {
    throw InvalidArgument("cli", "--budget '" + original + "': " + why +
                                     " (write e.g. 12GiB, 800MiB, 4096 or 60%)");
  };
  std::string s;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  }
  if (s.empty()) return reject("empty");
  std::size_t used = 0;
  double number = 0;
  try {
    number = std::stod(s, &used);
  } catch (const std::exception&) {
    return reject("not a number");
  }
  std::string unit = s.substr(used);
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  static const std::map<std::string, double> kUnits{
      {"", 1},           {"b", 1},          {"kib", 1024.0},   {"mib", 1048576.0},
      {"gib", 1073741824.0}, {"tib", 1099511627776.0}, {"kb", 1e3}, {"mb", 1e6},
      {"gb", 1e9},       {"tb", 1e12}};
  double bytes = 0;
  if (unit == "%") {
    bytes = number / 100.0 * static_cast<double>(graph_peak);
  } else {
    auto it = kUnits.find(unit);
    if (it == kUnits.end()) return reject("unknown unit '" + unit + "'");
    bytes = number * it->second;
  }
  if (!std::isfinite(bytes) || bytes < 1) return reject("a budget must be > 0");
  if (bytes > 9.0e18) return reject("too large");
  return std::llround(bytes);
}

std::string format_budget_text(const BudgetPlan& plan, const std::string& device) {
  const Forecast& f = plan.forecast;
  const Forecast& b = plan.baseline;
  std::string out;
  out += "budget:             " + human_bytes(plan.options.budget_bytes) + " of device memory (" +
         device + ")\n";
  out += "predicted peak:     " + human_bytes(f.peak_bytes) + " at " + f.peak_node + " (" +
         std::string(to_string(f.peak_phase)) + "); without a plan " + human_bytes(b.peak_bytes) +
         "\n";
  const std::string at_peak = peak_categories_text(plan.simulation);
  if (!at_peak.empty()) out += "  at the peak:      " + at_peak + "\n";
  out += "predicted step:     " + ms(f.step_ms) + " (" + ratio(f.step_ms, b.step_ms) +
         " of the unplanned " + ms(b.step_ms) + "), compute waiting for copies " +
         ms(f.compute_wait_ms) + ", recomputing " + ms(f.recompute_ms) + "\n";
  if (f.host_ms > 0) {
    out += "host:               " + ms(f.host_ms) + " to issue the step, compute waiting for it " +
           ms(f.host_wait_ms) + "\n";
  }
  out += "moved to host:      " + human_bytes(f.bytes_offloaded) + " each way";
  if (plan.options.just_in_time_regions > 0) {
    const int tail = plan.options.just_in_time_regions;
    out += "; the last " + (tail == 1 ? std::string("backward region reloads")
                                      : std::to_string(tail) + " backward regions reload") +
           " just in time";
  }
  out += "\n";
  out += "recomputed:         " + human_bytes(f.bytes_recomputed) + "\n";
  out += "smallest reachable: " + human_bytes(plan.min_reachable_bytes) + "\n";
  out += "\nper block (values kept / offloaded / recomputed, bytes offloaded / recomputed):\n";
  for (const auto& [name, mix] : blocks_of(plan)) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-28s %3d / %3d / %3d   %10s / %10s\n",
                  name.empty() ? "(outside blocks)" : name.c_str(), mix.counts[0], mix.counts[1],
                  mix.counts[2], human_bytes(mix.bytes[1]).c_str(),
                  human_bytes(mix.bytes[2]).c_str());
    out += line;
  }
  return out;
}

std::string format_sweep_text(const std::vector<BudgetPlan>& plans, const std::string& device) {
  std::string out = "the curve (" + device + "): predicted step and peak per budget\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %12s %12s %12s %8s %12s %12s %10s\n", "budget", "peak",
                "step", "x none", "offloaded", "recomputed", "wait");
  out += line;
  for (const BudgetPlan& plan : plans) {
    const Forecast& f = plan.forecast;
    std::snprintf(line, sizeof line, "  %12s %12s %12s %8s %12s %12s %10s\n",
                  human_bytes(plan.options.budget_bytes).c_str(), human_bytes(f.peak_bytes).c_str(),
                  ms(f.step_ms).c_str(), ratio(f.step_ms, plan.baseline.step_ms).c_str(),
                  human_bytes(f.bytes_offloaded).c_str(), human_bytes(f.bytes_recomputed).c_str(),
                  ms(f.compute_wait_ms).c_str());
    out += line;
  }
  if (!plans.empty()) {
    out += "smallest reachable peak: " + human_bytes(plans.back().min_reachable_bytes) + "\n";
  }
  return out;
}

std::string format_budget_json(const BudgetPlan& plan) { return budget_plan_json(plan, true).dump(); }

std::string format_sweep_json(const std::vector<BudgetPlan>& plans) {
  json out = json::array();
  for (const BudgetPlan& plan : plans) out.push_back(budget_plan_json(plan, false));
  return out.dump();
}

}  // namespace spillway::cli
