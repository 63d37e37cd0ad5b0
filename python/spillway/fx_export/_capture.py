"""Capture the joint forward+backward graph that aot_autograd hands to its partitioner.

The route is torch.compile(fullgraph=True) with an aot_autograd backend whose
partition_fn first shows the joint graph to a callback and then runs the
default partitioner. The callback sees the graph exactly as a Spillway pass
installed as a partition_fn wrapper will: after aot_autograd's joint passes,
before the partitioner (which edits node metadata in place) touches it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch._dynamo
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition

T = TypeVar("T")

# on_joint(joint_module, joint_inputs, num_fwd_outputs) -> anything
JointCallback = Callable[[torch.fx.GraphModule, Any, int], T]


def _decomposition_table(decompositions: str | None) -> dict | None:
    if decompositions in (None, "none"):
        return None
    if decompositions == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    raise ValueError(f"[fx_export] unknown decompositions '{decompositions}' (none, inductor)")


def capture_joint_graph(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    on_joint: JointCallback,
    dynamic: Sequence[tuple[int, int]] = (),
    decompositions: str | None = None,
    on_graph_inputs: Callable[[list], None] | None = None,
) -> T:
    """Compile fn(*args, **kwargs) once and return on_joint's result for its joint graph.

    fn must produce at least one output that requires grad, and must compile
    without graph breaks. dynamic lists (positional argument index, dim) pairs
    marked dynamic with torch._dynamo.mark_dynamic. When args hold FakeTensors
    the call runs under their fake mode, so no real memory is allocated.
    The forward runs once (on fake tensors when the inputs are fake); the
    backward never runs. Resets dynamo's caches before and after.
    on_graph_inputs, when given, is called first with the inputs dynamo hands
    its backend, in the order of the placeholders of dynamo's graph (the user's
    inputs and the parameters and buffers it lifted): real tensors when the
    call ran on real tensors. aot_autograd's joint graph takes them as its
    primals after dropping repeats of one tensor (tied weights).
    Raises RuntimeError when no joint graph (no grad-requiring output) or more
    than one was produced.
    """
    for index, dim in dynamic:
        torch._dynamo.mark_dynamic(args[index], dim)
    results: list[T] = []

    def partition_fn(joint_module, joint_inputs, *, num_fwd_outputs, **partition_kwargs):
        results.append(on_joint(joint_module, joint_inputs, num_fwd_outputs))
        return default_partition(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **partition_kwargs
        )

    def keep(gm, _inputs):
        return gm

    backend = aot_autograd(
        fw_compiler=keep,
        bw_compiler=keep,
        partition_fn=partition_fn,
        decompositions=_decomposition_table(decompositions),
    )
    if on_graph_inputs is not None:
        aot_backend = backend

        def backend(gm, example_inputs):
            on_graph_inputs(list(example_inputs))
            return aot_backend(gm, example_inputs)

    fake_mode = torch._guards.detect_fake_mode(list(args) + list((kwargs or {}).values()))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            compiled(*args, **(kwargs or {}))
    finally:
        torch._dynamo.reset()
    if len(results) != 1:
        raise RuntimeError(
            f"[fx_export] expected one joint graph, got {len(results)} "
            "(does an output require grad? is the function compiled as one graph?)"
        )
    return results[0]
