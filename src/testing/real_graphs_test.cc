// Plans every joint graph shipped under examples/graphs/ (exported from Hugging
// Face models, see examples/graphs/README.md) and checks the counts against
// what the model's structure predicts, layer by layer.
//
// Where the numbers come from. Each decoder layer's attention produces the same
// activations, so every expectation is "per layer × layers", with the layer
// count read from the graph's own metadata (config.num_hidden_layers / n_layer):
//
// * Llama (SDPA, CPU flash kernel), grouped-query attention: the activations of
//   self_attn large enough to matter and read by backward are the repeated K
//   and V of repeat_kv (`clone`, `clone_1`: batch × heads × seq × head_dim ×
//   element size) and the additive causal mask (`where`: batch × 1 × seq × seq
//   × element size). All three are last read in forward by
//   `_scaled_dot_product_flash_attention_for_cpu`, which returns a tuple (output,
//   logsumexp), so the seed policy cannot pin their free to it and skips them
//   (Rule::kTupleLastUse). The q/k/v projections are not read by backward, the
//   rotary results are not contiguous, the attention output is a strided getitem.
//   - llama3-8b-s8192 (batch 1, seq 8192, 32 heads × 128, bf16):
//     clone/clone_1 = 1×32×8192×128×2 B = 64 MiB, where = 1×1×8192×8192×2 B =
//     128 MiB: 3 values, 256 MiB per layer, 96 values / 8 GiB over 32 layers;
//     nothing chosen, no candidate.
//   - llama3-8b-s8192-cuda, the same model traced on an H200 (torch 2.11+cu130):
//     SDPA picks cuDNN attention, whose logsumexp (`getitem_1` of each layer,
//     1×32×8192×1×4 B = 1 MiB, contiguous, read by the attention backward) is
//     chosen: 1 value / 1 MiB per layer, 32 values / 32 MiB, every reload
//     prefetched; the same 3 values per layer as above hit kTupleLastUse.
//   - llama-tiny(-dynamic) (batch 2, seq 256, 4 heads × 64, fp32): 512 KiB each,
//     below the default 1 MiB, so with the defaults nothing is even considered;
//     with min_bytes 0 the same 3 values per layer (1.5 MiB) hit kTupleLastUse.
// * GPT-2 (SDPA math path with dropout; the module is "attn", not "self_attn",
//   so the default scope matches nothing and planning is refused): with scope
//   "attn" the dropout output of the attention probabilities (batch × heads ×
//   seq × seq × 4 B = 2×4×256×256×4 = 2 MiB) is chosen, one per layer, and the
//   softmax feeding it is skipped because native_dropout returns a tuple.
//   Both reloads are prefetched (a reload may start a region before its reader).

//
// With both relaxations (ActivationPlanOptions::offload_tuple_outputs and
// dense_storages) the Llama graphs move, per layer: the mask `where`, the
// repeated K/V `clone`/`clone_1` (tuple last use, now pinned to SDPA's last
// getitem), the rotary Q `add_4` (dense: [1, 32, seq, 128] with strides of the
// transposed projection; tuple last use too), the attention output `getitem`
// (dense, strided the same way) and the logsumexp `getitem_1`: six values.
//   - llama3-8b-s8192(-cuda): 128 + 4 × 64 + 1 MiB = 385 MiB per layer, 192
//     values / 12.03 GiB over 32 layers (the seed policy: 0 / 32 MiB). The
//     rotary K (`add_5`) is read by backward only through repeat_kv's clone.
//   - llama-tiny(-dynamic) with min_bytes 0: 5 × 512 KiB + 8 KiB per layer.

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "spillway/error.h"
#include "spillway/graph.h"
#include "spillway/plan.h"
#include "testing/offload_oracle.h"

namespace spillway::testing {
namespace {

namespace fs = std::filesystem;

constexpr std::int64_t kMiB = 1 << 20;

struct LayerCounts {
  std::int64_t values = 0;
  std::int64_t bytes = 0;
};

struct GraphExpectation {
  std::string file;  // under examples/graphs/
  std::string scope;
  std::int64_t min_bytes = ActivationPlanOptions{}.min_bytes;
  LayerCounts chosen_per_layer;
  std::int64_t reloads_prefetched = 0;  // over the whole graph
  // A rule that rejects the same values in every layer, and how many.
  Rule skip_rule = Rule::kTupleLastUse;
  LayerCounts skipped_per_layer;
};

const std::vector<GraphExpectation>& documented_graphs() {
  // Per layer: 1×32×8192×128×2 B for each repeated K/V, 1×1×8192×8192×2 B for
  // the mask (Llama-3-8B); 2×4×256×64×4 B and 2×1×256×256×4 B (llama-tiny);
  // 2×4×256×256×4 B for GPT-2's attention probabilities.
  constexpr std::int64_t kLlama8bSkipped = 2 * (1 * 32 * 8192 * 128 * 2) + 1 * 1 * 8192 * 8192 * 2;
  constexpr std::int64_t kLlamaTinySkipped = 2 * (2 * 4 * 256 * 64 * 4) + 2 * 1 * 256 * 256 * 4;
  constexpr std::int64_t kGpt2Probabilities = 2 * 4 * 256 * 256 * 4;
  // T1 (batch 4, seq 4096, 16 heads of 128, bf16): rotary Q and K and the
  // causal mask, all read by SDPA's tuple; its fp32 logsumexp moves.
  constexpr std::int64_t kT1Skipped = 2 * (4 * 16 * 4096 * 128 * 2) + 4 * 1 * 4096 * 4096 * 2;
  static const std::vector<GraphExpectation> graphs = {
      {.file = "llama3-8b-s8192.json.zst",
       .scope = "self_attn",
       .chosen_per_layer = {0, 0},
       .skipped_per_layer = {3, kLlama8bSkipped}},
      {.file = "llama3-8b-s8192-cuda.json.zst",
       .scope = "self_attn",
       .chosen_per_layer = {1, 1 * 32 * 8192 * 1 * 4},
       .reloads_prefetched = 32,
       .skipped_per_layer = {3, kLlama8bSkipped}},
      {.file = "llama-tiny.json.zst",
       .scope = "self_attn",
       .chosen_per_layer = {0, 0},
       .skipped_per_layer = {0, 0}},
      {.file = "llama-tiny.json.zst",
       .scope = "self_attn",
       .min_bytes = 0,
       .chosen_per_layer = {0, 0},
       .skipped_per_layer = {3, kLlamaTinySkipped}},
      {.file = "llama-tiny-dynamic.json.zst",
       .scope = "self_attn",
       .min_bytes = 0,
       .chosen_per_layer = {0, 0},
       .skipped_per_layer = {3, kLlamaTinySkipped}},
      {.file = "t1-h200-timed.json.zst",
       .scope = "self_attn",
       .chosen_per_layer = {1, 4 * 16 * 4096 * 1 * 4},
       .reloads_prefetched = 16,
       .skipped_per_layer = {3, kT1Skipped}},
      {.file = "gpt2-tiny.json.zst",
       .scope = "attn",
       .chosen_per_layer = {1, kGpt2Probabilities},
       .reloads_prefetched = 2,
       .skipped_per_layer = {1, kGpt2Probabilities}},
  };
  return graphs;
}

fs::path graphs_dir() { return fs::path(SPILLWAY_SOURCE_DIR) / "examples" / "graphs"; }

// Decoder layers from the exporter's metadata ("config" is a JSON object).
std::int64_t layer_count(const Graph& graph) {
  const auto it = graph.metadata.find("config");
  if (it == graph.metadata.end()) return -1;
  const nlohmann::json config = nlohmann::json::parse(it->second);
  for (const char* key : {"num_hidden_layers", "n_layer"}) {
    if (config.contains(key)) return config.at(key).get<std::int64_t>();
  }
  return -1;
}

// The decoder layer a node belongs to ("model.layers.3" or "transformer.h.3"),
// or -1 outside any layer.
std::int64_t layer_of(const Node& node) {
  for (const std::string& module : node.module_stack) {
    const std::size_t dot = module.rfind('.');
    if (dot == std::string::npos || dot + 1 == module.size()) continue;
    const std::string index = module.substr(dot + 1);
    if (index.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string parent = module.substr(0, dot);
    if (parent.ends_with(".layers") || parent.ends_with(".h")) return std::stoll(index);
  }
  return -1;
}

const Node& find(const Graph& graph, NodeId id) {
  for (const Node& node : graph.nodes) {
    if (node.id == id) return node;
  }
  throw std::out_of_range("node " + std::to_string(id));
}

// Counts per layer; a value outside every layer lands at -1.
template <typename Items, typename NodeOf, typename BytesOf>
std::map<std::int64_t, LayerCounts> per_layer(const Graph& graph, const Items& items,
                                              NodeOf node_of, BytesOf bytes_of) {
  std::map<std::int64_t, LayerCounts> counts;
  for (const auto& item : items) {
    LayerCounts& layer = counts[layer_of(find(graph, node_of(item)))];
    layer.values += 1;
    layer.bytes += bytes_of(item);
  }
  return counts;
}

void expect_uniform(const std::map<std::int64_t, LayerCounts>& counts, std::int64_t layers,
                    const LayerCounts& expected, const std::string& what) {
  if (expected.values == 0) {
    EXPECT_TRUE(counts.empty()) << what << ": expected none, found some in " << counts.size()
                                << " layer(s)";
    return;
  }
  EXPECT_EQ(counts.count(-1), 0u) << what << ": some outside every decoder layer";
  EXPECT_EQ(static_cast<std::int64_t>(counts.size()), layers) << what << ": layers covered";
  for (const auto& [layer, got] : counts) {
    EXPECT_EQ(got.values, expected.values) << what << " in layer " << layer;
    EXPECT_EQ(got.bytes, expected.bytes) << what << " (bytes) in layer " << layer;
  }
}

TEST(RealGraphs, EveryDocumentedGraphIsShipped) {
  std::set<std::string> documented;
  for (const GraphExpectation& expectation : documented_graphs()) {
    documented.insert(expectation.file);
    EXPECT_TRUE(fs::is_regular_file(graphs_dir() / expectation.file))
        << "missing " << (graphs_dir() / expectation.file);
  }
  // A graph shipped without documented expectations is a test someone forgot.
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(graphs_dir(), error)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".json") || name.ends_with(".json.zst")) {
      EXPECT_TRUE(documented.count(name)) << name << " has no expectations in " << __FILE__;
    }
  }
  EXPECT_FALSE(error) << error.message();
}

class RealGraphPlan : public ::testing::TestWithParam<GraphExpectation> {};

TEST_P(RealGraphPlan, MatchesModelStructure) {
  const GraphExpectation& expected = GetParam();
  const fs::path path = graphs_dir() / expected.file;
  ASSERT_TRUE(fs::is_regular_file(path)) << "missing " << path;
  const Graph graph = load_graph(path.string());
  ASSERT_NO_THROW(verify_graph(graph));
  const std::int64_t layers = layer_count(graph);
  ASSERT_GT(layers, 0) << "metadata.config names no layer count";

  ActivationPlanOptions options;
  options.scope = expected.scope;
  options.min_bytes = expected.min_bytes;
  const PlanResult result = plan_activation_offload(graph, options);
  const Plan& plan = result.plan;

  const std::vector<std::string> problems = check_offload_plan(graph, options, result);
  for (const std::string& problem : problems) ADD_FAILURE() << problem;

  EXPECT_EQ(static_cast<std::int64_t>(plan.offloads.size()),
            expected.chosen_per_layer.values * layers);
  EXPECT_EQ(plan.candidate_count, expected.chosen_per_layer.values * layers)
      << "with no budget every candidate is chosen";
  EXPECT_EQ(plan.bytes_offloaded, expected.chosen_per_layer.bytes * layers);
  EXPECT_EQ(plan.reloads_prefetched, expected.reloads_prefetched);
  expect_uniform(per_layer(
                     graph, plan.offloads, [](const Offload& o) { return o.producer; },
                     [](const Offload& o) { return o.bytes; }),
                 layers, expected.chosen_per_layer, "chosen values");

  std::vector<ValueDecision> skipped;
  for (const ValueDecision& decision : plan.decisions) {
    if (decision.rule == expected.skip_rule && decision.bytes &&
        *decision.bytes >= expected.min_bytes) {
      skipped.push_back(decision);
    }
  }
  expect_uniform(per_layer(
                     graph, skipped, [](const ValueDecision& d) { return d.node; },
                     [](const ValueDecision& d) { return *d.bytes; }),
                 layers, expected.skipped_per_layer,
                 "values skipped by " + std::string(to_string(expected.skip_rule)));
}

std::string test_name(const ::testing::TestParamInfo<GraphExpectation>& info) {
  std::string name = info.param.file.substr(0, info.param.file.find('.')) + "_scope_" +
                     info.param.scope + "_min_" + std::to_string(info.param.min_bytes);
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Shipped, RealGraphPlan, ::testing::ValuesIn(documented_graphs()),
                         test_name);

struct RelaxedExpectation {
  std::string file;
  std::int64_t min_bytes = ActivationPlanOptions{}.min_bytes;
  LayerCounts chosen_per_layer;
  std::int64_t at_least_bytes = 0;  // over the whole graph
};

class RelaxedRealGraphPlan : public ::testing::TestWithParam<RelaxedExpectation> {};

TEST_P(RelaxedRealGraphPlan, MovesTheAttentionActivations) {
  const RelaxedExpectation& expected = GetParam();
  const fs::path path = graphs_dir() / expected.file;
  ASSERT_TRUE(fs::is_regular_file(path)) << "missing " << path;
  const Graph graph = load_graph(path.string());
  const std::int64_t layers = layer_count(graph);
  ASSERT_GT(layers, 0);

  ActivationPlanOptions options;
  options.min_bytes = expected.min_bytes;
  options.offload_tuple_outputs = true;
  options.dense_storages = true;
  const PlanResult result = plan_activation_offload(graph, options);
  for (const std::string& problem : check_offload_plan(graph, options, result)) {
    ADD_FAILURE() << problem;
  }
  const Plan& plan = result.plan;
  EXPECT_GE(plan.bytes_offloaded, expected.at_least_bytes);
  EXPECT_EQ(plan.bytes_offloaded, expected.chosen_per_layer.bytes * layers);
  expect_uniform(per_layer(
                     graph, plan.offloads, [](const Offload& o) { return o.producer; },
                     [](const Offload& o) { return o.bytes; }),
                 layers, expected.chosen_per_layer, "chosen values");
  std::int64_t dense = 0;
  for (const Offload& offload : plan.offloads) dense += offload.dense_permute_node >= 0;
  EXPECT_GE(dense, 2 * layers) << "the rotary Q and the attention output of every layer";
  for (const ValueDecision& decision : plan.decisions) {
    EXPECT_NE(decision.rule, Rule::kTupleLastUse) << decision.name << ": " << decision.detail;
  }
}

std::string relaxed_name(const ::testing::TestParamInfo<RelaxedExpectation>& info) {
  std::string name = info.param.file.substr(0, info.param.file.find('.')) + "_min_" +
                     std::to_string(info.param.min_bytes);
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

constexpr std::int64_t kLlama8bRelaxedPerLayer = 385 * kMiB;
constexpr std::int64_t kLlamaTinyRelaxedPerLayer = 5 * (2 * 4 * 256 * 64 * 4) + 2 * 4 * 256 * 4;
constexpr std::int64_t kGiB = std::int64_t{1} << 30;

INSTANTIATE_TEST_SUITE_P(
    Shipped, RelaxedRealGraphPlan,
    ::testing::Values(
        RelaxedExpectation{.file = "llama3-8b-s8192-cuda.json.zst",
                           .chosen_per_layer = {6, kLlama8bRelaxedPerLayer},
                           .at_least_bytes = 12 * kGiB},
        RelaxedExpectation{.file = "llama3-8b-s8192.json.zst",
                           .chosen_per_layer = {6, kLlama8bRelaxedPerLayer},
                           .at_least_bytes = 12 * kGiB},
        RelaxedExpectation{.file = "llama-tiny.json.zst",
                           .min_bytes = 0,
                           .chosen_per_layer = {6, kLlamaTinyRelaxedPerLayer},
                           .at_least_bytes = 5 * kMiB},
        RelaxedExpectation{.file = "llama-tiny-dynamic.json.zst",
                           .min_bytes = 0,
                           .chosen_per_layer = {6, kLlamaTinyRelaxedPerLayer},
                           .at_least_bytes = 5 * kMiB}),
    relaxed_name);

TEST(RealGraphs, DefaultScopeThatMatchesNothingIsRefused) {
  const fs::path path = graphs_dir() / "gpt2-tiny.json.zst";
  ASSERT_TRUE(fs::is_regular_file(path)) << "missing " << path;
  const Graph graph = load_graph(path.string());
  try {
    plan_activation_offload(graph, ActivationPlanOptions{});
    FAIL() << "GPT-2 has no self_attn module; planning must be refused";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("self_attn"), std::string::npos) << e.what();
  }
}

TEST(RealGraphs, DynamicGraphPlansLikeItsStaticTwin) {
  // The same model traced with a symbolic sequence length (hint 256) must get
  // the same decisions by rule as the static trace: hints are read, never
  // specialised. Views are left out: the dynamic trace carries a few more of
  // them (shape plumbing around the symbolic size), none of which can move.
  const fs::path static_path = graphs_dir() / "llama-tiny.json.zst";
  const fs::path dynamic_path = graphs_dir() / "llama-tiny-dynamic.json.zst";
  ASSERT_TRUE(fs::is_regular_file(static_path) && fs::is_regular_file(dynamic_path));
  ActivationPlanOptions options;
  options.min_bytes = 0;
  auto large_rules = [&](const fs::path& path) {
    std::map<Rule, std::int64_t> rules;
    const PlanResult result = plan_activation_offload(load_graph(path.string()), options);
    for (const ValueDecision& decision : result.plan.decisions) {
      if (decision.bytes && *decision.bytes >= 256 * 1024 && decision.rule != Rule::kView) {
        ++rules[decision.rule];
      }
    }
    return rules;
  };
  EXPECT_EQ(large_rules(static_path), large_rules(dynamic_path));
}

}  // namespace
}  // namespace spillway::testing
