#pragma once
// Renders simulation results (include/spillway/sim.h) for people: the summary
// `spillway simulate` prints, and the forecast `spillway plan` prints of the
// rewritten graph against the original.
//
// Thread-safety: pure functions over const inputs; call from any thread.
// Failure: none beyond std::bad_alloc; a node id missing from the graph
// renders as "#<id>".

#include <string>
#include <string_view>

#include "spillway/graph.h"
#include "spillway/sim.h"

namespace spillway::cli {

// One graph's simulation before and after a plan, on one device.
struct PlanForecast {
  std::string device;   // DeviceProfile::name
  SimResult original;   // the graph as given
  SimResult rewritten;  // the plan's rewritten graph
};

// The summary of one simulated step of `graph` on `profile`: predicted step
// time and where it goes, the peak (human_bytes and exact bytes, node, phase,
// when, by category),
// bytes moved each way and the compute stream's wait for copies.
std::string format_sim_text(const Graph& graph, const SimResult& result,
                            const DeviceProfile& profile);

// What is live at the peak, by category: "inputs 1.78 GiB, activations 7.08
// GiB, ..." (categories holding nothing left out; empty when all are).
std::string peak_categories_text(const SimResult& result);

// A few lines: predicted step time and peak (human_bytes) of the original and
// the rewritten graph, side by side, and their differences.
std::string format_forecast_text(const Graph& original, const Graph& rewritten,
                                 const PlanForecast& forecast);

}  // namespace spillway::cli
