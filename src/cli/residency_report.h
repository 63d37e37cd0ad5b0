#pragma once
// The residency side of `spillway simulate TRACE --budget B` and of
// spillway._C.plan_residency: a residency plan (include/spillway/residency.h)
// as text and JSON.
//
// Thread-safety: pure functions; call from any thread.

#include <nlohmann/json.hpp>
#include <string>

#include "spillway/residency.h"

namespace spillway::cli {

// "budget_bytes", "candidates", "unplanned" and "forecast" (step_ms,
// compute_ms, stall_ms, peak_bytes, peak_op (a name), bytes_d2h, bytes_h2d,
// host_bytes, host_busy_ms), "host_update_candidates" (how many the model
// offered) and "host_updates": per optimizer step the plan runs on the host,
// the graph's storage ids of its params, grads and states, its ops (names and
// op_positions), grad_complete_pos (the position after which each gradient is
// complete), elements and host_ms; and "gaps" (of the model the host
// updates leave): one object per planned gap (storage (the graph's
// id), name, bytes, leaves_after, back_before, issued_at (op names), wrap, and
// the same as node positions: after_pos, back_pos, issue_pos, write_back_pos
// (-1: never written)), and "storages": per moved storage id (as text) its
// name, bytes, uses and writes (positions) and across_steps.
nlohmann::json residency_json(const ResidencyModel& model, const ResidencyResult& result,
                              std::int64_t budget_bytes);

// The same for people: the forecast against the step with everything on the
// device, then the storages that move, largest first.
std::string format_residency_text(const ResidencyModel& model, const ResidencyResult& result,
                                  std::int64_t budget_bytes, const std::string& device);

}  // namespace spillway::cli
