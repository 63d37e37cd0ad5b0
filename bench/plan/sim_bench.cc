// Times simulate() the way the planners call it, on the Llama-3-8B graph
// traced on the H200 (examples/graphs/llama3-8b-s8192-cuda.json.zst) with the
// shipped H200 profile:
//   simulate/original/timeline_off   the planners' mode (totals and peak only)
//   simulate/original/timeline_on    what the writers need (per-node points)
//   simulate/planned/timeline_off    the graph rewritten by the default plan
//   simulate/planned/timeline_on
// Graphs are read from $SPILLWAY_GRAPHS_DIR, default <source>/examples/graphs;
// each is loaded (and planned) once before the benchmarks run.
//   build/release/bench/plan/sim_bench [--benchmark_filter=...]

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "spillway/graph.h"
#include "spillway/plan.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

namespace fs = std::filesystem;

constexpr const char* kGraph = "llama3-8b-s8192-cuda.json.zst";

fs::path graph_path() {
  const char* override_dir = std::getenv("SPILLWAY_GRAPHS_DIR");
  const fs::path dir = override_dir && *override_dir
                           ? fs::path(override_dir)
                           : fs::path(SPILLWAY_SOURCE_DIR) / "examples" / "graphs";
  return dir / kGraph;
}

void bm_simulate(benchmark::State& state, const Graph* graph, bool record_timeline) {
  const CostModel cost(h200_profile());
  SimOptions options;
  options.record_timeline = record_timeline;
  SimResult result;
  for (auto _ : state) {
    result = simulate(*graph, cost, options);
    benchmark::DoNotOptimize(result);
  }
  state.counters["nodes"] = static_cast<double>(graph->nodes.size());
  state.counters["peak_GiB"] = static_cast<double>(result.peak_bytes) / (1 << 30);
  state.counters["step_ms"] = result.step_ms;
  state.counters["wait_ms"] = result.compute_wait_ms;
}

}  // namespace
}  // namespace spillway

int main(int argc, char** argv) {
  using namespace spillway;
  benchmark::Initialize(&argc, argv);
  static Graph original;
  static Graph planned;
  try {
    original = load_graph(graph_path().string());
    planned = plan_activation_offload(original, ActivationPlanOptions{}).graph;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  for (const auto& [name, graph] : {std::pair{"original", &original}, {"planned", &planned}}) {
    for (bool timeline : {false, true}) {
      const std::string label = std::string("simulate/") + name +
                                (timeline ? "/timeline_on" : "/timeline_off");
      benchmark::RegisterBenchmark(label.c_str(), bm_simulate, graph, timeline)
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
