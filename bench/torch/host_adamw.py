#!/usr/bin/env python3
"""The host AdamW's speed (Note [Host AdamW]) beside torch's CPU AdamW, on this machine.

    PYTHONPATH=python python3 bench/torch/host_adamw.py [--elements 64M] [--repeat 5] [--json OUT]

For fp32 tensors of --elements values: spillway's update (torch.ops.spillway.adamw_update_,
each form, on 1 thread, the default count (spillway.optim's host_threads()) and all of
this process's CPUs) and torch.optim.AdamW on CPU
(fused=True, and foreach) at torch's thread count. Reports the median time per update
and the bandwidth it reaches, counting 28 bytes per element (param, grad, exp_avg,
exp_avg_sq read; param, exp_avg, exp_avg_sq written). The host side of T3: its 2.9 B
parameters are 45 times 64M elements.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))


def _elements(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text)


def _median_s(fn, repeat: int) -> float:
    fn()  # warm: pages touched, threads started
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=_elements, default=64 << 20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import torch
    from spillway import ops  # registers torch.ops.spillway.adamw_update_
    from spillway.optim._probe import ARITHMETICS, arithmetic_code, host_threads
    del ops

    n = args.elements
    cpus = len(os.sched_getaffinity(0))
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    rows = []

    def add(name, threads, seconds):
        rows.append({"method": name, "threads": threads, "ms": seconds * 1e3,
                     "gb_per_s": 28 * n / seconds / 1e9})

    for form in ARITHMETICS:
        for threads in sorted({1, host_threads(), cpus}):
            add(f"spillway {form}", threads, _median_s(
                lambda: torch.ops.spillway.adamw_update_(
                    p, g, m, v, 1e-4, 0.9, 0.999, 1e-8, 1e-2, False, 0.9, 0.999,
                    arithmetic_code(form), threads), args.repeat))
    for name, kwargs in (("torch AdamW(fused=True)", dict(fused=True)),
                         ("torch AdamW(foreach=True)", dict(foreach=True))):
        q = torch.randn(n, requires_grad=True)
        q.grad = g.clone()
        opt = torch.optim.AdamW([q], lr=1e-4, **kwargs)
        add(name, torch.get_num_threads(), _median_s(opt.step, args.repeat))

    lines = [f"host AdamW, {n} fp32 elements ({28 * n / 1e9:.2f} GB moved per update), "
             f"{cpus} CPUs, torch {torch.__version__}",
             "| method | threads | ms / update | GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['threads']} | {r['ms']:.1f} | {r['gb_per_s']:.1f} |"
              for r in rows]
    print("\n".join(lines))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"elements": n, "cpus": cpus, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
