"""Opaque regions: a function recorded as one node in forward and one in backward
(Note [The op recorder])."""
from __future__ import annotations

import functools
import time

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from spillway.trace import _recorder, _replay


class _Enter(torch.autograd.Function):
    """Identity at the region's entry: its backward is where the region's backward ends."""

    @staticmethod
    def forward(ctx, region, *inputs):
        ctx.region = region
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.region.backward_ends(grads)
        return (None, *grads)


class _Leave(torch.autograd.Function):
    """Identity at the region's exit: its backward is where the region's backward starts."""

    @staticmethod
    def forward(ctx, region, *outputs):
        ctx.region = region
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.region.backward_starts(grads)
        return (None, *grads)


class _Region:
    """One call of an opaque function under a recorder."""

    def __init__(self, recorder: _recorder.Recorder, name: str):
        self.recorder, self.name = recorder, name
        self.grad_outputs: tuple = ()
        self.began = 0.0

    def backward_starts(self, grads) -> None:
        self.grad_outputs = tuple(g for g in grads if isinstance(g, torch.Tensor))
        self.recorder.begin_virtual(f"spillway.opaque.{self.name}.backward", self.grad_outputs)
        with self.recorder._lock:
            self.recorder._opaque += 1
        self.began = time.perf_counter()

    def backward_ends(self, grads) -> None:
        recorder = self.recorder
        with recorder._lock:
            recorder._opaque = max(0, recorder._opaque - 1)
            if recorder._closed:
                return
            elapsed = (time.perf_counter() - self.began) * 1e3
            outs = tuple(g for g in grads if isinstance(g, torch.Tensor))
            recorder.record(f"spillway.opaque.{self.name}.backward", None,
                            [list(self.grad_outputs)], {}, outs, elapsed)
            self.grad_outputs = ()


def opaque(fn=None, *, name: str | None = None):
    """Marks `fn` as an opaque region: under spillway.trace.record() a call of it is
    recorded as one node (target spillway.opaque.NAME) that reads its tensor inputs
    and produces its outputs, and its backward as one node (NAME.backward); the ops
    inside run unrecorded. Outside a recording it is `fn` itself. Use it for a
    custom kernel or a layer whose inner ops need not be planned one by one.

        @spillway.trace.opaque
        def attention(q, k, v): ...
    """
    if fn is None:
        return functools.partial(opaque, name=name)
    region_name = name or getattr(fn, "__name__", "region")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        # Whoever observes the step: the recorder, or a replay inside a step.
        recorder = _recorder.active()
        if recorder is None:
            replay = _replay.active()
            if replay is not None and getattr(replay, "_in_step", False):
                recorder = replay
        if recorder is None or recorder._opaque or recorder._closed:
            return fn(*args, **kwargs)
        region = _Region(recorder, region_name)
        flat, spec = tree_flatten((args, kwargs))
        tensors = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        inputs = [flat[i] for i in tensors]
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        recorder.begin_virtual(f"spillway.opaque.{region_name}", inputs)
        with recorder._lock:
            recorder._opaque += 1
        began = time.perf_counter()
        try:
            if grads:
                entered = _Enter.apply(region, *inputs)
                for i, t in zip(tensors, entered):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, spec)
            out = fn(*args, **kwargs)
            if inputs and inputs[0].is_cuda:
                torch.cuda.synchronize()  # the region's time, on the host clock
            elapsed = (time.perf_counter() - began) * 1e3
            out_flat, out_spec = tree_flatten(out)
            produced = [o for o in out_flat if isinstance(o, torch.Tensor)]
            with recorder._lock:
                recorder.record(f"spillway.opaque.{region_name}", None, [inputs], {},
                                tuple(produced), elapsed)
            if grads and any(o.requires_grad for o in produced):
                positions = [i for i, o in enumerate(out_flat) if isinstance(o, torch.Tensor)]
                left = _Leave.apply(region, *produced)
                for i, t in zip(positions, left):
                    out_flat[i] = t
                out = tree_unflatten(out_flat, out_spec)
        finally:
            with recorder._lock:
                recorder._opaque = max(0, recorder._opaque - 1)
        return out

    return wrapped
