"""What the replay's dispatch mode costs the host per op, measured on this machine.

A replayed step is issued by one host thread through a Python dispatch mode (Note
[Replay] in _replay.py); on a GPU that thread, not the kernels, can set the pace. The
residency forecast runs the host thread too (Note [The host in residency replay] in
src/sim/residency.cc): each op costs its recorded cpu_ms, which already holds the
dispatch machinery around a mode (the recorder was one), plus the replay's own work
inside its mode. That last part is what replay_overhead_us measures: a chain of small
ops on `device`, recorded once, then issued under a mode that only calls through and
under the replay of an empty plan; the difference per op, the fastest of a few rounds.
"""
from __future__ import annotations

import functools
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _CallThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _program(x: torch.Tensor, w: torch.Tensor, links: int) -> torch.Tensor:
    """A chain of the ops a model's step is made of: matmuls, elementwise, reductions."""
    for _ in range(links):
        h = torch.mm(x, w)
        x = torch.relu(h) * 0.5 + x
        x = x / (x.abs().amax() + 1.0)
    return x


@functools.lru_cache(maxsize=None)
def replay_overhead_us(device: str = "cuda", links: int = 40, rounds: int = 9) -> float:
    """The replay's own host microseconds per op on `device` (an empty plan: every op
    numbered, checked and guarded, nothing moved), over a mode that only calls
    through. Measured once per process and device (about 0.1 s), with one CPU
    thread for torch's kernels (the host thread's costs, not the CPU pool's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return _measure(torch.device(device), links, rounds)
    finally:
        torch.set_num_threads(threads)


def _measure(device: torch.device, links: int, rounds: int) -> float:
    from spillway.trace import record
    from spillway.trace._replay import Replay

    x = torch.randn(64, 64, device=device)
    w = torch.randn(64, 64, device=device)

    def issue(context) -> float:
        """Seconds the host takes to issue the program (the GPU idle before and after)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        with context():
            _program(x, w, links)
        ended = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return ended - began

    _program(x, w, links)
    with record(timed=False) as recording:
        _program(x, w, links)
    ops = sum(n["kind"] == "call_function" for n in recording.trace.graph["nodes"])
    replay = Replay(recording.trace, {"gaps": [], "storages": {}})
    through, replayed = [], []
    for _ in range(rounds + 1):  # interleaved, so that both see the same machine
        through.append(issue(_CallThrough))
        with replay:
            replayed.append(issue(replay.step))
    through, replayed = through[1:], replayed[1:]  # the first warms up
    if replay.stats()["misses"]:
        raise RuntimeError("[trace] replay_overhead_us: the measuring program diverged from "
                           "its own trace")
    return max(0.0, (min(replayed) - min(through)) / ops * 1e6)
