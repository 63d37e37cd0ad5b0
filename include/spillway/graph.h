#pragma once
// The Spillway graph IR: an ordered list of nodes over values that live in
// storages. One IR serves every planner: a joint forward+backward FX graph, a
// recorded op trace and a piecewise compiled graph are all expressed with it.
//
// The types here are plain values: copying a Graph copies everything, and no
// object points into another. Nodes refer to each other by NodeId, never by
// position, so inserting nodes does not invalidate references.
//
// Invariants of a valid Graph (checked by verify_graph, numbered so code and
// errors can cite them):
//   (1) node ids are unique and non-negative;
//   (2) every node reference in args/kwargs names a node that appears earlier
//       in `nodes` (the order is a topological order; there are no cycles);
//   (3) node names are unique and non-empty;
//   (4) a placeholder or get_attr node has no node inputs;
//   (5) there is at most one output node, and it is the last node;
//   (6) a call_function node whose target has an entry in `ops` respects that
//       schema: no keyword the schema does not name, no more positional
//       arguments than it has non-kwarg-only arguments;
//   (7) tensor values have element_size > 0, sizes and strides of equal rank
//       when strides are known, and non-negative concrete sizes;
//   (8) everything is representable in the JSON format: enum fields hold a
//       declared enumerator, a symbolic dim or sym_int argument has a non-empty
//       symbol, a concrete dim has a value, storage ids are >= 0, time_ms is
//       finite and >= 0, kwarg names within a node are unique, a schema has a
//       non-empty namespace and unique non-empty argument names, args lists
//       and sequence values nest at most 64 deep, every string is valid UTF-8.
//
// Thread-safety: none of these types synchronises; share a const Graph freely,
// mutate it from one thread.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spillway {

using NodeId = std::int64_t;

// A dimension size or stride. Concrete (symbol empty, hint set), symbolic with a
// trace-time hint (symbol set, hint set) or unbacked/data-dependent (symbol set,
// no hint). Planners read hints only: they never specialise a symbol.
struct SymSize {
  std::string symbol;               // empty for a concrete size
  std::optional<std::int64_t> hint; // nullopt only for unbacked symbols

  static SymSize concrete(std::int64_t value) { return {"", value}; }
  static SymSize symbolic(std::string name, std::optional<std::int64_t> hint) {
    return {std::move(name), hint};
  }
  bool is_concrete() const { return symbol.empty(); }
  bool has_hint() const { return hint.has_value(); }
  friend bool operator==(const SymSize&, const SymSize&) = default;
};

// Facts about a tensor-valued result, as the producer saw them at trace time.
struct TensorInfo {
  std::string dtype;          // "bfloat16", "float32", ... (informational)
  int element_size = 0;       // bytes per element, > 0
  std::vector<SymSize> sizes;
  std::vector<SymSize> strides;  // empty when unknown
  bool contiguous = false;       // torch's is_contiguous() at trace time
  // Identity of the underlying storage; equal ids mean the same memory.
  // nullopt when the identity cannot be proven (treated as "not offloadable").
  std::optional<std::int64_t> storage;
  std::string device;         // "cuda:0", "cpu", "meta", ...
  bool dtensor_like = false;  // a DTensor or similar wrapper subclass

  int rank() const { return static_cast<int>(sizes.size()); }
  // numel * element_size from the size hints; nullopt when any size is
  // unbacked (has no hint).
  std::optional<std::int64_t> nbytes() const;
  friend bool operator==(const TensorInfo&, const TensorInfo&) = default;
};

enum class ValueKind {
  kNone,      // the node produces nothing (None, or an output node)
  kTensor,    // one tensor: `tensor` is set
  kSequence,  // a tuple or list: `elements` holds one Value each
  kSymInt,    // a symbolic or concrete integer: `scalar` holds it
  kScalar,    // a Python number or bool
  kOther,     // anything else (an opaque object); `repr` describes it
};

struct Value {
  ValueKind kind = ValueKind::kNone;
  TensorInfo tensor;            // kTensor only
  std::vector<Value> elements;  // kSequence only
  SymSize scalar;               // kSymInt only
  std::string repr;             // kOther / kScalar: a human-readable form

  bool is_tensor() const { return kind == ValueKind::kTensor; }
  bool is_sequence() const { return kind == ValueKind::kSequence; }
  static Value none() { return {}; }
  static Value of_tensor(TensorInfo info) {
    Value v;
    v.kind = ValueKind::kTensor;
    v.tensor = std::move(info);
    return v;
  }
  friend bool operator==(const Value&, const Value&) = default;
};

// One argument of a node: a literal, a reference to another node's result, or a
// list of arguments (Tensor[] and nested containers).
struct Arg {
  enum class Kind { kNone, kBool, kInt, kDouble, kString, kNode, kList, kSymInt, kOther };
  Kind kind = Kind::kNone;
  bool b = false;
  std::int64_t i = 0;
  double d = 0.0;
  std::string s;      // kString: the string; kOther: a repr ("torch.bfloat16")
  NodeId node = -1;   // kNode
  SymSize sym;        // kSymInt
  std::vector<Arg> list;  // kList

  static Arg none() { return {}; }
  static Arg of_node(NodeId id) {
    Arg a;
    a.kind = Kind::kNode;
    a.node = id;
    return a;
  }
  static Arg of_int(std::int64_t v) {
    Arg a;
    a.kind = Kind::kInt;
    a.i = v;
    return a;
  }
  static Arg of_string(std::string v) {
    Arg a;
    a.kind = Kind::kString;
    a.s = std::move(v);
    return a;
  }
  static Arg of_other(std::string repr) {
    Arg a;
    a.kind = Kind::kOther;
    a.s = std::move(repr);
    return a;
  }
  static Arg of_list(std::vector<Arg> items) {
    Arg a;
    a.kind = Kind::kList;
    a.list = std::move(items);
    return a;
  }
  friend bool operator==(const Arg&, const Arg&) = default;
};

enum class NodeKind { kPlaceholder, kCallFunction, kCallMethod, kCallModule, kGetAttr, kOutput };
// kOptimizer (appended): an op of the optimizer step, after backward, in a
// recorded trace (python/spillway/trace); planners of joint graphs never see it.
enum class Phase { kForward, kBackward, kOptimizer };

std::string_view to_string(NodeKind kind);
std::string_view to_string(Phase phase);
// Parse the JSON spelling ("call_function", "backward"); nullopt if unknown.
std::optional<NodeKind> parse_node_kind(std::string_view text);
std::optional<Phase> parse_phase(std::string_view text);

// One argument in an operator schema.
struct OpArgument {
  std::string name;
  bool kwarg_only = false;
  bool is_write = false;  // the op writes this argument in place (alias_info.is_write)
  friend bool operator==(const OpArgument&, const OpArgument&) = default;
};

// What the operator's schema says, recorded once per target in Graph::ops.
struct OpSchema {
  std::string ns;           // "aten", "_c10d_functional", "spillway", ...
  bool is_mutable = false;  // the schema writes any argument
  bool is_view = false;     // the op returns an alias of an input (a view op)
  std::vector<OpArgument> arguments;
  // Appended after format v1's first release (absent in older files: false).
  // The op's torch tags: torch.Tag.pointwise (elementwise over broadcast
  // inputs, each output element a function of the matching input elements)
  // and torch.Tag.nondeterministic_seeded (draws from the RNG: dropout, rand*).
  bool is_pointwise = false;
  bool is_random = false;
  friend bool operator==(const OpSchema&, const OpSchema&) = default;
};

struct Node {
  NodeId id = -1;
  std::string name;     // unique, as FX named it
  NodeKind kind = NodeKind::kCallFunction;
  std::string target;   // "aten.mm.default", "operator.getitem", a placeholder's name
  std::vector<Arg> args;
  std::vector<std::pair<std::string, Arg>> kwargs;  // in source order
  Phase phase = Phase::kForward;
  // Qualified module names, outermost first: {"model.layers.0",
  // "model.layers.0.self_attn", "model.layers.0.self_attn.q_proj"}.
  std::vector<std::string> module_stack;
  Value value;                     // what the node produced at trace time
  std::optional<double> time_ms;   // measured or estimated run time
  // Appended after format v1's first release (absent in older files: false).
  // The trace tagged this node for recomputation in backward instead of being
  // saved (torch.utils.checkpoint's MUST_RECOMPUTE / PREFER_RECOMPUTE, FX
  // meta["recompute"]): planners leave its value to the recomputation.
  bool recompute = false;
  // Appended after format v1's first release (absent: empty). Storage ids of
  // values that were freed right after this node ran, as a recorded step saw
  // them go (a gradient that zero_grad let go of, long after its last use):
  // the residency model keeps such a storage until then.
  std::vector<std::int64_t> frees;
  // Appended after format v1's first release (absent: unknown). The host CPU
  // time the program spent on this op when the op ran on a GPU: the Python
  // and autograd-engine work since the op before, and the op's own dispatch
  // and kernel launches (a recorded step measures it; the residency simulator
  // lets an op start no earlier than the host has issued it).
  std::optional<double> cpu_ms;

  // Calls fn(NodeId) for every node reference in args then kwargs, in order,
  // descending into lists. A node referenced twice is visited twice.
  template <typename Fn>
  void for_each_input(Fn&& fn) const {
    for (const Arg& a : args) visit_arg(a, fn);
    for (const auto& kv : kwargs) visit_arg(kv.second, fn);
  }
  friend bool operator==(const Node&, const Node&) = default;

 private:
  template <typename Fn>
  static void visit_arg(const Arg& a, Fn& fn) {
    if (a.kind == Arg::Kind::kNode) fn(a.node);
    for (const Arg& item : a.list) visit_arg(item, fn);
  }
};

struct Graph {
  static constexpr int kFormatVersion = 1;

  std::string name;
  // Free-form provenance ("torch": "2.13.0", "model": "llama", ...).
  std::map<std::string, std::string> metadata;
  std::map<std::string, OpSchema> ops;  // keyed by Node::target
  std::vector<Node> nodes;              // in execution order

  // The schema recorded for node.target, or nullptr when there is none (a
  // call_method, a plain Python callable such as operator.getitem).
  const OpSchema* schema_of(const Node& node) const;
  // The largest TensorInfo::storage of any node's value (tuple and list
  // elements included), -1 when none has one: passes that add tensors take
  // new storage ids above it.
  std::int64_t max_storage() const;
  friend bool operator==(const Graph&, const Graph&) = default;
};

// ---- JSON format (docs/graph-format.md) ----------------------------------------
//
// Each of these throws InvalidGraph naming the node and field on any violation of
// the format or of invariants (1)-(7), and never crashes on malformed input.

// Parse a graph from JSON text.
Graph parse_graph(std::string_view json_text);
// Read a graph from a file; files ending in ".zst" are zstd-decompressed first.
// Throws Error("[graph] ...") when the file cannot be read.
Graph load_graph(const std::string& path);
// Serialise to JSON text; parse_graph(write_graph(g)) == g for any valid g.
std::string write_graph(const Graph& graph, bool pretty = false);
// Write to a file, zstd-compressing when the path ends in ".zst".
void save_graph(const Graph& graph, const std::string& path);

// Check invariants (1)-(7) of an in-memory graph; throws InvalidGraph on the first
// violation, naming the node and field.
void verify_graph(const Graph& graph);

}  // namespace spillway
