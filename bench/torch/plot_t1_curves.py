#!/usr/bin/env python3
"""Plots T1's memory/time plane from measured runs: each peer a point, each
spillway budget series a line (README's picture).

    python3 bench/torch/plot_t1_curves.py --out docs/t1-curves.svg \
        --eager bench/results/2026-12-02-t1-eager-budget-v8-h200.json \
        --compiled bench/results/2026-12-02-t1-compiled-v10a-h200.json \
        --compiled bench/results/2026-12-02-t1-compiled-v10b-h200.json

--eager and --compiled take t1.py JSON files (--compiled may repeat: each
file's points are relative to its own `compiled` method, or to the previous
file's when it has none); --compiled-peers (may repeat, read before
--compiled) a t1.py JSON whose peers only are drawn, the same way (a run whose
Spillway points a later change superseded); --eager-peers
(may repeat) a t1.py JSON whose peers only are drawn, relative to its own
`none` (an earlier run's peers beside a new Spillway series); --compiled-log a
t1.py log ("[t1] method: X ms, activation Y GiB" lines), for a run whose JSON
was not written. x = activation memory above the resident weights (GiB), y =
step time relative to the run's `none` (eager) or `compiled` method; each
panel's title dates it by the latest date in its files' names. Points
above 1.6x (save_on_cpu, torchtune without checkpointing) sit on the top
edge with their factor written beside them.
"""
from __future__ import annotations

import argparse
import functools
import json
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_LINE = re.compile(r"^\[t1\] (\S+): ([0-9.]+) ms, activation ([0-9.]+) GiB")


@functools.lru_cache(maxsize=None)
def _records(path: str) -> tuple[dict, ...]:
    """A t1.py JSON file's records (read once: the points and the panel titles use them)."""
    with open(path, encoding="utf-8") as f:
        return tuple(json.load(f))


def _from_json(path: str) -> list[tuple[str, float, float]]:
    return [(r["method"], r["step_ms_median"], r["activation_gib"])
            for r in _records(path) if "error" not in r]


def _from_log(path: str) -> list[tuple[str, float, float]]:
    points = []
    for line in open(path):
        m = _LINE.match(line.strip())
        if m:
            points.append((m.group(1), float(m.group(2)), float(m.group(3))))
    return points


def _dated(title: str, paths) -> str:
    """title, the GPU of the JSON files among paths (t1.py's `device`: "H100", "H200",
    both where they differ) and the latest YYYY-MM-DD in their names, if any."""
    gpus = []
    for p in paths:
        if p.endswith(".json"):
            for r in _records(p):
                gpu = next((g for g in ("H100", "H200") if g in str(r.get("device", ""))), None)
                if gpu and gpu not in gpus:
                    gpus.append(gpu)
    title = f"{title}, {' / '.join(gpus)}" if gpus else title
    dates = sorted(d for p in paths for d in re.findall(r"\d{4}-\d{2}-\d{2}", p))
    return f"{title} ({dates[-1]})" if dates else title


def _relative(points, base_name, base=None):
    """(method, step time / the base method's, activation GiB) for one run's points.

    A run without the base method takes `base` (ms), the one of the run before it."""
    base = next((ms for m, ms, _ in points if m == base_name), base)
    if base is None:
        raise SystemExit(f"plot_t1_curves: a run without {base_name!r} came first")
    return [(m, ms / base, act) for m, ms, act in points]


_TOP = 1.6
_EXACT = "offload_materialised=0"  # spillway-compiled's bit-exact mode: its own marker


def _label(method: str) -> str:
    names = {"none": "nothing", "ckpt-full": "checkpoint all", "compiled": "torch.compile",
             "compiled-ckpt-full": "compile + checkpoint all",
             "ckpt-selective": "selective checkpointing", "save-on-cpu": "save_on_cpu",
             "torchtune-offload": "torchtune offload",
             "torchtune-offload-ckpt": "torchtune offload + checkpoint all"}
    if method in names:
        return names[method]
    if method.startswith("ckpt:k="):
        return f"checkpoint {method.split('=')[1]} of 16"
    if method.startswith("compiled-amb:budget="):
        return f"activation_memory_budget {method.split('=')[1]}"
    return method


def _panel(ax, points, base_name, title, spillway_prefix, legend_loc, superseded=()):
    """points: (method, relative step time, activation GiB); `superseded`: Spillway
    methods whose plan the measured commit no longer makes (drawn hollow, apart)."""
    peers = [(m, x, act) for m, x, act in points if not m.startswith(spillway_prefix)]
    old = [(x, act) for m, x, act in points if m in superseded]
    points = [p for p in points if p[0] not in superseded]
    ours = sorted(((x, act) for m, x, act in points
                   if m.startswith(spillway_prefix) and _EXACT not in m), key=lambda p: p[1])
    exact = [(x, act) for m, x, act in points if m.startswith(spillway_prefix) and _EXACT in m]
    seen, above = set(), 0
    for m, x, act in peers:
        if m in seen:
            continue  # the same peer from a second run (its own base): shown once
        seen.add(m)
        shown = min(x, _TOP)
        ax.scatter(act, shown, color="0.35", zorder=3, marker="^" if x > _TOP else "o")
        text = _label(m) + (f" ({x:.2f}x)" if x > _TOP else "")
        offset = (5, 4 - 11 * above) if x > _TOP else (5, 4)
        above += x > _TOP
        if m.startswith("torchtune-offload-ckpt"):
            offset = (5, 10)
        elif m == "ckpt-full":
            offset = (5, -10)
        ax.annotate(text, (act, shown), textcoords="offset points", xytext=offset, fontsize=8)
    ax.margins(x=0.18)
    if ours:
        ax.plot([a for _, a in ours], [x for x, _ in ours], "-o", color="tab:blue",
                label="spillway, memory_budget", zorder=4)
    if exact:
        ax.scatter([a for _, a in exact], [x for x, _ in exact], marker="s", color="tab:green",
                   label="spillway, bit-exact mode (offload_materialised=0)", zorder=5)
    if old:
        ax.scatter([a for _, a in old], [x for x, _ in old], facecolors="none",
                   edgecolors="tab:blue", label="spillway, a plan the planner now refuses",
                   zorder=5)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("activation memory above the weights (GiB)")
    ax.set_ylabel(f"step time (x {_label(base_name)})")
    ax.grid(alpha=0.3)
    ax.legend(loc=legend_loc, fontsize=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eager", required=True)
    parser.add_argument("--eager-peers", action="append", default=[])
    parser.add_argument("--compiled", action="append", default=[])
    parser.add_argument("--compiled-peers", action="append", default=[])
    parser.add_argument("--compiled-log")
    parser.add_argument("--superseded", action="append", default=[],
                        help="a compiled Spillway method drawn apart, hollow: its plan is "
                             "no longer what the planner makes (may repeat)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not args.compiled and not args.compiled_log:
        parser.error("give --compiled (t1.py JSON, may repeat) or --compiled-log")
    compiled, base = [], None
    runs = [(path, True) for path in args.compiled_peers] + [(path, False) for path in args.compiled]
    for path, peers_only in runs:
        measured = _from_json(path)
        base = next((ms for m, ms, _ in measured if m == "compiled"), base)
        points = _relative(measured, "compiled", base)
        compiled += [p for p in points if not (peers_only and p[0].startswith("spillway"))]
    if args.compiled_log:
        compiled += _relative(_from_log(args.compiled_log), "compiled")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    eager = _relative(_from_json(args.eager), "none")
    for path in args.eager_peers:
        eager += [p for p in _relative(_from_json(path), "none")
                  if not p[0].startswith("spillway")]
    _panel(left, eager, "none", _dated("T1 eager", [args.eager, *args.eager_peers]),
           "spillway-eager-budget", "upper right")
    compiled_files = [*args.compiled_peers, *args.compiled, args.compiled_log or ""]
    _panel(right, compiled, "compiled", _dated("T1 torch.compile", compiled_files),
           "spillway-compiled", "upper center", set(args.superseded))
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
