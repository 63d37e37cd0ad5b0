#!/usr/bin/env python3
"""Plots T1's memory/time plane from measured runs: each peer a point, each
spillway budget series a line (README's picture).

    python3 bench/torch/plot_t1_curves.py --out docs/t1-curves.svg \
        --eager bench/results/2026-12-01-t1-budget-eager-h200.json \
        --compiled-log bench/results/2026-12-01-t1-budget-compiled-v2-h200.log

--eager takes a t1.py JSON file; --compiled-log a t1.py log ("[t1] method:
X ms, activation Y GiB" lines), for a run whose JSON was not written. x =
activation memory above the resident weights (GiB), y = step time relative
to the run's `none` (eager) or `compiled` method.
"""
from __future__ import annotations

import argparse
import json
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_LINE = re.compile(r"^\[t1\] (\S+): ([0-9.]+) ms, activation ([0-9.]+) GiB")


def _from_json(path: str) -> list[tuple[str, float, float]]:
    return [(r["method"], r["step_ms_median"], r["activation_gib"])
            for r in json.load(open(path)) if "error" not in r]


def _from_log(path: str) -> list[tuple[str, float, float]]:
    points = []
    for line in open(path):
        m = _LINE.match(line.strip())
        if m:
            points.append((m.group(1), float(m.group(2)), float(m.group(3))))
    return points


def _label(method: str) -> str:
    names = {"none": "nothing", "ckpt-full": "checkpoint all", "compiled": "torch.compile",
             "compiled-ckpt-full": "compile + checkpoint all"}
    if method in names:
        return names[method]
    if method.startswith("ckpt:k="):
        return f"checkpoint {method.split('=')[1]} of 16"
    if method.startswith("compiled-amb:budget="):
        return f"activation_memory_budget {method.split('=')[1]}"
    return method


def _panel(ax, points, base_name, title, spillway_prefix):
    base = next(ms for m, ms, _ in points if m == base_name)
    peers = [(m, ms / base, act) for m, ms, act in points if not m.startswith(spillway_prefix)]
    ours = sorted(((ms / base, act) for m, ms, act in points if m.startswith(spillway_prefix)),
                  key=lambda p: p[1])
    for m, x, act in peers:
        ax.scatter(act, x, color="0.35", zorder=3)
        ax.annotate(_label(m), (act, x), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if ours:
        ax.plot([a for _, a in ours], [x for x, _ in ours], "-o", color="tab:blue",
                label="spillway, memory_budget", zorder=4)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("activation memory above the weights (GiB)")
    ax.set_ylabel(f"step time (x {_label(base_name)})")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eager", required=True)
    parser.add_argument("--compiled-log", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    _panel(left, _from_json(args.eager), "none", "T1 eager, H200 (2026-12-01)",
           "spillway-eager-budget")
    _panel(right, _from_log(args.compiled_log), "compiled", "T1 torch.compile, H200 (2026-12-01)",
           "spillway-compiled")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
