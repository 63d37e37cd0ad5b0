// The `spillway` command: plan activation offload for a joint forward+backward
// graph, simulate a graph's step on a device profile, or validate a graph file. See README.md for the reference and
// `spillway --help` for the exit codes.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "cli/budget_report.h"
#include "cli/plan_report.h"
#include "cli/residency_report.h"
#include "cli/sim_report.h"
#include "spillway/budget.h"
#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/plan.h"
#include "spillway/residency.h"
#include "spillway/sim.h"

namespace spillway::cli {
namespace {

namespace fs = std::filesystem;

constexpr int kExitOk = 0;
constexpr int kExitInvalid = 1;
constexpr int kExitUsage = 2;
constexpr int kExitIo = 3;

constexpr const char* kExitCodeHelp =
    "Exit codes:\n"
    "  0  success\n"
    "  1  invalid graph or option value (stderr names it, starting with \"[component]\")\n"
    "  2  usage error: unknown option, missing or malformed argument\n"
    "  3  I/O error: graph or profile file missing or unreadable, output not writable";

// The graph `spillway plan` uses when none is named, relative to the source tree.
constexpr const char* kDefaultGraph = "examples/graphs/llama3-8b-s8192-cuda.json.zst";

// Without --scope, the first of these that names a module of the graph: the
// attention block's name in Llama-family models, GPT-2, and others.
constexpr std::array<std::string_view, 4> kDefaultScopes{"self_attn", "attn", "attention",
                                                         "self_attention"};

// "a, b, c".
template <typename Names>
std::string join_names(const Names& names) {
  std::string joined;
  for (std::string_view name : names) joined.append(joined.empty() ? "" : ", ").append(name);
  return joined;
}

// A file could not be found, read or written. Maps to exit code 3.
class IoError : public Error {
 public:
  using Error::Error;
};

// `what` names the file for the message: "graph", "device profile".
void require_readable_file(const std::string& path, std::string_view what = "graph") {
  const std::string kind(what);
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (!fs::exists(status)) throw IoError("cli", kind + " file not found: " + path);
  if (fs::is_directory(status)) throw IoError("cli", kind + " path is a directory: " + path);
  std::ifstream stream(path, std::ios::binary);
  if (!stream) throw IoError("cli", "cannot open " + kind + " file for reading: " + path);
}

void write_text_file(const std::string& path, const std::string& text, std::string_view what) {
  std::ofstream stream(path, std::ios::binary | std::ios::trunc);
  if (stream) stream << text;
  if (!stream || !stream.flush()) {
    throw IoError("cli", "cannot write the " + std::string(what) + " to " + path);
  }
}

// Where the default graph may live: the source tree this binary was built from,
// then the tree around the executable (build/<preset>/src/cli/spillway).
std::vector<fs::path> default_graph_locations() {
  std::vector<fs::path> locations;
#ifdef SPILLWAY_SOURCE_DIR
  locations.push_back(fs::path(SPILLWAY_SOURCE_DIR) / kDefaultGraph);
#endif
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error) {
    const fs::path root = exe.parent_path().parent_path().parent_path().parent_path().parent_path();
    locations.push_back(root / kDefaultGraph);
  }
  return locations;
}

std::string resolve_default_graph() {
  std::string tried;
  for (const fs::path& location : default_graph_locations()) {
    std::error_code error;
    if (fs::is_regular_file(location, error)) return location.string();
    tried += (tried.empty() ? "" : ", ") + location.string();
  }
  throw IoError("cli", std::string("the built-in default graph ") + kDefaultGraph +
                           " is missing (looked in: " + tried + "); pass a GRAPH file");
}

Graph load_verified(const std::string& path) {
  require_readable_file(path);
  Graph graph = load_graph(path);
  verify_graph(graph);
  return graph;
}

// What `simulate` and `plan` share: the device and the pictures of the step.
struct SimArgs {
  std::string device_profile;  // empty: h200_profile()
  std::string trace;           // Chrome trace JSON, when not empty
  std::string timeline;        // memory SVG, when not empty

  bool wants_timeline() const { return !trace.empty() || !timeline.empty(); }
};

DeviceProfile load_profile(const SimArgs& args) {
  if (args.device_profile.empty()) return h200_profile();
  require_readable_file(args.device_profile, "device profile");
  return load_device_profile(args.device_profile);
}

void add_sim_options(CLI::App& command, SimArgs& args) {
  command.add_option("--device-profile", args.device_profile,
                     "Device profile JSON (docs/device-profile.md) to simulate on (default: the "
                     "built-in NVIDIA H200 profile)");
  command.add_option("--trace", args.trace,
                     "Write the simulated step as a Chrome trace (Perfetto, chrome://tracing) "
                     "to OUT.json");
  command.add_option("--timeline", args.timeline,
                     "Write a picture of live device memory over the step to OUT.svg");
}

// Writes what `args` asks for from `result` (simulated with record_timeline)
// and returns one line per file written.
std::string write_sim_outputs(const SimArgs& args, const Graph& graph, const SimResult& result,
                              std::string_view title) {
  std::string written;
  if (!args.trace.empty()) {
    write_text_file(args.trace, chrome_trace(graph, result), "trace");
    written += "wrote the trace to " + args.trace + "\n";
  }
  if (!args.timeline.empty()) {
    write_text_file(args.timeline, memory_svg(graph, result, title), "timeline");
    written += "wrote the memory timeline to " + args.timeline + "\n";
  }
  return written;
}

// Simulates `graph` and the plan's rewrite of it on `profile`; replayed values
// are the rewritten graph's recomputation. Only the rewritten graph's timeline
// is kept, and only when `record_timeline`.
PlanForecast forecast_plan(const Graph& graph, const PlanResult& result, const DeviceProfile& profile,
                       bool record_timeline) {
  const CostModel cost(profile);
  PlanForecast forecast;
  forecast.device = profile.name;
  SimOptions original_options;
  original_options.record_timeline = false;
  forecast.original = simulate(graph, cost, original_options);
  SimOptions rewritten_options;
  rewritten_options.record_timeline = record_timeline;
  for (const Replay& replay : result.plan.replays) {
    rewritten_options.recomputed.push_back(replay.replay_node);
  }
  forecast.rewritten = simulate(result.graph, cost, rewritten_options);
  return forecast;
}

// The graph's name, or its file's when it has none: the pictures' titles.
std::string display_name(const Graph& graph, const std::string& path) {
  return graph.name.empty() ? fs::path(path).filename().string() : graph.name;
}

struct PlanArgs {
  std::string graph_path;
  std::string scope;
  bool scope_given = false;  // false: default_scope() picks one from the graph
  std::string mode = "scope";
  double host_budget_gib = 0.0;
  std::int64_t min_bytes = ActivationPlanOptions{}.min_bytes;
  int prefetch_regions = ActivationPlanOptions{}.prefetch_regions;
  std::string prefetch_anchor = "start";
  int release_lag = ActivationPlanOptions{}.release_lag;
  bool release_lag_given = false;  // the budget planner's default differs (1)
  bool offload_tuple_outputs = false;
  bool dense_storages = false;
  bool replay_pointwise = false;
  bool json = false;
  std::string emit_graph;
  SimArgs sim;
  // The memory-budget planner instead of the scope policy.
  std::string budget;  // parse_budget's forms; empty: no budget
  bool sweep = false;
  bool no_offload = false;
  bool no_recompute = false;
  bool partitioner = false;
  bool offload_materialised = false;
  bool release_when_copied = false;
  bool relax = false;
};

// `spillway plan --budget B` / `--sweep`: keep, offload or recompute per
// saved value (include/spillway/budget.h). --scope restricts the candidates.
int run_budget(const PlanArgs& args, const std::string& path, const Graph& graph,
               const DeviceProfile& profile) {
  const CostModel cost(profile);
  BudgetOptions options;
  options.scope = args.scope_given ? args.scope : std::string();
  options.allow_offload = !args.no_offload;
  options.allow_recompute = !args.no_recompute;
  options.partitioner_recomputes_pointwise = args.partitioner;
  options.offload_materialised = args.offload_materialised;
  options.release_when_copied = args.release_when_copied;
  options.relax = args.relax;
  options.min_bytes = args.min_bytes;
  options.prefetch_regions = args.prefetch_regions;
  options.release_lag = args.release_lag_given ? args.release_lag : BudgetOptions{}.release_lag;
  SimOptions quiet;
  quiet.record_timeline = false;
  const std::int64_t graph_peak = simulate(graph, cost, quiet).peak_bytes;
  if (args.sweep) {
    if (!args.budget.empty()) {
      throw InvalidArgument("cli", "--sweep plans its own ten budgets; drop --budget");
    }
    options.budget_bytes = 1;
    const std::vector<BudgetPlan> plans = sweep_memory_budget(graph, options, cost);
    if (args.json) {
      std::cout << format_sweep_json(plans) << "\n";
    } else {
      std::cout << "file:               " << path << "\n" << format_sweep_text(plans, profile.name);
    }
    return kExitOk;
  }
  options.budget_bytes = parse_budget(args.budget, graph_peak);
  const BudgetPlan plan = plan_memory_budget(graph, options, cost);
  verify_offload_graph(graph, plan.graph);
  if (!args.emit_graph.empty()) save_graph(plan.graph, args.emit_graph);
  const std::string title = display_name(graph, path) + ", budget " +
                            human_bytes(options.budget_bytes) + " (" + profile.name + ")";
  const std::string written = write_sim_outputs(args.sim, plan.graph, plan.simulation, title);
  if (args.json) {
    std::cout << format_budget_json(plan) << "\n";
  } else {
    std::cout << "file:               " << path << "\n" << format_budget_text(plan, profile.name);
    if (!args.emit_graph.empty()) {
      std::cout << "\nwrote the rewritten graph (" << plan.graph.nodes.size() << " nodes) to "
                << args.emit_graph << "\n";
    }
    if (!written.empty()) std::cout << (args.emit_graph.empty() ? "\n" : "") << written;
  }
  return kExitOk;
}

ActivationPlanOptions to_options(const PlanArgs& args) {
  ActivationPlanOptions options;
  if (args.mode == "scope") {
    options.mode = ActivationMode::kScope;
  } else if (args.mode == "none") {
    options.mode = ActivationMode::kNone;
  } else {
    throw InvalidArgument("cli", "--mode must be 'scope' or 'none', got '" + args.mode + "'");
  }
  constexpr double kBytesPerGib = 1024.0 * 1024.0 * 1024.0;
  // 2^63 bytes is 8 EiB; anything near it is a typo, not a budget.
  if (!std::isfinite(args.host_budget_gib) || args.host_budget_gib < 0 ||
      args.host_budget_gib > 1e9) {
    throw InvalidArgument("cli", "--host-budget-gib must be a number in [0, 1e9], got " +
                                     std::to_string(args.host_budget_gib));
  }
  options.host_budget_bytes = std::llround(args.host_budget_gib * kBytesPerGib);
  options.scope = args.scope;
  options.min_bytes = args.min_bytes;
  options.prefetch_regions = args.prefetch_regions;
  if (args.prefetch_anchor == "start") {
    options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionStart;
  } else if (args.prefetch_anchor == "end") {
    options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionEnd;
  } else {
    throw InvalidArgument("cli", "--prefetch-anchor must be 'start' or 'end', got '" +
                                     args.prefetch_anchor + "'");
  }
  options.release_lag = args.release_lag;
  options.offload_tuple_outputs = args.offload_tuple_outputs;
  options.dense_storages = args.dense_storages;
  options.replay_pointwise = args.replay_pointwise;
  return options;
}

// The first of kDefaultScopes that names a module of `graph`. Throws
// InvalidArgument listing the graph's module names when none does.
std::string default_scope(const Graph& graph) {
  const std::vector<std::string> names = scope_names(graph);
  for (std::string_view scope : kDefaultScopes) {
    if (std::find(names.begin(), names.end(), scope) != names.end()) return std::string(scope);
  }
  const std::string message = "no --scope given and graph '" + graph.name +
                              "' has no module named " + join_names(kDefaultScopes) + "; ";
  if (names.empty()) throw InvalidArgument("cli", message + "no node of it carries a module stack");
  throw InvalidArgument("cli", message + "pass --scope with one of its module names: " +
                                   join_names(names));
}

int run_plan(const PlanArgs& args) {
  ActivationPlanOptions options = to_options(args);
  const DeviceProfile profile = load_profile(args.sim);
  const std::string path = args.graph_path.empty() ? resolve_default_graph() : args.graph_path;
  const Graph graph = load_verified(path);
  if (!args.budget.empty() || args.sweep) return run_budget(args, path, graph, profile);
  std::string scope_note;
  if (!args.scope_given && options.mode == ActivationMode::kScope) {
    options.scope = default_scope(graph);
    scope_note = "(no --scope: the first found of " + join_names(kDefaultScopes) + ")";
  }
  const PlanResult result = plan_activation_offload(graph, options);
  verify_offload_graph(graph, result.graph);
  if (!args.emit_graph.empty()) save_graph(result.graph, args.emit_graph);

  const PlanForecast forecast = forecast_plan(graph, result, profile, args.sim.wants_timeline());
  const std::string title =
      display_name(graph, path) +
      (options.mode == ActivationMode::kNone
           ? std::string(", not planned")
           : ", " + std::to_string(result.plan.offloads.size()) + " values of " +
                 options.scope + " moved") +
      " (" + profile.name + ")";
  const std::string written = write_sim_outputs(args.sim, result.graph, forecast.rewritten, title);

  if (args.json) {
    std::cout << format_plan_json(graph, result, &forecast) << "\n";
  } else {
    std::cout << "file:               " << path << "\n"
              << format_plan_text(graph, result, scope_note) << "\n"
              << format_forecast_text(graph, result.graph, forecast);
    if (!args.emit_graph.empty()) {
      std::cout << "\nwrote the rewritten graph (" << result.graph.nodes.size() << " nodes) to "
                << args.emit_graph << "\n";
    }
    if (!written.empty()) std::cout << (args.emit_graph.empty() ? "\n" : "") << written;
  }
  return kExitOk;
}

struct SimulateArgs {
  std::string graph_path;
  SimArgs sim;
  bool inductor_fusion = false;
  std::string budget;  // parse_budget's forms; empty: no residency plan
  std::int64_t min_bytes = 1 << 20;
  double host_adamw_gbs = 0;  // > 0: AdamW steps may run on the host at this bandwidth
  double replay_op_us = 0;    // the replay's own host time per op (ResidencyModel::replay_op_ms)
  double replay_copy_us = 0;  // and per copy (ResidencyModel::replay_copy_ms)
  bool json = false;
};

// --budget: plan residency for a recorded step (include/spillway/residency.h)
// and print its forecast.
int run_residency(const SimulateArgs& args, const Graph& graph, const DeviceProfile& profile) {
  const CostModel cost(profile);
  ResidencyModel model = residency_model(graph, cost);
  if (args.host_adamw_gbs != 0) add_host_update_candidates(graph, model, args.host_adamw_gbs);
  model.replay_op_ms = args.replay_op_us / 1e3;
  model.replay_copy_ms = args.replay_copy_us / 1e3;
  ResidencyOptions options;
  options.min_bytes = args.min_bytes;
  const std::int64_t own_peak = simulate_residency(model, {}, cost).peak_bytes;
  options.budget_bytes = parse_budget(args.budget, own_peak);
  const ResidencyResult result = plan_residency(model, options, cost);
  std::string written;
  if (args.sim.wants_timeline()) {
    const ResidencyForecast recorded = simulate_residency(model, result.plan, cost, true);
    written = write_sim_outputs(args.sim, graph, residency_sim_result(graph, model, recorded),
                                display_name(graph, args.graph_path) + " under a residency plan (" +
                                    profile.name + ")");
  }
  if (args.json) {
    std::cout << residency_json(model, result, options.budget_bytes).dump(2) << "\n";
  } else {
    std::cout << "file:               " << args.graph_path << "\n"
              << format_residency_text(model, result, options.budget_bytes, profile.name);
    if (!written.empty()) std::cout << "\n" << written;
  }
  return kExitOk;
}

int run_simulate(const SimulateArgs& args) {
  const DeviceProfile profile = load_profile(args.sim);
  const Graph graph = load_verified(args.graph_path);
  if (!args.budget.empty()) return run_residency(args, graph, profile);
  SimOptions options;
  options.record_timeline = args.sim.wants_timeline();
  options.inductor_fusion = args.inductor_fusion;
  const SimResult result = simulate(graph, CostModel(profile), options);
  const std::string title = display_name(graph, args.graph_path) + " (" + profile.name + ")";
  const std::string written = write_sim_outputs(args.sim, graph, result, title);
  std::cout << "file:               " << args.graph_path << "\n"
            << format_sim_text(graph, result, profile);
  if (!written.empty()) std::cout << "\n" << written;
  return kExitOk;
}

int run_validate(const std::string& path) {
  const Graph graph = load_verified(path);
  std::int64_t forward = 0;
  std::int64_t optimizer = 0;
  std::int64_t tensors = 0;
  std::set<std::int64_t> storages;
  for (const Node& node : graph.nodes) {
    if (node.phase == Phase::kForward) ++forward;
    if (node.phase == Phase::kOptimizer) ++optimizer;
    if (node.value.is_tensor()) {
      ++tensors;
      if (node.value.tensor.storage) storages.insert(*node.value.tensor.storage);
    }
  }
  std::cout << "ok: " << path << ": '" << graph.name << "', " << graph.nodes.size() << " nodes ("
            << forward << " forward, "
            << static_cast<std::int64_t>(graph.nodes.size()) - forward - optimizer << " backward"
            << (optimizer > 0 ? ", " + std::to_string(optimizer) + " optimizer" : std::string()) << "), "
            << tensors << " tensor values in " << storages.size() << " storages, "
            << graph.ops.size() << " op schemas\n";
  return kExitOk;
}

// Runs `action`, mapping Spillway's exceptions to the documented exit codes.
template <typename Action>
int run_guarded(Action&& action) {
  try {
    return action();
  } catch (const InvalidGraph& e) {
    std::cerr << e.what() << "\n";
    return kExitInvalid;
  } catch (const InvalidArgument& e) {
    std::cerr << e.what() << "\n";
    return kExitInvalid;
  } catch (const IoError& e) {
    std::cerr << e.what() << "\n";
    return kExitIo;
  } catch (const Error& e) {
    // load_graph and save_graph report an unreadable or unwritable file as a
    // plain Error; every other failure has a subclass handled above.
    std::cerr << e.what() << "\n";
    return typeid(e) == typeid(Error) ? kExitIo : kExitInvalid;
  } catch (const std::exception& e) {
    std::cerr << "[cli] unexpected error: " << e.what() << "\n";
    return kExitInvalid;
  }
}

int main_impl(int argc, char** argv) {
  CLI::App app{
      "spillway: plan which saved activations of a PyTorch joint forward+backward "
      "graph move to pinned host memory, and forecast what that does to a step."};
  app.footer(kExitCodeHelp);
  app.require_subcommand(1);

  PlanArgs plan_args;
  CLI::App* plan = app.add_subcommand(
      "plan", "Plan activation offload for GRAPH and print a summary of what moves and why.");
  plan->footer(kExitCodeHelp);
  plan->add_option(
      "GRAPH", plan_args.graph_path,
      std::string("Graph file (.json or .json.zst); default: the built-in ") + kDefaultGraph);
  plan->add_option("--scope", plan_args.scope,
                   "Leaf module name whose activations may move (default: the first of " +
                       join_names(kDefaultScopes) + " that the graph has)");
  plan->add_option("--mode", plan_args.mode, "scope: plan over --scope; none: plan nothing")
      ->default_str("scope");
  plan->add_option("--host-budget-gib", plan_args.host_budget_gib,
                   "Host memory the plan may fill, in GiB; 0 = unlimited (default 0)");
  plan->add_option("--min-bytes", plan_args.min_bytes,
                   "Smallest activation worth moving, in bytes (default 1048576)");
  plan->add_option("--prefetch-regions", plan_args.prefetch_regions,
                   "Start each reload this many scope regions early (default 1)");
  plan->add_option("--prefetch-anchor", plan_args.prefetch_anchor,
                   "start: issue a prefetched reload before the first node of the earlier "
                   "region (the reference); end: after its last node, so the value is not "
                   "resident while that region runs")
      ->default_str("start");
  plan->add_option("--release-lag", plan_args.release_lag,
                   "Keep a moved value's device copy until the start of the scope region "
                   "this many regions after its own, so its D2H overlaps compute (default 0: "
                   "release right after its last forward use)");
  plan->add_flag("--offload-tuple-outputs", plan_args.offload_tuple_outputs,
                 "Also move values whose last forward use returns a tuple (SDPA): the "
                 "forward wait goes after that node's last getitem");
  plan->add_flag("--dense-storages", plan_args.dense_storages,
                 "Also move non-contiguous values whose strides are a permutation of a "
                 "contiguous layout, through a permute view (rotary Q/K)");
  plan->add_flag("--replay-pointwise", plan_args.replay_pointwise,
                 "Recompute cheap pointwise values of moved values in backward from their "
                 "reloads instead of moving them (SiLU(gate), SiLU * up)");
  plan->add_flag("--json", plan_args.json, "Print a JSON object instead of the text summary");
  plan->add_option("--emit-graph", plan_args.emit_graph,
                   "Write the rewritten graph to OUT (.json, or .json.zst to compress)");
  plan->add_option("--budget", plan_args.budget,
                   "Plan for a peak device-memory budget instead of a scope: keep, offload or "
                   "recompute each saved activation, the fastest plan whose simulated peak fits "
                   "(12GiB, 800MiB, 4096 bytes, or 60% of the graph's own peak); --scope then "
                   "only restricts the candidates");
  plan->add_flag("--sweep", plan_args.sweep,
                 "Print the whole curve instead: the best plan at ten budgets between the "
                 "smallest reachable peak and the graph's own");
  plan->add_flag("--no-offload", plan_args.no_offload, "With --budget/--sweep: never offload");
  plan->add_flag("--no-recompute", plan_args.no_recompute,
                 "With --budget/--sweep: never recompute");
  plan->add_flag("--release-when-copied", plan_args.release_when_copied,
                 "With --budget/--sweep: plan as for the eager store, which lets each offloaded "
                 "value go at the first block end by which its copy has finished (at the latest "
                 "at the end of the last block)");
  plan->add_flag("--relax", plan_args.relax,
                 "With --budget/--sweep: search from both ends, from nothing taken off (greedy) "
                 "and from everything taken off (relax), the faster plan (models of at most 1024 "
                 "candidates)");
  plan->add_flag("--partitioner", plan_args.partitioner,
                 "With --budget/--sweep: plan as for torch.compile, whose partitioner "
                 "recomputes cheap pointwise values by itself at no cost");
  plan->add_flag("--offload-materialised", plan_args.offload_materialised,
                 "With --partitioner: pointwise values a backward matmul reads may be offloaded "
                 "(spillway.compile's offload_materialised: faster at small budgets, not "
                 "bit-exact)");
  add_sim_options(*plan, plan_args.sim);

  SimulateArgs simulate_args;
  CLI::App* simulate_command = app.add_subcommand(
      "simulate",
      "Simulate one step of GRAPH on a device's compute and copy streams and print the "
      "predicted step time, the peak of device memory and the bytes moved.");
  simulate_command->footer(kExitCodeHelp);
  simulate_command
      ->add_option("GRAPH", simulate_args.graph_path,
                   "Graph file (.json or .json.zst), original or rewritten by a plan")
      ->required();
  simulate_command->add_flag(
      "--inductor-fusion", simulate_args.inductor_fusion,
      "Simulate as torch.compile runs the graph: values Inductor computes inside fused "
      "kernels (pointwise chains, casts, softmax and loss reductions) are never allocated, "
      "and fused ops keep only the share of their time that their traffic in memory keeps");
  simulate_command->add_option(
      "--budget", simulate_args.budget,
      "Plan residency for a recorded step (spillway.trace): which storages spend which gaps "
      "between their uses in pinned host memory, the fastest plan whose simulated peak fits "
      "(12GiB, 800MiB, 4096 bytes, or 60% of the step's own peak); prints its forecast");
  simulate_command->add_option("--min-bytes", simulate_args.min_bytes,
                               "With --budget: smaller storages stay on the device (default 1048576)");
  simulate_command->add_option(
      "--host-adamw-gbs", simulate_args.host_adamw_gbs,
      "With --budget: the trace's AdamW(fused=True) steps may run on the host CPUs instead "
      "(spillway.optim.HostAdamW's update) at this many GB/s, counting 28 bytes per element "
      "(bench/torch/host_adamw.py measures it); the planner takes that when it is faster");
  simulate_command->add_option(
      "--replay-op-us", simulate_args.replay_op_us,
      "With --budget, for a trace with host times (nodes' cpu_ms): the replay's own host "
      "microseconds for each op it dispatches (spillway.trace.replay_overhead_us measures "
      "it); default 0")
      ->check(CLI::Range(0.0, 1e9));
  simulate_command->add_option(
      "--replay-copy-us", simulate_args.replay_copy_us,
      "With --budget, for a trace with host times: the replay's own host microseconds for "
      "each copy it issues (spillway.trace.replay_copy_us measures it); default 0")
      ->check(CLI::Range(0.0, 1e9));
  simulate_command->add_flag("--json", simulate_args.json,
                             "With --budget: print a JSON object instead of the text summary");
  add_sim_options(*simulate_command, simulate_args.sim);

  std::string validate_path;
  CLI::App* validate = app.add_subcommand(
      "validate", "Load GRAPH, check every invariant, print a one-line summary.");
  validate->footer(kExitCodeHelp);
  validate->add_option("GRAPH", validate_path, "Graph file (.json or .json.zst)")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  plan_args.scope_given = plan->count("--scope") > 0;
  plan_args.release_lag_given = plan->count("--release-lag") > 0;
  if (*plan) return run_guarded([&] { return run_plan(plan_args); });
  if (*simulate_command) return run_guarded([&] { return run_simulate(simulate_args); });
  return run_guarded([&] { return run_validate(validate_path); });
}

}  // namespace
}  // namespace spillway::cli

int main(int argc, char** argv) { return spillway::cli::main_impl(argc, argv); }
