"""python -m spillway.fx_export --model llama-tiny --out examples/graphs/llama-tiny.json.zst"""

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
    parser.add_argument("--device", help="device of the fake tensors (llama3-8b only; cuda needs a GPU)")
    parser.add_argument("--decompositions", choices=["none", "inductor"], default="none")
    args = parser.parse_args(argv)

    overrides = {k: v for k, v in (("seq", args.seq), ("batch", args.batch), ("device", args.device)) if v is not None}
    start = time.monotonic()
    preset = PRESETS[args.model](**overrides)
    graph = export_joint_graph(
        preset.model, preset.args, loss_fn=lambda _model, *a: preset.fn(*a),
        dynamic=preset.dynamic, decompositions=args.decompositions,
        name=f"{args.model} joint fwd+bwd", metadata={"preset": args.model, **preset.metadata},
    )
    save(graph, args.out)
    elapsed = time.monotonic() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.out}: {_summary(graph)}; {elapsed:.1f} s, peak RSS {peak_mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
