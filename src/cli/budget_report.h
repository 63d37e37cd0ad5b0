#pragma once
// The memory-budget side of `spillway plan` (--budget, --sweep): parsing a
// budget as people write it, and rendering plans (include/spillway/budget.h)
// as text and JSON.
//
// Thread-safety: pure functions; call from any thread.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/budget.h"
#include "spillway/graph.h"

namespace spillway::cli {

// Bytes from "12GiB", "800 MiB", "1.5GB", "4096" (bytes) or "60%" (of
// `graph_peak`, the graph's own simulated peak). Units: B, KiB, MiB, GiB,
// TiB, KB, MB, GB, TB (case-insensitive). Throws InvalidArgument("[cli] ...")
// naming the text when it is not one of those or not > 0.
std::int64_t parse_budget(std::string_view text, std::int64_t graph_peak);

// One plan: predicted step time and peak against the graph's own, bytes
// offloaded and recomputed, then the decisions per block (how many values
// kept / offloaded / recomputed and their bytes).
std::string format_budget_text(const BudgetPlan& plan, const std::string& device);

// The curve of a sweep: one row per budget.
std::string format_sweep_text(const std::vector<BudgetPlan>& plans, const std::string& device);

// The same as JSON objects ("budget_bytes", "forecast", "baseline",
// "min_reachable_bytes", "blocks", and with_choices "choices" for one plan; a
// list of them, without "choices", for a sweep). budget_plan_json is the
// object itself (the Python bindings add to it).
nlohmann::json budget_plan_json(const BudgetPlan& plan, bool with_choices);
std::string format_budget_json(const BudgetPlan& plan);
std::string format_sweep_json(const std::vector<BudgetPlan>& plans);

}  // namespace spillway::cli
