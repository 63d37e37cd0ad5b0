// verify_graph: invariants (1)-(8) of include/spillway/graph.h in one O(n) pass
// over the nodes (plus the size of their args and values). parse_graph checks
// only the JSON shape and leaves every invariant to this file, so "loads" and
// "verifies" mean the same thing.

#include <cmath>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "ir/field_path.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

using ir::FieldPath;

bool is_declared(NodeKind kind) {
  return kind >= NodeKind::kPlaceholder && kind <= NodeKind::kOutput;
}
bool is_declared(Phase phase) {
  return phase == Phase::kForward || phase == Phase::kBackward || phase == Phase::kOptimizer;
}

std::string single_quoted(std::string_view text) { return "'" + std::string(text) + "'"; }

class Verifier {
 public:
  explicit Verifier(const Graph& graph) : graph_(graph) {}

  void run() {
    check_text(graph_.name, "", FieldPath("name"));
    for (const auto& [key, value] : graph_.metadata) {
      FieldPath metadata = FieldPath("metadata");
      check_text(key, "", metadata);
      check_text(value, "", metadata.field(key));
    }
    for (const auto& [target, schema] : graph_.ops) check_schema(target, schema);
    index_nodes();
    for (std::size_t i = 0; i < graph_.nodes.size(); ++i) check_node(i);
  }

 private:
  // Strings are written as JSON text, which must be UTF-8 (invariant 8).
  void check_text(std::string_view text, std::string_view where, const FieldPath& path) {
    if (!ir::is_valid_utf8(text)) ir::fail_at(where, path, " is not valid UTF-8");
  }

  void check_schema(const std::string& target, const OpSchema& schema) {
    if (!ir::is_valid_utf8(target)) ir::fail_whole("", "an op target is not valid UTF-8");
    const std::string where = "op " + single_quoted(target);
    check_text(schema.ns, where, FieldPath("namespace"));
    if (schema.ns.empty()) ir::fail_at(where, FieldPath("namespace"), " is empty");
    SchemaIndex& index = schemas_[&schema];
    index.names.reserve(schema.arguments.size());
    FieldPath arguments = FieldPath("arguments");
    for (std::size_t a = 0; a < schema.arguments.size(); ++a) {
      FieldPath argument = arguments.index(a);
      FieldPath name = argument.field("name");
      const std::string& arg_name = schema.arguments[a].name;
      check_text(arg_name, where, name);
      if (arg_name.empty()) ir::fail_at(where, name, " is empty");
      auto [first, inserted] = index.names.emplace(arg_name, a);
      if (!inserted) {
        ir::fail_at(where, name,
                    ": duplicate argument name " + single_quoted(arg_name) + " (also arguments[" +
                        std::to_string(first->second) + "])");
      }
      if (!schema.arguments[a].kwarg_only) ++index.positional;
    }
  }

  // Invariants (1) and (3): ids unique and non-negative, names unique and non-empty.
  void index_nodes() {
    position_.reserve(graph_.nodes.size());
    std::unordered_map<std::string_view, std::size_t> by_name;
    by_name.reserve(graph_.nodes.size());
    for (std::size_t i = 0; i < graph_.nodes.size(); ++i) {
      const Node& node = graph_.nodes[i];
      const std::string where = ir::node_label(node.id, node.name);
      if (node.id < 0) {
        ir::fail_at(where, FieldPath("id"),
                    ": must be non-negative, got " + std::to_string(node.id));
      }
      auto [id_it, id_new] = position_.emplace(node.id, i);
      if (!id_new) {
        const Node& first = graph_.nodes[id_it->second];
        ir::fail_at(where, FieldPath("id"),
                    ": duplicate id " + std::to_string(node.id) + ", also used by nodes[" +
                        std::to_string(id_it->second) + "] (" + first.name + ")");
      }
      check_text(node.name, where, FieldPath("name"));
      if (node.name.empty()) ir::fail_at(where, FieldPath("name"), " is empty");
      auto [name_it, name_new] = by_name.emplace(node.name, i);
      if (!name_new) {
        const Node& first = graph_.nodes[name_it->second];
        ir::fail_at(where, FieldPath("name"),
                    ": duplicate name " + single_quoted(node.name) + ", also used by " +
                        ir::node_label(first.id, first.name));
      }
    }
  }

  void check_node(std::size_t position) {
    const Node& node = graph_.nodes[position];
    const std::string where = ir::node_label(node.id, node.name);
    FieldPath root;
    if (!is_declared(node.kind)) {
      ir::fail_at(where, root.field("kind"),
                  ": undeclared NodeKind " + std::to_string(static_cast<int>(node.kind)));
    }
    if (!is_declared(node.phase)) {
      ir::fail_at(where, root.field("phase"),
                  ": undeclared Phase " + std::to_string(static_cast<int>(node.phase)));
    }
    check_text(node.target, where, root.field("target"));
    // Invariant (5): one output node at most, and last. A second output node
    // is necessarily not last, so this one check covers both halves.
    if (node.kind == NodeKind::kOutput && position + 1 != graph_.nodes.size()) {
      ir::fail_whole(where, "an output node must be the last node, but " +
                                std::to_string(graph_.nodes.size() - position - 1) +
                                " node(s) follow it");
    }
    FieldPath args = root.field("args");
    for (std::size_t a = 0; a < node.args.size(); ++a) {
      check_arg(node, position, where, node.args[a], args.index(a), 0);
    }
    FieldPath kwargs = root.field("kwargs");
    // Kwargs are few; a hash set only for the rare node with many, so the
    // duplicate check stays linear.
    constexpr std::size_t kScanLimit = 16;
    std::unordered_set<std::string_view> kwarg_names;
    for (std::size_t k = 0; k < node.kwargs.size(); ++k) {
      const auto& [key, arg] = node.kwargs[k];
      check_text(key, where, kwargs);
      bool duplicate = false;
      if (node.kwargs.size() <= kScanLimit) {
        for (std::size_t j = 0; j < k && !duplicate; ++j) duplicate = node.kwargs[j].first == key;
      } else {
        duplicate = !kwarg_names.insert(key).second;
      }
      if (duplicate) ir::fail_at(where, kwargs.field(key), ": duplicate keyword argument");
      check_arg(node, position, where, arg, kwargs.field(key), 0);
    }
    check_schema_use(node, where);
    FieldPath module_stack = root.field("module_stack");
    for (std::size_t m = 0; m < node.module_stack.size(); ++m) {
      check_text(node.module_stack[m], where, module_stack.index(m));
    }
    check_value(node.value, where, root.field("value"), 0);
    if (node.time_ms && !(std::isfinite(*node.time_ms) && *node.time_ms >= 0)) {
      ir::fail_at(where, root.field("time_ms"),
                  ": must be a finite number >= 0, got " + std::to_string(*node.time_ms));
    }
    if (node.cpu_ms && !(std::isfinite(*node.cpu_ms) && *node.cpu_ms >= 0)) {
      ir::fail_at(where, root.field("cpu_ms"),
                  ": must be a finite number >= 0, got " + std::to_string(*node.cpu_ms));
    }
  }

  // Invariants (2) and (4) for every node reference, and (8) for literals.
  void check_arg(const Node& node, std::size_t position, const std::string& where, const Arg& arg,
                 const FieldPath& path, int depth) {
    switch (arg.kind) {
      case Arg::Kind::kNode: {
        if (node.kind == NodeKind::kPlaceholder || node.kind == NodeKind::kGetAttr) {
          ir::fail_at(where, path,
                      ": a " + std::string(to_string(node.kind)) +
                          " node takes no node inputs, got a reference to node " +
                          std::to_string(arg.node));
        }
        auto it = position_.find(arg.node);
        if (it == position_.end()) {
          ir::fail_at(where, path, " refers to unknown node " + std::to_string(arg.node));
        }
        if (it->second >= position) {
          const Node& target = graph_.nodes[it->second];
          ir::fail_at(where, path,
                      " refers to " + ir::node_label(target.id, target.name) +
                          ", which does not come earlier (a forward reference or a cycle)");
        }
        break;
      }
      case Arg::Kind::kString:
      case Arg::Kind::kOther:
        check_text(arg.s, where, path);
        break;
      case Arg::Kind::kSymInt:
        check_text(arg.sym.symbol, where, path.field("sym"));
        if (arg.sym.symbol.empty()) {
          ir::fail_at(where, path.field("sym"), ": a sym_int argument needs a symbol name");
        }
        break;
      case Arg::Kind::kList:
        if (depth >= ir::kMaxNesting) {
          ir::fail_at(where, path, ": lists nest deeper than " + std::to_string(ir::kMaxNesting));
        }
        for (std::size_t i = 0; i < arg.list.size(); ++i) {
          check_arg(node, position, where, arg.list[i], path.index(i), depth + 1);
        }
        break;
      case Arg::Kind::kNone:
      case Arg::Kind::kBool:
      case Arg::Kind::kInt:
      case Arg::Kind::kDouble:
        break;
      default:
        ir::fail_at(where, path,
                    ": undeclared Arg::Kind " + std::to_string(static_cast<int>(arg.kind)));
    }
  }

  // Invariant (6).
  void check_schema_use(const Node& node, const std::string& where) {
    const OpSchema* schema = graph_.schema_of(node);
    if (schema == nullptr) return;
    const SchemaIndex& index = schemas_.at(schema);
    if (node.args.size() > index.positional) {
      ir::fail_at(where, FieldPath("args"),
                  ": " + std::to_string(node.args.size()) + " positional arguments, but the " +
                      "schema of " + single_quoted(node.target) + " takes at most " +
                      std::to_string(index.positional));
    }
    for (const auto& [key, arg] : node.kwargs) {
      if (index.names.find(key) == index.names.end()) {
        FieldPath kwargs("kwargs");
        ir::fail_at(where, kwargs.field(key),
                    ": the schema of " + single_quoted(node.target) + " has no argument " + single_quoted(key));
      }
    }
  }

  void check_dim(const SymSize& dim, bool is_size, const std::string& where,
                 const FieldPath& path) {
    if (dim.is_concrete()) {
      if (!dim.hint) ir::fail_at(where, path, ": a concrete dim has no value");
      if (is_size && *dim.hint < 0) {
        ir::fail_at(where, path, ": negative size " + std::to_string(*dim.hint));
      }
      return;
    }
    check_text(dim.symbol, where, path.field("sym"));
    if (is_size && dim.hint && *dim.hint < 0) {
      ir::fail_at(where, path.field("hint"), ": negative size hint " + std::to_string(*dim.hint));
    }
  }

  // Invariant (7), and (8) for values.
  void check_value(const Value& value, const std::string& where, const FieldPath& path,
                   int depth) {
    switch (value.kind) {
      case ValueKind::kNone:
        return;
      case ValueKind::kTensor: {
        const TensorInfo& t = value.tensor;
        check_text(t.dtype, where, path.field("dtype"));
        check_text(t.device, where, path.field("device"));
        if (t.element_size <= 0) {
          ir::fail_at(where, path.field("element_size"),
                      ": must be > 0, got " + std::to_string(t.element_size));
        }
        FieldPath sizes = path.field("sizes");
        for (std::size_t d = 0; d < t.sizes.size(); ++d) {
          check_dim(t.sizes[d], true, where, sizes.index(d));
        }
        if (!t.strides.empty() && t.strides.size() != t.sizes.size()) {
          ir::fail_at(where, path.field("strides"),
                      ": has " + std::to_string(t.strides.size()) + " entries for a tensor of rank " +
                          std::to_string(t.sizes.size()));
        }
        FieldPath strides = path.field("strides");
        for (std::size_t d = 0; d < t.strides.size(); ++d) {
          check_dim(t.strides[d], false, where, strides.index(d));
        }
        if (t.storage && *t.storage < 0) {
          ir::fail_at(where, path.field("storage"),
                      ": must be >= 0 or null, got " + std::to_string(*t.storage));
        }
        return;
      }
      case ValueKind::kSequence: {
        if (depth >= ir::kMaxNesting) {
          ir::fail_at(where, path,
                      ": sequences nest deeper than " + std::to_string(ir::kMaxNesting));
        }
        FieldPath elements = path.field("elements");
        for (std::size_t i = 0; i < value.elements.size(); ++i) {
          check_value(value.elements[i], where, elements.index(i), depth + 1);
        }
        return;
      }
      case ValueKind::kSymInt:
        check_dim(value.scalar, false, where, path.field("value"));
        return;
      case ValueKind::kScalar:
      case ValueKind::kOther:
        check_text(value.repr, where, path.field("repr"));
        return;
    }
    ir::fail_at(where, path.field("type"),
                ": undeclared ValueKind " + std::to_string(static_cast<int>(value.kind)));
  }

  // What invariant (6) needs of a schema, built once per op.
  struct SchemaIndex {
    std::size_t positional = 0;                              // non-kwarg-only arguments
    std::unordered_map<std::string_view, std::size_t> names;  // argument name -> position
  };

  const Graph& graph_;
  std::unordered_map<NodeId, std::size_t> position_;  // node id -> index in nodes
  std::unordered_map<const OpSchema*, SchemaIndex> schemas_;
};

}  // namespace

void verify_graph(const Graph& graph) { Verifier(graph).run(); }

}  // namespace spillway
