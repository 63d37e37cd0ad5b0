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

import torch

from spillway.trace._opaque import opaque
from spillway.trace import _overhead
from spillway.trace._overhead import replay_copy_us, replay_overhead_us
from spillway.trace._recorder import Recorder, StorageInfo, Trace

__all__ = ["record", "save", "load", "plan", "replay", "opaque", "with_host_times", "replay_overhead_us",
           "replay_copy_us", "Trace", "StorageInfo"]


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


def plan(trace, budget, *, min_bytes: int = 1 << 20, device_profile=None,
         strategy: str = "greedy", live_bytes: bool = False,
         host_adamw_gbs: float | None = None, replay_op_us: float | None = None,
         replay_copy_us: float | None = None) -> dict:
    """The residency plan of a recorded step (include/spillway/residency.h): which
    storages spend which gaps between their uses in pinned host memory, the fastest
    plan whose simulated peak fits `budget`, and its forecast against the step with
    everything on the device.

    budget: bytes (int), a fraction of the step's own simulated peak (0 < float <= 1),
    or text ("12GiB", "800MiB": bytes; "60%": a fraction). A budget in bytes counts what the
    allocator held that the trace does not account for (its metadata's
    untracked_bytes: cuBLAS workspaces...; "untracked_bytes" in the result), as the
    measured peak does. device_profile: a path or dict (docs/device-profile.md);
    default the shipped H200's. strategy: "greedy", or "exact"
    (every subset of the candidate gaps; small traces only). Raises ValueError naming
    the problem when no plan fits.

    host_adamw_gbs: the step's AdamW(fused=True) ops may instead run on the host CPUs
    (spillway.optim.HostAdamW's update: gradients down once complete, the update on
    the host from its AdamW op on, parameters back, the moments on the host for good)
    at this bandwidth in GB/s, counting 28 bytes per element (bench/torch/
    host_adamw.py measures it); the plan takes that when its forecast is faster
    ("host_updates" lists what it chose); replay() runs such a plan (Note [Host
    updates in replay] in _replay.py).

    A trace recorded on a GPU has each op's host time (its nodes' cpu_ms): the forecast
    then runs the host thread that issues the replayed step too, and an op starts no
    earlier than the host has issued it (Note [The host in residency replay] in
    src/sim/residency.cc; the forecast's host_issue_ms, host_blocked_ms and
    host_late_ms). replay_op_us, replay_copy_us: the replay's own host time per op and
    per copy it issues; default measured once on the trace's device
    (spillway.trace.replay_overhead_us, replay_copy_us). A recorder's cpu_ms hold the
    recorder's own work too; host times measured in a replayed step (with_host_times)
    hold the replay's per-op work already, and replay_op_us defaults to 0 for them.
    """
    import json

    from spillway import _C
    from spillway._budget import device_profile_json, parse_memory_budget
    graph = trace.graph if isinstance(trace, Trace) else trace
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"[trace] budget must be bytes, a fraction or text, got {budget!r}")
    if isinstance(budget, str):  # "12GiB" is bytes, as an int is; "60%" a fraction
        kind, number = parse_memory_budget(budget, "trace", "budget", "the step's own simulated peak")
        budget = float(number) if kind == "fraction" else int(number)
    # Bytes the allocator held that no storage of the step accounts for (cuBLAS's
    # workspaces...: Recorder metadata): a budget in bytes leaves room for them.
    untracked = int(graph.get("metadata", {}).get("untracked_bytes", 0))
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"[trace] a fractional budget must be in (0, 1], got {budget}")
        budget = f"{budget * 100:.6f}%"
        untracked = 0  # a fraction of the simulated peak, which leaves them out too
    elif isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"[trace] budget must be > 0 bytes, got {budget}")
        if budget <= untracked:
            raise ValueError(f"[trace] a budget of {budget} bytes leaves nothing for the step: "
                             f"{untracked} bytes the step does not account for (cuBLAS "
                             f"workspaces, tensors it never touched) are allocated already")
        budget = str(budget - untracked)
    if host_adamw_gbs is not None and (isinstance(host_adamw_gbs, bool) or
                                       not isinstance(host_adamw_gbs, (int, float)) or
                                       not host_adamw_gbs > 0):
        raise ValueError(f"[trace] host_adamw_gbs must be a number of GB/s > 0, got "
                         f"{host_adamw_gbs!r}")
    for name, value in (("replay_op_us", replay_op_us), ("replay_copy_us", replay_copy_us)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value < float("inf")):
            raise ValueError(f"[trace] {name} must be a number of microseconds >= 0, got "
                             f"{value!r}")
    if replay_op_us is None or replay_copy_us is None:  # measured where the host is modelled
        timed = next((n for n in graph["nodes"] if n.get("cpu_ms") is not None), None)
        device = _device_of(graph, timed) if timed is not None else None
        if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"[trace] the trace's host times were recorded on {device}, which "
                             f"this machine lacks to measure the replay's own: pass "
                             f"replay_op_us and replay_copy_us (0 leaves them out)")
        if replay_op_us is None:
            replay_op_us = (_overhead.replay_overhead_us(device) if device and
                            graph.get("metadata", {}).get("cpu_ms_from") != "replay" else 0.0)
        if replay_copy_us is None:
            replay_copy_us = _overhead.replay_copy_us(device) if device else 0.0
    result = json.loads(_C.plan_residency(
        json.dumps(graph), budget, device_profile_json=device_profile_json(device_profile, "trace"),
        min_bytes=min_bytes, strategy=strategy, live_bytes=live_bytes,
        host_adamw_gbs=float(host_adamw_gbs or 0), replay_op_us=float(replay_op_us),
        replay_copy_us=float(replay_copy_us)))
    result["replay_op_us"] = float(replay_op_us)
    result["replay_copy_us"] = float(replay_copy_us)
    # The budget and peaks as the device sees them, the untracked bytes included.
    result["untracked_bytes"] = untracked
    if untracked:
        result["budget_bytes"] += untracked
        for forecast in (result["forecast"], result["unplanned"]):
            forecast["peak_bytes"] += untracked
            if "live_bytes" in forecast:
                forecast["live_bytes"] = [b + untracked for b in forecast["live_bytes"]]
    return result


def with_host_times(trace, host_times_ms) -> Trace:
    """The trace with each op's host time (its nodes' cpu_ms) replaced by `host_times_ms`,
    one per op in order: Replay.host_times_ms() of a step replayed under a plan that moves
    nothing is the host's own time per op as a replayed step spends it. The recorder's
    cpu_ms hold its own Python work (T3 on an H100: 832 ms a step against 150 ms of
    the plain step's issue); a forecast from these runs the host as the replay does."""
    graph = trace.graph if isinstance(trace, Trace) else trace
    times = list(host_times_ms)
    nodes = [dict(n) if n["kind"] == "call_function" else n for n in graph["nodes"]]
    ops = [n for n in nodes if n["kind"] == "call_function"]
    if len(times) != len(ops):
        raise ValueError(f"[trace] {len(times)} host times for a trace of {len(ops)} ops")
    for node, ms in zip(ops, times):
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < float("inf"):
            raise ValueError(f"[trace] host time of op {node['name']} must be ms >= 0, got {ms!r}")
        node["cpu_ms"] = float(ms)
    metadata = dict(graph.get("metadata", {}), cpu_ms_from="replay")
    new_graph = dict(graph, nodes=nodes, metadata=metadata)
    if isinstance(trace, Trace):
        return Trace(new_graph, trace.storages, refs=trace.refs)
    return Trace(new_graph)


def _device_of(graph: dict, node: dict) -> str:
    """The device of the first tensor an op read or made (where its cpu_ms was timed)."""
    by_id = {n["id"]: n for n in graph["nodes"]}
    values = [node.get("value", {})]
    values += [by_id[a["node"]].get("value", {}) for a in node.get("args", [])
               if isinstance(a, dict) and "node" in a]
    while values:
        value = values.pop(0)
        if value.get("type") == "tensor" and value.get("device"):
            return value["device"]
        values.extend(value.get("elements", []))
    return "cuda"


def replay(trace, plan_or_budget, *, max_misses: int = 3, min_bytes: int = 1 << 20,
           device_profile=None, host_adamw_gbs: float | None = None):
    """The executor of a residency plan (Note [Replay] in _replay.py):

        with spillway.trace.replay(trace, 0.5) as r:   # or a plan from plan()
            for batch in data:
                with r.step():
                    ...one training step, as recorded...
        r.stats()

    Inside `with`, every op first brings back any storage it touches that is away, so
    tensors stay valid between steps too; leaving it brings everything back. A budget
    (bytes, fraction or text, as plan() takes) also lets a step that diverged
    max_misses times in a row be recorded and planned again (host_adamw_gbs as plan()
    takes it, for the plans it makes)."""
    from spillway.trace._replay import Replay
    budget = None
    if isinstance(plan_or_budget, dict) and "gaps" in plan_or_budget:
        plan_dict = plan_or_budget
    else:
        budget = plan_or_budget
        plan_dict = plan(trace, budget, min_bytes=min_bytes, device_profile=device_profile,
                         host_adamw_gbs=host_adamw_gbs)
    return Replay(trace, plan_dict, budget=budget, max_misses=max_misses, min_bytes=min_bytes,
                  device_profile=device_profile, host_adamw_gbs=host_adamw_gbs)
