"""What the replay costs the host per op and per copy, measured on this machine.

A replayed step is issued by one host thread through the replay's dispatch mode (Note
[Replay] in _replay.py; its quiet ops in C++ where torch allows, Note [Replay dispatch
in C++]); on a GPU that thread, not the kernels, can set the pace. The
residency forecast runs the host thread too (Note [The host in residency replay] in
src/sim/residency.cc): each op costs its recorded cpu_ms, which already holds the
dispatch machinery around a mode (the recorder was one), plus the replay's own work
inside its mode; each copy costs what the replay does to issue it.

Both are measured on a small program on `device`: a chain of matmuls over eight
weights, recorded once, then issued (the host's time, the device idle before and
after) under a mode that only calls through, under the replay of an empty plan, and
under the replay of a plan that moves the weights between their uses. Rounds are
interleaved, so that all three see the same machine, and the fastest of each counts.
  replay_overhead_us: (empty plan - call-through) per op;
  replay_copy_us: (moving plan - empty plan) per copy the replay issued (its ops'
  extra work on the general path included).
"""
from __future__ import annotations

import functools
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _CallThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _program(x: torch.Tensor, weights: list, links: int) -> torch.Tensor:
    """The ops a model's step is made of: matmuls, elementwise, reductions."""
    for i in range(links):
        h = torch.mm(x, weights[i % len(weights)])
        x = torch.relu(h) * 0.5 + x
        x = x / (x.abs().amax() + 1.0)
    return x


def replay_overhead_us(device: str = "cuda") -> float:
    """The replay's own host microseconds per op on `device` (an empty plan: every op
    numbered, checked and guarded, nothing moved), over a mode that only calls
    through. Measured once per process and device (well under a second)."""
    return _measured(str(torch.device(device)))[0]


def replay_copy_us(device: str = "cuda") -> float:
    """The replay's own host microseconds per copy it issues on `device`: a plan that
    moves storages against the empty plan, over the copies moved (write-backs and
    copies back). Measured with replay_overhead_us."""
    return _measured(str(torch.device(device)))[1]


@functools.lru_cache(maxsize=None)
def _measured(device: str, links: int = 40, rounds: int = 9) -> tuple[float, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host thread's own costs, not the CPU kernels' pool
    try:
        with torch.no_grad():
            return _measure(torch.device(device), links, rounds)
    finally:
        torch.set_num_threads(threads)


def _measure(device: torch.device, links: int, rounds: int) -> tuple[float, float]:
    from spillway.trace import plan, record
    from spillway.trace._replay import Replay

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=generator).to(device)
    weights = [torch.randn(256, 256, generator=generator).to(device) for _ in range(8)]

    def issue(context) -> float:
        """Seconds the host takes to issue the program."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        with context():
            _program(x, weights, links)
        ended = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return ended - began

    _program(x, weights, links)
    with record(timed=False) as recording:
        _program(x, weights, links)
    trace = recording.trace
    ops = sum(n["kind"] == "call_function" for n in trace.graph["nodes"])
    empty = Replay(trace, {"gaps": [], "storages": {}})
    # The weights between their uses (60 % of the step's peak leaves each on the host
    # for most of the gaps between its reads).
    moving = Replay(trace, plan(trace, 0.6, min_bytes=0, replay_op_us=0, replay_copy_us=0))
    through, replayed, moved, copies = [], [], [], []
    for _ in range(rounds + 1):
        through.append(issue(_CallThrough))
        with empty:
            replayed.append(issue(empty.step))
        with moving:
            before = moving.stats()
            moved.append(issue(moving.step))
            after = moving.stats()
        copies.append(sum(after[k] - before[k] for k in ("write_backs", "copies_back")))
    if empty.stats()["misses"] or moving.stats()["misses"]:
        raise RuntimeError("[trace] measuring the replay's overhead: the program diverged "
                           "from its own trace")
    through, replayed, moved = through[1:], replayed[1:], moved[1:]  # the first warms up
    per_op = max(0.0, (min(replayed) - min(through)) / ops * 1e6)
    per_copy = max(0.0, (min(moved) - min(replayed)) / max(1, min(copies[1:])) * 1e6)
    return per_op, per_copy
