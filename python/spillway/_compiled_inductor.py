"""Inductor lowerings of spillway.offload and spillway.wait_tensor that keep the
offload's source buffer alive until its wait (Note [Keepalive under Inductor]
in compiled.py).

By default Inductor lowers a custom op as a fallback kernel and, to meet the
op's stride contract, may copy an input into a buffer written for that call
alone (for instance a permuted view of a value it computed in a pointwise
kernel: the dense_storages case). Inductor reuses a buffer right after its
last reader in the graph, so such a hidden copy could be overwritten while the
asynchronous D2H still reads it; the forward wait's `keepalive` names the FX
value, not that copy. These lowerings make the buffer the offload reads
explicit (realised contiguous: the copy engine moves contiguous bytes) and
hand that same buffer to the offload's forward wait as its keepalive, so the
buffer is live, and unreused, until the wait.

Lowerings are per operator and process-wide; they behave as the default
fallback for graphs that spillway.compiled did not edit (a wait whose first
argument is not an offload lowered here keeps its own keepalive).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Registers the lowerings once per process. Thread-safe."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _register()
        _installed = True


def _register() -> None:
    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V

    offload_op = torch.ops.spillway.offload.default
    wait_op = torch.ops.spillway.wait_tensor.default
    offload_fallback = fallback_handler(offload_op, add_to_fallback_set=False)
    wait_fallback = fallback_handler(wait_op, add_to_fallback_set=False)

    def read_by_offload() -> dict[int, tuple[Any, Any]]:
        # id(offload result) -> (offload result, the buffer it reads), for the
        # graph being lowered; holding both keeps the ids unique.
        graph = V.graph
        table = getattr(graph, "_spillway_offload_sources", None)
        if table is None:
            table = {}
            graph._spillway_offload_sources = table
        return table

    @register_lowering(offload_op, type_promotion_kind=None)
    def lower_offload(t):
        source = ir.ExternKernel.require_contiguous(t)
        result = offload_fallback(source)
        read_by_offload()[id(result)] = (result, source)
        return result

    @register_lowering(wait_op, type_promotion_kind=None)
    def lower_wait(t, keepalive=None, last_use=None):
        entry = read_by_offload().get(id(t))
        if entry is not None and entry[0] is t:
            keepalive = entry[1]
        return wait_fallback(t, keepalive, last_use)
