"""An independent reading of docs/graph-format.md, used to check exported graphs.

It re-states the format's rules instead of importing the exporter, so an
exporter bug and a validator bug have to agree to slip through. check_graph
raises GraphFormatError naming the node and field at fault.
"""

from __future__ import annotations

import math
from typing import Any

_TOP_FIELDS = {"format", "version", "name", "metadata", "ops", "nodes"}
_NODE_FIELDS = {"id", "name", "kind", "target", "args", "kwargs", "phase", "module_stack", "value", "time_ms",
                "recompute"}
_KINDS = {"placeholder", "call_function", "call_method", "call_module", "get_attr", "output"}
_PHASES = {"forward", "backward"}
_SCHEMA_FIELDS = {"namespace", "mutable", "view", "pointwise", "random", "arguments"}
_ARGUMENT_FIELDS = {"name", "kwarg_only", "write"}
_TENSOR_FIELDS = {"type", "dtype", "element_size", "sizes", "strides", "contiguous", "storage", "device", "dtensor"}


class GraphFormatError(ValueError):
    pass


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_sym(x: Any, where: str) -> None:
    if set(x) != {"sym", "hint"} or not isinstance(x["sym"], str) or not x["sym"]:
        raise GraphFormatError(f"{where}: bad symbolic integer {x!r}")
    if x["hint"] is not None and not _is_int(x["hint"]):
        raise GraphFormatError(f"{where}: hint must be an integer or null")


def _check_dim(x: Any, where: str, *, size: bool) -> None:
    if _is_int(x):
        if size and x < 0:
            raise GraphFormatError(f"{where}: negative size {x}")
        return
    if isinstance(x, dict):
        _check_sym(x, where)
        return
    raise GraphFormatError(f"{where}: a dim must be an integer or a symbol, got {x!r}")


def _check_arg(a: Any, where: str, seen: dict[int, str], inputs: list[int]) -> None:
    if a is None or isinstance(a, (bool, str)) or _is_int(a):
        return
    if isinstance(a, float):
        if not math.isfinite(a):
            raise GraphFormatError(f"{where}: non-finite float")
        return
    if isinstance(a, list):
        for i, item in enumerate(a):
            _check_arg(item, f"{where}[{i}]", seen, inputs)
        return
    if isinstance(a, dict):
        if set(a) == {"node"}:
            if not _is_int(a["node"]) or a["node"] not in seen:
                raise GraphFormatError(f"{where} refers to unknown or later node {a['node']!r}")
            inputs.append(a["node"])
            return
        if "sym" in a:
            _check_sym(a, where)
            return
        if set(a) == {"other"} and isinstance(a["other"], str):
            return
    raise GraphFormatError(f"{where}: not an argument: {a!r}")


def _check_value(v: Any, where: str) -> None:
    if not isinstance(v, dict) or "type" not in v:
        raise GraphFormatError(f"{where}: a value needs a type")
    kind = v["type"]
    if kind == "none":
        return
    if kind == "tensor":
        extra = set(v) - _TENSOR_FIELDS
        if extra:
            raise GraphFormatError(f"{where}: unknown tensor fields {sorted(extra)}")
        if not isinstance(v.get("dtype"), str) or not isinstance(v.get("device"), str):
            raise GraphFormatError(f"{where}: dtype and device must be strings")
        if not _is_int(v.get("element_size")) or v["element_size"] <= 0:
            raise GraphFormatError(f"{where}.element_size: must be > 0")
        sizes = v.get("sizes")
        if not isinstance(sizes, list):
            raise GraphFormatError(f"{where}.sizes: must be a list")
        for i, d in enumerate(sizes):
            _check_dim(d, f"{where}.sizes[{i}]", size=True)
        strides = v.get("strides")
        if strides is not None:
            if not isinstance(strides, list) or len(strides) != len(sizes):
                raise GraphFormatError(f"{where}.strides: rank differs from sizes")
            for i, d in enumerate(strides):
                _check_dim(d, f"{where}.strides[{i}]", size=False)
        if not isinstance(v.get("contiguous"), bool):
            raise GraphFormatError(f"{where}.contiguous: must be a bool")
        storage = v.get("storage")
        if storage is not None and (not _is_int(storage) or storage < 0):
            raise GraphFormatError(f"{where}.storage: must be a non-negative integer or null")
        if not isinstance(v.get("dtensor", False), bool):
            raise GraphFormatError(f"{where}.dtensor: must be a bool")
        return
    if kind == "sequence":
        for i, e in enumerate(v.get("elements", [])):
            _check_value(e, f"{where}.elements[{i}]")
        return
    if kind == "sym_int":
        _check_dim(v.get("value"), f"{where}.value", size=False)
        return
    if kind in ("scalar", "other"):
        if not isinstance(v.get("repr"), str):
            raise GraphFormatError(f"{where}.repr: must be a string")
        return
    raise GraphFormatError(f"{where}: unknown value type {kind!r}")


def _check_ops(ops: Any) -> None:
    if not isinstance(ops, dict):
        raise GraphFormatError("ops: must be an object")
    for target, schema in ops.items():
        where = f"ops[{target}]"
        extra = set(schema) - _SCHEMA_FIELDS
        if extra:
            raise GraphFormatError(f"{where}: unknown fields {sorted(extra)}")
        if not isinstance(schema.get("namespace"), str):
            raise GraphFormatError(f"{where}.namespace: required string")
        for flag in ("mutable", "view", "pointwise", "random"):
            if not isinstance(schema.get(flag, False), bool):
                raise GraphFormatError(f"{where}.{flag}: must be a boolean")
        names = set()
        for i, arg in enumerate(schema.get("arguments", [])):
            if set(arg) - _ARGUMENT_FIELDS or not isinstance(arg.get("name"), str):
                raise GraphFormatError(f"{where}.arguments[{i}]: bad argument {arg!r}")
            if arg["name"] in names:
                raise GraphFormatError(f"{where}.arguments[{i}]: duplicate name {arg['name']}")
            names.add(arg["name"])


def check_graph(g: Any) -> None:
    """Raise GraphFormatError unless g follows docs/graph-format.md version 1."""
    if not isinstance(g, dict):
        raise GraphFormatError("graph: must be an object")
    extra = set(g) - _TOP_FIELDS
    if extra:
        raise GraphFormatError(f"graph: unknown fields {sorted(extra)}")
    if g.get("format") != "spillway.graph" or g.get("version") != 1:
        raise GraphFormatError("graph: format must be 'spillway.graph', version 1")
    if not all(isinstance(v, str) for v in g.get("metadata", {}).values()):
        raise GraphFormatError("metadata: values must be strings")
    ops = g.get("ops", {})
    _check_ops(ops)
    nodes = g.get("nodes")
    if not isinstance(nodes, list):
        raise GraphFormatError("graph: nodes must be an array")
    seen: dict[int, str] = {}
    names: set[str] = set()
    for index, node in enumerate(nodes):
        where = f"node {node.get('id')} ({node.get('name')})"
        extra = set(node) - _NODE_FIELDS
        if extra:
            raise GraphFormatError(f"{where}: unknown fields {sorted(extra)}")
        if not _is_int(node.get("id")) or node["id"] < 0 or node["id"] in seen:
            raise GraphFormatError(f"{where}: id must be a unique non-negative integer")
        if not isinstance(node.get("name"), str) or not node["name"] or node["name"] in names:
            raise GraphFormatError(f"{where}: name must be unique and non-empty")
        if node.get("kind") not in _KINDS:
            raise GraphFormatError(f"{where}: unknown kind {node.get('kind')!r}")
        if not isinstance(node.get("target"), str):
            raise GraphFormatError(f"{where}: target must be a string")
        if node.get("phase", "forward") not in _PHASES:
            raise GraphFormatError(f"{where}: unknown phase {node.get('phase')!r}")
        if not isinstance(node.get("recompute", False), bool):
            raise GraphFormatError(f"{where}: recompute must be a boolean")
        stack = node.get("module_stack", [])
        if not isinstance(stack, list) or not all(isinstance(s, str) for s in stack):
            raise GraphFormatError(f"{where}: module_stack must be a list of strings")
        inputs: list[int] = []
        args = node.get("args", [])
        kwargs = node.get("kwargs", {})
        for i, a in enumerate(args):
            _check_arg(a, f"{where}: field 'args[{i}]'", seen, inputs)
        for k, a in kwargs.items():
            _check_arg(a, f"{where}: field 'kwargs[{k}]'", seen, inputs)
        if node["kind"] in ("placeholder", "get_attr") and inputs:
            raise GraphFormatError(f"{where}: a {node['kind']} takes no node inputs")
        if node["kind"] == "output" and index != len(nodes) - 1:
            raise GraphFormatError(f"{where}: the output node must be last")
        schema = ops.get(node["target"]) if node["kind"] == "call_function" else None
        if schema is not None:
            arguments = schema.get("arguments", [])
            positional = [a for a in arguments if not a.get("kwarg_only", False)]
            if len(args) > len(positional):
                raise GraphFormatError(f"{where}: {len(args)} positional args, schema takes {len(positional)}")
            known = {a["name"] for a in arguments}
            for k in kwargs:
                if k not in known:
                    raise GraphFormatError(f"{where}: keyword '{k}' not in the schema")
        _check_value(node.get("value", {"type": "none"}), f"{where}: field 'value'")
        if "time_ms" in node and (not isinstance(node["time_ms"], (int, float)) or node["time_ms"] < 0):
            raise GraphFormatError(f"{where}: time_ms must be >= 0")
        seen[node["id"]] = node["name"]
        names.add(node["name"])
