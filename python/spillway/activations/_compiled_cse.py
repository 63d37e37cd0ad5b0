"""Merge the joint graph's common subexpressions in place, before planning.

aot_autograd's min-cut partitioner runs fx_graph_cse on the joint graph after
spillway's pass. If two nodes the planner moved separately are the same
expression (every layer turning one boolean attention mask into the same
additive bias, as SDPA's CUDA kernels do), that CSE merges them and then their
two spillway.offload calls (now with one argument), leaving one transfer for
two forward waits: the second wait raises "no offload or reload into it is in
flight". Found on the H200 with offload_tuple_outputs (2026-11-29).

merge_common_subexpressions() applies the same merges among forward nodes
first, in place, with the partitioner's rules (torch._functorch.compile_utils.fx_graph_cse: never
placeholders, outputs, get_attr, random ops, aten.empty, values aliasing a
graph output, unbacked symbols; only within one mutation region), and in
addition never a node with side effects. The planner then sees each value
once, moves it once, and the partitioner's own CSE finds nothing more to
merge among the moved values. The graph computes the same values: merged
nodes are the same op on the same inputs.

Only forward nodes merge. A backward node that repeats a forward expression
(the fp32 upcast of a bf16 gate projection, which SiLU's backward recomputes)
merged into its forward twin would make the forward value a saved activation
the plan then moves (on T1, 2026-11-30: the 352 MiB fp32 upcast of each
layer's gate projection moved instead of the 176 MiB projection, 8.25 GiB in
all instead of 5.50 GiB, 1.82x torch.compile instead of 1.38x). Left apart,
the backward twin reads the projection, which the plan redirects to its
reload; the partitioner's CSE then sees two different inputs and keeps both.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten


def storage_of(node: Any) -> StorageWeakRef | None:
    """The storage of an FX node's fake tensor value; None for other values and non-nodes."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _flat(args: Any) -> tuple[tuple, Any]:
    flat, spec = tree_flatten(args)
    return tuple(a.node if isinstance(a, (torch.SymInt, torch.SymBool, torch.SymFloat)) else a
                 for a in flat), spec


def merge_common_subexpressions(graph: torch.fx.Graph) -> int:
    """Replaces each repeated expression by its first occurrence; returns how many went."""
    from torch._functorch.compile_utils import get_aten_target, rand_ops
    from torch._inductor.pattern_matcher import compute_mutation_region_ids, same_mutation_regions

    from spillway.fx_export._serialize import phases_of

    compute_mutation_region_ids(graph)
    phases = phases_of(graph)
    output = next(iter(reversed(graph.nodes)))
    output_storages = {s for n in output.all_input_nodes if (s := storage_of(n)) is not None}
    seen: dict[tuple, tuple[tuple, torch.fx.Node]] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.is_impure() or phases[node] != "forward":
            continue
        target = get_aten_target(node)
        if target in rand_ops or target is torch.ops.aten.empty:
            continue
        storage = storage_of(node)
        if storage is not None and storage in output_storages:
            continue
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, sympy.Symbol)) and free_unbacked_symbols(val):
            continue
        args, args_spec = _flat(node.args)
        kwargs, kwargs_spec = _flat(node.kwargs)
        token = (node.target, args, args_spec, kwargs, kwargs_spec)
        try:
            key = (node.target, hash((tuple((a, type(a)) for a in args),
                                      tuple((a, type(a)) for a in kwargs))))
        except TypeError:  # an unhashable literal: leave it to the partitioner
            continue
        earlier = seen.get(key)
        if earlier is not None and earlier[0] == token:
            if same_mutation_regions(node, earlier[1]):
                node.replace_all_uses_with(earlier[1])
                graph.erase_node(node)
                merged += 1
                continue
        seen[key] = (token, node)
    return merged
