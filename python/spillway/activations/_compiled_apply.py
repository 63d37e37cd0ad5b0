"""Replay a Spillway plan's edits on aot_autograd's joint FX graph.

The planner (spillway._C.plan_activation_offload) works on the graph as
spillway.fx_export serialised it, where a node's id is its position in
graph.nodes. Its edits come back in application order; each insertion carries
the new node complete (target, args, phase, value). This module turns them
into FX nodes calling torch.ops.spillway.*, with fake-tensor meta["val"] and
the partitioner tags that keep each node on its side of the forward/backward
boundary:

  * offload and the forward wait are tagged "must_be_in_forward": the host
    tensor (the wait's output) is what the forward saves for backward;
  * reload, the backward wait, replayed views and replayed pointwise ops
    (replay_pointwise) are tagged "must_be_in_backward": they run in backward,
    reading the saved host tensor or what was rebuilt from it.

Note [Forward wait without last_use]: the planner's forward wait reads the
value's last forward use as its third argument (an ordering edge in the IR).
Replayed on the FX graph that edge would give the last use one more user,
and Inductor's pattern passes fuse only nodes whose users they see: with the
wait reading `mm`, the residual `x + tanh(x) @ w` stayed an mm plus a
separate add instead of one addmm, and its weight gradient moved in the last
bits (a custom autograd.Function in a residual layer, CPU, 2026-11-30). So
the FX wait gets no last_use; it sits right after the last use in graph order,
which the partitioner keeps and aot_eager runs as is, and
_compiled_inductor.py keeps it after the value's last reader under
Inductor with ordering-only dependencies, which change no fusion.

A replay copies a forward FX node: a replayed view ("spillway_replay_<name>")
the node <name>, a replayed pointwise op (edit kind "replay_op") the node its
edit names as source. The copy takes the node's target,
its literal args and kwargs (SymInts included), and the meta that points at
the model code; its node inputs are the planner's (reloads, other copies). It
carries no "recompute" tag of its own: it is a backward node, not a forward
one the partitioner may choose to recompute. A replayed view may return a
list (a split: Phi3 chunks its fused gate_up projection) and be read by
replayed operator.getitem nodes (target "operator.getitem", the index taken
from the copied node like any literal); their fake values, a list of tensors
and one of them, come from running the copy's target on the inputs' fake
values as for any op.

Nothing here specialises a symbolic size: fake values are computed from the
producers' fake values with guard recording suppressed (the ops and views only
re-state facts the original trace already established).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

from spillway.fx_export._serialize import target_string

_FORWARD_TAG = "must_be_in_forward"
_BACKWARD_TAG = "must_be_in_backward"

_SPILLWAY_TARGETS = {
    "spillway.offload.default": lambda: torch.ops.spillway.offload.default,
    "spillway.reload.default": lambda: torch.ops.spillway.reload.default,
    "spillway.wait_tensor.default": lambda: torch.ops.spillway.wait_tensor.default,
}

# Meta keys copied from the node an inserted node serves, so stack traces,
# module stacks and provenance point at the model code that produced the value.
_COPIED_META = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "source_fn_stack",
                "original_aten", "from_node", "seq_nr")


class EditError(RuntimeError):
    """A plan edit could not be replayed on the FX graph; names the edit and node."""


_REPLAY_PREFIX = "spillway_replay_"


def _resolve_target(name: str, index: int) -> Any:
    """torch.ops.<ns>.<op>.<overload> for "ns.op.overload"."""
    parts = name.split(".")
    try:
        if len(parts) != 3:
            raise AttributeError(name)
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except AttributeError:
        raise EditError(f"[compiled] edit {index}: unknown op target '{name}'") from None


def _suppress_guards(vals: list[Any]):
    stack = contextlib.ExitStack()
    for val in vals:
        shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
        if shape_env is not None:
            stack.enter_context(shape_env.suppress_guards())
            break
    return stack


def _meta_val(arg: Any) -> Any:
    return torch.fx.node.map_arg(arg, lambda n: n.meta["val"])


def _fake_value(target: Any, args: tuple, kwargs: dict, fake_mode: Any) -> Any:
    vals = list(_meta_val(args)) + list(_meta_val(kwargs).values())
    with _suppress_guards([v for v in vals if isinstance(v, torch.Tensor)]):
        with fake_mode:
            return target(*_meta_val(args), **_meta_val(kwargs))


class EditReplayer:
    """Applies one plan's edit_list to `graph` (whose node ids are positions)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.by_id: dict[int, torch.fx.Node] = dict(enumerate(graph.nodes))
        self.by_name = {node.name: node for node in graph.nodes}
        self.after_runs: dict[int, torch.fx.Node] = {}
        vals = [n.meta.get("val") for n in graph.nodes]
        self.fake_mode = torch._guards.detect_fake_mode(
            [v for v in vals if isinstance(v, torch.Tensor)])
        if self.fake_mode is None:
            raise EditError("[compiled] the joint graph carries no fake values (meta['val'])")

    def node(self, node_id: int, edit_index: int) -> torch.fx.Node:
        try:
            return self.by_id[node_id]
        except KeyError:
            raise EditError(f"[compiled] edit {edit_index} names node {node_id}, "
                            "which the FX graph does not have") from None

    def apply(self, edits: list[dict]) -> list[torch.fx.Node]:
        """Applies every edit in order; returns the inserted nodes."""
        inserted = []
        for index, edit in enumerate(edits):
            if edit["kind"] == "redirect":
                reader = self.node(edit["reader"], index)
                reader.replace_input_with(self.node(edit["from"], index),
                                          self.node(edit["to"], index))
            else:
                inserted.append(self._insert(edit, index))
        return inserted

    def _decode(self, encoded: Any, original: Any, index: int) -> Any:
        """A planner arg as an FX arg; literals come from `original` when given."""
        if isinstance(encoded, dict) and "node" in encoded:
            return self.node(encoded["node"], index)
        if isinstance(encoded, list):
            originals = original if isinstance(original, (list, tuple)) else [None] * len(encoded)
            items = [self._decode(e, o, index) for e, o in zip(encoded, originals)]
            return type(original)(items) if isinstance(original, tuple) else items
        return original if original is not None else encoded

    def _decode_literal(self, encoded: Any, index: int) -> Any:
        if isinstance(encoded, dict):
            if "node" in encoded:
                return self.node(encoded["node"], index)
            raise EditError(f"[compiled] edit {index}: argument {encoded} has no FX literal")
        if isinstance(encoded, list):
            return [self._decode_literal(e, index) for e in encoded]
        return encoded

    def _call(self, edit: dict, index: int) -> tuple[Any, tuple, dict, torch.fx.Node | None]:
        """The target, args and kwargs of a new node, and the FX node it copies (replays)."""
        node = edit["node"]
        target_name = node["target"]
        if target_name in _SPILLWAY_TARGETS:
            target = _SPILLWAY_TARGETS[target_name]()
            args = [self._decode(a, None, index) for a in node["args"]]
            if target is torch.ops.spillway.reload.default:
                args[1] = torch.device(args[1])
            if edit["kind"] == "forward_wait" and len(args) == 3:
                args[2] = None  # Note [Forward wait without last_use]
            kwargs = {k: self._decode(v, None, index) for k, v in node["kwargs"].items()}
            return target, tuple(args), kwargs, None
        if not node["name"].startswith(_REPLAY_PREFIX):
            # Another aten op the planner adds (the permutes of dense storages):
            # its literals are plain JSON (ints, lists of ints).
            target = _resolve_target(target_name, index)
            args = tuple(self._decode_literal(a, index) for a in node["args"])
            kwargs = {k: self._decode_literal(v, index) for k, v in node["kwargs"].items()}
            return target, args, kwargs, None
        # A replayed view or pointwise op: the planner copied a forward node (a
        # pointwise copy names it as its source) and remapped its node inputs; its
        # literals (SymInts included) are taken from that node.
        if edit["kind"] == "replay_op":
            copied = self.node(edit["source"], index)
            copied_name = copied.name
        else:
            copied_name = node["name"].removeprefix(_REPLAY_PREFIX)
            copied = self.by_name.get(copied_name)
        if copied is None or copied.op != "call_function":
            raise EditError(f"[compiled] edit {index} replays '{copied_name}', which the FX "
                            "graph does not have")
        if target_name != target_string(copied):
            raise EditError(f"[compiled] edit {index} replays '{copied_name}' as {target_name}, "
                            f"but the FX node calls {target_string(copied)}")
        args = tuple(self._decode(a, o, index) for a, o in zip(node["args"], copied.args))
        kwargs = {k: self._decode(v, copied.kwargs.get(k), index)
                  for k, v in node["kwargs"].items()}
        return copied.target, args, kwargs, copied

    def _insert(self, edit: dict, index: int) -> torch.fx.Node:
        node = edit["node"]
        target, args, kwargs, copied = self._call(edit, index)
        anchor_id = edit["anchor"]
        anchor = self.node(anchor_id, index)
        if edit["placement"] == "after":
            point = self.after_runs.get(anchor_id, anchor)
            context = self.graph.inserting_after(point)
        else:
            context = self.graph.inserting_before(anchor)
        with context:
            fx_node = self.graph.create_node("call_function", target, args, kwargs,
                                             name=node["name"])
        if edit["placement"] == "after":
            self.after_runs[anchor_id] = fx_node

        source = self.node(edit["source"], index)
        meta_from = copied if copied is not None else source
        for key in _COPIED_META:
            if key in meta_from.meta:
                fx_node.meta[key] = meta_from.meta[key]
        fx_node.meta["val"] = _fake_value(target, args, kwargs, self.fake_mode)
        backward = node.get("phase") == "backward"
        fx_node.meta["partitioner_tag"] = _BACKWARD_TAG if backward else _FORWARD_TAG
        if backward:
            fx_node.meta["autograd_backward"] = True
        fx_node.meta["spillway_edit"] = edit["kind"]
        self.by_id[node["id"]] = fx_node
        self.by_name[fx_node.name] = fx_node
        return fx_node
