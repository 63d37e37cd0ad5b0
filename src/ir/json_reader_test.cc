// parse_graph on malformed input: every rejection is an InvalidGraph whose
// message names the node and the field, exactly as a user reads it.

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

#include "spillway/error.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

using Json = nlohmann::ordered_json;

// x, w -> mm_1 -> add (alpha kwarg) -> output, with schemas for mm and add.
Json base_document() {
  return Json::parse(R"({
    "format": "spillway.graph", "version": 1, "name": "t",
    "metadata": {"torch": "2.13.0"},
    "ops": {
      "aten.mm.default": {"namespace": "aten", "arguments": [{"name": "self"}, {"name": "mat2"}]},
      "aten.add.Tensor": {"namespace": "aten", "mutable": false, "view": false,
                          "arguments": [{"name": "self"}, {"name": "other"},
                                        {"name": "alpha", "kwarg_only": true}]}
    },
    "nodes": [
      {"id": 0, "name": "x", "kind": "placeholder", "target": "x",
       "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [2, 3],
                 "strides": [3, 1], "contiguous": true, "storage": 0, "device": "cpu"}},
      {"id": 1, "name": "w", "kind": "get_attr", "target": "w",
       "value": {"type": "tensor", "dtype": "float32", "element_size": 4, "sizes": [3, 3]}},
      {"id": 2, "name": "mm_1", "kind": "call_function", "target": "aten.mm.default",
       "args": [{"node": 0}, {"node": 1}], "kwargs": {}, "phase": "forward",
       "module_stack": ["model"], "time_ms": 0.5,
       "value": {"type": "tensor", "dtype": "float32", "element_size": 4,
                 "sizes": [2, {"sym": "s0", "hint": 3}], "strides": null, "storage": 5}},
      {"id": 3, "name": "add", "kind": "call_function", "target": "aten.add.Tensor",
       "args": [{"node": 2}, {"node": 2}], "kwargs": {"alpha": 1}, "phase": "backward"},
      {"id": 4, "name": "output", "kind": "output", "target": "output",
       "args": [[{"node": 3}]]}
    ]
  })");
}

// The message of the InvalidGraph that parse_graph throws, or "" if it parses.
std::string parse_error(const std::string& text) {
  try {
    parse_graph(text);
  } catch (const InvalidGraph& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an InvalidGraph: " << e.what();
    return "";
  }
  return "";
}

// The error after setting the value at a JSON pointer ("/nodes/2/id") to `json`.
std::string error_after_set(const std::string& pointer, const std::string& json) {
  Json doc = base_document();
  doc[Json::json_pointer(pointer)] = Json::parse(json);
  return parse_error(doc.dump());
}

// The error after removing the value at a JSON pointer.
std::string error_after_erase(const std::string& pointer) {
  Json doc = base_document();
  Json::json_pointer at(pointer);
  Json& parent = doc[at.parent_pointer()];
  if (parent.is_array()) {
    parent.erase(std::stoul(at.back()));
  } else {
    parent.erase(at.back());
  }
  return parse_error(doc.dump());
}

TEST(JsonReader, AcceptsTheBaseDocument) {
  Graph g = parse_graph(base_document().dump());
  ASSERT_EQ(g.nodes.size(), 5u);
  EXPECT_EQ(g.nodes[2].value.tensor.sizes[1], SymSize::symbolic("s0", 3));
  EXPECT_EQ(g.nodes[3].phase, Phase::kBackward);
  EXPECT_EQ(g.nodes[3].kwargs[0].first, "alpha");
  EXPECT_EQ(g.ops.at("aten.add.Tensor").arguments[2].kwarg_only, true);
}

TEST(JsonReader, MaxStorageLooksIntoTupleElements) {
  Graph g = parse_graph(base_document().dump());
  const std::int64_t before = g.max_storage();
  EXPECT_GE(before, 5);  // mm_1's
  Value pair;
  pair.kind = ValueKind::kSequence;
  pair.elements.push_back(g.nodes[0].value);
  pair.elements.push_back(g.nodes[0].value);
  pair.elements[1].tensor.storage = before + 7;
  g.nodes[3].value = pair;
  EXPECT_EQ(g.max_storage(), before + 7);
  EXPECT_EQ(Graph{}.max_storage(), -1);
}

TEST(JsonReader, RejectsTextThatIsNotJson) {
  for (const char* text : {"", "{", "nodes", "{\"format\": }", "[1, 2"}) {
    std::string error = parse_error(text);
    EXPECT_EQ(error.rfind("[graph] not valid JSON: ", 0), 0u) << text << " -> " << error;
  }
}

TEST(JsonReader, RejectsInvalidUtf8) {
  std::string text = base_document().dump();
  text.replace(text.find("mm_1"), 1, "\xff");
  EXPECT_EQ(parse_error(text).rfind("[graph] not valid JSON: ", 0), 0u);
}

TEST(JsonReader, RejectsAWrongTopLevelType) {
  EXPECT_EQ(parse_error("[]"), "[graph] expected a JSON object at the top level, got an array");
  EXPECT_EQ(parse_error("42"), "[graph] expected a JSON object at the top level, got an integer");
}

TEST(JsonReader, RejectsBadFormatAndVersion) {
  EXPECT_EQ(error_after_set("/format", R"("onnx")"),
            "[graph] field 'format': expected 'spillway.graph', got 'onnx'");
  EXPECT_EQ(error_after_set("/version", "2"), "[graph] field 'version': expected 1, got 2");
  EXPECT_EQ(error_after_set("/version", R"("1")"),
            "[graph] field 'version': expected an integer, got a string");
  EXPECT_EQ(error_after_set("/version", "1.0"),
            "[graph] field 'version': expected an integer, got a non-integer number");
  EXPECT_EQ(error_after_erase("/format"), "[graph] field 'format' is missing");
  EXPECT_EQ(error_after_erase("/version"), "[graph] field 'version' is missing");
}

TEST(JsonReader, RejectsMissingAndUnknownTopLevelFields) {
  EXPECT_EQ(error_after_erase("/nodes"), "[graph] field 'nodes' is missing");
  EXPECT_EQ(error_after_set("/nodez", "[]"), "[graph] field 'nodez' is not a field of a graph");
  EXPECT_EQ(error_after_set("/nodes", "{}"),
            "[graph] field 'nodes': expected an array, got an object");
  EXPECT_EQ(error_after_set("/name", "7"), "[graph] field 'name': expected a string, got an integer");
  EXPECT_EQ(error_after_set("/metadata", "[]"),
            "[graph] field 'metadata': expected an object, got an array");
  EXPECT_EQ(error_after_set("/metadata/layers", "32"),
            "[graph] field 'metadata.layers': expected a string, got an integer");
  EXPECT_EQ(error_after_set("/ops", "null"), "[graph] field 'ops': expected an object, got null");
}

TEST(JsonReader, OptionalTopLevelFieldsMayBeAbsent) {
  Json doc = base_document();
  doc.erase("name");
  doc.erase("metadata");
  doc.erase("ops");
  Graph g = parse_graph(doc.dump());
  EXPECT_TRUE(g.name.empty());
  EXPECT_TRUE(g.ops.empty());
}

TEST(JsonReader, RejectsANodeThatIsNotAnObject) {
  EXPECT_EQ(error_after_set("/nodes/1", "5"),
            "[graph] field 'nodes[1]': expected an object, got an integer");
}

TEST(JsonReader, RejectsMissingNodeFields) {
  EXPECT_EQ(error_after_erase("/nodes/2/id"), "[graph] nodes[2] (mm_1): field 'id' is missing");
  EXPECT_EQ(error_after_erase("/nodes/2/name"), "[graph] node 2: field 'name' is missing");
  EXPECT_EQ(error_after_erase("/nodes/2/kind"), "[graph] node 2 (mm_1): field 'kind' is missing");
  EXPECT_EQ(error_after_erase("/nodes/2/target"),
            "[graph] node 2 (mm_1): field 'target' is missing");
}

TEST(JsonReader, RejectsUnknownNodeFields) {
  EXPECT_EQ(error_after_set("/nodes/2/argz", "[]"),
            "[graph] node 2 (mm_1): field 'argz' is not a field of a node");
}

struct TypeCase {
  const char* pointer;
  const char* json;
  const char* message;
};

TEST(JsonReader, RejectsWrongJsonTypesForEveryNodeField) {
  const TypeCase cases[] = {
      {"/nodes/2/id", R"("2")", "[graph] nodes[2] (mm_1): field 'id': expected an integer, got a string"},
      {"/nodes/2/id", "2.5", "[graph] nodes[2] (mm_1): field 'id': expected an integer, got a non-integer number"},
      {"/nodes/2/name", "2", "[graph] node 2: field 'name': expected a string, got an integer"},
      {"/nodes/2/kind", "1", "[graph] node 2 (mm_1): field 'kind': expected a string, got an integer"},
      {"/nodes/2/target", "null", "[graph] node 2 (mm_1): field 'target': expected a string, got null"},
      {"/nodes/2/args", "{}", "[graph] node 2 (mm_1): field 'args': expected an array, got an object"},
      {"/nodes/2/kwargs", "[]", "[graph] node 2 (mm_1): field 'kwargs': expected an object, got an array"},
      {"/nodes/2/phase", "true", "[graph] node 2 (mm_1): field 'phase': expected a string, got a boolean"},
      {"/nodes/2/module_stack", R"("model")", "[graph] node 2 (mm_1): field 'module_stack': expected an array, got a string"},
      {"/nodes/2/module_stack/0", "0", "[graph] node 2 (mm_1): field 'module_stack[0]': expected a string, got an integer"},
      {"/nodes/2/value", R"("tensor")", "[graph] node 2 (mm_1): field 'value': expected an object, got a string"},
      {"/nodes/2/time_ms", R"("fast")", "[graph] node 2 (mm_1): field 'time_ms': expected a number, got a string"},
      {"/nodes/2/cpu_ms", "[]", "[graph] node 2 (mm_1): field 'cpu_ms': expected a number, got an array"},
      {"/nodes/2/recompute", "1", "[graph] node 2 (mm_1): field 'recompute': expected a boolean, got an integer"},
      {"/nodes/2/frees", "3", "[graph] node 2 (mm_1): field 'frees': expected an array, got an integer"},
      {"/nodes/2/frees", "[1.5]", "[graph] node 2 (mm_1): field 'frees[0]': expected an integer, got a non-integer number"},
      {"/nodes/2/value/type", "3", "[graph] node 2 (mm_1): field 'value.type': expected a string, got an integer"},
      {"/nodes/2/value/dtype", "4", "[graph] node 2 (mm_1): field 'value.dtype': expected a string, got an integer"},
      {"/nodes/2/value/element_size", "4.0", "[graph] node 2 (mm_1): field 'value.element_size': expected an integer, got a non-integer number"},
      {"/nodes/2/value/sizes", "{}", "[graph] node 2 (mm_1): field 'value.sizes': expected an array, got an object"},
      {"/nodes/2/value/sizes/0", R"("2")", "[graph] node 2 (mm_1): field 'value.sizes[0]': expected an integer or a {\"sym\", \"hint\"} object, got a string"},
      {"/nodes/2/value/strides", "{}", "[graph] node 2 (mm_1): field 'value.strides': expected an array, got an object"},
      {"/nodes/2/value/contiguous", R"("yes")", "[graph] node 2 (mm_1): field 'value.contiguous': expected a boolean, got a string"},
      {"/nodes/2/value/storage", R"("5")", "[graph] node 2 (mm_1): field 'value.storage': expected an integer, got a string"},
      {"/nodes/2/value/device", "0", "[graph] node 2 (mm_1): field 'value.device': expected a string, got an integer"},
      {"/nodes/2/value/dtensor", "1", "[graph] node 2 (mm_1): field 'value.dtensor': expected a boolean, got an integer"},
      {"/nodes/2/args/0/node", R"("0")", "[graph] node 2 (mm_1): field 'args[0].node': expected an integer, got a string"},
  };
  for (const TypeCase& c : cases) {
    EXPECT_EQ(error_after_set(c.pointer, c.json), c.message) << c.pointer << " = " << c.json;
  }
}

TEST(JsonReader, RejectsNumbersOutsideInt64) {
  EXPECT_EQ(error_after_set("/nodes/2/id", "9223372036854775808"),
            "[graph] nodes[2] (mm_1): field 'id': 9223372036854775808 is out of the int64 range");
  EXPECT_EQ(error_after_set("/nodes/3/args/1", "18446744073709551615"),
            "[graph] node 3 (add): field 'args[1]': 18446744073709551615 is out of the int64 range");
  // Integer literals past uint64 (which nlohmann would read as doubles).
  std::string text = base_document().dump();
  text.replace(text.find(R"("alpha":1)"), 9, R"("alpha":123456789012345678901234567890)");
  EXPECT_EQ(parse_error(text),
            "[graph] field 'nodes[3].kwargs.alpha': integer 123456789012345678901234567890 is out "
            "of the int64 range");
  text = base_document().dump();
  text.replace(text.find(R"([{"node":3}])"), 12, R"([{"node":3},-99999999999999999999])");
  EXPECT_EQ(parse_error(text),
            "[graph] field 'nodes[4].args[0][1]': integer -99999999999999999999 is out of the "
            "int64 range");
  EXPECT_EQ(error_after_set("/nodes/2/value/storage", "1e30"),
            "[graph] node 2 (mm_1): field 'value.storage': expected an integer, got a non-integer "
            "number");
  EXPECT_EQ(error_after_set("/nodes/2/value/element_size", "4294967300"),
            "[graph] node 2 (mm_1): field 'value.element_size': 4294967300 is out of range");
  // The extremes of int64 themselves are fine.
  Json doc = base_document();
  doc["nodes"][3]["args"][1] = -9223372036854775807LL - 1;
  doc["nodes"][2]["value"]["storage"] = 9223372036854775807LL;
  Graph g = parse_graph(doc.dump());
  EXPECT_EQ(g.nodes[3].args[1].i, INT64_MIN);
}

TEST(JsonReader, RejectsDuplicateIds) {
  EXPECT_EQ(error_after_set("/nodes/3/id", "1"),
            "[graph] node 1 (add): field 'id': duplicate id 1, also used by nodes[1] (w)");
}

TEST(JsonReader, RejectsNegativeIds) {
  EXPECT_EQ(error_after_set("/nodes/1/id", "-1"),
            "[graph] node -1 (w): field 'id': must be non-negative, got -1");
}

TEST(JsonReader, RejectsDuplicateAndEmptyNames) {
  EXPECT_EQ(error_after_set("/nodes/3/name", R"("mm_1")"),
            "[graph] node 3 (mm_1): field 'name': duplicate name 'mm_1', also used by node 2 (mm_1)");
  EXPECT_EQ(error_after_set("/nodes/3/name", R"("")"), "[graph] node 3: field 'name' is empty");
}

TEST(JsonReader, RejectsUnknownKindAndPhase) {
  EXPECT_EQ(error_after_set("/nodes/2/kind", R"("call_fn")"),
            "[graph] node 2 (mm_1): field 'kind': unknown node kind 'call_fn'");
  EXPECT_EQ(error_after_set("/nodes/2/phase", R"("sideways")"),
            "[graph] node 2 (mm_1): field 'phase': unknown phase 'sideways'");
}

TEST(JsonReader, ReadsAndWritesTheOptimizerPhase) {
  Json doc = base_document();
  doc["nodes"][2]["phase"] = "optimizer";
  const Graph graph = parse_graph(doc.dump());
  EXPECT_EQ(graph.nodes[2].phase, Phase::kOptimizer);
  EXPECT_EQ(to_string(Phase::kOptimizer), "optimizer");
  EXPECT_EQ(parse_graph(write_graph(graph)), graph);
}

TEST(JsonReader, RejectsDanglingReferences) {
  EXPECT_EQ(error_after_set("/nodes/2/args/0", R"({"node": 99})"),
            "[graph] node 2 (mm_1): field 'args[0]' refers to unknown node 99");
  EXPECT_EQ(error_after_set("/nodes/4/args/0/0", R"({"node": 99})"),
            "[graph] node 4 (output): field 'args[0][0]' refers to unknown node 99");
  EXPECT_EQ(error_after_set("/nodes/3/kwargs/alpha", R"({"node": -5})"),
            "[graph] node 3 (add): field 'kwargs.alpha' refers to unknown node -5");
}

TEST(JsonReader, RejectsForwardReferencesAndCycles) {
  EXPECT_EQ(error_after_set("/nodes/2/args/1", R"({"node": 3})"),
            "[graph] node 2 (mm_1): field 'args[1]' refers to node 3 (add), which does not come "
            "earlier (a forward reference or a cycle)");
  EXPECT_EQ(error_after_set("/nodes/2/args/1", R"({"node": 2})"),
            "[graph] node 2 (mm_1): field 'args[1]' refers to node 2 (mm_1), which does not come "
            "earlier (a forward reference or a cycle)");
}

TEST(JsonReader, RejectsNodeInputsOfPlaceholdersAndGetAttrs) {
  EXPECT_EQ(error_after_set("/nodes/1/args", R"([[{"node": 0}]])"),
            "[graph] node 1 (w): field 'args[0][0]': a get_attr node takes no node inputs, got a "
            "reference to node 0");
  Json doc = base_document();
  doc["nodes"][0]["kwargs"] = Json::parse(R"({"default": {"node": 4}})");
  EXPECT_EQ(parse_error(doc.dump()),
            "[graph] node 0 (x): field 'kwargs.default': a placeholder node takes no node inputs, "
            "got a reference to node 4");
  // Literal arguments (an FX placeholder's default) are fine.
  EXPECT_EQ(error_after_set("/nodes/0/args", "[1.5, null]"), "");
}

TEST(JsonReader, RejectsAnOutputNodeThatIsNotLast) {
  Json doc = base_document();
  std::swap(doc["nodes"][3], doc["nodes"][4]);
  doc["nodes"][3]["args"] = Json::parse(R"([[{"node": 2}]])");
  EXPECT_EQ(parse_error(doc.dump()),
            "[graph] node 4 (output): an output node must be the last node, but 1 node(s) follow it");
}

TEST(JsonReader, RejectsTwoOutputNodes) {
  Json doc = base_document();
  Json second = doc["nodes"][4];
  second["id"] = 5;
  second["name"] = "output_1";
  doc["nodes"].push_back(second);
  EXPECT_EQ(parse_error(doc.dump()),
            "[graph] node 4 (output): an output node must be the last node, but 1 node(s) follow it");
}

TEST(JsonReader, RejectsBadDims) {
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/0", "-2"),
            "[graph] node 2 (mm_1): field 'value.sizes[0]': negative size -2");
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1", R"({"hint": 3})"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].sym' is missing");
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1", R"({"sym": "", "hint": 3})"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].sym': is empty (a concrete size is a "
            "plain integer)");
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1", R"({"sym": 0, "hint": 3})"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].sym': expected a string, got an integer");
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1/hint", "3.5"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].hint': expected an integer, got a "
            "non-integer number");
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1/hint", R"("3")"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].hint': expected an integer, got a string");
  EXPECT_EQ(error_after_erase("/nodes/2/value/sizes/1/hint"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].hint' is missing");
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1/hint", "-3"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].hint': negative size hint -3");
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1/stride", "1"),
            "[graph] node 2 (mm_1): field 'value.sizes[1].stride' is not a field of a symbolic "
            "integer");
  // Unbacked sizes and negative strides are representable.
  EXPECT_EQ(error_after_set("/nodes/2/value/sizes/1/hint", "null"), "");
  EXPECT_EQ(error_after_set("/nodes/0/value/strides/1", "-1"), "");
}

TEST(JsonReader, RejectsElementSizeNotPositive) {
  EXPECT_EQ(error_after_set("/nodes/0/value/element_size", "0"),
            "[graph] node 0 (x): field 'value.element_size': must be > 0, got 0");
  EXPECT_EQ(error_after_set("/nodes/0/value/element_size", "-4"),
            "[graph] node 0 (x): field 'value.element_size': must be > 0, got -4");
}

TEST(JsonReader, RejectsStridesOfTheWrongRank) {
  EXPECT_EQ(error_after_set("/nodes/0/value/strides", "[1]"),
            "[graph] node 0 (x): field 'value.strides': has 1 entries for a tensor of rank 2");
}

TEST(JsonReader, RejectsBadStorage) {
  EXPECT_EQ(error_after_set("/nodes/0/value/storage", "-1"),
            "[graph] node 0 (x): field 'value.storage': must be >= 0 or null, got -1");
  EXPECT_EQ(error_after_set("/nodes/0/value/storage", "[0]"),
            "[graph] node 0 (x): field 'value.storage': expected an integer, got an array");
}

TEST(JsonReader, RejectsMissingTensorFields) {
  EXPECT_EQ(error_after_erase("/nodes/1/value/dtype"),
            "[graph] node 1 (w): field 'value.dtype' is missing");
  EXPECT_EQ(error_after_erase("/nodes/1/value/element_size"),
            "[graph] node 1 (w): field 'value.element_size' is missing");
  EXPECT_EQ(error_after_erase("/nodes/1/value/sizes"),
            "[graph] node 1 (w): field 'value.sizes' is missing");
  EXPECT_EQ(error_after_set("/nodes/1/value/shape", "[]"),
            "[graph] node 1 (w): field 'value.shape' is not a field of a tensor value");
}

TEST(JsonReader, RejectsBadValues) {
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({"type": "tuple"})"),
            "[graph] node 3 (add): field 'value.type': unknown value type 'tuple'");
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({})"),
            "[graph] node 3 (add): field 'value.type' is missing");
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({"type": "none", "repr": "None"})"),
            "[graph] node 3 (add): field 'value.repr' is not a field of a none value");
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({"type": "sequence"})"),
            "[graph] node 3 (add): field 'value.elements' is missing");
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({"type": "sequence", "elements": [{"type": "x"}]})"),
            "[graph] node 3 (add): field 'value.elements[0].type': unknown value type 'x'");
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({"type": "sym_int", "value": {"sym": "s1"}})"),
            "[graph] node 3 (add): field 'value.value.hint' is missing");
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({"type": "scalar"})"),
            "[graph] node 3 (add): field 'value.repr' is missing");
  EXPECT_EQ(error_after_set("/nodes/3/value", R"({"type": "other", "repr": 1})"),
            "[graph] node 3 (add): field 'value.repr': expected a string, got an integer");
}

TEST(JsonReader, RejectsMalformedObjectArgs) {
  EXPECT_EQ(error_after_set("/nodes/3/args/1", R"({})"),
            "[graph] node 3 (add): field 'args[1]': an object argument needs one of the keys "
            "'node', 'sym', 'other' or 'float'");
  EXPECT_EQ(error_after_set("/nodes/3/args/1", R"({"node": 2, "index": 0})"),
            "[graph] node 3 (add): field 'args[1].index' is not a field of a node reference");
  EXPECT_EQ(error_after_set("/nodes/3/args/1", R"({"other": 3})"),
            "[graph] node 3 (add): field 'args[1].other': expected a string, got an integer");
  EXPECT_EQ(error_after_set("/nodes/3/args/1", R"({"float": "Infinity"})"),
            "[graph] node 3 (add): field 'args[1].float': expected 'inf', '-inf' or 'nan', got "
            "'Infinity'");
  EXPECT_EQ(error_after_set("/nodes/3/args/1", R"({"sym": "s0"})"),
            "[graph] node 3 (add): field 'args[1].hint' is missing");
}

TEST(JsonReader, RejectsKwargsThatAreNotAnObject) {
  EXPECT_EQ(error_after_set("/nodes/3/kwargs", R"([["alpha", 1]])"),
            "[graph] node 3 (add): field 'kwargs': expected an object, got an array");
}

TEST(JsonReader, RejectsMalformedSchemas) {
  const TypeCase cases[] = {
      {"/ops/aten.mm.default", "[]", "[graph] op 'aten.mm.default': field '': expected an object, got an array"},
      {"/ops/aten.mm.default/namespace", "1", "[graph] op 'aten.mm.default': field 'namespace': expected a string, got an integer"},
      {"/ops/aten.mm.default/namespace", R"("")", "[graph] op 'aten.mm.default': field 'namespace' is empty"},
      {"/ops/aten.mm.default/mutable", "0", "[graph] op 'aten.mm.default': field 'mutable': expected a boolean, got an integer"},
      {"/ops/aten.mm.default/view", "null", "[graph] op 'aten.mm.default': field 'view': expected a boolean, got null"},
      {"/ops/aten.mm.default/pointwise", "1", "[graph] op 'aten.mm.default': field 'pointwise': expected a boolean, got an integer"},
      {"/ops/aten.mm.default/random", R"("no")", "[graph] op 'aten.mm.default': field 'random': expected a boolean, got a string"},
      {"/ops/aten.mm.default/arguments", "{}", "[graph] op 'aten.mm.default': field 'arguments': expected an array, got an object"},
      {"/ops/aten.mm.default/arguments/1", R"("mat2")", "[graph] op 'aten.mm.default': field 'arguments[1]': expected an object, got a string"},
      {"/ops/aten.mm.default/arguments/1", "{}", "[graph] op 'aten.mm.default': field 'arguments[1].name' is missing"},
      {"/ops/aten.mm.default/arguments/1/name", "2", "[graph] op 'aten.mm.default': field 'arguments[1].name': expected a string, got an integer"},
      {"/ops/aten.mm.default/arguments/1/name", R"("")", "[graph] op 'aten.mm.default': field 'arguments[1].name' is empty"},
      {"/ops/aten.mm.default/arguments/1/name", R"("self")", "[graph] op 'aten.mm.default': field 'arguments[1].name': duplicate argument name 'self' (also arguments[0])"},
      {"/ops/aten.mm.default/arguments/1/kwarg_only", R"("no")", "[graph] op 'aten.mm.default': field 'arguments[1].kwarg_only': expected a boolean, got a string"},
      {"/ops/aten.mm.default/arguments/1/write", "1", "[graph] op 'aten.mm.default': field 'arguments[1].write': expected a boolean, got an integer"},
      {"/ops/aten.mm.default/arguments/1/type", R"("Tensor")", "[graph] op 'aten.mm.default': field 'arguments[1].type' is not a field of a schema argument"},
      {"/ops/aten.mm.default/overload", R"("default")", "[graph] op 'aten.mm.default': field 'overload' is not a field of an op schema"},
  };
  for (const TypeCase& c : cases) {
    EXPECT_EQ(error_after_set(c.pointer, c.json), c.message) << c.pointer << " = " << c.json;
  }
  EXPECT_EQ(error_after_erase("/ops/aten.mm.default/namespace"),
            "[graph] op 'aten.mm.default': field 'namespace' is missing");
}

TEST(JsonReader, RejectsCallsThatBreakTheirSchema) {
  EXPECT_EQ(error_after_set("/nodes/3/kwargs/beta", "2"),
            "[graph] node 3 (add): field 'kwargs.beta': the schema of 'aten.add.Tensor' has no "
            "argument 'beta'");
  EXPECT_EQ(error_after_set("/nodes/3/args/2", "1"),
            "[graph] node 3 (add): field 'args': 3 positional arguments, but the schema of "
            "'aten.add.Tensor' takes at most 2");
  // A kwarg naming a positional argument is fine; so is a target without a schema.
  EXPECT_EQ(error_after_set("/nodes/3/kwargs/other", "1"), "");
  EXPECT_EQ(error_after_set("/nodes/3/target", R"("aten.add.Scalar")"), "");
}

TEST(JsonReader, RejectsDuplicateKeys) {
  std::string text = base_document().dump();
  std::string with_two_ids = text;
  with_two_ids.replace(with_two_ids.find(R"("id":2)"), 6, R"("id":2,"id":7)");
  EXPECT_EQ(parse_error(with_two_ids), "[graph] field 'nodes[2]' has the key 'id' twice");
  std::string with_two_alphas = text;
  with_two_alphas.replace(with_two_alphas.find(R"("alpha":1)"), 9, R"("alpha":1,"alpha":2)");
  EXPECT_EQ(parse_error(with_two_alphas), "[graph] field 'nodes[3].kwargs' has the key 'alpha' twice");
  std::string with_two_versions = R"({"version":1,"format":"spillway.graph","version":1,"nodes":[]})";
  EXPECT_EQ(parse_error(with_two_versions), "[graph] the top-level object has the key 'version' twice");
}

TEST(JsonReader, RejectsDuplicateKeysInLargeObjects) {
  // Objects past a few members are checked through a hash set; same verdict.
  Json doc = base_document();
  for (int i = 0; i < 40; ++i) doc["metadata"]["key" + std::to_string(i)] = "v";
  std::string text = doc.dump();
  EXPECT_EQ(parse_error(text), "");
  text.replace(text.find(R"("key39":"v")"), 11, R"("key39":"v","key7":"w")");
  EXPECT_EQ(parse_error(text), "[graph] field 'metadata' has the key 'key7' twice");
}

TEST(JsonReader, WideObjectsAndSchemasCostLinearTime) {
  // 100k kwargs on one node and a 100k-argument schema: a quadratic duplicate
  // or schema check would take minutes here, a linear one well under a second.
  constexpr int kWide = 100000;
  // Spliced as text: building a wide ordered_json is itself quadratic.
  std::string wide_kwargs, wide_arguments;
  for (int i = 0; i < kWide; ++i) {
    std::string name = "\"k" + std::to_string(i) + "\"";
    wide_kwargs += "," + name + ":" + std::to_string(i);
    wide_arguments += R"(,{"name":)" + name + R"(,"kwarg_only":true})";
  }
  std::string text = base_document().dump();
  const std::string alpha_argument = R"({"name":"alpha","kwarg_only":true})";
  const std::string alpha_kwarg = R"("alpha":1)";
  text.insert(text.find(alpha_argument) + alpha_argument.size(), wide_arguments);
  text.insert(text.find(alpha_kwarg) + alpha_kwarg.size(), wide_kwargs);
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(parse_error(text), "");
  std::string duplicate = text;
  duplicate.replace(duplicate.find(R"("k99999":99999)"), 14, R"("k99999":99999,"k5":0)");
  EXPECT_EQ(parse_error(duplicate), "[graph] field 'nodes[3].kwargs' has the key 'k5' twice");
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 20.0);
}

TEST(JsonReader, RejectsNestingBeyondTheLimit) {
  std::string deep = "1";
  for (int i = 0; i < 65; ++i) deep = "[" + deep + "]";
  std::string error = error_after_set("/nodes/3/args/1", deep);
  EXPECT_EQ(error.rfind("[graph] node 3 (add): field 'args[1]", 0), 0u) << error;
  EXPECT_NE(error.find("nests deeper than 64"), std::string::npos) << error;
  // Very deep JSON must not overflow the stack either (spliced into the text:
  // nlohmann's own dump() would recurse).
  std::string text = base_document().dump();
  std::string very_deep = std::string(100000, '[') + std::string(100000, ']');
  text.replace(text.find(R"("alpha":1)"), 9, "\"alpha\":" + very_deep);
  EXPECT_EQ(parse_error(text).rfind("[graph] node 3 (add): field 'kwargs.alpha[0][0]", 0), 0u);
  std::string sixty_four = "1";
  for (int i = 0; i < 64; ++i) sixty_four = "[" + sixty_four + "]";
  EXPECT_EQ(error_after_set("/nodes/3/args/1", sixty_four), "");
}

TEST(JsonReader, RejectsNegativeOrNonFiniteTime) {
  EXPECT_EQ(error_after_set("/nodes/2/time_ms", "-0.5"),
            "[graph] node 2 (mm_1): field 'time_ms': must be a finite number >= 0, got -0.500000");
  std::string text = base_document().dump();
  text.replace(text.find(R"("time_ms":0.5)"), 13, R"("time_ms":1e400)");
  EXPECT_EQ(parse_error(text), "[graph] not valid JSON: number overflow parsing '1e400'");
  EXPECT_EQ(error_after_set("/nodes/2/time_ms", "null"), "");
  EXPECT_EQ(error_after_set("/nodes/2/cpu_ms", "-1"),
            "[graph] node 2 (mm_1): field 'cpu_ms': must be a finite number >= 0, got -1.000000");
  EXPECT_EQ(error_after_set("/nodes/2/cpu_ms", "0.02"), "");
  EXPECT_EQ(error_after_set("/nodes/2/cpu_ms", "null"), "");
}

}  // namespace
}  // namespace spillway
