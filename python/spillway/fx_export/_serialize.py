"""Turn an FX GraphModule into a Spillway graph dict (docs/graph-format.md).

Everything here only reads the graph: it never specialises a symbolic size.
Symbolic facts are read from hints, with the shape environment's guard
recording suppressed, so exporting a dynamic graph installs no guard.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Iterable, Mapping

import torch
import torch.fx

FORMAT = "spillway.graph"
VERSION = 1

_BACKWARD_TAGS = ("is_backward", "must_be_in_backward")


class ExportError(RuntimeError):
    """The graph cannot be expressed in the Spillway format; the message names the node."""


# ---- targets and op schemas -------------------------------------------------------


def target_string(node: torch.fx.Node) -> str:
    """A stable spelling of node.target: "aten.mm.default", "operator.getitem", ..."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.mm.default"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name is None:
        return repr(target)
    if module in ("_operator", "operator"):
        module = "operator"
    return f"{module}.{name}" if module else name


def op_schema_entry(target: Any) -> dict | None:
    """The `ops` entry for an OpOverload target, or None for anything without a schema."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    arguments = []
    for argument in schema.arguments:
        entry: dict[str, Any] = {"name": argument.name}
        if argument.kwarg_only:
            entry["kwarg_only"] = True
        if argument.alias_info is not None and argument.alias_info.is_write:
            entry["write"] = True
        arguments.append(entry)
    is_view = any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )
    entry = {
        "namespace": target.namespace,
        "mutable": bool(schema.is_mutable),
        "view": bool(is_view),
    }
    # The op's torch tags, written only when set (docs/graph-format.md).
    tags = getattr(target, "tags", ())
    if torch.Tag.pointwise in tags:
        entry["pointwise"] = True
    if torch.Tag.nondeterministic_seeded in tags:
        entry["random"] = True
    entry["arguments"] = arguments
    return entry


def tagged_for_recompute(node: torch.fx.Node) -> bool:
    """Whether the trace tagged `node` for recompute in backward.

    torch.utils.checkpoint under torch.compile sets node.meta["recompute"] to a
    CheckpointPolicy: MUST_RECOMPUTE and PREFER_RECOMPUTE ask the partitioner
    to recompute the value; MUST_SAVE and PREFER_SAVE do not.
    """
    policy = node.meta.get("recompute")
    if policy is None:
        return False
    from torch.utils.checkpoint import CheckpointPolicy

    return policy in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


# ---- symbolic integers ------------------------------------------------------------


def _hint_of(node: Any) -> int | None:
    hint = node.hint
    if callable(hint):  # older torch spelled it as a method
        hint = hint()
    if hint is None:
        return None
    try:
        return int(hint)
    except (TypeError, ValueError):
        return None


def dim(value: Any) -> int | dict:
    """A size or stride: a plain int, or {"sym": expr, "hint": int|None}. Never guards."""
    if isinstance(value, torch.SymInt):
        node = value.node
        constant = node.maybe_as_int()
        if constant is not None:
            return int(constant)
        return {"sym": str(node.expr), "hint": _hint_of(node)}
    return int(value)


# ---- values -----------------------------------------------------------------------


class StorageIds:
    """Small stable integers for distinct storages, in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}

    def id_of(self, tensor: torch.Tensor) -> int | None:
        try:
            key = tensor.untyped_storage()._cdata
        except Exception:  # no storage (some wrapper subclasses): identity unknown
            return None
        return self._ids.setdefault(key, len(self._ids))


def _is_dtensor_like(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "device_mesh") or hasattr(tensor, "to_local")


def _tensor_value(tensor: torch.Tensor, storages: StorageIds) -> dict:
    try:
        strides = [dim(s) for s in tensor.stride()]
    except Exception:  # sparse and some subclasses have no strides
        strides = None
    try:
        contiguous = bool(tensor.is_contiguous())
    except Exception:
        contiguous = False
    return {
        "type": "tensor",
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "element_size": int(tensor.element_size()),
        "sizes": [dim(s) for s in tensor.shape],
        "strides": strides,
        "contiguous": contiguous,
        "storage": storages.id_of(tensor),
        "device": str(tensor.device),
        "dtensor": _is_dtensor_like(tensor),
    }


def value_of(val: Any, storages: StorageIds) -> dict:
    """The `value` of a node from its meta["val"]."""
    if val is None:
        return {"type": "none"}
    if isinstance(val, torch.Tensor):
        return _tensor_value(val, storages)
    if isinstance(val, (tuple, list)):
        return {"type": "sequence", "elements": [value_of(v, storages) for v in val]}
    if isinstance(val, torch.SymInt) or (isinstance(val, int) and not isinstance(val, bool)):
        return {"type": "sym_int", "value": dim(val)}
    if isinstance(val, (bool, float, torch.SymFloat, torch.SymBool)):
        return {"type": "scalar", "repr": _scalar_repr(val)}
    return {"type": "other", "repr": repr(val)}


def _scalar_repr(val: Any) -> str:
    if isinstance(val, (torch.SymFloat, torch.SymBool)):
        node = val.node
        hint = node.hint() if callable(node.hint) else node.hint
        return f"{node.expr} (hint {hint})"
    return repr(val)


# ---- arguments --------------------------------------------------------------------


def arg_of(value: Any, ids: Mapping[torch.fx.Node, int], where: str) -> Any:
    """Encode one FX argument; `where` names it in errors ("node 12 (mm_3) args[0]")."""
    if isinstance(value, torch.fx.Node):
        if value not in ids:
            raise ExportError(f"[fx_export] {where} refers to node {value.name} that comes later")
        return {"node": ids[value]}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"other": repr(value)}
    if isinstance(value, torch.SymInt):
        encoded = dim(value)
        return encoded
    if isinstance(value, (list, tuple)):
        return [arg_of(v, ids, f"{where}[{i}]") for i, v in enumerate(value)]
    return {"other": str(value) if isinstance(value, (torch.dtype, torch.device)) else repr(value)}


# ---- phases -----------------------------------------------------------------------


def phases_of(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """forward/backward for every node.

    torch >= 2.x tags every node that the joint trace recorded inside the
    autograd.grad call with meta["partitioner_tag"] == "is_backward" (tangent
    placeholders included), and the autograd engine's pre-hook marks the same
    call_function nodes with meta["autograd_backward"]. Either tag means
    backward. No positional rule ("everything after the first backward node")
    is used: in a 2.13 joint graph the tangent placeholders are tagged
    backward yet come before every forward op. Nearly every op the backward
    trace records carries the tag; an untagged op after the first tagged
    backward op (a slice a custom autograd.Function's backward returns) is
    backward too, since the joint trace records every forward op first. A graph without any tag (an older torch) falls back to the
    partitioner's classic rule: a node is backward when it is a tangent or
    depends on one. The output node of a joint graph returns the gradients and
    runs last, so it is backward whenever the graph has a backward part.
    """
    nodes = list(graph.nodes)
    tagged = any(
        "partitioner_tag" in n.meta or n.meta.get("autograd_backward") for n in nodes
    )
    phase: dict[torch.fx.Node, str] = {}
    backward_ops_started = False
    for node in nodes:
        if node.op == "output":
            continue
        if tagged:
            # Tagged, or an untagged op after the first tagged backward op:
            # torch 2.13 leaves some ops of a custom autograd.Function's
            # backward untagged (the slice of a saved tensor it returns), and
            # the joint trace records every forward op before any backward op.
            tag = (node.meta.get("partitioner_tag") in _BACKWARD_TAGS
                   or bool(node.meta.get("autograd_backward")))
            if tag and node.op == "call_function":
                backward_ops_started = True
            backward = tag or (backward_ops_started and node.op == "call_function")
        elif node.op == "placeholder":
            backward = "tangents" in node.name
        else:
            backward = any(phase.get(i) == "backward" for i in node.all_input_nodes)
        phase[node] = "backward" if backward else "forward"
    has_backward = any(p == "backward" for p in phase.values())
    for node in nodes:
        if node.op == "output":
            phase[node] = "backward" if has_backward else "forward"
    return phase


# ---- module stacks ----------------------------------------------------------------

_PATH_TOKEN = re.compile(
    r"""\[\s*'([^']*)'\s*\]|\[\s*"([^"]*)"\s*\]|\[\s*(\d+)\s*\]|\.?([A-Za-z_][A-Za-z0-9_]*|\d+)"""
)


def _path_tokens(name: str) -> list[str]:
    tokens = []
    for match in _PATH_TOKEN.finditer(name):
        token = next(g for g in match.groups() if g is not None)
        tokens.append(token)
    # "._modules['layers']" is dynamo's spelling of ".layers".
    return [t for i, t in enumerate(tokens) if not (t == "_modules" and i + 1 < len(tokens))]


def _same_type(module_type: type, recorded: Any) -> bool:
    if recorded is None:
        return True
    if isinstance(recorded, type):
        return module_type is recorded
    text = str(recorded)  # some torch versions record the type as a string
    return text in (module_type.__qualname__, f"{module_type.__module__}.{module_type.__qualname__}")


class ModuleNames:
    """Maps dynamo's module paths ("L['self'].model.layers[0]") to named_modules() names."""

    def __init__(self, known: Mapping[str, type] | Iterable[str] | None) -> None:
        if known is not None and not isinstance(known, Mapping):
            known = {name: None for name in known}
        self._known = dict(known) if known is not None else None
        self._cache: dict[tuple[str, Any], str | None] = {}

    def normalise(self, dynamo_name: str, module_type: Any = None) -> str | None:
        """The model's own name for a module, or None for the root module itself."""
        key = (dynamo_name, module_type)
        if key not in self._cache:
            self._cache[key] = self._normalise(dynamo_name, module_type)
        return self._cache[key]

    def _normalise(self, dynamo_name: str, module_type: Any) -> str | None:
        tokens = _path_tokens(dynamo_name)
        if self._known is not None:
            # Drop the shortest prefix (the root reference: L['self'],
            # L['args'][0], G['model'], ...) that leaves a known module of the
            # recorded type. The type matters: L['model'] is the root of a
            # LlamaForCausalLM, not its child named "model".
            for k in range(len(tokens) + 1):
                candidate = ".".join(tokens[k:])
                if candidate in self._known:
                    known_type = self._known[candidate]
                    if known_type is None or _same_type(known_type, module_type):
                        return candidate or None
            return ".".join(tokens) or None
        # No model to compare with: drop a leading L[...]/G[...] reference.
        match = re.match(r"^[LG]\[[^\]]*\](\[\d+\])*", dynamo_name)
        rest = dynamo_name[match.end():] if match else dynamo_name
        return ".".join(_path_tokens(rest)) or None


def module_stack_of(node: torch.fx.Node, names: ModuleNames) -> list[str]:
    """Qualified module names, outermost first.

    Forward nodes carry meta["nn_module_stack"]; backward nodes of a joint graph
    carry the stack of the forward op they differentiate in
    meta["fwd_nn_module_stack"]. Both map a key to (qualified name, type).
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    result: list[str] = []
    for entry in stack.values():
        if isinstance(entry, (tuple, list)):
            raw, recorded_type = entry[0], (entry[1] if len(entry) > 1 else None)
        else:
            raw, recorded_type = entry, None
        name = names.normalise(str(raw), recorded_type)
        if name is not None and (not result or result[-1] != name):
            result.append(name)
    return result


# ---- the graph --------------------------------------------------------------------


def _suppress_guards(graph: torch.fx.Graph):
    """Suppress guard recording in every shape environment the graph's values use."""
    stack = contextlib.ExitStack()
    seen = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        fake_mode = getattr(val, "fake_mode", None)
        shape_env = getattr(fake_mode, "shape_env", None)
        if shape_env is not None and id(shape_env) not in seen and hasattr(shape_env, "suppress_guards"):
            seen.add(id(shape_env))
            stack.enter_context(shape_env.suppress_guards())
    return stack


def _val_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    """meta["val"], or for a get_attr without one, the attribute itself (a constant)."""
    if "val" in node.meta or node.op != "get_attr":
        return node.meta.get("val")
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def export_graph_module(
    gm: torch.fx.GraphModule,
    *,
    module_names: Mapping[str, type] | Iterable[str] | None = None,
    name: str = "",
    metadata: Mapping[str, str] | None = None,
) -> dict:
    """Serialise an FX GraphModule whose nodes carry meta["val"] into a Spillway graph dict.

    module_names: the model's named_modules() names, best as a name -> type
    mapping (types disambiguate); dynamo's module paths are mapped onto them.
    Without it a leading L[...]/G[...] root is dropped.
    Reads the graph only; raises ExportError naming the node on a graph the
    format cannot express.
    """
    graph = gm.graph
    names = ModuleNames(module_names)
    phases = phases_of(graph)
    storages = StorageIds()
    ids: dict[torch.fx.Node, int] = {}
    ops: dict[str, dict] = {}
    nodes: list[dict] = []
    with _suppress_guards(graph):
        for index, node in enumerate(graph.nodes):
            where = f"node {index} ({node.name})"
            target = target_string(node)
            if node.op == "call_function":
                schema = op_schema_entry(node.target)
                if schema is not None:
                    ops.setdefault(target, schema)
            args = [arg_of(a, ids, f"{where} args[{i}]") for i, a in enumerate(node.args)]
            kwargs = {k: arg_of(v, ids, f"{where} kwargs[{k}]") for k, v in node.kwargs.items()}
            entry = {
                "id": index,
                "name": node.name,
                "kind": node.op,
                "target": target,
                "args": args,
                "kwargs": kwargs,
                "phase": phases[node],
                "module_stack": module_stack_of(node, names),
                "value": value_of(_val_of(gm, node), storages)
                if node.op != "output"
                else {"type": "none"},
            }
            if tagged_for_recompute(node):
                entry["recompute"] = True
            nodes.append(entry)
            ids[node] = index
    result: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    if name:
        result["name"] = name
    result["metadata"] = {str(k): str(v) for k, v in (metadata or {}).items()}
    result["ops"] = dict(sorted(ops.items()))
    result["nodes"] = nodes
    return result
