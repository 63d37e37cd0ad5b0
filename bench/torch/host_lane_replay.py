"""The host lane (Note [The host lane], src/plan/budget_problem.cc) replayed on a
recorded T1 eager run: runs on CPU, from the JSON t1.py wrote on the GPU.

For every spillway-eager-budget plan of the run, the plan is made again from its
recorded graph and options (bit for bit the plan that ran) and simulated three ways:

  device   the forecast as planned: the device's streams only;
  replay   the same plan with each block's host time of the run's last planned step
           (stats()["block_forward_host_ms"]) as its cpu_ms, and the rest of the
           forward's host time (t1.py's forward_host_ms less the blocks') on the head;
           compared with that step, the one those times come from;
  model    the same plan with the host times Note [Host costs by mode]
           (_budget_graph.host_lane) predicts from the profiling step's launches.

  measured the model scaled to the host's speed in that step, its time between block
           calls spread over them (Note [Replanning on the host's speed]: what the
           context does at planned step _REPLAN_AT, from the step before);

and the plans the planner makes with the model's host lane (_eager_budget._HOST_LANE)
and with the measured one (the replan; here at the recorded prefetch distance only,
where the context tries every distance).

    PYTHONPATH=python python3 bench/torch/host_lane_replay.py \\
        bench/results/2026-12-07-t1-eager-budget-v18-h200.json [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import types

from spillway import _C
from spillway.activations._budget_graph import (charge_host, host_lane, measured_host_lane,
                                                mode_ratio)


def _copy(obj: dict) -> dict:
    return json.loads(json.dumps(obj))


def _lane(plan: dict, graph: dict, costs: list[dict], decisions: dict, budget: int,
          options: dict) -> tuple[dict, dict]:
    """The plan's simulation with the host lane of `graph` and `costs` charged as its
    decisions take them, and the plan the planner makes with that lane."""
    charged = charge_host(_copy(plan["graph"]), graph, costs, decisions)
    simulated = json.loads(_C.simulate_graph(json.dumps(charged),
                                             recomputed=plan["recomputed_nodes"]))
    made = json.loads(_C.plan_memory_budget(json.dumps(graph), budget, **options,
                                            host_costs_json=json.dumps(costs)))
    return simulated, made


def _mix(result: dict) -> dict:
    return dict(collections.Counter(f"{c['name'].split('_', 1)[1]} {c['decision']}"
                                    for c in result["choices"] if c["decision"] != "keep"))


def replay(run: list[dict]) -> list[dict]:
    rows = []
    none = next((r["step_ms_median"] for r in run if r["method"] == "none"), None)
    for record in run:
        stats = record.get("method_stats") or {}
        if "choices" not in stats or "block_forward_host_ms" not in stats:
            continue
        graph, options = stats["plan_graph"], dict(stats["planner_options"])
        budget = stats["planner_budget"]
        plan = json.loads(_C.plan_memory_budget(json.dumps(graph), budget, **options,
                                                planned_graph=True))
        decisions = {c["name"]: c["decision"] for c in plan["choices"]}
        block_host = stats["block_forward_host_ms"]

        measured = _copy(plan["graph"])
        by_name = {n["name"]: n for n in measured["nodes"]}
        for k, ms in enumerate(block_host):
            by_name[f"b{k}_forward"]["cpu_ms"] = ms
        head = max(0.0, record["host"]["forward_host_ms"] - sum(block_host))
        by_name["post_forward"]["cpu_ms"] = head
        replayed = json.loads(_C.simulate_graph(json.dumps(measured),
                                                recomputed=plan["recomputed_nodes"]))

        profile = types.SimpleNamespace(calls=[
            types.SimpleNamespace(forward_host_ms=c["forward_host_ms"])
            for c in stats["profile"]["calls"]])
        modelled_graph = _copy(graph)
        costs = host_lane(modelled_graph, profile)
        modelled, aware = _lane(plan, modelled_graph, costs, decisions, budget, options)
        ratios = [mode_ratio(c["saved"], c.get("linear"), c.get("cheap"), c.get("input", "keep"))
                  for c in stats["choices"]]
        scaled_graph = _copy(graph)
        scaled_costs, scale, between = measured_host_lane(
            scaled_graph, profile, ratios, block_host, record["host"]["forward_host_ms"])
        scaled, replanned = _lane(plan, scaled_graph, scaled_costs, decisions, budget, options)
        rows.append({
            "method": record["method"],
            "step_ms_median": record["step_ms_median"],
            "last_step_ms": record["step_ms_all"][-1],
            "device_forecast_ms": plan["forecast"]["step_ms"],
            "replay_ms": replayed["step_ms"],
            "replay_host_wait_ms": replayed["host_wait_ms"],
            "head_host_ms": head,
            "model_ms": modelled["step_ms"],
            "aware_plan_ms": aware["forecast"]["step_ms"],
            "aware_plan_x_none": aware["forecast"]["step_ms"] / none if none else None,
            "aware_plan_mix": _mix(aware),
            "scale": scale,
            "between_ms": between,
            "measured_ms": scaled["step_ms"],
            "replanned_ms": replanned["forecast"]["step_ms"],
            "replanned_x_none": replanned["forecast"]["step_ms"] / none if none else None,
            "replanned_mix": _mix(replanned),
        })
    return rows


def _error(forecast: float, measured: float) -> str:
    return f"{100 * (forecast - measured) / measured:+.1f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a t1.py JSON with spillway-eager-budget records")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    with open(args.run, encoding="utf-8") as f:
        rows = replay(json.load(f))
    print("| plan | median ms | device forecast | last step ms | device | replay (host wait) "
          "| model | measured (scale) | host-aware plan | replanned (x none) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        budget = r["method"].split(":", 1)[1]
        print(f"| {budget} | {r['step_ms_median']:.1f} | {r['device_forecast_ms']:.1f} "
              f"({_error(r['device_forecast_ms'], r['step_ms_median'])}) "
              f"| {r['last_step_ms']:.1f} | {_error(r['device_forecast_ms'], r['last_step_ms'])} "
              f"| {_error(r['replay_ms'], r['last_step_ms'])} ({r['replay_host_wait_ms']:.1f}) "
              f"| {_error(r['model_ms'], r['last_step_ms'])} "
              f"| {_error(r['measured_ms'], r['last_step_ms'])} ({r['scale']:.2f}) "
              f"| {r['aware_plan_ms']:.1f} "
              f"| {r['replanned_ms']:.1f} ({r['replanned_x_none']:.3f}) |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
