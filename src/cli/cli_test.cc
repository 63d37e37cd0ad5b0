// Drives the built `spillway` binary the way a user does and checks what the
// user sees: exit codes, messages, the JSON summary and the emitted graph.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/budget_report.h"
#include "cli/plan_report.h"
#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/plan.h"
#include "spillway/sim.h"

namespace spillway {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string read_text(const fs::path& path) {
  std::ifstream stream(path, std::ios::binary);
  std::stringstream buffer;
  buffer << stream.rdbuf();
  return buffer.str();
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("spillway_cli_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `spillway <args>`; `args` is passed through the shell, so quote paths.
  CliRun run(const std::string& args) const {
    const fs::path out = dir_ / "stdout.txt";
    const fs::path err = dir_ / "stderr.txt";
    const std::string command = std::string("'") + SPILLWAY_CLI + "' " + args + " >'" +
                                out.string() + "' 2>'" + err.string() + "'";
    const int status = std::system(command.c_str());
    CliRun result;
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.out = read_text(out);
    result.err = read_text(err);
    return result;
  }

  fs::path write_file(const std::string& name, const std::string& text) const {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  fs::path dir_;
};

// Two decoder layers; each has a self_attn block producing two 4 MiB float32
// activations (mm, relu) that backward reads, and an mlp block whose 4 MiB
// activation backward never reads. With the defaults the planner moves the four
// self_attn activations: 16 MiB.
constexpr const char* kTwoLayerGraph = R"json({
  "format": "spillway.graph", "version": 1, "name": "two-layer test graph",
  "ops": {
    "aten.mm.default": {"namespace": "aten", "arguments": [{"name": "self"}, {"name": "mat2"}]},
    "aten.relu.default": {"namespace": "aten", "arguments": [{"name": "self"}]},
    "aten.mul.Tensor": {"namespace": "aten", "arguments": [{"name": "self"}, {"name": "other"}]},
    "aten.sum.default": {"namespace": "aten", "arguments": [{"name": "self"}, {"name": "dtype", "kwarg_only": true}]}
  },
  "nodes": [
    {"id": 0, "name": "x", "kind": "placeholder", "target": "x",
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 0, "device": "cuda:0"}},
    {"id": 1, "name": "w", "kind": "placeholder", "target": "w",
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [256, 256], "strides": [256, 1], "contiguous": true, "storage": 1, "device": "cuda:0"}},
    {"id": 2, "name": "mm_0", "kind": "call_function", "target": "aten.mm.default", "args": [{"node": 0}, {"node": 1}],
     "module_stack": ["model.layers.0", "model.layers.0.self_attn"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 2, "device": "cuda:0"}},
    {"id": 3, "name": "relu_0", "kind": "call_function", "target": "aten.relu.default", "args": [{"node": 2}],
     "module_stack": ["model.layers.0", "model.layers.0.self_attn"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 3, "device": "cuda:0"}},
    {"id": 4, "name": "mm_1", "kind": "call_function", "target": "aten.mm.default", "args": [{"node": 3}, {"node": 1}],
     "module_stack": ["model.layers.0", "model.layers.0.mlp"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 4, "device": "cuda:0"}},
    {"id": 5, "name": "mm_2", "kind": "call_function", "target": "aten.mm.default", "args": [{"node": 4}, {"node": 1}],
     "module_stack": ["model.layers.1", "model.layers.1.self_attn"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 5, "device": "cuda:0"}},
    {"id": 6, "name": "relu_1", "kind": "call_function", "target": "aten.relu.default", "args": [{"node": 5}],
     "module_stack": ["model.layers.1", "model.layers.1.self_attn"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 6, "device": "cuda:0"}},
    {"id": 7, "name": "mm_3", "kind": "call_function", "target": "aten.mm.default", "args": [{"node": 6}, {"node": 1}],
     "module_stack": ["model.layers.1", "model.layers.1.mlp"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 7, "device": "cuda:0"}},
    {"id": 8, "name": "loss", "kind": "call_function", "target": "aten.sum.default", "args": [{"node": 7}],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [], "strides": [], "contiguous": true, "storage": 8, "device": "cuda:0"}},
    {"id": 9, "name": "grad_1", "kind": "call_function", "target": "aten.mul.Tensor", "args": [{"node": 6}, {"node": 5}], "phase": "backward",
     "module_stack": ["model.layers.1", "model.layers.1.self_attn"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 9, "device": "cuda:0"}},
    {"id": 10, "name": "grad_0", "kind": "call_function", "target": "aten.mul.Tensor", "args": [{"node": 3}, {"node": 9}], "phase": "backward",
     "module_stack": ["model.layers.0", "model.layers.0.self_attn"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 10, "device": "cuda:0"}},
    {"id": 11, "name": "grad_00", "kind": "call_function", "target": "aten.mul.Tensor", "args": [{"node": 2}, {"node": 10}], "phase": "backward",
     "module_stack": ["model.layers.0", "model.layers.0.self_attn"],
     "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [4096, 256], "strides": [256, 1], "contiguous": true, "storage": 11, "device": "cuda:0"}},
    {"id": 12, "name": "output", "kind": "output", "target": "output", "args": [[{"node": 8}, {"node": 11}]], "phase": "backward"}
  ]
})json";

constexpr std::int64_t kTwoLayerBytes = 4 * 4 * 1024 * 1024;

TEST_F(CliTest, PlanPrintsReadableSummary) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const CliRun run_result = run("plan '" + graph.string() + "'");
  ASSERT_EQ(run_result.exit_code, 0) << run_result.err;
  EXPECT_NE(run_result.out.find("two-layer test graph"), std::string::npos) << run_result.out;
  EXPECT_NE(run_result.out.find("13 (9 forward, 4 backward)"), std::string::npos) << run_result.out;
  EXPECT_NE(run_result.out.find("chosen:             4 values, 16.00 MiB"), std::string::npos)
      << run_result.out;
  EXPECT_NE(run_result.out.find("host budget:        unlimited"), std::string::npos);
  // The table names the chosen values with shape and dtype.
  EXPECT_NE(run_result.out.find("relu_1"), std::string::npos);
  EXPECT_NE(run_result.out.find("[4096, 256]"), std::string::npos);
  // The input and the mlp activations are large but out of scope, and the
  // summary says so.
  EXPECT_NE(run_result.out.find("not chosen: 3"), std::string::npos) << run_result.out;
  EXPECT_NE(run_result.out.find("3 x " + std::string(to_string(Rule::kOutOfScope))),
            std::string::npos)
      << run_result.out;
  EXPECT_NE(run_result.out.find("e.g. mm_1 (4.00 MiB)"), std::string::npos) << run_result.out;
}

TEST_F(CliTest, JsonSummaryIsParseableAndCountsMatch) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const CliRun run_result = run("plan --json '" + graph.string() + "'");
  ASSERT_EQ(run_result.exit_code, 0) << run_result.err;
  const nlohmann::json summary = nlohmann::json::parse(run_result.out);
  EXPECT_EQ(summary.at("chosen").get<int>(), 4);
  EXPECT_EQ(summary.at("candidates").get<int>(), 4);
  EXPECT_EQ(summary.at("bytes_offloaded").get<std::int64_t>(), kTwoLayerBytes);
  EXPECT_TRUE(summary.at("reloads_prefetched").is_number_integer());
  EXPECT_EQ(summary.at("offloads").size(), 4u);
  ASSERT_TRUE(summary.at("decisions").is_array());
  int chosen_decisions = 0;
  for (const nlohmann::json& decision : summary.at("decisions")) {
    ASSERT_TRUE(decision.contains("node") && decision.contains("name") &&
                decision.contains("bytes") && decision.contains("rule"))
        << decision.dump();
    if (decision.at("rule") == std::string(to_string(Rule::kChosen))) ++chosen_decisions;
  }
  EXPECT_EQ(chosen_decisions, 4);
}

TEST_F(CliTest, BudgetLimitsTheBytesMoved) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  // 9 MiB fits two of the four 4 MiB activations.
  const CliRun run_result =
      run("plan --json --host-budget-gib 0.0087890625 '" + graph.string() + "'");
  ASSERT_EQ(run_result.exit_code, 0) << run_result.err;
  const nlohmann::json summary = nlohmann::json::parse(run_result.out);
  EXPECT_EQ(summary.at("chosen").get<int>(), 2);
  EXPECT_EQ(summary.at("candidates").get<int>(), 4);
  EXPECT_EQ(summary.at("bytes_offloaded").get<std::int64_t>(), kTwoLayerBytes / 2);
}

TEST_F(CliTest, ModeNoneMovesNothing) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const CliRun run_result = run("plan --json --mode none '" + graph.string() + "'");
  ASSERT_EQ(run_result.exit_code, 0) << run_result.err;
  const nlohmann::json summary = nlohmann::json::parse(run_result.out);
  EXPECT_EQ(summary.at("chosen").get<int>(), 0);
  EXPECT_EQ(summary.at("bytes_offloaded").get<std::int64_t>(), 0);
}

TEST_F(CliTest, EmittedGraphValidates) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  for (const std::string name : {"out.json", "out.json.zst"}) {
    const fs::path out = dir_ / name;
    const CliRun planned = run("plan --emit-graph '" + out.string() + "' '" + graph.string() + "'");
    ASSERT_EQ(planned.exit_code, 0) << planned.err;
    const CliRun validated = run("validate '" + out.string() + "'");
    EXPECT_EQ(validated.exit_code, 0) << validated.err;
    EXPECT_EQ(validated.out.rfind("ok: ", 0), 0u) << validated.out;

    const Graph original = load_graph(graph.string());
    const Graph rewritten = load_graph(out.string());
    EXPECT_NO_THROW(verify_graph(rewritten));
    EXPECT_NO_THROW(verify_offload_graph(original, rewritten));
    int offloads = 0;
    for (const Node& node : rewritten.nodes) offloads += node.target == kOffloadTarget;
    EXPECT_EQ(offloads, 4) << name;
  }
}

TEST_F(CliTest, ValidatePrintsOneLine) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const CliRun run_result = run("validate '" + graph.string() + "'");
  ASSERT_EQ(run_result.exit_code, 0) << run_result.err;
  EXPECT_EQ(run_result.out.find('\n'), run_result.out.size() - 1) << run_result.out;
  EXPECT_NE(run_result.out.find("13 nodes (9 forward, 4 backward)"), std::string::npos)
      << run_result.out;
}

TEST_F(CliTest, BadGraphExitsOneWithComponentMessage) {
  std::string broken = kTwoLayerGraph;
  const std::string reference = R"("args": [{"node": 6}, {"node": 5}])";
  broken.replace(broken.find(reference), reference.size(),
                 R"("args": [{"node": 6}, {"node": 99}])");
  const fs::path graph = write_file("bad.json", broken);
  for (const std::string command : {"validate", "plan"}) {
    const CliRun run_result = run(command + " '" + graph.string() + "'");
    EXPECT_EQ(run_result.exit_code, 1) << command;
    EXPECT_EQ(run_result.err.rfind("[", 0), 0u) << run_result.err;
    EXPECT_NE(run_result.err.find("grad_1"), std::string::npos) << run_result.err;
    EXPECT_NE(run_result.err.find("99"), std::string::npos) << run_result.err;
  }
  const CliRun not_json = run("validate '" + write_file("junk.json", "{not json").string() + "'");
  EXPECT_EQ(not_json.exit_code, 1);
  EXPECT_EQ(not_json.err.rfind("[", 0), 0u) << not_json.err;
}

TEST_F(CliTest, MissingFileExitsThree) {
  const std::string missing = (dir_ / "no_such_graph.json").string();
  for (const std::string command : {"validate", "plan"}) {
    const CliRun run_result = run(command + " '" + missing + "'");
    EXPECT_EQ(run_result.exit_code, 3) << command;
    EXPECT_NE(run_result.err.find("no_such_graph.json"), std::string::npos) << run_result.err;
  }
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const CliRun unwritable = run("plan --emit-graph '" + (dir_ / "no_dir" / "out.json").string() +
                                "' '" + graph.string() + "'");
  EXPECT_EQ(unwritable.exit_code, 3) << unwritable.err;
}

TEST_F(CliTest, InvalidOptionValuesExitOne) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const std::string path = " '" + graph.string() + "'";
  const CliRun budget = run("plan --host-budget-gib -1" + path);
  EXPECT_EQ(budget.exit_code, 1);
  EXPECT_EQ(budget.err.rfind("[cli] --host-budget-gib", 0), 0u) << budget.err;
  const CliRun mode = run("plan --mode sometimes" + path);
  EXPECT_EQ(mode.exit_code, 1);
  EXPECT_NE(mode.err.find("sometimes"), std::string::npos) << mode.err;
  const CliRun scope = run("plan --scope no_such_module" + path);
  EXPECT_EQ(scope.exit_code, 1);
  EXPECT_EQ(scope.err.rfind("[", 0), 0u) << scope.err;
  EXPECT_NE(scope.err.find("no_such_module"), std::string::npos) << scope.err;
  const CliRun min_bytes = run("plan --min-bytes -5" + path);
  EXPECT_EQ(min_bytes.exit_code, 1);
  EXPECT_EQ(min_bytes.err.rfind("[", 0), 0u) << min_bytes.err;
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (std::size_t at = text.find(from); at != std::string::npos;
       at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

// GPT-2 calls its attention block `attn`: without --scope the command finds it
// and says so; an explicit scope that GPT-2 lacks lists the names it has.
TEST_F(CliTest, WithoutScopeGpt2PlansItsAttnBlockAndNamesIt) {
  const fs::path graph = fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/gpt2-tiny.json.zst";
  if (!fs::exists(graph)) GTEST_SKIP() << "missing " << graph;
  const CliRun text = run("plan '" + graph.string() + "'");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("scope:              attn (no --scope: the first found of self_attn, "
                          "attn, attention, self_attention)\n"),
            std::string::npos)
      << text.out;
  const CliRun json = run("plan --json '" + graph.string() + "'");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json summary = nlohmann::json::parse(json.out);
  EXPECT_EQ(summary.at("scope"), "attn");
  EXPECT_GT(summary.at("chosen").get<int>(), 0);
  EXPECT_GT(summary.at("bytes_offloaded").get<std::int64_t>(), 0);

  const CliRun given = run("plan --scope mlp '" + graph.string() + "'");
  ASSERT_EQ(given.exit_code, 0) << given.err;
  EXPECT_NE(given.out.find("scope:              mlp\n"), std::string::npos) << given.out;
}

TEST_F(CliTest, ScopeThatMatchesNothingListsTheGraphsModuleNames) {
  const fs::path gpt2 = fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/gpt2-tiny.json.zst";
  if (!fs::exists(gpt2)) GTEST_SKIP() << "missing " << gpt2;
  const CliRun given = run("plan --scope self_attn '" + gpt2.string() + "'");
  EXPECT_EQ(given.exit_code, 1);
  EXPECT_EQ(given.err,
            "[plan] scope 'self_attn' matches no module in graph 'gpt2-tiny joint fwd+bwd'; its "
            "module names are: transformer, wte, wpe, drop, ln_1, attn, c_attn, c_proj, "
            "resid_dropout, ln_2, mlp, c_fc, act, dropout, ln_f, lm_head\n");
  EXPECT_TRUE(given.out.empty()) << given.out;

  // No --scope, and none of the default names: the command says what to pass.
  const fs::path mixer =
      write_file("mixer.json", replace_all(kTwoLayerGraph, "self_attn", "mixer"));
  const CliRun defaulted = run("plan '" + mixer.string() + "'");
  EXPECT_EQ(defaulted.exit_code, 1);
  EXPECT_EQ(defaulted.err,
            "[cli] no --scope given and graph 'two-layer test graph' has no module named "
            "self_attn, attn, attention, self_attention; pass --scope with one of its module "
            "names: mixer, mlp\n");
  const CliRun mixer_json = run("plan --json --scope mixer '" + mixer.string() + "'");
  ASSERT_EQ(mixer_json.exit_code, 0) << mixer_json.err;
  EXPECT_EQ(nlohmann::json::parse(mixer_json.out).at("bytes_offloaded").get<std::int64_t>(),
            kTwoLayerBytes);
}

// The two self_attn regions follow each other (grad_1, then grad_0 and
// grad_00). Anchored at region starts, both layer 0 reloads move before
// grad_1; anchored at region ends, they go after grad_1: relu_0's reload
// already sits there (not moved), mm_0's moves up behind it.
TEST_F(CliTest, PrefetchAnchorEndIssuesReloadsAfterTheEarlierRegion) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const fs::path out = dir_ / "end.json";
  const CliRun start = run("plan --json '" + graph.string() + "'");
  const CliRun end = run("plan --json --prefetch-anchor end --emit-graph '" + out.string() +
                         "' '" + graph.string() + "'");
  ASSERT_EQ(start.exit_code, 0) << start.err;
  ASSERT_EQ(end.exit_code, 0) << end.err;
  const nlohmann::json before = nlohmann::json::parse(start.out);
  const nlohmann::json after = nlohmann::json::parse(end.out);
  EXPECT_EQ(before.at("prefetch_anchor"), "start");
  EXPECT_EQ(after.at("prefetch_anchor"), "end");
  EXPECT_EQ(before.at("reloads_prefetched").get<int>(), 2);
  EXPECT_EQ(after.at("reloads_prefetched").get<int>(), 1);
  const Graph rewritten = load_graph(out.string());
  EXPECT_NO_THROW(verify_offload_graph(load_graph(graph.string()), rewritten));
  std::size_t grad_1 = 0;
  std::vector<std::size_t> layer0_reloads;
  for (std::size_t i = 0; i < rewritten.nodes.size(); ++i) {
    const Node& node = rewritten.nodes[i];
    if (node.name == "grad_1") grad_1 = i;
    if (node.name == "spillway_reload_mm_0" || node.name == "spillway_reload_relu_0") {
      layer0_reloads.push_back(i);
    }
  }
  ASSERT_EQ(layer0_reloads.size(), 2u);
  EXPECT_EQ(layer0_reloads[0], grad_1 + 1);
  EXPECT_EQ(layer0_reloads[1], grad_1 + 2);
  EXPECT_NE(run("plan --prefetch-anchor end '" + graph.string() + "'").out.find(
                "after the region's end"),
            std::string::npos);
  const CliRun bad = run("plan --prefetch-anchor middle '" + graph.string() + "'");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_EQ(bad.err.rfind("[cli] --prefetch-anchor must be 'start' or 'end', got 'middle'", 0), 0u)
      << bad.err;
}

TEST_F(CliTest, UsageErrorsExitTwo) {
  EXPECT_EQ(run("plan --no-such-flag").exit_code, 2);
  EXPECT_EQ(run("validate").exit_code, 2);
  EXPECT_EQ(run("simulate").exit_code, 2);
  EXPECT_EQ(run("").exit_code, 2);
  EXPECT_EQ(run("plan --min-bytes lots").exit_code, 2);
}

TEST_F(CliTest, HelpOnEveryCommandDocumentsExitCodes) {
  for (const std::string command : {"--help", "plan --help", "validate --help", "simulate --help"}) {
    const CliRun run_result = run(command);
    EXPECT_EQ(run_result.exit_code, 0) << command;
    EXPECT_NE(run_result.out.find("Exit codes"), std::string::npos) << command;
    EXPECT_NE(run_result.out.find("3  I/O error"), std::string::npos) << command;
  }
  EXPECT_NE(run("plan --help").out.find("--emit-graph"), std::string::npos);
  for (const std::string command : {"plan --help", "simulate --help"}) {
    const std::string help = run(command).out;
    for (const char* flag : {"--device-profile", "--trace", "--timeline"}) {
      EXPECT_NE(help.find(flag), std::string::npos) << command << " " << flag;
    }
  }
}

TEST_F(CliTest, DefaultGraphIsPlannedOrReportedMissing) {
  const fs::path default_graph =
      fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/llama3-8b-s8192-cuda.json.zst";
  const CliRun run_result = run("plan --json");
  if (fs::exists(default_graph)) {
    ASSERT_EQ(run_result.exit_code, 0) << run_result.err;
    const nlohmann::json summary = nlohmann::json::parse(run_result.out);
    EXPECT_GT(summary.at("nodes").get<int>(), 0);
    EXPECT_NE(summary.at("graph").get<std::string>().find("llama3-8b"), std::string::npos);
  } else {
    EXPECT_EQ(run_result.exit_code, 3);
    EXPECT_NE(run_result.err.find("llama3-8b-s8192-cuda.json.zst"), std::string::npos) << run_result.err;
  }
}

TEST_F(CliTest, RelaxationFlagsMoveTheLlamaAttentionActivations) {
  const fs::path graph =
      fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/llama3-8b-s8192-cuda.json.zst";
  if (!fs::exists(graph)) GTEST_SKIP() << "missing " << graph;
  const CliRun seed = run("plan --json '" + graph.string() + "'");
  const CliRun relaxed = run("plan --json --offload-tuple-outputs --dense-storages '" +
                             graph.string() + "'");
  ASSERT_EQ(seed.exit_code, 0) << seed.err;
  ASSERT_EQ(relaxed.exit_code, 0) << relaxed.err;
  const nlohmann::json before = nlohmann::json::parse(seed.out);
  const nlohmann::json after = nlohmann::json::parse(relaxed.out);
  EXPECT_FALSE(before.at("offload_tuple_outputs").get<bool>());
  EXPECT_FALSE(before.at("dense_storages").get<bool>());
  EXPECT_TRUE(after.at("offload_tuple_outputs").get<bool>());
  EXPECT_TRUE(after.at("dense_storages").get<bool>());
  EXPECT_EQ(before.at("bytes_offloaded").get<std::int64_t>(), 32 * 1024 * 1024);
  EXPECT_GT(after.at("bytes_offloaded").get<std::int64_t>(), std::int64_t{12} << 30);
  bool dense_listed = false;
  for (const nlohmann::json& offload : after.at("offloads")) {
    dense_listed = dense_listed || offload.contains("restore_permute_node");
  }
  EXPECT_TRUE(dense_listed);
  // The text summary names the relaxations; the default summary does not.
  EXPECT_NE(run("plan --dense-storages '" + graph.string() + "'").out.find("dense-storages"),
            std::string::npos);
  EXPECT_EQ(run("plan '" + graph.string() + "'").out.find("relaxations:"), std::string::npos);
  // The rewritten graph is valid and loads again.
  const fs::path out = dir_ / "relaxed.json.zst";
  const CliRun emitted = run("plan --offload-tuple-outputs --dense-storages --emit-graph '" +
                             out.string() + "' '" + graph.string() + "'");
  ASSERT_EQ(emitted.exit_code, 0) << emitted.err;
  EXPECT_NO_THROW(verify_offload_graph(load_graph(graph.string()), load_graph(out.string())));
}

TEST_F(CliTest, ReplayPointwiseRecomputesTaggedMlpValuesInsteadOfMovingThem) {
  const fs::path source =
      fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/llama3-8b-s8192-cuda.json.zst";
  if (!fs::exists(source)) GTEST_SKIP() << "missing " << source;
  // The example predates the op tags: tag SiLU and mul as the exporter now does.
  Graph tagged = load_graph(source.string());
  for (const char* target : {"aten.silu.default", "aten.mul.Tensor"}) {
    auto it = tagged.ops.find(target);
    ASSERT_NE(it, tagged.ops.end()) << target;
    it->second.is_pointwise = true;
  }
  const fs::path graph = dir_ / "tagged.json.zst";
  save_graph(tagged, graph.string());

  const CliRun moved = run("plan --json --scope mlp '" + graph.string() + "'");
  const CliRun replayed = run("plan --json --scope mlp --replay-pointwise '" + graph.string() + "'");
  ASSERT_EQ(moved.exit_code, 0) << moved.err;
  ASSERT_EQ(replayed.exit_code, 0) << replayed.err;
  const nlohmann::json before = nlohmann::json::parse(moved.out);
  const nlohmann::json after = nlohmann::json::parse(replayed.out);
  EXPECT_FALSE(before.at("replay_pointwise").get<bool>());
  EXPECT_EQ(before.at("replayed").get<int>(), 0);
  EXPECT_TRUE(after.at("replay_pointwise").get<bool>());
  EXPECT_GT(after.at("replayed").get<int>(), 0);
  EXPECT_EQ(after.at("replays").size(), after.at("replayed").get<std::size_t>());
  // Every value either still moves or is replayed; replayed bytes are not moved.
  EXPECT_EQ(after.at("bytes_offloaded").get<std::int64_t>() +
                after.at("bytes_replayed").get<std::int64_t>(),
            before.at("bytes_offloaded").get<std::int64_t>());
  EXPECT_LT(after.at("chosen").get<int>(), before.at("chosen").get<int>());
  EXPECT_NE(run("plan --scope mlp --replay-pointwise '" + graph.string() + "'").out.find("replayed:"),
            std::string::npos);
  const fs::path out = dir_ / "replayed.json.zst";
  const CliRun emitted = run("plan --scope mlp --replay-pointwise --emit-graph '" + out.string() +
                             "' '" + graph.string() + "'");
  ASSERT_EQ(emitted.exit_code, 0) << emitted.err;
  EXPECT_NO_THROW(verify_offload_graph(tagged, load_graph(out.string())));
}

// ---- simulate, and the forecast and pictures of plan ---------------------------

TEST_F(CliTest, SimulatePrintsStepPeakAndBytesMoved) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const CliRun original = run("simulate '" + graph.string() + "'");
  ASSERT_EQ(original.exit_code, 0) << original.err;
  EXPECT_TRUE(original.err.empty()) << original.err;
  const std::vector<std::string> lines = {
      "graph:              two-layer test graph\n",
      "nodes:              13 (9 forward, 4 backward)\n",
      "device profile:     " + h200_profile().name + "\n",
      "predicted step:     ",
      "peak device memory: ",
      "moved D2H:          0 B",
      "moved H2D:          0 B",
      "compute wait:       0.00 ms"};
  for (const std::string& line : lines) {
    EXPECT_NE(original.out.find(line), std::string::npos) << line << "\n" << original.out;
  }
  const SimResult expected = simulate(load_graph(graph.string()), CostModel(h200_profile()));
  EXPECT_NE(original.out.find("peak device memory: " + cli::human_bytes(expected.peak_bytes) +
                              " (" + std::to_string(expected.peak_bytes) + " bytes) at node "),
            std::string::npos)
      << original.out;

  // The planned graph moves the 16 MiB each way.
  const fs::path rewritten = dir_ / "rewritten.json";
  ASSERT_EQ(run("plan --emit-graph '" + rewritten.string() + "' '" + graph.string() + "'").exit_code,
            0);
  const CliRun planned = run("simulate '" + rewritten.string() + "'");
  ASSERT_EQ(planned.exit_code, 0) << planned.err;
  EXPECT_NE(planned.out.find("moved D2H:          16.00 MiB"), std::string::npos) << planned.out;
  EXPECT_NE(planned.out.find("moved H2D:          16.00 MiB"), std::string::npos) << planned.out;
}

TEST_F(CliTest, SimulateWritesTheTraceAndTheTimeline) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const fs::path trace = dir_ / "step.json";
  const fs::path timeline = dir_ / "step.svg";
  const CliRun result = run("simulate --trace '" + trace.string() + "' --timeline '" +
                            timeline.string() + "' '" + graph.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("wrote the trace to " + trace.string() + "\n"), std::string::npos)
      << result.out;
  EXPECT_NE(result.out.find("wrote the memory timeline to " + timeline.string() + "\n"),
            std::string::npos)
      << result.out;
  const nlohmann::json events = nlohmann::json::parse(read_text(trace)).at("traceEvents");
  int slices = 0;
  for (const nlohmann::json& event : events) slices += event.at("ph") == "X";
  EXPECT_GT(slices, 0);
  const std::string svg = read_text(timeline);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("two-layer test graph (" + h200_profile().name + ")"), std::string::npos);
  EXPECT_NE(svg.find(">peak "), std::string::npos);

  // Without the flags nothing is written.
  fs::remove(trace);
  ASSERT_EQ(run("simulate '" + graph.string() + "'").exit_code, 0);
  EXPECT_FALSE(fs::exists(trace));
}

TEST_F(CliTest, PlanForecastsTheRewrittenGraphAgainstTheOriginal) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const CliRun text = run("plan '" + graph.string() + "'");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  const std::vector<std::string> lines = {"forecast (simulated on " + h200_profile().name + "):\n",
                                          "original",
                                          "rewritten",
                                          "difference\n",
                                          "  step time  ",
                                          "  peak device memory  ",
                                          "  peak at  "};
  for (const std::string& line : lines) {
    EXPECT_NE(text.out.find(line), std::string::npos) << line << "\n" << text.out;
  }

  const CliRun json = run("plan --json '" + graph.string() + "'");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json forecast = nlohmann::json::parse(json.out).at("forecast");
  EXPECT_EQ(forecast.at("device"), h200_profile().name);
  const nlohmann::json& before = forecast.at("original");
  const nlohmann::json& after = forecast.at("rewritten");
  // The numbers are simulate()'s on the two graphs.
  const Graph original = load_graph(graph.string());
  const SimResult expected = simulate(original, CostModel(h200_profile()));
  EXPECT_EQ(before.at("peak_bytes").get<std::int64_t>(), expected.peak_bytes);
  EXPECT_DOUBLE_EQ(before.at("step_ms").get<double>(), expected.step_ms);
  EXPECT_EQ(before.at("bytes_d2h").get<std::int64_t>(), 0);
  EXPECT_EQ(after.at("bytes_d2h").get<std::int64_t>(), kTwoLayerBytes);
  EXPECT_EQ(after.at("bytes_h2d").get<std::int64_t>(), kTwoLayerBytes);
  EXPECT_EQ(forecast.at("peak_bytes_change").get<std::int64_t>(),
            after.at("peak_bytes").get<std::int64_t>() - before.at("peak_bytes").get<std::int64_t>());
  EXPECT_DOUBLE_EQ(forecast.at("step_ms_change").get<double>(),
                   after.at("step_ms").get<double>() - before.at("step_ms").get<double>());

  // Planning nothing forecasts no change.
  const CliRun none = run("plan --json --mode none '" + graph.string() + "'");
  ASSERT_EQ(none.exit_code, 0) << none.err;
  const nlohmann::json unchanged = nlohmann::json::parse(none.out).at("forecast");
  EXPECT_EQ(unchanged.at("peak_bytes_change").get<std::int64_t>(), 0);
  EXPECT_EQ(unchanged.at("step_ms_change").get<double>(), 0.0);
  const std::string none_text = run("plan --mode none '" + graph.string() + "'").out;
  EXPECT_NE(none_text.find("forecast (simulated on"), std::string::npos) << none_text;
  EXPECT_NE(none_text.find("none\n"), std::string::npos) << none_text;
}

TEST_F(CliTest, PlanWritesTheTraceAndTimelineOfTheRewrittenGraph) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const fs::path trace = dir_ / "plan.json";
  const fs::path timeline = dir_ / "plan.svg";
  const CliRun result = run("plan --trace '" + trace.string() + "' --timeline '" +
                            timeline.string() + "' '" + graph.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("wrote the trace to "), std::string::npos) << result.out;
  const nlohmann::json events = nlohmann::json::parse(read_text(trace)).at("traceEvents");
  std::int64_t d2h_tid = -1;
  for (const nlohmann::json& event : events) {
    if (event.at("ph") == "M" && event.at("name") == "thread_name" &&
        event.at("args").at("name") == "D2H") {
      d2h_tid = event.at("tid").get<std::int64_t>();
    }
  }
  int offload_slices = 0;
  for (const nlohmann::json& event : events) {
    if (event.at("ph") != "X" || event.at("tid").get<std::int64_t>() != d2h_tid) continue;
    EXPECT_EQ(event.at("args").at("bytes").get<std::int64_t>(), kTwoLayerBytes / 4);
    ++offload_slices;
  }
  EXPECT_EQ(offload_slices, 4);
  const std::string svg = read_text(timeline);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("4 values of self_attn moved"), std::string::npos);
  EXPECT_NE(svg.find("class=\"in_flight\""), std::string::npos);
  EXPECT_NE(svg.find("class=\"reloads\""), std::string::npos);

  // With --json stdout stays one JSON object.
  const CliRun json = run("plan --json --timeline '" + timeline.string() + "' '" +
                          graph.string() + "'");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  EXPECT_TRUE(nlohmann::json::accept(json.out)) << json.out;
}

TEST_F(CliTest, DeviceProfileFlagSimulatesOnThatDevice) {
  DeviceProfile slow = h200_profile();
  slow.name = "Test GPU with a slow link";
  for (LinkCurve* curve : {&slow.d2h, &slow.h2d, &slow.d2h_duplex, &slow.h2d_duplex}) {
    for (auto& point : curve->points) point.second /= 100;
  }
  const fs::path profile = write_file("slow.json", write_device_profile(slow));
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const std::string flag = "--device-profile '" + profile.string() + "' ";

  const CliRun simulated = run("simulate " + flag + "'" + graph.string() + "'");
  ASSERT_EQ(simulated.exit_code, 0) << simulated.err;
  EXPECT_NE(simulated.out.find("device profile:     Test GPU with a slow link\n"),
            std::string::npos)
      << simulated.out;

  const CliRun fast = run("plan --json '" + graph.string() + "'");
  const CliRun planned = run("plan --json " + flag + "'" + graph.string() + "'");
  ASSERT_EQ(fast.exit_code, 0) << fast.err;
  ASSERT_EQ(planned.exit_code, 0) << planned.err;
  const nlohmann::json on_h200 = nlohmann::json::parse(fast.out).at("forecast");
  const nlohmann::json on_slow = nlohmann::json::parse(planned.out).at("forecast");
  EXPECT_EQ(on_slow.at("device"), "Test GPU with a slow link");
  // The copies take 100x longer: the rewritten step waits for them.
  EXPECT_GT(on_slow.at("rewritten").at("step_ms").get<double>(),
            on_h200.at("rewritten").at("step_ms").get<double>());
  EXPECT_NE(run("plan " + flag + "'" + graph.string() + "'")
                .out.find("forecast (simulated on Test GPU with a slow link):"),
            std::string::npos);
}

TEST_F(CliTest, DeviceProfileAndOutputErrors) {
  const fs::path graph = write_file("g.json", kTwoLayerGraph);
  const std::string path = " '" + graph.string() + "'";
  for (const std::string command : {"simulate", "plan"}) {
    SCOPED_TRACE(command);
    // Missing or unreadable: an I/O error naming the file.
    const std::string missing = (dir_ / "no_such_profile.json").string();
    const CliRun not_found = run(command + " --device-profile '" + missing + "'" + path);
    EXPECT_EQ(not_found.exit_code, 3);
    EXPECT_EQ(not_found.err, "[cli] device profile file not found: " + missing + "\n");
    const CliRun directory = run(command + " --device-profile '" + dir_.string() + "'" + path);
    EXPECT_EQ(directory.exit_code, 3);
    EXPECT_NE(directory.err.find("device profile path is a directory"), std::string::npos)
        << directory.err;
    // Malformed: an invalid value, named by the profile parser.
    const fs::path junk = write_file("junk_profile.json", "{\"name\": 3}");
    const CliRun malformed = run(command + " --device-profile '" + junk.string() + "'" + path);
    EXPECT_EQ(malformed.exit_code, 1);
    EXPECT_EQ(malformed.err.rfind("[sim] ", 0), 0u) << malformed.err;
    // A flag without its argument is a usage error.
    EXPECT_EQ(run(command + path + " --device-profile").exit_code, 2);
    EXPECT_EQ(run(command + path + " --trace").exit_code, 2);
    EXPECT_EQ(run(command + path + " --timeline").exit_code, 2);
    // An output that cannot be written.
    const std::string unwritable = (dir_ / "no_dir" / "out.svg").string();
    const CliRun output = run(command + " --timeline '" + unwritable + "'" + path);
    EXPECT_EQ(output.exit_code, 3);
    EXPECT_EQ(output.err, "[cli] cannot write the timeline to " + unwritable + "\n");
  }
  const CliRun no_graph = run("simulate '" + (dir_ / "no_such_graph.json").string() + "'");
  EXPECT_EQ(no_graph.exit_code, 3);
  EXPECT_NE(no_graph.err.find("no_such_graph.json"), std::string::npos) << no_graph.err;
}

}  // namespace

// ---- --budget / --sweep: the memory-budget planner ------------------------

TEST(ParseBudget, ReadsUnitsBytesAndPercentages) {
  constexpr std::int64_t kGiB = std::int64_t{1} << 30;
  EXPECT_EQ(cli::parse_budget("12GiB", 0), 12 * kGiB);
  EXPECT_EQ(cli::parse_budget("800 mib", 0), 800 * (std::int64_t{1} << 20));
  EXPECT_EQ(cli::parse_budget("1.5GB", 0), 1500000000);
  EXPECT_EQ(cli::parse_budget("4096", 0), 4096);
  EXPECT_EQ(cli::parse_budget("50%", 10 * kGiB), 5 * kGiB);
  for (const char* bad : {"", "abc", "12 parsecs", "-1GiB", "0", "0%"}) {
    try {
      cli::parse_budget(bad, kGiB);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("--budget '" + std::string(bad) + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST_F(CliTest, BudgetPlansFitAndSayWhatTheyCost) {
  const fs::path graph = fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/llama-tiny.json.zst";
  const CliRun text = run("plan '" + graph.string() + "' --budget 90%");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  for (const char* line : {"budget:", "predicted peak:", "at the peak:      inputs",
                           "predicted step:", "moved to host:", "recomputed:", "per block",
                           "model.layers.0"}) {
    EXPECT_NE(text.out.find(line), std::string::npos) << line << "\n" << text.out;
  }
  const CliRun json = run("plan '" + graph.string() + "' --budget 90% --json");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json plan = nlohmann::json::parse(json.out);
  const std::int64_t peak = simulate(load_graph(graph.string()), CostModel(h200_profile())).peak_bytes;
  EXPECT_EQ(plan.at("budget_bytes").get<std::int64_t>(), cli::parse_budget("90%", peak));
  EXPECT_LE(plan.at("forecast").at("peak_bytes").get<std::int64_t>(),
            plan.at("budget_bytes").get<std::int64_t>());
  EXPECT_EQ(plan.at("baseline").at("peak_bytes").get<std::int64_t>(), peak);
  EXPECT_FALSE(plan.at("choices").empty());
}

TEST_F(CliTest, AnUnreachableBudgetNamesTheSmallestPeak) {
  const fs::path graph = fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/llama-tiny.json.zst";
  const CliRun out = run("plan '" + graph.string() + "' --budget 1KiB");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.err.find("smallest reachable peak"), std::string::npos) << out.err;
  const CliRun bad = run("plan '" + graph.string() + "' --budget lots");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("[cli] --budget 'lots'"), std::string::npos) << bad.err;
  const CliRun both = run("plan '" + graph.string() + "' --budget 1GiB --sweep");
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_NE(both.err.find("drop --budget"), std::string::npos) << both.err;
}

TEST_F(CliTest, TheSweepIsAMonotoneCurve) {
  const fs::path graph = fs::path(SPILLWAY_SOURCE_DIR) / "examples/graphs/llama-tiny.json.zst";
  const CliRun text = run("plan '" + graph.string() + "' --sweep");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("the curve"), std::string::npos) << text.out;
  const CliRun json = run("plan '" + graph.string() + "' --sweep --json");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json curve = nlohmann::json::parse(json.out);
  ASSERT_GE(curve.size(), 5u);
  for (std::size_t i = 1; i < curve.size(); ++i) {
    EXPECT_LT(curve[i].at("budget_bytes").get<std::int64_t>(),
              curve[i - 1].at("budget_bytes").get<std::int64_t>());
    EXPECT_GE(curve[i].at("forecast").at("step_ms").get<double>(),
              curve[i - 1].at("forecast").at("step_ms").get<double>());
    EXPECT_LE(curve[i].at("forecast").at("peak_bytes").get<std::int64_t>(),
              curve[i - 1].at("forecast").at("peak_bytes").get<std::int64_t>());
  }
}

}  // namespace spillway
