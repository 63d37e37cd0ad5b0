// write_graph: Graph -> JSON text in the format of docs/graph-format.md.
// Fields are always written in the documented order, with defaults spelled
// out, so two writes of equal graphs are byte-identical.

#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "spillway/graph.h"

namespace spillway {
namespace {

using Json = nlohmann::ordered_json;

Json dim_json(const SymSize& dim) {
  if (dim.is_concrete()) return *dim.hint;  // verify_graph guarantees the value
  Json out = Json::object();
  out["sym"] = dim.symbol;
  out["hint"] = dim.hint ? Json(*dim.hint) : Json(nullptr);
  return out;
}

Json dims_json(const std::vector<SymSize>& dims) {
  Json out = Json::array();
  for (const SymSize& dim : dims) out.push_back(dim_json(dim));
  return out;
}

Json arg_json(const Arg& arg) {
  switch (arg.kind) {
    case Arg::Kind::kNone:
      return nullptr;
    case Arg::Kind::kBool:
      return arg.b;
    case Arg::Kind::kInt:
      return arg.i;
    case Arg::Kind::kDouble:
      // JSON has no inf/nan; they take a tagged form (graph-format.md, Arg).
      if (std::isnan(arg.d)) return Json{{"float", "nan"}};
      if (std::isinf(arg.d)) return Json{{"float", arg.d > 0 ? "inf" : "-inf"}};
      return arg.d;
    case Arg::Kind::kString:
      return arg.s;
    case Arg::Kind::kNode:
      return Json{{"node", arg.node}};
    case Arg::Kind::kList: {
      Json out = Json::array();
      for (const Arg& item : arg.list) out.push_back(arg_json(item));
      return out;
    }
    case Arg::Kind::kSymInt:
      return dim_json(arg.sym);
    case Arg::Kind::kOther:
      return Json{{"other", arg.s}};
  }
  return nullptr;  // unreachable for a verified graph
}

Json value_json(const Value& value) {
  Json out = Json::object();
  switch (value.kind) {
    case ValueKind::kNone:
      out["type"] = "none";
      break;
    case ValueKind::kTensor: {
      const TensorInfo& t = value.tensor;
      out["type"] = "tensor";
      out["dtype"] = t.dtype;
      out["element_size"] = t.element_size;
      out["sizes"] = dims_json(t.sizes);
      // Empty strides mean "unknown", except on a rank-0 tensor where [] is exact.
      out["strides"] = t.strides.empty() && !t.sizes.empty() ? Json(nullptr) : dims_json(t.strides);
      out["contiguous"] = t.contiguous;
      out["storage"] = t.storage ? Json(*t.storage) : Json(nullptr);
      out["device"] = t.device;
      out["dtensor"] = t.dtensor_like;
      break;
    }
    case ValueKind::kSequence: {
      out["type"] = "sequence";
      Json elements = Json::array();
      for (const Value& element : value.elements) elements.push_back(value_json(element));
      out["elements"] = std::move(elements);
      break;
    }
    case ValueKind::kSymInt:
      out["type"] = "sym_int";
      out["value"] = dim_json(value.scalar);
      break;
    case ValueKind::kScalar:
      out["type"] = "scalar";
      out["repr"] = value.repr;
      break;
    case ValueKind::kOther:
      out["type"] = "other";
      out["repr"] = value.repr;
      break;
  }
  return out;
}

Json schema_json(const OpSchema& schema) {
  Json out = Json::object();
  out["namespace"] = schema.ns;
  out["mutable"] = schema.is_mutable;
  out["view"] = schema.is_view;
  // Written only when true, so graphs without the tags read and write as before.
  if (schema.is_pointwise) out["pointwise"] = true;
  if (schema.is_random) out["random"] = true;
  Json arguments = Json::array();
  for (const OpArgument& argument : schema.arguments) {
    Json a = Json::object();
    a["name"] = argument.name;
    if (argument.kwarg_only) a["kwarg_only"] = true;
    if (argument.is_write) a["write"] = true;
    arguments.push_back(std::move(a));
  }
  out["arguments"] = std::move(arguments);
  return out;
}

Json node_json(const Node& node) {
  Json out = Json::object();
  out["id"] = node.id;
  out["name"] = node.name;
  out["kind"] = to_string(node.kind);
  out["target"] = node.target;
  Json args = Json::array();
  for (const Arg& arg : node.args) args.push_back(arg_json(arg));
  out["args"] = std::move(args);
  Json kwargs = Json::object();
  // Keys are unique (verified), so append rather than let ordered_map search.
  auto& kwarg_slots = static_cast<Json::object_t::Container&>(kwargs.get_ref<Json::object_t&>());
  for (const auto& [key, arg] : node.kwargs) kwarg_slots.emplace_back(key, arg_json(arg));
  out["kwargs"] = std::move(kwargs);
  out["phase"] = to_string(node.phase);
  out["module_stack"] = node.module_stack;
  out["value"] = value_json(node.value);
  if (node.time_ms) out["time_ms"] = *node.time_ms;
  if (node.recompute) out["recompute"] = true;
  if (!node.frees.empty()) out["frees"] = node.frees;
  if (node.cpu_ms) out["cpu_ms"] = *node.cpu_ms;
  return out;
}

// Layout: compact, or with one op and one node per line so that diffs of two
// graphs read node by node.
class Layout {
 public:
  explicit Layout(bool pretty) : pretty_(pretty) {}
  const char* open_line() const { return pretty_ ? "\n  " : ""; }
  const char* item_line() const { return pretty_ ? "\n    " : ""; }
  const char* colon() const { return pretty_ ? ": " : ":"; }

 private:
  bool pretty_;
};

void append_string(std::string& out, const std::string& text) { out += Json(text).dump(); }

}  // namespace

std::string write_graph(const Graph& graph, bool pretty) {
  verify_graph(graph);  // a written graph always loads again
  Layout layout(pretty);
  std::string out = "{";
  auto field = [&](const char* name, bool first = false) {
    if (!first) out += ',';
    out += layout.open_line();
    out += '"';
    out += name;
    out += '"';
    out += layout.colon();
  };
  field("format", true);
  out += "\"spillway.graph\"";
  field("version");
  out += std::to_string(Graph::kFormatVersion);
  field("name");
  append_string(out, graph.name);
  field("metadata");
  Json metadata = Json::object();
  auto& metadata_slots =
      static_cast<Json::object_t::Container&>(metadata.get_ref<Json::object_t&>());
  for (const auto& [key, value] : graph.metadata) metadata_slots.emplace_back(key, value);
  out += metadata.dump();

  field("ops");
  out += '{';
  bool first = true;
  for (const auto& [target, schema] : graph.ops) {
    if (!first) out += ',';
    first = false;
    out += layout.item_line();
    append_string(out, target);
    out += layout.colon();
    out += schema_json(schema).dump();
  }
  if (!graph.ops.empty()) out += layout.open_line();
  out += '}';

  field("nodes");
  out += '[';
  for (std::size_t i = 0; i < graph.nodes.size(); ++i) {
    if (i > 0) out += ',';
    out += layout.item_line();
    out += node_json(graph.nodes[i]).dump();
  }
  if (!graph.nodes.empty()) out += layout.open_line();
  out += ']';
  if (pretty) out += '\n';
  out += "}\n";
  return out;
}

}  // namespace spillway
