"""Trace and replay: one step of a program recorded op by op (Note [The op recorder]).

    with spillway.trace.record(model, optimizer) as recording:
        loss = model(x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trace = recording.trace                      # trace.graph: a Spillway graph
    spillway.trace.save(trace, "step.json.zst")  # spillway simulate step.json.zst

The planner that chooses what lives on the host between its uses, and the
executor that replays the plan, are the next steps of this package.
"""
from __future__ import annotations

import contextlib
import os

from spillway.trace._opaque import opaque
from spillway.trace._recorder import Recorder, StorageInfo, Trace

__all__ = ["record", "save", "load", "opaque", "Trace", "StorageInfo"]


@contextlib.contextmanager
def record(model=None, optimizer=None, *, timed: bool = True):
    """Records every op that runs inside the block, forward, backward and optimizer step,
    as a Spillway graph; yields the Recorder, whose .trace is set when the block ends.

    model, optimizer: optional; their parameters, buffers, gradients and optimizer state
    name the graph's placeholders. timed: record each op's time (CUDA events on a GPU).
    Record a step after the first: a first step makes the optimizer's state inside it.
    """
    recorder = Recorder(model, optimizer, timed=timed)
    with recorder:
        yield recorder


def save(trace, path: str | os.PathLike) -> None:
    """Writes a Trace's graph (or a graph dict) to `path`: .json, or .json.zst compressed;
    the `spillway` command reads it (spillway simulate PATH)."""
    from spillway.fx_export import _io
    graph = trace.graph if isinstance(trace, Trace) else trace
    if not isinstance(graph, dict) or graph.get("format") != "spillway.graph":
        raise TypeError(f"[trace] save needs a Trace or a Spillway graph dict, "
                        f"got {type(trace).__name__}")
    _io.save(graph, path)


def load(path: str | os.PathLike) -> dict:
    """The graph dict a save() wrote."""
    from spillway.fx_export import _io
    return _io.load(path)
