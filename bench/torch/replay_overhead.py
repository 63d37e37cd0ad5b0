#!/usr/bin/env python3
"""What trace and replay's dispatch mode costs per op, with a plan that moves nothing.

    python3 bench/torch/replay_overhead.py [--device cpu|cuda] [--layers 2] [--hidden 64]

A small Llama training step (forward, backward, SGD step) timed three ways, median of
--reps: plain; under a TorchDispatchMode that only calls through (what any Python
dispatch mode costs); under spillway.trace.replay with an empty plan (the recorder's
numbering, the divergence checks and the guards, nothing moved). Prints the step times
and the extra microseconds per op of each mode. On a GPU the question is whether the
CPU keeps ahead of the kernels; this measures the CPU side.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "python" / "tests")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import spillway.trace
    from _models import tiny_llama

    torch.set_num_threads(1)
    model, ids = tiny_llama(1, layers=args.layers, hidden=args.hidden, vocab=128, seq=args.seq)
    model, ids = model.to(args.device), ids.to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(args.reps):
            if args.device != "cpu":
                torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            if args.device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2] * 1e3

    step()
    with spillway.trace.record(model, optimizer) as recording:
        step()
    ops = sum(n["kind"] == "call_function" for n in recording.trace.graph["nodes"])

    class CallThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def through():
        with CallThrough():
            step()

    plain = median_ms(step)
    null = median_ms(through)
    replay = spillway.trace.replay(recording.trace, {"gaps": [], "storages": {}})
    with replay:
        def replayed():
            with replay.step():
                step()
        under_replay = median_ms(replayed)
        misses = replay.stats()["misses"]
    print(f"device {args.device}, torch {torch.__version__}, {ops} ops per step, "
          f"median of {args.reps}")
    print(f"plain step            {plain:8.2f} ms")
    print(f"call-through mode     {null:8.2f} ms  (+{(null - plain) / ops * 1e3:.1f} us/op)")
    print(f"replay, empty plan    {under_replay:8.2f} ms  (+{(under_replay - plain) / ops * 1e3:.1f} "
          f"us/op; misses {misses})")
    return 0 if misses == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
