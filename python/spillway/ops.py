"""Spillway's custom ops, torch.ops.spillway.{offload, reload, wait_tensor}.

Importing this module loads the extension spillway._C (which registers the ops
and their CPU/CUDA kernels) and adds what torch.compile needs: fake kernels, a
functionalization kernel for wait_tensor, and wait_tensor's side-effect mark.

The pattern, as in PyTorch's ao:: activation-offload ops::

    host = offload(x)                      # D2H after the compute stream's current point
    host = wait_tensor(host, keepalive=x)  # compute waits for the D2H; spillway drops its
                                           # reference to x's storage
    y = reload(host, x.device)             # y allocated on the compute stream, H2D on a copy stream
    y = wait_tensor(y, keepalive=host)     # compute waits for the H2D

On CPU, CPU tensors play device memory and the runtime's fake backend moves
them on worker threads, so the same code path runs without a GPU. Tensors of
zero bytes move nothing; their wait is a no-op.

Schemas (see Note [Ops schemas] in python/csrc/offload_ops.cc):
    offload(Tensor t, bool exact=False) -> Tensor   (exact: a pinned block of t's size
                                                     rounded to a page, for long-lived copies)
    reload(Tensor host, Device device) -> Tensor
    wait_tensor(Tensor(a) t, Tensor? keepalive=None, Tensor? last_use=None) -> Tensor(a)

The ops are not differentiable: they move values that autograd saved, inside
graphs autograd has already built (the compiled joint graph, saved-tensor hooks).
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from spillway import _C

__all__ = ["offload", "reload", "wait_tensor", "synchronize", "pending_waits",
           "copy_stats", "pool_stats", "cuda_built"]

synchronize = _C.synchronize
pending_waits = _C.pending_waits
copy_stats = _C.copy_stats
pool_stats = _C.pool_stats
cuda_built = _C.cuda_built

_lib = torch.library.Library("spillway", "FRAGMENT")


@torch.library.register_fake("spillway::offload", lib=_lib)
def _offload_fake(t: torch.Tensor, exact: bool = False) -> torch.Tensor:
    return t.new_empty(t.shape, device="cpu")


@torch.library.register_fake("spillway::reload", lib=_lib)
def _reload_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.new_empty(host.shape, device=device)


@torch.library.register_fake("spillway::wait_tensor", lib=_lib)
def _wait_tensor_fake(t, keepalive=None, last_use=None):
    return torch.ops.aten.alias.default(t)


def _wait_tensor_functionalize(t, keepalive=None, last_use=None):
    """wait_tensor under functionalization (aot_autograd, torch.compile).

    Functionalization refuses custom ops whose output aliases an input, so this
    kernel unwraps the functional tensors, records the op one level down (where
    the tracer sees it with its alias schema) and wraps the output as a fresh
    functional value. Sound because nothing writes the waited tensor afterwards:
    every reader reads the wait's output.
    """

    def unwrap(x):
        if x is None or not torch._is_functional_tensor(x):
            return x
        torch._sync(x)
        return torch._from_functional_tensor(x)

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
    with torch._C._ExcludeDispatchKeyGuard(below):
        out = torch.ops.spillway.wait_tensor.default(
            unwrap(t), unwrap(keepalive), unwrap(last_use))
    return torch._to_functional_tensor(out)


_lib.impl("wait_tensor", _wait_tensor_functionalize, "Functionalize")

# A wait orders streams and releases memory: never dead code, even when its
# output is unused.
has_side_effect(torch.ops.spillway.wait_tensor.default)


def offload(t: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """Starts copying contiguous `t` (cpu or cuda) into a host tensor; pair with wait_tensor.
    exact: its pinned block is t's size rounded to a page, freed when the host tensor is
    (for long-lived copies); otherwise a reusable size class up to 1/16 larger."""
    return torch.ops.spillway.offload.default(t, exact)


def reload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Starts copying a host tensor made by offload() to `device`; pair with wait_tensor."""
    return torch.ops.spillway.reload.default(host, torch.device(device))


def wait_tensor(t: torch.Tensor, keepalive: torch.Tensor | None = None,
                last_use: torch.Tensor | None = None) -> torch.Tensor:
    """Waits for the offload or reload that produced `t`; returns `t` (an alias)."""
    return torch.ops.spillway.wait_tensor.default(t, keepalive, last_use)
