#include "testing/random_graph.h"

#include <algorithm>
#include <array>
#include <map>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace spillway::testing {
namespace {

using Stack = std::vector<std::string>;

enum class SizeClass { kSmall, kLarge };

// Schemas of every op the generator emits, as the exporter would record them.
std::map<std::string, OpSchema> make_schemas() {
  auto args = [](std::initializer_list<OpArgument> list) { return std::vector<OpArgument>(list); };
  std::map<std::string, OpSchema> ops;
  ops["aten.mm.default"] = {"aten", false, false, args({{"self"}, {"mat2"}})};
  ops["aten.add.Tensor"] = {"aten", false, false, args({{"self"}, {"other"}, {"alpha", true}})};
  ops["aten.mul.Tensor"] = {"aten", false, false, args({{"self"}, {"other"}})};
  ops["aten.relu.default"] = {"aten", false, false, args({{"self"}})};
  ops["aten.gelu.default"] = {"aten", false, false, args({{"self"}, {"approximate", true}})};
  ops["aten.sum.default"] = {"aten", false, false, args({{"self"}, {"dtype", true}})};
  ops["aten.ones_like.default"] = {"aten", false, false, args({{"self"}})};
  ops["aten.view.default"] = {"aten", false, true, args({{"self"}, {"size"}})};
  ops["aten.t.default"] = {"aten", false, true, args({{"self"}})};
  ops["aten.transpose.int"] = {"aten", false, true, args({{"self"}, {"dim0"}, {"dim1"}})};
  // _unsafe_view carries no alias_info: an alias only storage identity reveals.
  ops["aten._unsafe_view.default"] = {"aten", false, false, args({{"self"}, {"size"}})};
  ops["aten.split.Tensor"] = {"aten", false, true, args({{"self"}, {"split_size"}, {"dim"}})};
  ops["aten.native_layer_norm.default"] = {
      "aten", false, false, args({{"input"}, {"normalized_shape"}, {"weight"}, {"bias"}, {"eps"}})};
  ops["aten.sym_size.int"] = {"aten", false, false, args({{"self"}, {"dim"}})};
  ops["aten.add_.Tensor"] = {"aten", true, false,
                             args({{"self", false, true}, {"other"}, {"alpha", true}})};
  ops["aten.mul.out"] = {"aten", true, false, args({{"self"}, {"other"}, {"out", true, true}})};
  ops["aten._foreach_add_.Scalar"] = {"aten", true, false,
                                      args({{"self", false, true}, {"scalar"}})};
  // A mutable op whose written argument the node omits: unresolvable target.
  ops["mylib.fused_update_.default"] = {"mylib", true, false,
                                        args({{"self"}, {"buf", false, true}})};
  ops["_c10d_functional.all_reduce.default"] = {"_c10d_functional", false, false,
                                                args({{"input"}, {"reduce_op"}, {"group_name"}})};
  ops["_c10d_functional.wait_tensor.default"] = {"_c10d_functional", false, false,
                                                 args({{"tensor"}})};
  return ops;
}

struct Region {
  int block = 0;
  Stack stack;
};

class Generator {
 public:
  explicit Generator(std::uint64_t seed) : rng_(seed) {}

  Graph generate();

 private:
  // ---- node emission ----
  NodeId emit(Node node);
  NodeId call(const std::string& target, const std::string& base, std::vector<Arg> args,
              Value value, Phase phase, const Stack& stack,
              std::vector<std::pair<std::string, Arg>> kwargs = {},
              NodeKind kind = NodeKind::kCallFunction);
  const Node& node(NodeId id) const { return graph_.nodes[position_.at(id)]; }
  const TensorInfo& tensor_of(NodeId id) const { return node(id).value.tensor; }

  // ---- values ----
  SymSize make_dim(SizeClass size_class, bool leading);
  TensorInfo make_tensor(SizeClass size_class, bool allow_odd = true);
  TensorInfo aliased(NodeId base, std::vector<SymSize> sizes, bool contiguous) const;
  void set_contiguous_strides(TensorInfo& tensor) const;
  SizeClass random_size() { return rng_.chance(0.5) ? SizeClass::kLarge : SizeClass::kSmall; }
  NodeId pick_recent(const std::vector<NodeId>& pool);

  // ---- graph parts ----
  void emit_inputs();
  void emit_forward_region(const Region& region);
  void emit_forward_op(const Region& region);
  void emit_backward_block(int block);
  void emit_output(NodeId loss);
  void remember_forward(NodeId id, int block);

  Rng rng_;
  Graph graph_;
  std::unordered_map<NodeId, std::size_t> position_;
  NodeId next_id_ = 0;
  std::int64_t next_storage_ = 0;
  int next_unbacked_ = 0;
  std::int64_t seq_hint_ = 512;
  std::map<std::string, int> name_counts_;
  std::vector<NodeId> inputs_;        // tensor placeholders and get_attrs
  std::vector<NodeId> forward_pool_;  // tensor-valued forward nodes
  std::vector<std::vector<NodeId>> block_values_;
  std::vector<Stack> block_stacks_;  // a representative stack per block
  std::vector<NodeId> grads_;
  NodeId grad_ = -1;
};

NodeId Generator::emit(Node node) {
  node.id = next_id_;
  next_id_ += rng_.chance(0.2) ? rng_.uniform(2, 5) : 1;  // ids are not positions
  position_[node.id] = graph_.nodes.size();
  graph_.nodes.push_back(std::move(node));
  return graph_.nodes.back().id;
}

NodeId Generator::call(const std::string& target, const std::string& base, std::vector<Arg> args,
                       Value value, Phase phase, const Stack& stack,
                       std::vector<std::pair<std::string, Arg>> kwargs, NodeKind kind) {
  Node n;
  int& count = name_counts_[base];
  n.name = count == 0 ? base : base + "_" + std::to_string(count);
  ++count;
  n.kind = kind;
  n.target = target;
  n.args = std::move(args);
  n.kwargs = std::move(kwargs);
  n.phase = phase;
  n.module_stack = stack;
  n.value = std::move(value);
  if (rng_.chance(0.5)) n.time_ms = static_cast<double>(rng_.uniform(1, 500)) / 100.0;
  return emit(std::move(n));
}

SymSize Generator::make_dim(SizeClass size_class, bool leading) {
  if (leading && rng_.chance(0.25)) return SymSize::symbolic("s0", seq_hint_);
  if (leading && rng_.chance(0.04)) {
    return SymSize::symbolic("u" + std::to_string(next_unbacked_++), std::nullopt);
  }
  static constexpr std::array<std::int64_t, 7> kSmallDims = {1, 2, 3, 4, 8, 16, 32};
  static constexpr std::array<std::int64_t, 8> kLargeDims = {4, 8, 64, 128, 256, 512, 1024, 2048};
  return SymSize::concrete(size_class == SizeClass::kLarge ? rng_.pick(kLargeDims)
                                                           : rng_.pick(kSmallDims));
}

void Generator::set_contiguous_strides(TensorInfo& tensor) const {
  tensor.strides.assign(tensor.sizes.size(), SymSize::concrete(1));
  std::int64_t stride = 1;
  std::string symbols;  // product of the symbolic sizes to the right
  bool unbacked = false;
  for (std::size_t i = tensor.sizes.size(); i-- > 0;) {
    if (symbols.empty()) {
      tensor.strides[i] = SymSize::concrete(stride);
    } else {
      std::optional<std::int64_t> hint;
      if (!unbacked) hint = stride;
      tensor.strides[i] = SymSize::symbolic(symbols + "*" + std::to_string(stride), hint);
    }
    const SymSize& size = tensor.sizes[i];
    if (size.is_concrete()) {
      stride *= *size.hint;
    } else {
      symbols += (symbols.empty() ? "" : "*") + size.symbol;
      if (size.hint) stride *= *size.hint;
      unbacked = unbacked || !size.hint;
    }
  }
}

TensorInfo Generator::make_tensor(SizeClass size_class, bool allow_odd) {
  TensorInfo tensor;
  const bool bf16 = rng_.chance(0.6);
  tensor.dtype = bf16 ? "bfloat16" : "float32";
  tensor.element_size = bf16 ? 2 : 4;
  const std::int64_t roll = rng_.uniform(0, 99);
  const int rank = roll < 10 ? 1 : roll < 55 ? 2 : roll < 90 ? 3 : 4;
  for (int i = 0; i < rank; ++i) tensor.sizes.push_back(make_dim(size_class, i == 0));
  if (rank >= 2 && size_class == SizeClass::kLarge) {
    static constexpr std::array<std::int64_t, 5> kLastDims = {256, 512, 1024, 2048, 4096};
    tensor.sizes.back() = SymSize::concrete(rng_.pick(kLastDims));
  }
  tensor.device = "cuda:0";
  tensor.contiguous = true;
  set_contiguous_strides(tensor);
  tensor.storage = next_storage_++;
  if (!allow_odd) return tensor;
  if (rank >= 2 && rng_.chance(0.08)) {  // a strided (e.g. channels-last) result
    std::swap(tensor.strides[0], tensor.strides[1]);
    tensor.contiguous = false;
  }
  if (rng_.chance(0.06)) tensor.strides.clear();  // strides unknown
  if (rng_.chance(0.03)) tensor.storage.reset();  // storage identity unknown
  tensor.dtensor_like = rng_.chance(0.03);
  return tensor;
}

TensorInfo Generator::aliased(NodeId base, std::vector<SymSize> sizes, bool contiguous) const {
  TensorInfo tensor = tensor_of(base);
  tensor.sizes = std::move(sizes);
  tensor.contiguous = contiguous;
  set_contiguous_strides(tensor);
  if (!contiguous && tensor.strides.size() >= 2) {
    std::swap(tensor.strides[tensor.strides.size() - 1], tensor.strides[tensor.strides.size() - 2]);
  }
  return tensor;
}

NodeId Generator::pick_recent(const std::vector<NodeId>& pool) {
  // Favour the last few values, as real layers read what was just computed.
  const std::int64_t size = static_cast<std::int64_t>(pool.size());
  if (rng_.chance(0.7))
    return pool[static_cast<std::size_t>(
        rng_.uniform(std::max<std::int64_t>(0, size - 4), size - 1))];
  return pool[static_cast<std::size_t>(rng_.uniform(0, size - 1))];
}

void Generator::remember_forward(NodeId id, int block) {
  forward_pool_.push_back(id);
  block_values_[static_cast<std::size_t>(block)].push_back(id);
}

void Generator::emit_inputs() {
  const int weights = static_cast<int>(rng_.uniform(2, 4));
  for (int i = 0; i < weights; ++i) {
    Node n;
    n.name = "primals_" + std::to_string(i + 1);
    n.kind = NodeKind::kPlaceholder;
    n.target = n.name;
    n.value = Value::of_tensor(make_tensor(random_size(), false));
    inputs_.push_back(emit(std::move(n)));
  }
  Node x;
  x.name = "x";
  x.kind = NodeKind::kPlaceholder;
  x.target = "x";
  TensorInfo x_tensor = make_tensor(SizeClass::kLarge, false);
  x_tensor.sizes[0] = SymSize::symbolic("s0", seq_hint_);
  set_contiguous_strides(x_tensor);
  x.value = Value::of_tensor(x_tensor);
  inputs_.push_back(emit(std::move(x)));
  if (rng_.chance(0.3)) {  // a second input sharing the first one's storage
    Node shared;
    shared.name = "x_alias";
    shared.kind = NodeKind::kPlaceholder;
    shared.target = "x_alias";
    shared.value = Value::of_tensor(x_tensor);
    inputs_.push_back(emit(std::move(shared)));
  }
  if (rng_.chance(0.3)) {
    Node attr;
    attr.name = "model_embed_weight";
    attr.kind = NodeKind::kGetAttr;
    attr.target = "model.embed.weight";
    attr.value = Value::of_tensor(make_tensor(random_size(), false));
    inputs_.push_back(emit(std::move(attr)));
  }
  Node tangent;
  tangent.name = "tangents_1";
  tangent.kind = NodeKind::kPlaceholder;
  tangent.target = "tangents_1";
  tangent.value = Value::of_tensor(make_tensor(SizeClass::kSmall, false));
  emit(std::move(tangent));
}

void Generator::emit_forward_op(const Region& region) {
  const Phase fwd = Phase::kForward;
  const Stack& stack = region.stack;
  std::vector<NodeId> pool = block_values_[static_cast<std::size_t>(region.block)];
  if (pool.empty()) pool = forward_pool_.empty() ? inputs_ : forward_pool_;
  const NodeId a = pick_recent(pool);
  const NodeId b = rng_.chance(0.8) ? pick_recent(pool) : rng_.pick(inputs_);
  const std::int64_t roll = rng_.uniform(0, 99);

  if (roll < 40) {  // fresh compute
    static constexpr std::array<std::string_view, 5> kComputeTargets = {
        "aten.mm.default", "aten.add.Tensor", "aten.mul.Tensor", "aten.relu.default",
        "aten.gelu.default"};
    const std::string target(rng_.pick(kComputeTargets));
    std::vector<Arg> args = {Arg::of_node(a)};
    std::vector<std::pair<std::string, Arg>> kwargs;
    if (target == "aten.mm.default" || target == "aten.add.Tensor" || target == "aten.mul.Tensor") {
      args.push_back(Arg::of_node(b));
    }
    if (target == "aten.add.Tensor" && rng_.chance(0.3))
      kwargs.push_back({"alpha", Arg::of_int(2)});
    if (target == "aten.gelu.default" && rng_.chance(0.5)) {
      kwargs.push_back({"approximate", Arg::of_string("tanh")});
    }
    const std::string base = target.substr(5, target.find('.', 5) - 5);
    remember_forward(
        call(target, base, std::move(args), Value::of_tensor(make_tensor(random_size())), fwd,
             stack, std::move(kwargs)),
        region.block);
  } else if (roll < 52) {  // a chain of views, sometimes ending in _unsafe_view
    NodeId current = a;
    const int length = static_cast<int>(rng_.uniform(1, 3));
    for (int i = 0; i < length; ++i) {
      const TensorInfo& base = tensor_of(current);
      const std::int64_t kind = rng_.uniform(0, 3);
      if (kind == 0 && base.rank() == 2) {
        current = call("aten.t.default", "t", {Arg::of_node(current)},
                       Value::of_tensor(aliased(current, {base.sizes[1], base.sizes[0]}, false)),
                       fwd, stack);
      } else if (kind == 1 && base.rank() >= 2) {
        std::vector<SymSize> sizes = base.sizes;
        std::swap(sizes[sizes.size() - 1], sizes[sizes.size() - 2]);
        current = call(
            "aten.transpose.int", "transpose",
            {Arg::of_node(current), Arg::of_int(base.rank() - 2), Arg::of_int(base.rank() - 1)},
            Value::of_tensor(aliased(current, std::move(sizes), false)), fwd, stack);
      } else {
        // Leading 1 prepended: same bytes, one more dimension.
        std::vector<SymSize> sizes = base.sizes;
        sizes.insert(sizes.begin(), SymSize::concrete(1));
        std::vector<Arg> size_list;
        for (const SymSize& s : sizes) {
          if (s.is_concrete()) {
            size_list.push_back(Arg::of_int(*s.hint));
          } else {
            Arg sym;
            sym.kind = Arg::Kind::kSymInt;
            sym.sym = s;
            size_list.push_back(sym);
          }
        }
        const bool unsafe = kind == 3;
        current =
            call(unsafe ? "aten._unsafe_view.default" : "aten.view.default",
                 unsafe ? "_unsafe_view" : "view",
                 {Arg::of_node(current), Arg::of_list(std::move(size_list))},
                 Value::of_tensor(aliased(current, std::move(sizes), base.contiguous)), fwd, stack);
      }
    }
    // Half the chains feed forward; the rest are read only by backward.
    if (rng_.chance(0.5))
      remember_forward(current, region.block);
    else
      block_values_[static_cast<std::size_t>(region.block)].push_back(current);
  } else if (roll < 58) {  // tuple-returning op read through getitem
    Value result;
    result.kind = ValueKind::kSequence;
    for (int i = 0; i < 3; ++i)
      result.elements.push_back(
          Value::of_tensor(make_tensor(i == 0 ? random_size() : SizeClass::kSmall)));
    const NodeId ln = call("aten.native_layer_norm.default", "native_layer_norm",
                           {Arg::of_node(a), Arg::of_list({Arg::of_int(64)}), Arg::of_node(b),
                            Arg::none(), Arg::of_other("1e-05")},
                           result, fwd, stack);
    for (int i = 0; i < 3; ++i) {
      if (i > 0 && rng_.chance(0.5)) continue;
      const NodeId item = call("operator.getitem", "getitem", {Arg::of_node(ln), Arg::of_int(i)},
                               result.elements[static_cast<std::size_t>(i)], fwd, stack);
      remember_forward(item, region.block);
    }
  } else if (roll < 62) {  // split: a view returning a list, members read by getitem
    const TensorInfo& base = tensor_of(a);
    Value result;
    result.kind = ValueKind::kSequence;
    for (int i = 0; i < 2; ++i)
      result.elements.push_back(Value::of_tensor(aliased(a, base.sizes, base.contiguous)));
    const NodeId split =
        call("aten.split.Tensor", "split", {Arg::of_node(a), Arg::of_int(2), Arg::of_int(0)},
             result, fwd, stack);
    for (int i = 0; i < 2; ++i) {
      remember_forward(call("operator.getitem", "getitem", {Arg::of_node(split), Arg::of_int(i)},
                            result.elements[static_cast<std::size_t>(i)], fwd, stack),
                       region.block);
    }
  } else if (roll < 68) {  // in-place write of one positional argument
    std::vector<std::pair<std::string, Arg>> kwargs;
    if (rng_.chance(0.3)) kwargs.push_back({"alpha", Arg::of_int(1)});
    remember_forward(call("aten.add_.Tensor", "add_", {Arg::of_node(a), Arg::of_node(b)},
                          Value::of_tensor(tensor_of(a)), fwd, stack, std::move(kwargs)),
                     region.block);
  } else if (roll < 72) {  // keyword-only out= write
    const NodeId out_target =
        rng_.chance(0.5) ? b : rng_.pick(forward_pool_.empty() ? inputs_ : forward_pool_);
    remember_forward(call("aten.mul.out", "mul_out", {Arg::of_node(a), Arg::of_node(b)},
                          Value::of_tensor(tensor_of(out_target)), fwd, stack,
                          {{"out", Arg::of_node(out_target)}}),
                     region.block);
  } else if (roll < 76) {  // Tensor[] write returning nothing
    call("aten._foreach_add_.Scalar", "_foreach_add_",
         {Arg::of_list({Arg::of_node(a), Arg::of_node(b)}), Arg::of_other("1.0")}, Value::none(),
         fwd, stack);
  } else if (roll < 79) {  // mutable schema whose written argument is absent
    call("mylib.fused_update_.default", "fused_update_", {Arg::of_node(a)}, Value::none(), fwd,
         stack);
  } else if (roll < 82) {  // in-place method: no schema
    remember_forward(call("mul_", "mul__method", {Arg::of_node(a), Arg::of_other("2.0")},
                          Value::of_tensor(tensor_of(a)), fwd, stack, {}, NodeKind::kCallMethod),
                     region.block);
  } else if (roll < 84) {  // a submodule call: no schema
    remember_forward(
        call(stack.back() + ".act", "act", {Arg::of_node(a)},
             Value::of_tensor(make_tensor(random_size())), fwd, stack, {}, NodeKind::kCallModule),
        region.block);
  } else if (roll < 87) {  // opaque call_function without a schema entry
    remember_forward(call("mylib.opaque.default", "opaque", {Arg::of_node(a)},
                          Value::of_tensor(make_tensor(random_size())), fwd, stack),
                     region.block);
  } else if (roll < 91) {  // a functional collective and its wait
    const NodeId reduced = call("_c10d_functional.all_reduce.default", "all_reduce",
                                {Arg::of_node(a), Arg::of_string("sum"), Arg::of_string("0")},
                                Value::of_tensor(make_tensor(random_size())), fwd, stack);
    remember_forward(
        call("_c10d_functional.wait_tensor.default", "wait_tensor", {Arg::of_node(reduced)},
             Value::of_tensor(tensor_of(reduced)), fwd, stack),
        region.block);
  } else if (roll < 94) {  // a symbolic size read from a tensor
    Value size;
    size.kind = ValueKind::kSymInt;
    size.scalar = tensor_of(a).rank() > 0 ? tensor_of(a).sizes[0] : SymSize::concrete(1);
    call("aten.sym_size.int", "sym_size_int", {Arg::of_node(a), Arg::of_int(0)}, size, fwd, stack);
  } else {  // an alias of an input without a view schema: external storage
    const NodeId input = rng_.pick(inputs_);
    const TensorInfo& base = tensor_of(input);
    std::vector<Arg> size_list;
    for (const SymSize& s : base.sizes) size_list.push_back(Arg::of_int(s.hint.value_or(1)));
    remember_forward(
        call("aten._unsafe_view.default", "_unsafe_view",
             {Arg::of_node(input), Arg::of_list(std::move(size_list))},
             Value::of_tensor(aliased(input, base.sizes, base.contiguous)), fwd, stack),
        region.block);
  }
}

void Generator::emit_forward_region(const Region& region) {
  const int ops = static_cast<int>(rng_.uniform(2, 7));
  for (int i = 0; i < ops; ++i) emit_forward_op(region);
}

void Generator::emit_backward_block(int block) {
  const Phase bwd = Phase::kBackward;
  const Stack& stack = block_stacks_[static_cast<std::size_t>(block)];
  const std::vector<NodeId>& saved_pool = block_values_[static_cast<std::size_t>(block)];
  const int ops = static_cast<int>(rng_.uniform(1, 5));
  for (int i = 0; i < ops; ++i) {
    const std::int64_t source = rng_.uniform(0, 99);
    NodeId saved = source < 75 && !saved_pool.empty()      ? rng_.pick(saved_pool)
                   : source < 92 && !forward_pool_.empty() ? rng_.pick(forward_pool_)
                                                           : rng_.pick(inputs_);
    const Stack& node_stack = rng_.chance(0.85) ? stack : Stack{};
    if (rng_.chance(0.2) && tensor_of(saved).rank() >= 2) {  // a backward view of a saved value
      const TensorInfo& base = tensor_of(saved);
      std::vector<SymSize> sizes = base.sizes;
      std::swap(sizes[sizes.size() - 1], sizes[sizes.size() - 2]);
      saved =
          call("aten.transpose.int", "transpose",
               {Arg::of_node(saved), Arg::of_int(base.rank() - 2), Arg::of_int(base.rank() - 1)},
               Value::of_tensor(aliased(saved, std::move(sizes), false)), bwd, node_stack);
    }
    const std::int64_t roll = rng_.uniform(0, 99);
    if (roll < 6) {  // backward writes a saved forward value in place
      call("aten.add_.Tensor", "add_", {Arg::of_node(saved), Arg::of_node(grad_)},
           Value::of_tensor(tensor_of(saved)), bwd, node_stack);
    } else if (roll < 10) {
      call("aten._foreach_add_.Scalar", "_foreach_add_",
           {Arg::of_list({Arg::of_node(grad_), Arg::of_node(saved)}), Arg::of_other("1.0")},
           Value::none(), bwd, node_stack);
    } else if (roll < 14) {  // in-place on the gradient itself: harmless to saved values
      grad_ = call("aten.add_.Tensor", "add_", {Arg::of_node(grad_), Arg::of_node(saved)},
                   Value::of_tensor(tensor_of(grad_)), bwd, node_stack);
    } else {
      const std::string target = rng_.chance(0.5) ? "aten.mul.Tensor" : "aten.mm.default";
      grad_ = call(target, target == "aten.mm.default" ? "mm" : "mul",
                   {Arg::of_node(grad_), Arg::of_node(saved)},
                   Value::of_tensor(make_tensor(random_size(), false)), bwd, node_stack);
      if (rng_.chance(0.3)) grads_.push_back(grad_);
    }
  }
}

void Generator::emit_output(NodeId loss) {
  std::vector<Arg> results = {Arg::of_node(loss)};
  for (NodeId grad : grads_) results.push_back(Arg::of_node(grad));
  results.push_back(Arg::of_node(grad_));
  if (rng_.chance(0.15) && !forward_pool_.empty()) {  // a forward value is also returned
    results.push_back(Arg::of_node(rng_.pick(forward_pool_)));
  }
  if (rng_.chance(0.5)) results.push_back(Arg::none());
  Node out;
  out.name = "output";
  out.kind = NodeKind::kOutput;
  out.target = "output";
  out.args = {Arg::of_list(std::move(results))};
  out.phase = Phase::kBackward;
  emit(std::move(out));
}

Graph Generator::generate() {
  graph_.name = "random joint graph";
  graph_.metadata["generator"] = "spillway::testing::make_random_joint_graph";
  graph_.ops = make_schemas();
  seq_hint_ = rng_.pick(std::vector<std::int64_t>{128, 512, 1024, 2048});
  emit_inputs();

  const int blocks = static_cast<int>(rng_.uniform(1, 4));
  const bool shared_attention = rng_.chance(0.25);  // one self_attn reused by every block
  block_values_.resize(static_cast<std::size_t>(blocks));
  static constexpr std::array<std::string_view, 3> kOtherModules = {"mlp", "self_attn_norm",
                                                                    "cross_attn"};
  for (int block = 0; block < blocks; ++block) {
    const std::string layer = "model.layers." + std::to_string(block);
    Region attention{block, {"model", layer, layer + ".self_attn"}};
    if (shared_attention && (block == 0 || rng_.chance(0.8))) {
      attention.stack = {"model", layer, "model.shared.self_attn"};
    } else if (rng_.chance(0.3)) {
      attention.stack.push_back(layer + ".self_attn.rotary");  // nested inside the scope
    }
    // The mlp region of block 0 always exists so scope "mlp" matches a module.
    const std::string other(block == 0 ? "mlp" : rng_.pick(kOtherModules));
    std::string outside_module = layer;
    outside_module.append(".").append(other);
    const Region outside{block, {"model", layer, std::move(outside_module)}};
    block_stacks_.push_back(attention.stack);
    if (rng_.chance(0.5)) {
      emit_forward_region(attention);
      emit_forward_region(outside);
    } else {
      emit_forward_region(outside);
      emit_forward_region(attention);
      if (rng_.chance(0.3)) emit_forward_region(outside);
    }
  }

  const NodeId last = forward_pool_.empty() ? inputs_.back() : forward_pool_.back();
  TensorInfo scalar = make_tensor(SizeClass::kSmall, false);
  scalar.sizes.clear();
  scalar.strides.clear();
  const NodeId loss = call("aten.sum.default", "sum", {Arg::of_node(last)},
                           Value::of_tensor(scalar), Phase::kForward, {"model"});
  grad_ = call("aten.ones_like.default", "ones_like", {Arg::of_node(loss)},
               Value::of_tensor(make_tensor(SizeClass::kSmall, false)), Phase::kBackward, {});
  for (int block = blocks - 1; block >= 0; --block) emit_backward_block(block);
  emit_output(loss);
  return std::move(graph_);
}

}  // namespace

Rng::Rng(std::uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}

std::uint64_t Rng::next() {
  // splitmix64: tiny, fast, and identical on every platform.
  std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::int64_t Rng::uniform(std::int64_t lo, std::int64_t hi) {
  const std::uint64_t span = static_cast<std::uint64_t>(hi - lo) + 1;
  return lo + static_cast<std::int64_t>(next() % span);
}

bool Rng::chance(double p) { return static_cast<double>(next() >> 11) * 0x1.0p-53 < p; }

Graph make_random_joint_graph(std::uint64_t seed) { return Generator(seed).generate(); }

ActivationPlanOptions make_random_plan_options(std::uint64_t seed) {
  Rng rng(seed ^ 0x5EED0F0F5EED0F0Full);
  ActivationPlanOptions options;
  options.mode = rng.chance(0.04) ? ActivationMode::kNone : ActivationMode::kScope;
  options.scope = rng.chance(0.85) ? "self_attn" : "mlp";
  options.host_budget_bytes = rng.chance(0.4) ? 0 : rng.uniform(1, 64) << 20;
  options.min_bytes =
      rng.pick(std::vector<std::int64_t>{0, 1, 4096, 65536, 1 << 20, 1 << 20, 4 << 20});
  options.prefetch_regions = static_cast<int>(rng.uniform(0, 3));
  return options;
}

std::string describe_options(const ActivationPlanOptions& options) {
  return std::string("mode=") + (options.mode == ActivationMode::kNone ? "none" : "scope") +
         " scope=" + options.scope +
         " host_budget_bytes=" + std::to_string(options.host_budget_bytes) +
         " min_bytes=" + std::to_string(options.min_bytes) +
         " prefetch_regions=" + std::to_string(options.prefetch_regions);
}

}  // namespace spillway::testing
