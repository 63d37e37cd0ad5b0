// Robustness: thousands of random single mutations of a valid graph's JSON,
// with a fixed seed. Each mutant either loads to a graph that verifies and
// round-trips, or is refused with InvalidGraph; nothing else (no other
// exception type, no crash, no hang) is acceptable.

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ir/test_graphs.h"
#include "spillway/error.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

using Json = nlohmann::ordered_json;

class Mutator {
 public:
  explicit Mutator(std::uint64_t seed) : rng_(seed) {}

  std::size_t below(std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }

  // Every value in the document, as pointers into it (root first).
  static void collect(Json& j, std::vector<Json*>& out) {
    out.push_back(&j);
    if (j.is_object() || j.is_array()) {
      for (auto& child : j) collect(child, out);
    }
  }

  Json random_value() {
    switch (below(14)) {
      case 0: return nullptr;
      case 1: return below(2) == 1;
      case 2: return static_cast<std::int64_t>(below(5));
      case 3: return -static_cast<std::int64_t>(below(5)) - 1;
      case 4: return 0.5;
      case 5: return std::numeric_limits<std::uint64_t>::max();
      case 6: return std::numeric_limits<std::int64_t>::min();
      case 7: return "";
      case 8: return kWords[below(std::size(kWords))];
      case 9: return Json::array();
      case 10: return Json::object();
      case 11: return Json{{"node", static_cast<std::int64_t>(below(25))}};
      case 12: return Json{{"sym", "s9"}, {"hint", static_cast<std::int64_t>(below(3)) - 1}};
      default: return Json::array({static_cast<std::int64_t>(below(3))});
    }
  }

  // One structural mutation of the document.
  void mutate_document(Json& doc) {
    std::vector<Json*> values;
    collect(doc, values);
    Json& target = *values[below(values.size())];
    switch (below(6)) {
      case 0:  // replace a value with a value of another (or the same) type
        target = random_value();
        break;
      case 1:  // delete a field or element
        if (target.is_object() && !target.empty()) {
          auto it = target.begin();
          std::advance(it, below(target.size()));
          target.erase(it.key());
        } else if (target.is_array() && !target.empty()) {
          target.erase(below(target.size()));
        }
        break;
      case 2:  // add a field or element
        if (target.is_object()) {
          target[kWords[below(std::size(kWords))]] = random_value();
        } else if (target.is_array()) {
          target.push_back(random_value());
        }
        break;
      case 3: {  // swap the ids of two nodes
        Json& nodes = doc["nodes"];
        std::size_t a = below(nodes.size()), b = below(nodes.size());
        std::swap(nodes[a]["id"], nodes[b]["id"]);
        break;
      }
      case 4: {  // move a node elsewhere in the order
        Json& nodes = doc["nodes"];
        std::size_t from = below(nodes.size()), to = below(nodes.size());
        Json node = nodes[from];
        nodes.erase(from);
        nodes.insert(nodes.begin() + static_cast<std::ptrdiff_t>(to), node);
        break;
      }
      default:  // copy one value over another
        target = *values[below(values.size())];
        break;
    }
  }

  // One textual mutation.
  void mutate_text(std::string& text) {
    std::size_t at = below(text.size());
    switch (below(4)) {
      case 0:
        text.resize(at);
        break;
      case 1:
        text[at] = kBytes[below(std::size(kBytes))];
        break;
      case 2:
        text.insert(at, 1, kBytes[below(std::size(kBytes))]);
        break;
      default:
        text.erase(at, 1 + below(8));
        break;
    }
  }

 private:
  static constexpr const char* kWords[] = {
      "id", "name", "kind", "target", "args", "kwargs", "phase", "value", "node", "sym",
      "hint", "type", "tensor", "output", "placeholder", "backward", "alpha", "float",
      "inf", "elements", "sizes", "strides", "storage", "namespace", "arguments"};
  static constexpr char kBytes[] = {'{', '}', '[', ']', '"', ',', ':', '0', '9', '-',
                                    'e', '.', ' ', '\\', 'n', '\x80', '\xff', '\0'};
  std::mt19937_64 rng_;
};

enum class Outcome { kLoaded, kRefused };

Outcome check_mutant(const std::string& text) {
  Graph g;
  try {
    g = parse_graph(text);
  } catch (const InvalidGraph& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[graph] ", 0), 0u) << e.what();
    return Outcome::kRefused;
  }
  // A mutant that loads is a valid graph in every sense the API promises.
  verify_graph(g);
  EXPECT_EQ(parse_graph(write_graph(g)), g);
  return Outcome::kLoaded;
}

TEST(JsonMutation, EveryMutantLoadsValidOrIsRefusedWithInvalidGraph) {
  const Json base = Json::parse(write_graph(ir::testing::rich_graph()));
  Mutator mutator(20261129);
  int loaded = 0, refused = 0;
  for (int round = 0; round < 4000; ++round) {
    std::string text;
    if (round % 4 == 3) {
      text = base.dump();
      mutator.mutate_text(text);
    } else {
      Json doc = base;
      mutator.mutate_document(doc);
      text = doc.dump(-1, ' ', false, Json::error_handler_t::replace);
    }
    try {
      (check_mutant(text) == Outcome::kLoaded ? loaded : refused)++;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "round " << round << " threw " << e.what() << "\n" << text;
    }
    if (HasFailure()) break;
  }
  // Both outcomes must be exercised, or the mutator is not testing anything.
  EXPECT_GT(loaded, 200);
  EXPECT_GT(refused, 2000);
  std::printf("mutants: %d loaded, %d refused\n", loaded, refused);
}

}  // namespace
}  // namespace spillway
