#!/usr/bin/env python3
"""Makes a GPU run's eager budget plans again on this machine (no GPU needed).

    python3 bench/torch/replay_eager_plan.py bench/results/2026-12-02-t1-eager-budget-v8-h200.json
    python3 bench/torch/replay_eager_plan.py RUN.json --method 7.1GiB --activation-gib 6.5 6.0
    python3 bench/torch/replay_eager_plan.py RUN.json --method 24.6GiB --around-peak
    python3 bench/torch/replay_eager_plan.py RUN.json --relax --what-if-linear 416 1.6

For each spillway-eager-budget method of a t1.py JSON (or those whose name
contains --method), the block graph its plan was made from goes to the
planner again with the same options: the stats' plan_graph and
planner_options where the run recorded them (t1.py since 2026-12-02), else
rebuilt from the stats' measured profile (_budget_graph.block_graph with the
recorded calibration; the resident bytes are set so that the graph's own peak
is the recorded baseline, and of the planner calls _fastest_plan makes, the
one whose forecast the run recorded). Prints the replayed forecast beside the
recorded one and the measured step, then, with --activation-gib, the plans at
other budgets (activation GiB above what was allocated at the step's start,
as t1.py's method names give them), and with --around-peak what the
simulation holds live at the nodes around its peak, by category. With
--relax the planner also searches from both ends (BudgetOptions::relax);
with --what-if-linear MIB MS each block call of a recorded graph gets a
linear part (_recipes.py, Note [Linear recipes]) of MIB split off its
S_k, rebuilt in MS: a forecast of what linear recipes would plan on a run
recorded without them (the graph is rebuilt from the recorded profile and
the recorded graph's placeholders and transients).

A planner or simulator change can be judged on a measured run this way: the
same plans at the measured budgets mean the measured figures still stand.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

GIB = 1 << 30


def _rebuilt(stats: dict) -> tuple[dict, dict]:
    """(graph, planner options) from a run that recorded only the profile."""
    from spillway import _C
    from spillway.activations._budget_graph import (BlockCall, StepProfile, block_graph,
                                                    placeholder_bytes)

    fields = dict(stats["profile"])
    calls = [BlockCall(**{**c, "cheap_traffic": tuple(c["cheap_traffic"])})
             for c in fields.pop("calls")]
    profile = StepProfile(calls=calls, **fields)
    offset = stats["calibration"]["offset_bytes"]

    def graph_with(resident: int) -> dict:
        res, off = placeholder_bytes(resident, offset)
        return block_graph(profile, resident_bytes=res, offset_bytes=off, device="cuda:0")

    guess = profile.resident_bytes
    peak = json.loads(_C.simulate_graph(json.dumps(graph_with(guess))))["peak_bytes"]
    graph = graph_with(guess + stats["forecast"]["baseline_peak_bytes"] - peak)
    # _fastest_plan's options (2026-12-01): eager lag 1, with and without the blocks'
    # inputs as candidates (min_bytes above a hidden state's bytes).
    inputs = max((c.output_bytes for c in calls), default=0)
    base = dict(scope="", allow_offload=True, allow_recompute=True,
                prefetch_regions=stats["prefetch"], release_lag=2, device_profile_json="",
                release_when_copied=True)
    for min_bytes in (1 << 20, inputs + 1):
        options = dict(base, min_bytes=min_bytes)
        result = _plan(graph, stats["budget"], options)
        if result and same_forecast(result, stats["forecast"]):
            return graph, options
    return graph, dict(base, min_bytes=1 << 20)


def with_linear(graph: dict, stats: dict, mib: float, ms: float) -> dict:
    """`graph` (a recorded block graph) rebuilt from stats' profile with a linear part of
    `mib` MiB rebuilt in `ms` per block call (see --what-if-linear)."""
    from spillway.activations._budget_graph import BlockCall, StepProfile, block_graph

    fields = dict(stats["profile"])
    calls = [BlockCall(**{**c, "cheap_traffic": tuple(c["cheap_traffic"]),
                          "linear_bytes": int(mib * (1 << 20)), "linear_ms": ms})
             for c in fields.pop("calls")]
    nodes = {n["name"]: n for n in graph["nodes"]}

    def size(name: str) -> int:
        return nodes[name]["value"]["sizes"][1] if name in nodes else 0

    transients = (size("post_forward_transient"), size("post_backward_transient"),
                  size("b0_transient"))
    return block_graph(StepProfile(calls=calls, **fields), resident_bytes=size("resident"),
                       offset_bytes=size("offset"), transients=transients,
                       device=nodes["resident"]["value"]["device"])


def _plan(graph: dict, budget: int, options: dict, **extra) -> dict | None:
    from spillway import _C
    try:
        return json.loads(_C.plan_memory_budget(json.dumps(graph), budget, **options, **extra))
    except MemoryError as e:
        print(f"    {e}")
        return None


def replay(record: dict, **extra) -> tuple[dict, dict, str, dict | None]:
    """(graph, planner options, how they were found, the planner's answer or None when it
    refuses) for one t1.py record of a spillway-eager-budget method with a plan."""
    stats = record["method_stats"]
    if "plan_graph" in stats:
        graph, options, how = stats["plan_graph"], stats["planner_options"], "recorded graph"
    else:
        graph, options = _rebuilt(stats)
        how = "rebuilt from the profile"
    budget = stats.get("planner_budget", stats["budget"])  # recorded since 2026-12-06
    return graph, options, how, _plan(graph, budget, options, **extra)


def same_forecast(result: dict, recorded: dict) -> bool:
    # graph_peak_bytes: the planner's own peak, recorded beside the run's (as_run_peak)
    # since 2026-12-06.
    return (result["forecast"]["peak_bytes"] == recorded.get("graph_peak_bytes",
                                                             recorded["peak_bytes"]) and
            abs(result["forecast"]["step_ms"] - recorded["step_ms"]) < 1e-6)


def _row(label: str, forecast: dict, measured: dict | None = None) -> str:
    out = (f"  {label:<28} {forecast['step_ms']:7.1f} ms  peak {forecast['peak_bytes'] / GIB:6.2f}"
           f" GiB at {forecast['peak_node']}")
    if measured:
        out += (f"   measured {measured['step_ms_median']:7.1f} ms  peak "
                f"{measured['peak_allocated_gib']:6.2f} GiB")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a t1.py --json file")
    parser.add_argument("--method", default="", help="only methods whose name contains this")
    parser.add_argument("--activation-gib", type=float, nargs="*", default=[])
    parser.add_argument("--around-peak", action="store_true")
    parser.add_argument("--relax", action="store_true",
                        help="also search from both ends (BudgetOptions::relax)")
    parser.add_argument("--what-if-linear", type=float, nargs=2, metavar=("MIB", "MS"),
                        help="give each block call a linear part of MIB MiB rebuilt in MS")
    args = parser.parse_args()
    from spillway._budget import parse_memory_budget

    for record in json.load(open(args.run)):
        name, stats = record["method"], record.get("method_stats") or {}
        if not name.startswith("spillway-eager-budget") or args.method not in name:
            continue
        if "forecast" not in stats:
            print(f"{name}: no plan recorded ({record.get('error', 'no stats')[:80]})")
            continue
        graph, options, how, result = replay(record, timeline=args.around_peak)
        print(f"{name} ({how}; prefetch {options['prefetch_regions']}, min_bytes "
              f"{options['min_bytes']})")
        print(_row("recorded forecast", stats["forecast"], record))
        if result is None:
            continue
        same = same_forecast(result, stats["forecast"])
        print(_row("replayed" + ("" if same else " (DIFFERENT)"), result["forecast"]))
        if args.relax or args.what_if_linear:
            if args.what_if_linear:
                graph = with_linear(graph, stats, *args.what_if_linear)
            options = dict(options, relax=args.relax)
            budget = stats.get("planner_budget", stats["budget"])
            what_if = _plan(graph, budget, options)
            if what_if is not None:
                label = " + ".join(x for x in ("relax" if args.relax else "",
                                               "linear" if args.what_if_linear else "") if x)
                print(_row(f"with {label}", what_if["forecast"]))
        if args.around_peak:
            timeline = result["timeline"]
            at = max(range(len(timeline)),
                     key=lambda i: timeline[i]["live_bytes"] + timeline[i]["scratch_bytes"])
            for point in timeline[max(0, at - 3):at + 3]:
                parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in point["by_category"].items()
                                  if v)
                print(f"    {point['name']:<36} {point['live_bytes'] / GIB:6.2f} GiB: {parts}")
        kind, activation = parse_memory_budget(name.split(":", 1)[1].split(",")[0], "eager")
        start = stats["budget"] - int(activation) if kind == "bytes" else None
        for gib in args.activation_gib:
            if start is None:
                print("    --activation-gib needs a method whose budget is in bytes")
                break
            other = _plan(graph, start + int(gib * GIB), options)
            if other is not None:
                print(_row(f"at {gib:g} GiB of activation", other["forecast"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
