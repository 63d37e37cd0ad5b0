// Times what `spillway plan` spends its time on, per shipped example graph:
//   load/<graph>    load_graph: read, zstd-decompress, parse and verify
//   plan/<graph>    plan_activation_offload with the default options
//   verify/<graph>  verify_offload_graph of the rewritten graph
// Graphs are read from $SPILLWAY_GRAPHS_DIR, default <source>/examples/graphs.
// Each graph is loaded once before the plan and verify benchmarks run. Graphs
// without a "self_attn" module (GPT-2) are planned with scope "attn".

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "spillway/graph.h"
#include "spillway/plan.h"

namespace spillway {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> find_graphs() {
  const char* override_dir = std::getenv("SPILLWAY_GRAPHS_DIR");
  const fs::path dir = override_dir && *override_dir
                           ? fs::path(override_dir)
                           : fs::path(SPILLWAY_SOURCE_DIR) / "examples" / "graphs";
  std::vector<fs::path> graphs;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".json") || name.ends_with(".json.zst")) graphs.push_back(entry.path());
  }
  std::sort(graphs.begin(), graphs.end());
  return graphs;
}

std::string short_name(const fs::path& path) {
  std::string name = path.filename().string();
  for (const char* suffix : {".zst", ".json"}) {
    if (name.ends_with(suffix)) name.resize(name.size() - std::string(suffix).size());
  }
  return name;
}

// Loaded graphs, kept for the whole run so plan/verify time excludes loading.
std::map<std::string, Graph>& graph_cache() {
  static std::map<std::string, Graph> cache;
  return cache;
}

void bm_load(benchmark::State& state, const fs::path& path) {
  std::size_t nodes = 0;
  for (auto _ : state) {
    Graph graph = load_graph(path.string());
    nodes = graph.nodes.size();
    benchmark::DoNotOptimize(graph);
  }
  state.counters["nodes"] = static_cast<double>(nodes);
  state.counters["file_KiB"] = static_cast<double>(fs::file_size(path)) / 1024;
}

// The defaults, but with scope "attn" for models without a "self_attn" module
// (GPT-2), so every shipped graph has something to plan.
ActivationPlanOptions options_for(const Graph& graph) {
  ActivationPlanOptions options;
  for (const Node& node : graph.nodes) {
    for (const std::string& module : node.module_stack) {
      if (module == options.scope || module.ends_with("." + options.scope)) return options;
    }
  }
  options.scope = "attn";
  return options;
}

void bm_plan(benchmark::State& state, const Graph* graph) {
  const ActivationPlanOptions options = options_for(*graph);
  std::size_t chosen = 0;
  for (auto _ : state) {
    PlanResult result = plan_activation_offload(*graph, options);
    chosen = result.plan.offloads.size();
    benchmark::DoNotOptimize(result);
  }
  state.counters["nodes"] = static_cast<double>(graph->nodes.size());
  state.counters["chosen"] = static_cast<double>(chosen);
}

void bm_verify(benchmark::State& state, const Graph* graph) {
  const PlanResult result = plan_activation_offload(*graph, options_for(*graph));
  for (auto _ : state) verify_offload_graph(*graph, result.graph);
  state.counters["nodes"] = static_cast<double>(result.graph.nodes.size());
}

}  // namespace
}  // namespace spillway

int main(int argc, char** argv) {
  using namespace spillway;
  benchmark::Initialize(&argc, argv);
  const std::vector<fs::path> graphs = find_graphs();
  if (graphs.empty()) {
    std::fprintf(stderr, "[bench] no graphs (*.json, *.json.zst) found; set SPILLWAY_GRAPHS_DIR\n");
    return 1;
  }
  for (const fs::path& path : graphs) {
    const std::string name = short_name(path);
    try {
      graph_cache().emplace(name, load_graph(path.string()));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    const Graph* graph = &graph_cache().at(name);
    benchmark::RegisterBenchmark(("load/" + name).c_str(), bm_load, path)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("plan/" + name).c_str(), bm_plan, graph)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("verify/" + name).c_str(), bm_verify, graph)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
