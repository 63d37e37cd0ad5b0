#pragma once
// Renders an activation-offload plan for people (a text summary) and for
// programs (a JSON object). Used by the `spillway plan` command.
//
// Thread-safety: pure functions over const inputs; call from any thread.
// Failure: none beyond std::bad_alloc; a plan whose node ids are missing from
// the graph renders those ids as "#<id>".

#include <cstdint>
#include <string>
#include <string_view>

#include "cli/sim_report.h"
#include "spillway/graph.h"
#include "spillway/plan.h"

namespace spillway::cli {

// "1.50 GiB", "512.00 KiB", "17 B".
std::string human_bytes(std::int64_t bytes);

// "[4, s0=8192, 4096]"; an unbacked size prints as its symbol with "=?".
std::string format_shape(const TensorInfo& tensor);

// How many examples of each skip rule the text summary lists.
inline constexpr int kSkipExamplesPerRule = 3;

// The readable summary of `result`, planned from `original` (the graph before
// edits): header facts, the chosen values as a table, then why each forward
// value of at least `min_bytes` was skipped, condensed to a count per rule and
// the first kSkipExamplesPerRule examples. `scope_note`, when not empty,
// follows the scope on its line (how the scope was chosen).
std::string format_plan_text(const Graph& original, const PlanResult& result,
                             std::string_view scope_note = {});

// The same facts as one JSON object (see README.md, "spillway plan --json");
// with a `forecast`, also its numbers under "forecast".
std::string format_plan_json(const Graph& original, const PlanResult& result,
                             const PlanForecast* forecast = nullptr);

}  // namespace spillway::cli
