"""What is live at a T1 step's peak, allocation by allocation (CUDA only).

    python3 bench/torch/peak_snapshot.py --method compiled \
        --method spillway-compiled:memory_budget=16GiB --out DIR

For each method (t1.py's names and options): build T1, run 2 warm-up steps,
then record the caching allocator's history (torch.cuda.memory.
_record_memory_history) over one step, replay its alloc/free events to find
the step's peak, and list the blocks live there, largest first, each with the
source line that allocated it (for torch.compile: the line of Inductor's
generated code, e.g. `buf12 = empty_strided_cuda(...)`, and the buffer's
kernel). Where a simulator's forecast peak departs from the measured one,
this says which buffers make the difference. Writes DIR/<method>.md.
"""

from __future__ import annotations

import argparse
import linecache
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import t1  # noqa: E402

GIB = 1 << 30


def _where(frames: list[dict]) -> str:
    """The most telling frame: Inductor's generated code, else the first non-torch one."""
    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name or "/tmp/" in name:
            line = linecache.getline(name, f.get("line", 0)).strip()
            return f"{os.path.basename(name)}:{f.get('line')} {line[:140]}"
    for f in frames:
        name = f.get("filename", "")
        if "site-packages/torch" not in name and name:
            line = linecache.getline(name, f.get("line", 0)).strip()
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')} {line[:100]}"
    return frames[0].get("name", "?") if frames else "?"


def snapshot(spec: str, out_dir: str) -> str:
    import torch

    name, options = t1._parse_method(spec)
    model, ids = t1._build(t1.T1, "cuda", torch.bfloat16)
    step, _stats = t1._step_fn(name, options, model, "cuda")
    for _ in range(2):
        step(ids).backward()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    torch.cuda.reset_peak_memory_stats()
    step(ids).backward()
    torch.cuda.synchronize()
    peak_measured = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)

    events = [e for trace in snap["device_traces"] for e in trace]
    live: dict[int, dict] = {}
    total = start
    best, best_at, best_live = total, -1, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_at, best_live = total, i, dict(live)
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    rows = sorted(best_live.values(), key=lambda e: -e["size"])
    lines = [f"# {spec}: live at the step's peak", "",
             f"allocated at the step's start {start / GIB:.2f} GiB; measured peak "
             f"{peak_measured / GIB:.2f} GiB; replayed peak {best / GIB:.2f} GiB at event "
             f"{best_at} of {len(events)}; {len(rows)} blocks allocated during the step live "
             f"there ({sum(r['size'] for r in rows) / GIB:.2f} GiB)", "",
             "| MiB | allocated at |", "|---|---|"]
    for r in rows[:80]:
        lines.append(f"| {r['size'] / (1 << 20):.1f} | `{_where(r.get('frames', []))}` |")
    # The last allocations before the peak: what the peak kernel's neighbourhood made.
    lines += ["", "The 25 allocations before the peak (MiB, where):", ""]
    for e in events[max(0, best_at - 25):best_at + 1]:
        if e["action"] == "alloc":
            lines.append(f"- {e['size'] / (1 << 20):.1f} `{_where(e.get('frames', []))}`")
    text = "\n".join(lines) + "\n"
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec)
    with open(os.path.join(out_dir, f"{safe}.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", action="append", required=True)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for spec in args.method:
        print(snapshot(spec, args.out), flush=True)
        import torch
        import torch._dynamo
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
