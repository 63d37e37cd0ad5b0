#pragma once
// Hand-built graphs for the IR tests. Test-only; not part of spillway_ir.

#include <limits>
#include <string>

#include "spillway/graph.h"

namespace spillway::ir::testing {

inline TensorInfo bf16_tensor(std::vector<SymSize> sizes, std::int64_t storage) {
  TensorInfo t;
  t.dtype = "bfloat16";
  t.element_size = 2;
  t.sizes = std::move(sizes);
  std::int64_t stride = 1;
  t.strides.resize(t.sizes.size());
  for (std::size_t d = t.sizes.size(); d-- > 0;) {
    t.strides[d] = SymSize::concrete(stride);
    stride *= t.sizes[d].hint.value_or(1);
  }
  t.contiguous = true;
  t.storage = storage;
  t.device = "cuda:0";
  return t;
}

inline Node make_node(NodeId id, std::string name, NodeKind kind, std::string target) {
  Node n;
  n.id = id;
  n.name = std::move(name);
  n.kind = kind;
  n.target = std::move(target);
  return n;
}

// x, w placeholders; mm with a schema; a split producing a sequence; getitem;
// a sym_int size; an op whose kwargs are not in alphabetical order; every Arg
// kind, every Value kind, symbolic and unbacked dims; an output node.
inline Graph rich_graph() {
  Graph g;
  g.name = "rich \"test\" graph";
  g.metadata = {{"torch", "2.13.0+cpu"}, {"model", "tiny"}};
  g.ops["aten.mm.default"] = {"aten", false, false, {{"self"}, {"mat2"}}};
  g.ops["aten.split.Tensor"] = {"aten", false, true, {{"self"}, {"split_size"}, {"dim"}}};
  g.ops["aten.add_.Tensor"] = {
      "aten", true, false, {{"self", false, true}, {"other"}, {"alpha", true, false}}};
  g.ops["aten.full.default"] = {
      "aten", false, false,
      {{"size"}, {"fill_value"}, {"pin_memory", true}, {"dtype", true}, {"layout", true},
       {"device", true}}};

  Node x = make_node(10, "x", NodeKind::kPlaceholder, "x");
  x.value = Value::of_tensor(
      bf16_tensor({SymSize::symbolic("s0", 4), SymSize::concrete(8)}, 1));
  Node w = make_node(3, "w", NodeKind::kGetAttr, "model.w");
  w.value = Value::of_tensor(bf16_tensor({SymSize::concrete(8), SymSize::concrete(8)}, 2));
  w.module_stack = {"model", "model.layers.0"};

  Node mm = make_node(11, "mm", NodeKind::kCallFunction, "aten.mm.default");
  mm.args = {Arg::of_node(10), Arg::of_node(3)};
  mm.value = Value::of_tensor(bf16_tensor({SymSize::symbolic("s0", 4), SymSize::concrete(8)}, 3));
  mm.value.tensor.strides.clear();  // unknown strides
  mm.value.tensor.contiguous = false;
  mm.module_stack = {"model", "model.layers.0", "model.layers.0.q_proj"};
  mm.time_ms = 0.25;

  Node split = make_node(12, "split", NodeKind::kCallFunction, "aten.split.Tensor");
  split.args = {Arg::of_node(11), Arg::of_int(2), Arg::of_int(-1)};
  split.value.kind = ValueKind::kSequence;
  for (int k = 0; k < 2; ++k) {
    TensorInfo half = bf16_tensor({SymSize::symbolic("u0", std::nullopt), SymSize::concrete(4)}, 3);
    half.storage.reset();  // identity not proven
    half.dtensor_like = k == 1;
    split.value.elements.push_back(Value::of_tensor(half));
  }
  split.phase = Phase::kBackward;

  Node getitem = make_node(13, "getitem", NodeKind::kCallFunction, "operator.getitem");
  getitem.args = {Arg::of_node(12), Arg::of_int(0)};
  getitem.value = split.value.elements[0];

  Node size = make_node(14, "sym_size", NodeKind::kCallFunction, "aten.sym_size.int");
  size.args = {Arg::of_node(10), Arg::of_int(0)};
  size.value.kind = ValueKind::kSymInt;
  size.value.scalar = SymSize::symbolic("s0", 4);

  Node full = make_node(15, "full", NodeKind::kCallFunction, "aten.full.default");
  Arg sym;
  sym.kind = Arg::Kind::kSymInt;
  sym.sym = SymSize::symbolic("s0", 4);
  full.args = {Arg::of_list({sym, Arg::of_int(8)}), Arg{}};
  full.args[1].kind = Arg::Kind::kDouble;
  full.args[1].d = -std::numeric_limits<double>::infinity();
  Arg no_pin;
  no_pin.kind = Arg::Kind::kBool;
  full.kwargs = {{"pin_memory", no_pin},
                 {"dtype", Arg::of_other("torch.bfloat16")},
                 {"layout", Arg::none()},
                 {"device", Arg::of_string("cuda:0")}};
  full.value = Value::of_tensor(bf16_tensor({SymSize::symbolic("s0", 4), SymSize::concrete(8)}, 4));

  Node add = make_node(16, "add_", NodeKind::kCallFunction, "aten.add_.Tensor");
  Arg half;
  half.kind = Arg::Kind::kDouble;
  half.d = 0.5;
  add.args = {Arg::of_node(15), Arg::of_node(11)};
  add.kwargs = {{"alpha", half}};
  add.value = full.value;

  Node item = make_node(17, "item", NodeKind::kCallMethod, "item");
  item.args = {Arg::of_node(16)};
  item.value.kind = ValueKind::kScalar;
  item.value.repr = "1.5";
  Node mod = make_node(18, "submod", NodeKind::kCallModule, "model.submod_0");
  mod.args = {Arg::of_node(17)};
  mod.value.kind = ValueKind::kOther;
  mod.value.repr = "<object>";

  Node scalar_tensor = make_node(19, "scalar", NodeKind::kPlaceholder, "scalar");
  TensorInfo rank0;
  rank0.dtype = "float32";
  rank0.element_size = 4;
  rank0.device = "cpu";
  scalar_tensor.value = Value::of_tensor(rank0);

  Node out = make_node(20, "output", NodeKind::kOutput, "output");
  out.args = {Arg::of_list({Arg::of_node(13), Arg::of_node(16), Arg::none()})};

  g.nodes = {x, w, mm, split, getitem, size, full, add, item, mod, scalar_tensor, out};
  return g;
}

}  // namespace spillway::ir::testing
