#pragma once
// GraphBuilder: write small test graphs in a few readable lines.
//
//   using spillway::testing::GraphBuilder;
//   GraphBuilder b("attn");
//   auto w = b.input("w", b.tensor({1024, 1024}));       // placeholder, own storage
//   b.module({"model.layers.0", "model.layers.0.self_attn"});
//   auto q = b.call("aten.mm.default", {w, w}, b.tensor({1024, 1024}));
//   auto qt = b.view("aten.t.default", q, b.tensor({1024, 1024}, {1, 1024}));
//   b.backward().module({});
//   auto g = b.call("aten.mm.default", {qt, w}, b.tensor({1024, 1024}));
//   b.output({g});
//   spillway::Graph graph = b.build();
//
// State that applies to every node added afterwards: the phase (forward() /
// backward()) and the module stack (module(), outermost first). Each call_*
// returns a NodeRef, which converts to an Arg, so node references and literals
// (lit(3), str("mean"), list({a, b}), none()) mix in one argument list.
//
// Tensors: tensor({rows, cols}) is a contiguous bf16 tensor on cuda:0 (pass
// strides to make it non-contiguous); sym_tensor({SymSize::symbolic("s0",
// 4096), ...}) has symbolic or unbacked (hint nullopt) sizes.
//
// Storage: every tensor a node produces gets a fresh storage id unless the
// TensorInfo passed in already carries one (use share(x) to take x's storage,
// or unknown_storage() to record "cannot be proven"). view() and inplace()
// share the storage of their first argument automatically.
//
// Schemas: call() registers a plain schema for a target seen for the first
// time (namespace = the text before the first '.', arguments named a0, a1, ...
// not mutable, not a view); view() registers a view schema; inplace() a schema
// that writes argument 0; call_untyped() records no schema at all (like
// operator.getitem). op() sets any schema explicitly and wins over the
// automatic ones (register it before the first use of the target).
//
// Node ids are 0, 1, 2, ... in insertion order; names default to the target's
// op name plus a counter ("mm_0") unless given with named(). The builder never
// validates: build() returns whatever was described, so tests can also build
// invalid graphs on purpose. Not thread-safe; header-only, for tests only.

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "spillway/graph.h"

namespace spillway::testing {

// A reference to a node added by the builder; converts to an Arg.
struct NodeRef {
  NodeId id = -1;
  operator Arg() const { return Arg::of_node(id); }  // NOLINT: implicit on purpose
};

inline Arg lit(std::int64_t value) { return Arg::of_int(value); }
inline Arg str(std::string value) { return Arg::of_string(std::move(value)); }
inline Arg none() { return Arg::none(); }
inline Arg list(std::vector<Arg> items) { return Arg::of_list(std::move(items)); }
inline Arg sym(std::string name, std::optional<std::int64_t> hint) {
  Arg a;
  a.kind = Arg::Kind::kSymInt;
  a.sym = SymSize::symbolic(std::move(name), hint);
  return a;
}

// Schema helpers. Arguments are positional unless listed in `kwarg_only`.
inline OpSchema pure_schema(std::string ns, std::vector<std::string> names,
                            std::vector<std::string> kwarg_only = {}) {
  OpSchema s;
  s.ns = std::move(ns);
  for (auto& n : names) s.arguments.push_back({std::move(n), false, false});
  for (auto& n : kwarg_only) s.arguments.push_back({std::move(n), true, false});
  return s;
}
// A mutable schema; `written` names the arguments it writes (alias_info.is_write).
inline OpSchema mutable_schema(std::string ns, std::vector<std::string> names,
                               std::vector<std::string> written,
                               std::vector<std::string> kwarg_only = {}) {
  OpSchema s = pure_schema(std::move(ns), std::move(names), std::move(kwarg_only));
  s.is_mutable = true;
  for (auto& a : s.arguments) {
    for (const auto& w : written) {
      if (a.name == w) a.is_write = true;
    }
  }
  return s;
}

class GraphBuilder {
 public:
  explicit GraphBuilder(std::string name = "test") { graph_.name = std::move(name); }

  // ---- state for the nodes that follow ----
  GraphBuilder& forward() {
    phase_ = Phase::kForward;
    return *this;
  }
  GraphBuilder& backward() {
    phase_ = Phase::kBackward;
    return *this;
  }
  GraphBuilder& optimizer() {
    phase_ = Phase::kOptimizer;
    return *this;
  }
  // Module stack, outermost first; {} for none.
  GraphBuilder& module(std::vector<std::string> stack) {
    stack_ = std::move(stack);
    return *this;
  }
  // The stack of a dotted path: within("model.layers.0.self_attn") gives
  // {"model", "model.layers", "model.layers.0", "model.layers.0.self_attn"}.
  GraphBuilder& within(const std::string& path) {
    stack_.clear();
    for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1))
      stack_.push_back(path.substr(0, dot));
    if (!path.empty()) stack_.push_back(path);
    return *this;
  }
  // The name of the next node only.
  GraphBuilder& named(std::string name) {
    next_name_ = std::move(name);
    return *this;
  }
  // Register (or replace) the schema of `target`.
  GraphBuilder& op(const std::string& target, OpSchema schema) {
    graph_.ops[target] = std::move(schema);
    return *this;
  }

  // ---- tensors ----
  // A contiguous tensor on cuda:0; strides computed from sizes unless given.
  static TensorInfo tensor(std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides = {},
                           int element_size = 2, std::string dtype = "bfloat16") {
    TensorInfo t;
    t.dtype = std::move(dtype);
    t.element_size = element_size;
    t.device = "cuda:0";
    for (auto s : sizes) t.sizes.push_back(SymSize::concrete(s));
    std::vector<std::int64_t> contiguous_strides(sizes.size(), 1);
    for (int i = static_cast<int>(sizes.size()) - 2; i >= 0; --i)
      contiguous_strides[i] = contiguous_strides[i + 1] * sizes[i + 1];
    if (strides.empty()) strides = contiguous_strides;
    for (auto s : strides) t.strides.push_back(SymSize::concrete(s));
    t.contiguous = strides == contiguous_strides;
    return t;
  }
  // A contiguous tensor with symbolic or unbacked sizes; strides left unknown.
  static TensorInfo sym_tensor(std::vector<SymSize> sizes, int element_size = 2) {
    TensorInfo t;
    t.dtype = "bfloat16";
    t.element_size = element_size;
    t.device = "cuda:0";
    t.sizes = std::move(sizes);
    t.contiguous = true;
    return t;
  }
  // `info` on x's storage.
  TensorInfo share(NodeRef x, TensorInfo info) const {
    info.storage = storage_of(x);
    return info;
  }
  static TensorInfo unknown_storage(TensorInfo info) {
    info.storage = kUnknownStorage;
    return info;
  }

  // ---- nodes ----
  NodeRef input(const std::string& name, TensorInfo info) {
    return add(NodeKind::kPlaceholder, name, {}, Value::of_tensor(fresh(std::move(info))), name);
  }
  NodeRef param(const std::string& name, TensorInfo info) {
    return add(NodeKind::kGetAttr, name, {}, Value::of_tensor(fresh(std::move(info))), name);
  }
  // call_function producing a tensor; registers a plain schema if none.
  NodeRef call(const std::string& target, std::vector<Arg> args, TensorInfo out,
               std::vector<std::pair<std::string, Arg>> kwargs = {}) {
    ensure_schema(target, args.size(), kwargs);
    return add(NodeKind::kCallFunction, target, std::move(args),
               Value::of_tensor(fresh(std::move(out))), "", std::move(kwargs));
  }
  // call_function producing any value (a tuple, nothing, a scalar).
  NodeRef call_value(const std::string& target, std::vector<Arg> args, Value out,
                     std::vector<std::pair<std::string, Arg>> kwargs = {}) {
    ensure_schema(target, args.size(), kwargs);
    fresh_all(out);
    return add(NodeKind::kCallFunction, target, std::move(args), std::move(out), "",
               std::move(kwargs));
  }
  // call_function with no schema recorded (operator.getitem and friends).
  NodeRef call_untyped(const std::string& target, std::vector<Arg> args, Value out) {
    fresh_all(out);
    return add(NodeKind::kCallFunction, target, std::move(args), std::move(out), "");
  }
  NodeRef call_method(const std::string& target, std::vector<Arg> args, Value out) {
    fresh_all(out);
    return add(NodeKind::kCallMethod, target, std::move(args), std::move(out), "");
  }
  // A schema view of `base` (shares its storage). Extra literal args follow base.
  NodeRef view(const std::string& target, NodeRef base, TensorInfo out,
               std::vector<Arg> extra = {}) {
    if (!graph_.ops.count(target)) {
      OpSchema s = plain_schema(target, 1 + extra.size(), {});
      s.is_view = true;
      graph_.ops[target] = s;
    }
    std::vector<Arg> args{base};
    for (auto& a : extra) args.push_back(std::move(a));
    return add(NodeKind::kCallFunction, target, std::move(args),
               Value::of_tensor(share(base, std::move(out))), "");
  }
  // An in-place op writing argument 0 (`self`) and returning it.
  NodeRef inplace(const std::string& target, NodeRef self, std::vector<Arg> rest = {}) {
    if (!graph_.ops.count(target)) {
      OpSchema s = plain_schema(target, 1 + rest.size(), {});
      s.is_mutable = true;
      s.arguments[0].is_write = true;
      graph_.ops[target] = s;
    }
    std::vector<Arg> args{self};
    for (auto& a : rest) args.push_back(std::move(a));
    Value v = node(self).value;
    return add(NodeKind::kCallFunction, target, std::move(args), std::move(v), "");
  }
  // A tuple of tensors produced by one node (fresh storages unless set).
  static Value tuple(std::vector<TensorInfo> items) {
    Value v;
    v.kind = ValueKind::kSequence;
    for (auto& t : items) v.elements.push_back(Value::of_tensor(std::move(t)));
    return v;
  }
  NodeRef output(std::vector<Arg> results) {
    return add(NodeKind::kOutput, "output", {Arg::of_list(std::move(results))}, Value::none(),
               "output");
  }

  // ---- access ----
  Node& node(NodeRef ref) { return graph_.nodes.at(position_.at(ref.id)); }
  const Node& node(NodeRef ref) const { return graph_.nodes.at(position_.at(ref.id)); }
  std::optional<std::int64_t> storage_of(NodeRef ref) const {
    const Node& n = node(ref);
    if (!n.value.is_tensor()) return std::nullopt;
    return n.value.tensor.storage;
  }
  Graph& graph() { return graph_; }
  // A copy of the graph described so far (unknown storages are cleared).
  Graph build() const {
    Graph g = graph_;
    for (Node& n : g.nodes) clear_unknown(n.value);
    return g;
  }

 private:
  static constexpr std::int64_t kUnknownStorage = -1;

  static void clear_unknown(Value& v) {
    if (v.is_tensor() && v.tensor.storage == kUnknownStorage) v.tensor.storage.reset();
    for (Value& e : v.elements) clear_unknown(e);
  }
  TensorInfo fresh(TensorInfo info) {
    if (!info.storage) info.storage = next_storage_++;
    return info;
  }
  void fresh_all(Value& v) {
    if (v.is_tensor()) v.tensor = fresh(std::move(v.tensor));
    for (Value& e : v.elements) fresh_all(e);
  }
  static std::string ns_of(const std::string& target) {
    auto dot = target.find('.');
    return dot == std::string::npos ? target : target.substr(0, dot);
  }
  static OpSchema plain_schema(const std::string& target, std::size_t positional,
                               const std::vector<std::pair<std::string, Arg>>& kwargs) {
    OpSchema s;
    s.ns = ns_of(target);
    for (std::size_t i = 0; i < positional; ++i)
      s.arguments.push_back({"a" + std::to_string(i), false, false});
    for (const auto& kv : kwargs) s.arguments.push_back({kv.first, true, false});
    return s;
  }
  void ensure_schema(const std::string& target, std::size_t positional,
                     const std::vector<std::pair<std::string, Arg>>& kwargs) {
    if (!graph_.ops.count(target)) graph_.ops[target] = plain_schema(target, positional, kwargs);
  }
  std::string default_name(const std::string& target) {
    std::string base = target;
    auto first = base.find('.');
    if (first != std::string::npos) {
      auto second = base.find('.', first + 1);
      base = base.substr(first + 1, second == std::string::npos ? std::string::npos
                                                                  : second - first - 1);
    }
    return base + "_" + std::to_string(counter_[base]++);
  }
  NodeRef add(NodeKind kind, const std::string& target, std::vector<Arg> args, Value value,
              std::string name, std::vector<std::pair<std::string, Arg>> kwargs = {}) {
    Node n;
    n.id = static_cast<NodeId>(graph_.nodes.size());
    if (!next_name_.empty()) {
      name = std::move(next_name_);
      next_name_.clear();
    }
    n.name = name.empty() ? default_name(target) : std::move(name);
    n.kind = kind;
    n.target = target;
    n.args = std::move(args);
    n.kwargs = std::move(kwargs);
    n.phase = phase_;
    n.module_stack = kind == NodeKind::kOutput ? std::vector<std::string>{} : stack_;
    n.value = std::move(value);
    position_[n.id] = graph_.nodes.size();
    graph_.nodes.push_back(std::move(n));
    return NodeRef{graph_.nodes.back().id};
  }

  Graph graph_;
  Phase phase_ = Phase::kForward;
  std::vector<std::string> stack_;
  std::string next_name_;
  std::int64_t next_storage_ = 1000;
  std::map<NodeId, std::size_t> position_;
  std::map<std::string, int> counter_;
};

}  // namespace spillway::testing
