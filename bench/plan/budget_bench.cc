// Times the memory-budget planner on the Llama-3-8B graph traced on the H200
// (examples/graphs/llama3-8b-s8192-cuda.json.zst) with the shipped H200
// profile:
//   budget/sweep10   sweep_memory_budget over its ten default budgets
//   budget/plan_mid  plan_memory_budget at the middle of that range
// and prints the curve once. Graphs are read from $SPILLWAY_GRAPHS_DIR,
// default <source>/examples/graphs.
//   build/release/bench/plan/budget_bench [--benchmark_filter=...]

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "spillway/budget.h"
#include "spillway/graph.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

namespace fs = std::filesystem;

fs::path graph_path() {
  const char* override_dir = std::getenv("SPILLWAY_GRAPHS_DIR");
  const fs::path dir = override_dir && *override_dir
                           ? fs::path(override_dir)
                           : fs::path(SPILLWAY_SOURCE_DIR) / "examples" / "graphs";
  return dir / "llama3-8b-s8192-cuda.json.zst";
}

constexpr double kGiB = 1024.0 * 1024 * 1024;

void print_curve(const std::vector<BudgetPlan>& curve) {
  std::printf("%10s %10s %10s %10s %10s %10s %9s\n", "budget", "peak", "step_ms", "offload",
              "recompute", "wait_ms", "changed");
  for (const BudgetPlan& plan : curve) {
    int changed = 0;
    for (const BudgetChoice& c : plan.choices) changed += c.decision != Decision::kKeep;
    std::printf("%9.2fG %9.2fG %10.1f %9.2fG %9.2fG %10.1f %9d\n",
                plan.options.budget_bytes / kGiB, plan.forecast.peak_bytes / kGiB,
                plan.forecast.step_ms, plan.forecast.bytes_offloaded / kGiB,
                plan.forecast.bytes_recomputed / kGiB, plan.forecast.compute_wait_ms, changed);
  }
}

}  // namespace
}  // namespace spillway

int main(int argc, char** argv) {
  using namespace spillway;
  benchmark::Initialize(&argc, argv);
  static Graph graph;
  try {
    graph = load_graph(graph_path().string());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "budget_bench: %s\n", e.what());
    return 1;
  }
  static const CostModel cost(h200_profile());
  BudgetOptions options;
  options.budget_bytes = 1;
  static const std::vector<BudgetPlan> curve = sweep_memory_budget(graph, options, cost);
  print_curve(curve);
  static const std::int64_t mid =
      (curve.front().options.budget_bytes + curve.back().options.budget_bytes) / 2;
  benchmark::RegisterBenchmark("budget/sweep10", [](benchmark::State& state) {
    BudgetOptions o;
    o.budget_bytes = 1;
    for (auto _ : state) benchmark::DoNotOptimize(sweep_memory_budget(graph, o, cost));
  })->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("budget/plan_mid", [](benchmark::State& state) {
    BudgetOptions o;
    o.budget_bytes = mid;
    for (auto _ : state) benchmark::DoNotOptimize(plan_memory_budget(graph, o, cost));
  })->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
