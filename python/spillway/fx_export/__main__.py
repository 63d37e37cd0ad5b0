"""python -m spillway.fx_export --model llama-tiny --out examples/graphs/llama-tiny.json.zst

--time also runs the captured joint graph on the model's real tensors and
writes each call_function node's measured time_ms (CUDA events on a GPU,
time.perf_counter on the CPU, which says nothing about a GPU):

    python -m spillway.fx_export --model t1 --time --out t1-h200-timed.json.zst
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from . import export_joint_graph, save
from ._models import PRESETS


def _summary(graph: dict) -> str:
    nodes = graph["nodes"]
    backward = sum(1 for n in nodes if n.get("phase") == "backward")
    return f"{len(nodes)} nodes ({len(nodes) - backward} forward, {backward} backward), {len(graph['ops'])} ops"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spillway.fx_export", description=__doc__)
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="output path (.json or .json.zst)")
    parser.add_argument("--seq", type=int, help="sequence length (preset default if unset)")
    parser.add_argument("--batch", type=int, help="batch size (preset default if unset)")
    parser.add_argument("--device", help="device of the model's tensors: fake ones for llama3-8b, "
                        "real ones for the others (default cpu; t1: cuda); cuda needs a GPU")
    parser.add_argument("--decompositions", choices=["none", "inductor"], default="none")
    parser.add_argument("--time", action="store_true",
                        help="run the joint graph on real tensors and record each node's time_ms")
    parser.add_argument("--time-passes", type=int, default=3, metavar="N",
                        help="timed passes after one warm-up pass; each node gets its median (default 3)")
    args = parser.parse_args(argv)
    if args.time_passes < 1:
        parser.error("--time-passes must be >= 1")

    overrides = {k: v for k, v in (("seq", args.seq), ("batch", args.batch), ("device", args.device)) if v is not None}
    start = time.monotonic()
    try:
        preset = PRESETS[args.model](**overrides)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if args.time and preset.metadata.get("fake_tensors") == "true":
        parser.error(f"--time needs real tensors, and preset {args.model} is built from "
                     "FakeTensors; time a real-tensor preset (llama-tiny, gpt2-tiny, t1, t1-tiny)")
    graph = export_joint_graph(
        preset.model, preset.args, loss_fn=lambda _model, *a: preset.fn(*a),
        dynamic=preset.dynamic, decompositions=args.decompositions,
        name=f"{args.model} joint fwd+bwd", metadata={"preset": args.model, **preset.metadata},
        time_nodes=args.time, time_passes=args.time_passes,
    )
    del preset  # the model and its inputs; the caller of main() may run more steps
    save(graph, args.out)
    elapsed = time.monotonic() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.out}: {_summary(graph)}; {elapsed:.1f} s, peak RSS {peak_mib:.0f} MiB")
    if args.time:
        meta = graph["metadata"]
        print(f"timed {meta['timing_nodes']} nodes on {meta['timing_device']} "
              f"({meta['timing_passes']} passes, median): total node time "
              f"{meta['timing_total_node_ms']} ms, untimed pass wall {meta['timing_untimed_pass_wall_ms']} ms"
              + (f", peak allocated {int(meta['timing_peak_allocated_bytes']) / 2**30:.1f} GiB"
                 if "timing_peak_allocated_bytes" in meta else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
