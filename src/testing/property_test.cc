// Property test of the activation planner over thousands of random joint
// graphs (see random_graph.h for what they contain). Every plan must satisfy
// the independent checks of offload_oracle.h.
//
// Reproduce a failure with the seed it prints:
//   SPILLWAY_PROPERTY_SEED=<seed> SPILLWAY_PROPERTY_GRAPHS=1 ./property_tests
// The failing graph is also written to $TMPDIR/spillway_property_<seed>.json.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/plan.h"
#include "testing/offload_oracle.h"
#include "testing/random_graph.h"

namespace spillway::testing {
namespace {

bool analysis_holds_tensor(const Value& value) {
  if (value.is_tensor()) return true;
  for (const Value& element : value.elements) {
    if (analysis_holds_tensor(element)) return true;
  }
  return false;
}

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

// The checks of the relaxed paths are not vacuous either.
TEST(OffloadOracle, ReportsBrokenRelaxedPlans) {
  ActivationPlanOptions options;
  options.min_bytes = 0;
  options.offload_tuple_outputs = true;
  options.dense_storages = true;
  auto contains = [](const std::vector<std::string>& problems, const std::string& text) {
    for (const std::string& problem : problems) {
      if (problem.find(text) != std::string::npos) return true;
    }
    return false;
  };
  bool dense_seen = false;
  bool tuple_seen = false;
  for (std::uint64_t seed = kDefaultSeed; seed < kDefaultSeed + 4000 && !(dense_seen && tuple_seen);
       ++seed) {
    const Graph graph = make_random_joint_graph(seed);
    const PlanResult result = plan_activation_offload(graph, options);
    ASSERT_TRUE(check_offload_plan(graph, options, result).empty()) << "seed " << seed;
    for (const Offload& offload : result.plan.offloads) {
      if (!dense_seen && offload.dense_permute_node >= 0) {
        dense_seen = true;
        ActivationPlanOptions strict = options;
        strict.dense_storages = false;
        EXPECT_TRUE(contains(check_offload_plan(graph, strict, result), "is not contiguous"));
        // Backward readers handed the reloaded (permuted) tensor as it is.
        PlanResult unrestored = result;
        for (Node& node : unrestored.graph.nodes) {
          if (node.id == offload.restore_permute_node) continue;
          for (Arg& arg : node.args) {
            if (arg.kind == Arg::Kind::kNode && arg.node == offload.restore_permute_node) {
              arg.node = offload.backward_wait_node;
            }
          }
        }
        EXPECT_TRUE(contains(check_offload_plan(graph, options, unrestored),
                             "without restoring its layout"))
            << "seed " << seed;
        // The strided value handed to the offload directly.
        PlanResult direct = result;
        for (Node& node : direct.graph.nodes) {
          if (node.id == offload.offload_node) node.args[0].node = offload.producer;
        }
        EXPECT_TRUE(contains(check_offload_plan(graph, options, direct), "non-contiguous value"));
      }
      const Node* wait = nullptr;
      for (const Node& node : result.graph.nodes) {
        if (node.id == offload.forward_wait_node) wait = &node;
      }
      if (!tuple_seen && wait != nullptr && wait->args[2].node != offload.last_forward_use &&
          wait->args[2].node != offload.producer) {
        tuple_seen = true;
        ActivationPlanOptions strict = options;
        strict.offload_tuple_outputs = false;
        EXPECT_TRUE(contains(check_offload_plan(graph, strict, result),
                             "without offload_tuple_outputs"));
        // A wait pinned to the producer instead: no edge to the last reader.
        PlanResult unpinned = result;
        for (Node& node : unpinned.graph.nodes) {
          if (node.id == offload.forward_wait_node) node.args[2].node = offload.producer;
        }
        EXPECT_TRUE(contains(check_offload_plan(graph, options, unpinned),
                             "not on the last forward reader"));
      }
    }
  }
  EXPECT_TRUE(dense_seen) << "no random graph moved a dense value";
  EXPECT_TRUE(tuple_seen) << "no random graph pinned a wait through a tuple getitem";
}

struct Sweep {
  std::map<Rule, std::int64_t> rule_counts;
  std::int64_t graphs_with_offloads = 0;
  std::int64_t total_offloads = 0;
  std::int64_t total_prefetched = 0;
  std::int64_t dense_offloads = 0;   // moved through a permute view
  std::int64_t tuple_offloads = 0;   // forward wait pinned through a getitem
  std::int64_t getitem_view_offloads = 0;  // a getitem of a split replayed on the reload
  std::int64_t nodes = 0;
  std::int64_t failing_graphs = 0;
  double seconds = 0;

  std::string histogram() const {
    std::string text;
    for (const auto& [rule, n] : rule_counts) {
      text += " " + std::string(to_string(rule)) + "=" + std::to_string(n);
    }
    return text;
  }
};

// Plans `count` random graphs from `first_seed` with the options
// `options_for(seed)` gives and checks each plan with the oracle.
template <typename OptionsFor>
Sweep run_sweep(std::uint64_t first_seed, std::uint64_t count, OptionsFor options_for) {
  Sweep sweep;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t seed = first_seed; seed < first_seed + count; ++seed) {
    const Graph graph = make_random_joint_graph(seed);
    const ActivationPlanOptions options = options_for(seed);
    sweep.nodes += static_cast<std::int64_t>(graph.nodes.size());
    std::vector<std::string> problems;
    try {
      const PlanResult result = plan_activation_offload(graph, options);
      problems = check_offload_plan(graph, options, result);
      for (const ValueDecision& decision : result.plan.decisions) {
        ++sweep.rule_counts[decision.rule];
      }
      for (const Offload& offload : result.plan.offloads) {
        sweep.dense_offloads += offload.dense_permute_node >= 0;
        sweep.getitem_view_offloads += std::any_of(
            result.plan.edits.begin(), result.plan.edits.end(), [&](const Edit& edit) {
              return edit.kind == EditKind::kReplayView && edit.source == offload.producer &&
                     edit.node.target == "operator.getitem";
            });
        for (const Node& node : result.graph.nodes) {
          if (node.id == offload.forward_wait_node) {
            sweep.tuple_offloads += node.args.size() == 3 &&
                                    node.args[2].node != offload.last_forward_use &&
                                    node.args[2].node != offload.producer;
          }
        }
      }
      sweep.total_offloads += static_cast<std::int64_t>(result.plan.offloads.size());
      sweep.total_prefetched += result.plan.reloads_prefetched;
      sweep.graphs_with_offloads += !result.plan.offloads.empty();
      // Planning is a pure function of its inputs.
      if (seed % 16 == 0 &&
          write_graph(plan_activation_offload(graph, options).graph) != write_graph(result.graph)) {
        problems.push_back("planning the same graph twice gave different graphs");
      }
    } catch (const std::exception& e) {
      problems.push_back(std::string("plan_activation_offload threw: ") + e.what());
    }
    if (!problems.empty()) {
      ++sweep.failing_graphs;
      if (sweep.failing_graphs <= kReportedFailures) report_failure(seed, graph, options, problems);
    }
  }
  sweep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(sweep.failing_graphs, 0) << sweep.failing_graphs << " of " << count
                                     << " graphs broke a property (the first "
                                     << kReportedFailures << " are reported above)";
  std::printf(
      "%llu graphs (%lld nodes) in %.2f s; %lld offloads in %lld graphs, %lld prefetched, "
      "%lld dense, %lld through a tuple getitem, %lld with getitem views replayed\n"
      "decisions:%s\n",
      static_cast<unsigned long long>(count), static_cast<long long>(sweep.nodes), sweep.seconds,
      static_cast<long long>(sweep.total_offloads),
      static_cast<long long>(sweep.graphs_with_offloads),
      static_cast<long long>(sweep.total_prefetched), static_cast<long long>(sweep.dense_offloads),
      static_cast<long long>(sweep.tuple_offloads),
      static_cast<long long>(sweep.getitem_view_offloads), sweep.histogram().c_str());
  return sweep;
}

TEST(PlannerProperties, HoldOnRandomJointGraphs) {
  const std::uint64_t count = env_or("SPILLWAY_PROPERTY_GRAPHS", kDefaultGraphs);
  const std::uint64_t first_seed = env_or("SPILLWAY_PROPERTY_SEED", kDefaultSeed);
  const Sweep sweep = run_sweep(first_seed, count, make_random_plan_options);
  // The generator must give the planner real work, not only graphs it rejects.
  if (count >= 500) {
    EXPECT_GT(sweep.graphs_with_offloads, static_cast<std::int64_t>(count) / 8);
    EXPECT_GT(sweep.total_prefetched, 0);
    EXPECT_GT(sweep.rule_counts.at(Rule::kStorageWrittenInPlace), 0) << sweep.histogram();
    EXPECT_GT(sweep.rule_counts.at(Rule::kView), 0) << sweep.histogram();
    // Values read in backward through a getitem of a split move, the halves
    // replayed on the reload (alias_chain.h), under the oracle's checks.
    EXPECT_GT(sweep.getitem_view_offloads, 0);
    // The default policy never takes the relaxed paths.
    EXPECT_EQ(sweep.dense_offloads, 0);
    EXPECT_EQ(sweep.tuple_offloads, 0);
  }
}

// The same graphs with offload_tuple_outputs and dense_storages: both, one or
// the other by seed, so each path is checked alone and together.
TEST(PlannerProperties, HoldWithTupleOutputsAndDenseStorages) {
  const std::uint64_t count = env_or("SPILLWAY_PROPERTY_GRAPHS", kDefaultGraphs);
  const std::uint64_t first_seed = env_or("SPILLWAY_PROPERTY_SEED", kDefaultSeed);
  auto relaxed = [](std::uint64_t seed) {
    ActivationPlanOptions options = make_random_plan_options(seed);
    options.offload_tuple_outputs = seed % 4 != 1;
    options.dense_storages = seed % 4 != 2;
    return options;
  };
  const Sweep sweep = run_sweep(first_seed, count, relaxed);
  if (count >= 500) {
    const Sweep seed_policy = run_sweep(first_seed, count, make_random_plan_options);
    EXPECT_GT(sweep.total_offloads, seed_policy.total_offloads);
    EXPECT_GT(sweep.dense_offloads, 0) << "no dense value was moved";
    EXPECT_GT(sweep.tuple_offloads, 0) << "no value was pinned through a tuple getitem";
    // Refusals that remain: non-dense layouts, and tuple last uses in the
    // seeds that leave offload_tuple_outputs off (or without a getitem).
    EXPECT_GT(sweep.rule_counts.at(Rule::kNotContiguous), 0) << sweep.histogram();
    EXPECT_LT(sweep.rule_counts.at(Rule::kNotContiguous),
              seed_policy.rule_counts.at(Rule::kNotContiguous));
    const auto tuple_refusals = sweep.rule_counts.find(Rule::kTupleLastUse);
    EXPECT_LT(tuple_refusals == sweep.rule_counts.end() ? 0 : tuple_refusals->second,
              seed_policy.rule_counts.at(Rule::kTupleLastUse));
  }
}

// replay_pointwise over the same graphs with every plain op tagged pointwise
// (and some random): checked against the plan of the same graph without it,
// and by what a replay may read, independently of the planner's own rules.
std::vector<std::string> check_replays(const Graph& graph, const PlanResult& with,
                                       const PlanResult& without) {
  std::vector<std::string> problems;
  auto fail = [&](const std::string& what) { problems.push_back(what); };
  try {
    verify_offload_graph(graph, with.graph);
  } catch (const std::exception& e) {
    fail(std::string("verify_offload_graph: ") + e.what());
  }
  if (apply_edits(graph, with.plan.edits) != with.graph) fail("edits do not give the graph");
  std::map<NodeId, Rule> before;
  for (const ValueDecision& d : without.plan.decisions) before[d.node] = d.rule;
  std::set<NodeId> moved_before;
  for (const Offload& o : without.plan.offloads) moved_before.insert(o.producer);
  for (const Offload& o : with.plan.offloads) {
    if (!moved_before.count(o.producer)) fail("node " + std::to_string(o.producer) + " moves only with replays");
  }
  std::map<NodeId, const Node*> original;
  for (const Node& node : graph.nodes) original[node.id] = &node;
  std::set<std::int64_t> replayed_storages;
  std::int64_t bytes = 0;
  for (const Replay& replay : with.plan.replays) {
    const Rule rule = before.at(replay.producer);
    if (rule != Rule::kChosen && rule != Rule::kOverBudget) {
      fail("replayed node " + std::to_string(replay.producer) + " was no candidate (" +
           std::string(to_string(rule)) + ")");
    }
    replayed_storages.insert(*original.at(replay.producer)->value.tensor.storage);
    bytes += replay.bytes;
  }
  if (bytes != with.plan.bytes_replayed) fail("bytes_replayed does not add up");
  for (const Node& node : with.graph.nodes) {
    const bool inserted = !original.count(node.id);
    if (!inserted && node.phase == Phase::kBackward) {
      node.for_each_input([&](NodeId input) {
        if (!original.count(input)) return;  // an inserted node
        const Node& read = *original.at(input);
        if (read.phase == Phase::kForward && read.value.is_tensor() && read.value.tensor.storage &&
            replayed_storages.count(*read.value.tensor.storage)) {
          fail("backward " + node.name + " reads replayed storage of " + read.name);
        }
      });
    }
    if (!inserted) continue;
    const auto copied = std::find_if(with.plan.edits.begin(), with.plan.edits.end(),
                                     [&](const Edit& e) { return e.node.id == node.id; });
    if (copied == with.plan.edits.end() || copied->kind != EditKind::kReplayOp) continue;
    const Node& source = *original.at(copied->source);
    if (node.phase != Phase::kBackward || node.target != source.target) {
      fail(node.name + " is not a backward copy of " + source.name);
    }
    const OpSchema& schema = graph.ops.at(source.target);
    if (!schema.is_pointwise || schema.is_random) fail(node.name + " copies a non-replayable op");
    node.for_each_input([&](NodeId input) {
      if (original.count(input) && analysis_holds_tensor(original.at(input)->value)) {
        fail(node.name + " reads the forward tensor " + original.at(input)->name);
      }
    });
  }
  return problems;
}

TEST(PlannerProperties, HoldWithPointwiseReplays) {
  const std::uint64_t count = env_or("SPILLWAY_PROPERTY_GRAPHS", kDefaultGraphs / 4);
  const std::uint64_t first_seed = env_or("SPILLWAY_PROPERTY_SEED", kDefaultSeed);
  std::int64_t replays = 0;
  std::int64_t failing = 0;
  for (std::uint64_t seed = first_seed; seed < first_seed + count; ++seed) {
    Graph graph = make_random_joint_graph(seed);
    std::uint64_t k = seed;
    for (auto& [target, schema] : graph.ops) {
      if (schema.is_view || schema.is_mutable) continue;
      schema.is_pointwise = true;
      schema.is_random = (k++ % 7) == 0;
    }
    ActivationPlanOptions options = make_random_plan_options(seed);
    options.dense_storages = seed % 3 == 0;
    options.offload_tuple_outputs = seed % 3 == 1;
    std::vector<std::string> problems;
    try {
      const PlanResult without = plan_activation_offload(graph, options);
      options.replay_pointwise = true;
      const PlanResult with = plan_activation_offload(graph, options);
      problems = check_replays(graph, with, without);
      replays += static_cast<std::int64_t>(with.plan.replays.size());
    } catch (const std::exception& e) {
      problems.push_back(std::string("plan_activation_offload threw: ") + e.what());
    }
    if (!problems.empty() && ++failing <= kReportedFailures) {
      report_failure(seed, graph, options, problems);
    }
  }
  EXPECT_EQ(failing, 0);
  if (count >= 500) {
    EXPECT_GT(replays, 0) << "no random graph replayed a value";
  }
  std::printf("%lld replays in %llu graphs\n", static_cast<long long>(replays),
              static_cast<unsigned long long>(count));
}

// The same graphs with reloads prefetched to region ends: every plan passes
// the oracle (and so verify_offload_graph), and each prefetched reload
// follows, past other reloads only, an in-scope backward node (the end of
// the region it was anchored to).
TEST(PlannerProperties, HoldWithPrefetchAnchoredAtRegionEnds) {
  const std::uint64_t count = env_or("SPILLWAY_PROPERTY_GRAPHS", kDefaultGraphs);
  const std::uint64_t first_seed = env_or("SPILLWAY_PROPERTY_SEED", kDefaultSeed);
  auto at_end = [](std::uint64_t seed) {
    ActivationPlanOptions options = make_random_plan_options(seed);
    options.prefetch_anchor = ActivationPlanOptions::PrefetchAnchor::kRegionEnd;
    return options;
  };
  const Sweep sweep = run_sweep(first_seed, count, at_end);
  if (count >= 500) {
    EXPECT_GT(sweep.total_prefetched, 0);
  }
  std::int64_t checked = 0;
  for (std::uint64_t seed = first_seed; seed < first_seed + std::min<std::uint64_t>(count, 1000);
       ++seed) {
    const Graph graph = make_random_joint_graph(seed);
    const ActivationPlanOptions options = at_end(seed);
    const PlanResult result = plan_activation_offload(graph, options);
    for (const Offload& offload : result.plan.offloads) {
      if (!offload.prefetched) continue;
      std::size_t at = 0;
      while (result.graph.nodes[at].id != offload.reload_node) ++at;
      while (at > 0 && result.graph.nodes[at - 1].target == kReloadTarget) --at;
      ASSERT_GT(at, 0u) << "seed " << seed;
      const Node& end = result.graph.nodes[at - 1];
      EXPECT_TRUE(end.kind == NodeKind::kCallFunction && end.phase == Phase::kBackward &&
                  end.target != kWaitTarget && in_scope(end, options.scope))
          << "seed " << seed << ": prefetched reload of node " << offload.producer
          << " follows " << end.name;
      ++checked;
    }
  }
  if (count >= 500) {
    EXPECT_GT(checked, 0);
  }
}

}  // namespace
}  // namespace spillway::testing
