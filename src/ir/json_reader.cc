// parse_graph: JSON text -> Graph. This file checks the JSON shape (types,
// required and unknown fields, enum spellings, int64 range) and leaves every
// invariant of graph.h to verify_graph, which it calls last.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "ir/field_path.h"
#include "ir/json_dom.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

using ir::Json;
using ir::FieldPath;

constexpr std::string_view kFormatName = "spillway.graph";

std::string describe(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a non-integer number";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "an unsupported JSON value";
  }
}

std::string in_quotes(std::string_view text) { return "'" + std::string(text) + "'"; }

class Reader {
 public:
  Graph read(Json& root) {
    if (!root.is_object()) {
      ir::fail_whole("", "expected a JSON object at the top level, got " + describe(root));
    }
    Graph graph;
    FieldPath top;
    // format and version first: a file from another format or version should be
    // told so, not about the first field it does not know.
    auto format = root.find("format");
    if (format == root.end()) ir::fail_at("", top.field("format"), " is missing");
    std::string format_name = string_of(*format, top.field("format"));
    if (format_name != kFormatName) {
      ir::fail_at("", top.field("format"),
                  ": expected " + in_quotes(kFormatName) + ", got " + in_quotes(format_name));
    }
    auto version = root.find("version");
    if (version == root.end()) ir::fail_at("", top.field("version"), " is missing");
    std::int64_t version_number = int_of(*version, top.field("version"));
    if (version_number != Graph::kFormatVersion) {
      ir::fail_at("", top.field("version"),
                  ": expected " + std::to_string(Graph::kFormatVersion) + ", got " +
                      std::to_string(version_number));
    }
    bool has_nodes = false;
    for (auto& [key, value] : root.items()) {
      if (key == "format" || key == "version") {
        continue;
      } else if (key == "name") {
        graph.name = std::move(string_of(value, top.field("name")));
      } else if (key == "metadata") {
        read_metadata(value, graph.metadata);
      } else if (key == "ops") {
        read_ops(value, graph.ops);
      } else if (key == "nodes") {
        has_nodes = true;
        read_nodes(value, graph.nodes);
      } else {
        ir::fail_at("", top.field(key), " is not a field of a graph");
      }
    }
    if (!has_nodes) ir::fail_at("", top.field("nodes"), " is missing");
    return graph;
  }

 private:
  // ---- scalars: each names the field at fault -------------------------------

  [[noreturn]] void type_error(const Json& j, const FieldPath& path, std::string_view expected) {
    ir::fail_at(where_, path, ": expected " + std::string(expected) + ", got " + describe(j));
  }

  // The string at j; callers that keep it move it out of the DOM.
  std::string& string_of(Json& j, const FieldPath& path) {
    if (!j.is_string()) type_error(j, path, "a string");
    return j.get_ref<std::string&>();
  }

  bool bool_of(Json& j, const FieldPath& path) {
    if (!j.is_boolean()) type_error(j, path, "a boolean");
    return j.get<bool>();
  }

  // JSON integers outside int64 arrive as uint64 (up to 2^64-1) or as floats;
  // both are rejected rather than wrapped.
  std::int64_t int_of(Json& j, const FieldPath& path) {
    if (j.is_number_unsigned()) {
      auto value = j.get<std::uint64_t>();
      if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        ir::fail_at(where_, path, ": " + std::to_string(value) + " is out of the int64 range");
      }
      return static_cast<std::int64_t>(value);
    }
    if (j.is_number_integer()) return j.get<std::int64_t>();
    type_error(j, path, "an integer");
  }

  double number_of(Json& j, const FieldPath& path) {
    if (!j.is_number()) type_error(j, path, "a number");
    return j.get<double>();
  }

  Json& object_of(Json& j, const FieldPath& path) {
    if (!j.is_object()) type_error(j, path, "an object");
    return j;
  }

  Json& array_of(Json& j, const FieldPath& path) {
    if (!j.is_array()) type_error(j, path, "an array");
    return j;
  }

  [[noreturn]] void unknown_field(const FieldPath& path, std::string_view owner) {
    ir::fail_at(where_, path, " is not a field of " + std::string(owner));
  }

  [[noreturn]] void missing(const FieldPath& path) { ir::fail_at(where_, path, " is missing"); }

  // ---- top-level sections --------------------------------------------------

  void read_metadata(Json& j, std::map<std::string, std::string>& out) {
    FieldPath path = FieldPath("metadata");
    for (auto& [key, value] : object_of(j, path).items()) {
      out.emplace(key, std::move(string_of(value, path.field(key))));
    }
  }

  void read_ops(Json& j, std::map<std::string, OpSchema>& out) {
    for (auto& [target, value] : object_of(j, FieldPath("ops")).items()) {
      where_ = "op " + in_quotes(target);
      out.emplace(target, read_schema(value));
    }
    where_.clear();
  }

  OpSchema read_schema(Json& j) {
    FieldPath root;
    if (!j.is_object()) type_error(j, root, "an object");
    OpSchema schema;
    bool has_namespace = false;
    for (auto& [key, value] : j.items()) {
      if (key == "namespace") {
        has_namespace = true;
        schema.ns = std::move(string_of(value, root.field(key)));
      } else if (key == "mutable") {
        schema.is_mutable = bool_of(value, root.field(key));
      } else if (key == "view") {
        schema.is_view = bool_of(value, root.field(key));
      } else if (key == "pointwise") {
        schema.is_pointwise = bool_of(value, root.field(key));
      } else if (key == "random") {
        schema.is_random = bool_of(value, root.field(key));
      } else if (key == "arguments") {
        FieldPath arguments = root.field(key);
        Json& list = array_of(value, arguments);
        schema.arguments.reserve(list.size());
        for (std::size_t i = 0; i < list.size(); ++i) {
          schema.arguments.push_back(read_op_argument(list[i], arguments.index(i)));
        }
      } else {
        unknown_field(root.field(key), "an op schema");
      }
    }
    if (!has_namespace) missing(root.field("namespace"));
    return schema;
  }

  OpArgument read_op_argument(Json& j, const FieldPath& path) {
    OpArgument argument;
    bool has_name = false;
    for (auto& [key, value] : object_of(j, path).items()) {
      if (key == "name") {
        has_name = true;
        argument.name = std::move(string_of(value, path.field(key)));
      } else if (key == "kwarg_only") {
        argument.kwarg_only = bool_of(value, path.field(key));
      } else if (key == "write") {
        argument.is_write = bool_of(value, path.field(key));
      } else {
        unknown_field(path.field(key), "a schema argument");
      }
    }
    if (!has_name) missing(path.field("name"));
    return argument;
  }

  void read_nodes(Json& j, std::vector<Node>& out) {
    Json& list = array_of(j, FieldPath("nodes"));
    out.reserve(list.size());
    for (std::size_t i = 0; i < list.size(); ++i) out.push_back(read_node(list[i], i));
    where_.clear();
  }

  // ---- nodes ---------------------------------------------------------------

  // "node 12 (mm_3)" once id and name are known to be well-typed, else
  // "nodes[3]": every later error about this node starts with it.
  void label_node(Json& j, std::size_t index) {
    auto id = j.find("id");
    auto name = j.find("name");
    bool id_ok = id != j.end() && id->is_number_integer() &&
                 !(id->is_number_unsigned() &&
                   id->get<std::uint64_t>() >
                       static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
    std::string_view name_text;
    if (name != j.end() && name->is_string()) name_text = name->get_ref<const std::string&>();
    if (id_ok) {
      where_ = ir::node_label(id->get<std::int64_t>(), name_text);
    } else {
      where_ = "nodes[" + std::to_string(index) + "]";
      if (!name_text.empty()) where_ += " (" + std::string(name_text) + ")";
    }
  }

  Node read_node(Json& j, std::size_t index) {
    where_.clear();
    FieldPath nodes("nodes");
    if (!j.is_object()) type_error(j, nodes.index(index), "an object");
    label_node(j, index);
    FieldPath root;
    Node node;
    bool has_id = false, has_name = false, has_kind = false, has_target = false;
    for (auto& [key, value] : j.items()) {
      FieldPath path = root.field(key);
      if (key == "id") {
        has_id = true;
        node.id = int_of(value, path);
      } else if (key == "name") {
        has_name = true;
        node.name = std::move(string_of(value, path));
      } else if (key == "kind") {
        has_kind = true;
        const std::string& text = string_of(value, path);
        auto kind = parse_node_kind(text);
        if (!kind) ir::fail_at(where_, path, ": unknown node kind " + in_quotes(text));
        node.kind = *kind;
      } else if (key == "target") {
        has_target = true;
        node.target = std::move(string_of(value, path));
      } else if (key == "args") {
        Json& list = array_of(value, path);
        node.args.reserve(list.size());
        for (std::size_t i = 0; i < list.size(); ++i) {
          node.args.push_back(read_arg(list[i], path.index(i), 0));
        }
      } else if (key == "kwargs") {
        for (auto& [name, arg] : object_of(value, path).items()) {
          node.kwargs.emplace_back(name, read_arg(arg, path.field(name), 0));
        }
      } else if (key == "phase") {
        const std::string& text = string_of(value, path);
        auto phase = parse_phase(text);
        if (!phase) ir::fail_at(where_, path, ": unknown phase " + in_quotes(text));
        node.phase = *phase;
      } else if (key == "module_stack") {
        Json& list = array_of(value, path);
        node.module_stack.reserve(list.size());
        for (std::size_t i = 0; i < list.size(); ++i) {
          node.module_stack.push_back(std::move(string_of(list[i], path.index(i))));
        }
      } else if (key == "value") {
        node.value = read_value(value, path, 0);
      } else if (key == "time_ms") {
        if (!value.is_null()) node.time_ms = number_of(value, path);
      } else if (key == "cpu_ms") {
        if (!value.is_null()) node.cpu_ms = number_of(value, path);
      } else if (key == "recompute") {
        node.recompute = bool_of(value, path);
      } else if (key == "frees") {
        Json& list = array_of(value, path);
        node.frees.reserve(list.size());
        for (std::size_t i = 0; i < list.size(); ++i) node.frees.push_back(int_of(list[i], path.index(i)));
      } else {
        unknown_field(path, "a node");
      }
    }
    if (!has_id) missing(root.field("id"));
    if (!has_name) missing(root.field("name"));
    if (!has_kind) missing(root.field("kind"));
    if (!has_target) missing(root.field("target"));
    return node;
  }

  void check_depth(const FieldPath& path, int depth) {
    if (depth >= ir::kMaxNesting) {
      ir::fail_at(where_, path, ": nests deeper than " + std::to_string(ir::kMaxNesting));
    }
  }

  Arg read_arg(Json& j, const FieldPath& path, int depth) {
    Arg arg;
    switch (j.type()) {
      case Json::value_t::null:
        return arg;
      case Json::value_t::boolean:
        arg.kind = Arg::Kind::kBool;
        arg.b = j.get<bool>();
        return arg;
      case Json::value_t::number_integer:
      case Json::value_t::number_unsigned:
        arg.kind = Arg::Kind::kInt;
        arg.i = int_of(j, path);
        return arg;
      case Json::value_t::number_float:
        arg.kind = Arg::Kind::kDouble;
        arg.d = j.get<double>();
        return arg;
      case Json::value_t::string:
        arg.kind = Arg::Kind::kString;
        arg.s = std::move(j.get_ref<std::string&>());
        return arg;
      case Json::value_t::array:
        check_depth(path, depth);
        arg.kind = Arg::Kind::kList;
        arg.list.reserve(j.size());
        for (std::size_t i = 0; i < j.size(); ++i) {
          arg.list.push_back(read_arg(j[i], path.index(i), depth + 1));
        }
        return arg;
      case Json::value_t::object:
        return read_tagged_arg(j, path);
      default:
        type_error(j, path, "an argument");
    }
  }

  // {"node": 7}, {"sym": "s0", "hint": 4096}, {"other": "torch.bfloat16"},
  // {"float": "inf"}: exactly one form, with exactly its own keys.
  Arg read_tagged_arg(Json& j, const FieldPath& path) {
    Arg arg;
    if (auto it = j.find("node"); it != j.end()) {
      only_keys(j, path, {"node"}, "a node reference");
      arg.kind = Arg::Kind::kNode;
      arg.node = int_of(*it, path.field("node"));
    } else if (j.contains("sym")) {
      arg.kind = Arg::Kind::kSymInt;
      arg.sym = read_symbol(j, path);
    } else if (auto it = j.find("other"); it != j.end()) {
      only_keys(j, path, {"other"}, "an opaque argument");
      arg.kind = Arg::Kind::kOther;
      arg.s = std::move(string_of(*it, path.field("other")));
    } else if (auto it = j.find("float"); it != j.end()) {
      only_keys(j, path, {"float"}, "a non-finite float");
      const std::string& text = string_of(*it, path.field("float"));
      arg.kind = Arg::Kind::kDouble;
      if (text == "inf") {
        arg.d = std::numeric_limits<double>::infinity();
      } else if (text == "-inf") {
        arg.d = -std::numeric_limits<double>::infinity();
      } else if (text == "nan") {
        arg.d = std::numeric_limits<double>::quiet_NaN();
      } else {
        ir::fail_at(where_, path.field("float"),
                    ": expected 'inf', '-inf' or 'nan', got " + in_quotes(text));
      }
    } else {
      ir::fail_at(where_, path,
                  ": an object argument needs one of the keys 'node', 'sym', 'other' or 'float'");
    }
    return arg;
  }

  void only_keys(Json& j, const FieldPath& path, std::initializer_list<std::string_view> keys,
                 std::string_view owner) {
    for (auto& [key, value] : j.items()) {
      bool known = false;
      for (std::string_view allowed : keys) known = known || key == allowed;
      if (!known) unknown_field(path.field(key), owner);
    }
  }

  // {"sym": "s0", "hint": 4096} or {"sym": "u0", "hint": null}.
  SymSize read_symbol(Json& j, const FieldPath& path) {
    only_keys(j, path, {"sym", "hint"}, "a symbolic integer");
    auto sym = j.find("sym");
    auto hint = j.find("hint");
    if (sym == j.end()) missing(path.field("sym"));
    if (hint == j.end()) missing(path.field("hint"));
    SymSize size;
    size.symbol = std::move(string_of(*sym, path.field("sym")));
    if (size.symbol.empty()) {
      ir::fail_at(where_, path.field("sym"), ": is empty (a concrete size is a plain integer)");
    }
    if (!hint->is_null()) size.hint = int_of(*hint, path.field("hint"));
    return size;
  }

  SymSize read_dim(Json& j, const FieldPath& path) {
    if (j.is_object()) return read_symbol(j, path);
    if (!j.is_number_integer()) type_error(j, path, "an integer or a {\"sym\", \"hint\"} object");
    return SymSize::concrete(int_of(j, path));
  }

  std::vector<SymSize> read_dims(Json& j, const FieldPath& path) {
    Json& list = array_of(j, path);
    std::vector<SymSize> dims;
    dims.reserve(list.size());
    for (std::size_t i = 0; i < list.size(); ++i) dims.push_back(read_dim(list[i], path.index(i)));
    return dims;
  }

  // ---- values --------------------------------------------------------------

  Value read_value(Json& j, const FieldPath& path, int depth) {
    Json& object = object_of(j, path);
    auto type_it = object.find("type");
    if (type_it == object.end()) missing(path.field("type"));
    const std::string& type = string_of(*type_it, path.field("type"));
    Value value;
    if (type == "none") {
      only_keys(object, path, {"type"}, "a none value");
    } else if (type == "tensor") {
      value.kind = ValueKind::kTensor;
      value.tensor = read_tensor(object, path);
    } else if (type == "sequence") {
      only_keys(object, path, {"type", "elements"}, "a sequence value");
      check_depth(path, depth);
      value.kind = ValueKind::kSequence;
      auto elements = object.find("elements");
      if (elements == object.end()) missing(path.field("elements"));
      FieldPath elements_path = path.field("elements");
      Json& list = array_of(*elements, elements_path);
      value.elements.reserve(list.size());
      for (std::size_t i = 0; i < list.size(); ++i) {
        value.elements.push_back(read_value(list[i], elements_path.index(i), depth + 1));
      }
    } else if (type == "sym_int") {
      only_keys(object, path, {"type", "value"}, "a sym_int value");
      value.kind = ValueKind::kSymInt;
      auto scalar = object.find("value");
      if (scalar == object.end()) missing(path.field("value"));
      value.scalar = read_dim(*scalar, path.field("value"));
    } else if (type == "scalar" || type == "other") {
      value.kind = type == "scalar" ? ValueKind::kScalar : ValueKind::kOther;
      only_keys(object, path, {"type", "repr"}, type == "scalar" ? "a scalar value" : "an other value");
      auto repr = object.find("repr");
      if (repr == object.end()) missing(path.field("repr"));
      value.repr = std::move(string_of(*repr, path.field("repr")));
    } else {
      ir::fail_at(where_, path.field("type"), ": unknown value type " + in_quotes(type));
    }
    return value;
  }

  TensorInfo read_tensor(Json& object, const FieldPath& path) {
    TensorInfo t;
    bool has_dtype = false, has_element_size = false, has_sizes = false;
    for (auto& [key, value] : object.items()) {
      FieldPath field = path.field(key);
      if (key == "type") {
        continue;
      } else if (key == "dtype") {
        has_dtype = true;
        t.dtype = std::move(string_of(value, field));
      } else if (key == "element_size") {
        has_element_size = true;
        std::int64_t size = int_of(value, field);
        if (size > std::numeric_limits<int>::max() || size < std::numeric_limits<int>::min()) {
          ir::fail_at(where_, field, ": " + std::to_string(size) + " is out of range");
        }
        t.element_size = static_cast<int>(size);
      } else if (key == "sizes") {
        has_sizes = true;
        t.sizes = read_dims(value, field);
      } else if (key == "strides") {
        if (!value.is_null()) t.strides = read_dims(value, field);
      } else if (key == "contiguous") {
        t.contiguous = bool_of(value, field);
      } else if (key == "storage") {
        if (!value.is_null()) t.storage = int_of(value, field);
      } else if (key == "device") {
        t.device = std::move(string_of(value, field));
      } else if (key == "dtensor") {
        t.dtensor_like = bool_of(value, field);
      } else {
        unknown_field(field, "a tensor value");
      }
    }
    if (!has_dtype) missing(path.field("dtype"));
    if (!has_element_size) missing(path.field("element_size"));
    if (!has_sizes) missing(path.field("sizes"));
    return t;
  }

  std::string where_;  // the node or op being read, "" at the top level
};

}  // namespace

Graph parse_graph(std::string_view json_text) {
  Json root = ir::parse_json(json_text);
  Graph graph = Reader().read(root);
  verify_graph(graph);
  return graph;
}

}  // namespace spillway
