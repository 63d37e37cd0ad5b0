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
this says which buffers make the difference. Writes DIR/<method>.md (the
method's name with every character but letters, digits, "_.-" made "_") and
the method's t1.py stats beside it, DIR/<method>.stats.json.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def _chain(frames: list[dict], depth: int = 4) -> str:
    """The innermost `depth` frames outside torch's own Python files, innermost first."""
    mine = [f for f in frames if f.get("filename") and "site-packages/torch" not in f["filename"]
            and not f["filename"].startswith("<")]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f.get('line')} {f.get('name')}"
                      for f in mine[:depth]) or _where(frames)


def snapshot(spec: str, out_dir: str) -> str:
    import torch

    name, options = t1._parse_method(spec)
    model, ids = t1._build(t1.T1, "cuda", torch.bfloat16)
    step, stats = t1._step_fn(name, options, model, "cuda")
    step(ids).backward()
    torch.cuda.synchronize()
    # History from the second warm-up step on: what it allocated and still holds when
    # the measured step starts carries its stack (a step should leave nothing behind).
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    step(ids).backward()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    before = torch.cuda.memory._snapshot()
    survivors = [b for seg in before["segments"] for b in seg["blocks"]
                 if b["state"] == "active_allocated" and b.get("frames")]
    skip = sum(len(trace) for trace in before["device_traces"])
    torch.cuda.reset_peak_memory_stats()
    step(ids).backward()
    torch.cuda.synchronize()
    peak_measured = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    end = torch.cuda.memory_allocated()
    gc.collect()
    after_gc = torch.cuda.memory_allocated()

    events = [e for trace in snap["device_traces"] for e in trace][skip:]
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
    by_site: dict[str, list[int]] = {}
    for b in survivors:
        site = by_site.setdefault(_chain(b["frames"]), [0, 0])
        site[0] += 1
        site[1] += b["size"]
    lines += ["", f"After the step: {end / GIB:.3f} GiB allocated, {after_gc / GIB:.3f} GiB "
              "after gc.collect()"]
    lines += ["", f"Allocated by the step before and still live at this step's start: "
              f"{len(survivors)} blocks, {sum(b['size'] for b in survivors) / GIB:.3f} GiB", "",
              "| blocks | MiB | allocated at |", "|---|---|---|"]
    for where, (count, size) in sorted(by_site.items(), key=lambda kv: -kv[1][1])[:20]:
        lines.append(f"| {count} | {size / (1 << 20):.1f} | `{where}` |")
    # The last allocations before the peak: what the peak kernel's neighbourhood made.
    lines += ["", "The 25 allocations before the peak (MiB, where):", ""]
    for e in events[max(0, best_at - 25):best_at + 1]:
        if e["action"] == "alloc":
            lines.append(f"- {e['size'] / (1 << 20):.1f} `{_where(e.get('frames', []))}`")
    text = "\n".join(lines) + "\n"
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)
    with open(os.path.join(out_dir, f"{safe}.md"), "w", encoding="utf-8") as f:
        f.write(text)
    # The method's own stats (a budget plan's forecast, and for eager its measured
    # profile): the plan can be simulated again beside this snapshot.
    with open(os.path.join(out_dir, f"{safe}.stats.json"), "w", encoding="utf-8") as f:
        json.dump(stats(), f, default=str)
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
