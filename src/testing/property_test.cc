// Property test of the activation planner over thousands of random joint
// graphs (see random_graph.h for what they contain). Every plan must satisfy
// the independent checks of offload_oracle.h.
//
// Reproduce a failure with the seed it prints:
//   SPILLWAY_PROPERTY_SEED=<seed> SPILLWAY_PROPERTY_GRAPHS=1 ./property_tests
// The failing graph is also written to $TMPDIR/spillway_property_<seed>.json.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/plan.h"
#include "testing/offload_oracle.h"
#include "testing/random_graph.h"

namespace spillway::testing {
namespace {

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  return text && *text ? std::strtoull(text, nullptr, 10) : fallback;
}

constexpr std::uint64_t kDefaultGraphs = 4000;
constexpr std::uint64_t kDefaultSeed = 20261129;

// How many failing graphs are reported in full; the rest are only counted.
constexpr std::int64_t kReportedFailures = 3;

void report_failure(std::uint64_t seed, const Graph& graph, const ActivationPlanOptions& options,
                    const std::vector<std::string>& problems) {
  const std::string dump = (std::filesystem::temp_directory_path() /
                            ("spillway_property_" + std::to_string(seed) + ".json"))
                               .string();
  try {
    save_graph(graph, dump);
  } catch (const std::exception&) {
  }
  std::string report;
  for (const std::string& problem : problems) report += "\n  " + problem;
  ADD_FAILURE() << "seed " << seed << " (" << describe_options(options) << "), graph of "
                << graph.nodes.size() << " nodes written to " << dump << ":" << report
                << "\nreproduce: SPILLWAY_PROPERTY_SEED=" << seed
                << " SPILLWAY_PROPERTY_GRAPHS=1 property_tests";
}

TEST(RandomGraphGenerator, IsReproducibleAndValid) {
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const Graph graph = make_random_joint_graph(seed);
    ASSERT_NO_THROW(verify_graph(graph)) << "seed " << seed;
    EXPECT_EQ(write_graph(graph), write_graph(make_random_joint_graph(seed))) << "seed " << seed;
  }
  EXPECT_NE(write_graph(make_random_joint_graph(1)), write_graph(make_random_joint_graph(2)));
}

TEST(RandomGraphGenerator, RoundTripsThroughJson) {
  for (std::uint64_t seed = 100; seed < 150; ++seed) {
    const Graph graph = make_random_joint_graph(seed);
    const std::string text = write_graph(graph);
    EXPECT_EQ(write_graph(parse_graph(text)), text) << "seed " << seed;
  }
}

// The checker must not be vacuous: plans broken on purpose are reported.
TEST(OffloadOracle, ReportsBrokenPlans) {
  std::uint64_t seed = kDefaultSeed;
  Graph graph;
  PlanResult result;
  ActivationPlanOptions options;
  options.min_bytes = 0;
  for (;; ++seed) {
    graph = make_random_joint_graph(seed);
    result = plan_activation_offload(graph, options);
    if (!result.plan.offloads.empty()) break;
    ASSERT_LT(seed, kDefaultSeed + 1000) << "no random graph offloads anything";
  }
  ASSERT_TRUE(check_offload_plan(graph, options, result).empty()) << "seed " << seed;
  const Offload& offload = result.plan.offloads.front();
  auto contains = [](const std::vector<std::string>& problems, const std::string& text) {
    for (const std::string& problem : problems) {
      if (problem.find(text) != std::string::npos) return true;
    }
    return false;
  };

  ActivationPlanOptions stricter = options;
  stricter.min_bytes = offload.bytes + 1;
  EXPECT_TRUE(contains(check_offload_plan(graph, stricter, result), "< min_bytes"));
  stricter = options;
  stricter.host_budget_bytes = 1;
  EXPECT_TRUE(contains(check_offload_plan(graph, stricter, result), "over the budget"));
  PlanResult unfilled = result;  // a candidate dropped although the budget is unlimited
  for (ValueDecision& decision : unfilled.plan.decisions) {
    if (decision.node == offload.producer) decision.rule = Rule::kOverBudget;
  }
  unfilled.plan.offloads.erase(unfilled.plan.offloads.begin());
  unfilled.plan.bytes_offloaded -= offload.bytes;
  EXPECT_TRUE(contains(check_offload_plan(graph, options, unfilled), "unlimited budget"));
  stricter = options;
  stricter.scope = "no_such_scope";
  EXPECT_TRUE(contains(check_offload_plan(graph, stricter, result), "outside scope"));

  // A backward node that still reads the offloaded value on the device.
  PlanResult leaky = result;
  Node reader;
  reader.id = 1'000'000;
  reader.name = "leaky_reader";
  reader.target = "aten.relu.default";
  reader.args = {Arg::of_node(offload.producer)};
  reader.phase = Phase::kBackward;
  leaky.graph.nodes.insert(leaky.graph.nodes.end() - 1, reader);
  EXPECT_TRUE(contains(check_offload_plan(graph, options, leaky), "reads offloaded value"));

  // The same plan over a graph whose backward writes the value in place.
  Graph written = graph;
  Node write;
  write.id = 1'000'001;
  write.name = "late_write";
  write.target = "aten.add_.Tensor";
  write.args = {Arg::of_node(offload.producer), Arg::of_node(offload.producer)};
  write.phase = Phase::kBackward;
  written.nodes.insert(written.nodes.end() - 1, write);
  EXPECT_TRUE(contains(check_offload_plan(written, options, result), "written in place"));
}

TEST(PlannerProperties, HoldOnRandomJointGraphs) {
  const std::uint64_t count = env_or("SPILLWAY_PROPERTY_GRAPHS", kDefaultGraphs);
  const std::uint64_t first_seed = env_or("SPILLWAY_PROPERTY_SEED", kDefaultSeed);
  std::map<Rule, std::int64_t> rule_counts;
  std::int64_t graphs_with_offloads = 0;
  std::int64_t total_offloads = 0;
  std::int64_t total_prefetched = 0;
  std::int64_t nodes = 0;
  std::int64_t failing_graphs = 0;
  const auto start = std::chrono::steady_clock::now();

  for (std::uint64_t seed = first_seed; seed < first_seed + count; ++seed) {
    const Graph graph = make_random_joint_graph(seed);
    const ActivationPlanOptions options = make_random_plan_options(seed);
    nodes += static_cast<std::int64_t>(graph.nodes.size());
    std::vector<std::string> problems;
    try {
      const PlanResult result = plan_activation_offload(graph, options);
      problems = check_offload_plan(graph, options, result);
      for (const ValueDecision& decision : result.plan.decisions) {
        ++rule_counts[decision.rule];
      }
      total_offloads += static_cast<std::int64_t>(result.plan.offloads.size());
      total_prefetched += result.plan.reloads_prefetched;
      graphs_with_offloads += !result.plan.offloads.empty();
      // Planning is a pure function of its inputs.
      if (seed % 16 == 0 &&
          write_graph(plan_activation_offload(graph, options).graph) != write_graph(result.graph)) {
        problems.push_back("planning the same graph twice gave different graphs");
      }
    } catch (const std::exception& e) {
      problems.push_back(std::string("plan_activation_offload threw: ") + e.what());
    }
    if (!problems.empty()) {
      ++failing_graphs;
      if (failing_graphs <= kReportedFailures) report_failure(seed, graph, options, problems);
    }
  }
  EXPECT_EQ(failing_graphs, 0) << failing_graphs << " of " << count
                               << " graphs broke a property (the first " << kReportedFailures
                               << " are reported above)";

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string histogram;
  for (const auto& [rule, n] : rule_counts) {
    histogram += " " + std::string(to_string(rule)) + "=" + std::to_string(n);
  }
  std::printf(
      "%llu graphs (%lld nodes) in %.2f s; %lld offloads in %lld graphs, %lld prefetched\n"
      "decisions:%s\n",
      static_cast<unsigned long long>(count), static_cast<long long>(nodes), seconds,
      static_cast<long long>(total_offloads), static_cast<long long>(graphs_with_offloads),
      static_cast<long long>(total_prefetched), histogram.c_str());
  // The generator must give the planner real work, not only graphs it rejects.
  if (count >= 500) {
    EXPECT_GT(graphs_with_offloads, static_cast<std::int64_t>(count) / 8);
    EXPECT_GT(total_prefetched, 0);
    EXPECT_GT(rule_counts[Rule::kStorageWrittenInPlace], 0) << histogram;
    EXPECT_GT(rule_counts[Rule::kView], 0) << histogram;
  }
}

}  // namespace
}  // namespace spillway::testing
