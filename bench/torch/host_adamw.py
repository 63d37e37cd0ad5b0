#!/usr/bin/env python3
"""The host AdamW's speed (Note [Host AdamW]) beside torch's CPU AdamW, on this machine.

    PYTHONPATH=python python3 bench/torch/host_adamw.py [--elements 64M] [--repeat 5] [--json OUT]
        [--load]

For fp32 tensors of --elements values: spillway's update (torch.ops.spillway.adamw_update_,
each form, on 1 thread, the default count (spillway.optim's host_threads()) and all of
this process's CPUs) and torch.optim.AdamW on CPU
(fused=True, and foreach) at torch's thread count. Reports the median time per update
and the bandwidth it reaches, counting 28 bytes per element (param, grad, exp_avg,
exp_avg_sq read; param, exp_avg, exp_avg_sq written). The host side of T3: its 2.9 B
parameters are 45 times 64M elements.

--load: spillway's update again, at its default thread count and at fewer threads, while
the machine does what a replayed step does beside it: pinned copies both ways on the
link (CUDA only), a Python thread that stays busy issuing small ops (the replay's
dispatch), and both. In T3's replay the host AdamW ran 1.1 to 1.7x slower than alone
(bench/results/2026-12-04-t3-t1-h200-run11.md): these rows say whether memory bandwidth
(the copies) or the CPUs (the busy thread) take it.
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


class _Load:
    """Background work while the update is timed: `copies`, spillway.optim's LinkTraffic
    (256 MiB pinned copies both ways on two streams of the GPU, back to back); `busy`, a
    Python thread issuing small tensor ops (on the GPU when there is one) without pause.
    report(): what the load did meanwhile, so a row shows the load was there."""

    def __init__(self, copies: bool, busy: bool):
        import threading
        from spillway.optim._probe import LinkTraffic
        self.link = LinkTraffic() if copies else None
        self.busy = busy
        self.stop = threading.Event()
        self.thread = None
        self.ops = 0
        self.began = 0.0

    def __enter__(self):
        import threading
        import torch
        self.began = time.perf_counter()
        if self.link is not None:
            self.link.__enter__()
        if self.busy:
            def busy():
                x = torch.ones(1024, device="cuda" if torch.cuda.is_available() else "cpu")
                while not self.stop.is_set():
                    x = x.mul(1.0001).add_(1e-6)
                    self.ops += 2
            self.thread = threading.Thread(target=busy, daemon=True)
            self.thread.start()
            time.sleep(0.2)  # under way before the first timing
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.began
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        if self.link is not None:
            self.link.__exit__(*exc)

    def report(self) -> str:
        seconds = getattr(self, "elapsed", time.perf_counter() - self.began)
        parts = []
        if self.link is not None:
            parts.append(f"copied {self.link.copied_gbs():.1f} GB/s (both ways together)")
        if self.busy:
            parts.append(f"issued {self.ops / seconds / 1e3:.0f} k ops/s")
        return ", ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=_elements, default=64 << 20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--load", action="store_true",
                        help="also under a replayed step's load: copies, a busy thread, both")
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

    def spillway_update(form, threads):
        return lambda: torch.ops.spillway.adamw_update_(
            p, g, m, v, 1e-4, 0.9, 0.999, 1e-8, 1e-2, False, 0.9, 0.999,
            arithmetic_code(form), threads)

    for form in ARITHMETICS:
        for threads in sorted({1, host_threads(), cpus}):
            add(f"spillway {form}", threads, _median_s(spillway_update(form, threads), args.repeat))
    for name, kwargs in (("torch AdamW(fused=True)", dict(fused=True)),
                         ("torch AdamW(foreach=True)", dict(foreach=True))):
        q = torch.randn(n, requires_grad=True)
        q.grad = g.clone()
        opt = torch.optim.AdamW([q], lr=1e-4, **kwargs)
        add(name, torch.get_num_threads(), _median_s(opt.step, args.repeat))

    if args.load:
        form = ARITHMETICS[-1]
        counts = sorted({host_threads(), max(1, host_threads() - 2), max(1, cpus // 2)}, reverse=True)
        for load in ("copies", "busy thread", "copies and busy thread"):
            if "copies" in load and not torch.cuda.is_available():
                print(f"[host_adamw] --load: '{load}' skipped: no CUDA device", file=sys.stderr)
                continue
            with _Load(copies="copies" in load, busy="busy" in load) as under:
                for threads in counts:
                    add(f"spillway {form}, under {load}", threads,
                        _median_s(spillway_update(form, threads), args.repeat))
            rows[-1]["load"] = under.report()

    lines = [f"host AdamW, {n} fp32 elements ({28 * n / 1e9:.2f} GB moved per update), "
             f"{cpus} CPUs, torch {torch.__version__}",
             "| method | threads | ms / update | GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['threads']} | {r['ms']:.1f} | {r['gb_per_s']:.1f} |"
              for r in rows]
    lines += [f"{r['method']}: the load itself {r['load']}" for r in rows if "load" in r]
    print("\n".join(lines))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"elements": n, "cpus": cpus, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
