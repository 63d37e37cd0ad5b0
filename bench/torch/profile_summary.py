#!/usr/bin/env python3
"""Where a profiled step's time goes, from its Chrome trace (torch.profiler's export,
gzipped or not: t3.py --profile, t1.py --profile).

    python3 bench/torch/profile_summary.py TRACE.json[.gz] [...]

Per trace: the step's span on the GPU; per stream, the ms its kernels and copies ran;
the copies' bytes and GB/s while busy, per direction, and the ms both directions ran
at once; the compute stream's idle ms, split by why: its next kernel was launched late
(the CPU was behind), or it was launched in time and the stream waited (for a copy's
event, most often); and the CPU's blocking runtime calls (event and device
synchronizes) with their ms, and its time in Spillway's wait_tensor.
"""
from __future__ import annotations

import gzip
import json
import sys


def _load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union_ms(spans: list) -> float:
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def _overlap_ms(xs: list, ys: list) -> float:
    def merged(spans):
        out = []
        for a, b in sorted(spans):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out
    xs, ys = merged(xs), merged(ys)
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total / 1e3


def summarize(path: str) -> str:
    events = _load(path)
    gpu = [e for e in events if e.get("ph") == "X" and
           e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return f"{path}: no GPU events"
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") == "cuda_runtime" and e.get("ph") == "X"}
    by_stream: dict = {}
    for e in gpu:
        by_stream.setdefault(e["args"].get("stream"), []).append(e)
    kernels_per_stream = {s: sum(e.get("cat") == "kernel" for e in es)
                          for s, es in by_stream.items()}
    compute = max(kernels_per_stream, key=kernels_per_stream.get)
    begin = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    lines = [f"{path}: GPU span {(end - begin) / 1e3:.1f} ms; compute stream {compute}"]
    for stream, es in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
        busy = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in es])
        lines.append(f"  stream {stream}: {len(es)} events, busy {busy:.1f} ms")
    copies = {"DtoH": [], "HtoD": []}
    moved = {"DtoH": 0, "HtoD": 0}
    for e in gpu:
        if e.get("cat") != "gpu_memcpy":
            continue
        kind = e["args"].get("memcpy kind") or e["name"]
        for direction in copies:
            if direction in kind or direction.replace("to", "2") in kind:
                copies[direction].append((e["ts"], e["ts"] + e["dur"]))
                moved[direction] += e["args"].get("bytes", 0)
    for direction, spans in copies.items():
        busy = _union_ms(spans)
        rate = moved[direction] / busy / 1e6 if busy else 0.0
        lines.append(f"  {direction}: {moved[direction] / 1e9:.2f} GB in {len(spans)} copies, "
                     f"busy {busy:.1f} ms, {rate:.1f} GB/s while busy")
    lines.append(f"  both directions at once: "
                 f"{_overlap_ms(copies['DtoH'], copies['HtoD']):.1f} ms")
    # The compute stream's idle time: before each of its events, the gap since the last
    # ended; late when the event's launch call began after that (the CPU was behind).
    mine = sorted(by_stream[compute], key=lambda e: e["ts"])
    late = waited = 0.0
    late_n = waited_n = 0
    biggest = []
    last_end = mine[0]["ts"] + mine[0]["dur"]
    for e in mine[1:]:
        gap = e["ts"] - last_end
        if gap > 5:  # us: launch latency between back-to-back kernels is not idle time
            launch = launches.get(e["args"].get("correlation"))
            launched = launch["ts"] if launch is not None else e["ts"]
            cpu_late = max(0.0, min(gap, launched + (launch or {}).get("dur", 0) - last_end))
            late += cpu_late
            waited += gap - cpu_late
            late_n += cpu_late > 0
            waited_n += gap - cpu_late > 0
            biggest.append((gap, cpu_late, e["name"][:60], e["ts"] - begin))
        last_end = max(last_end, e["ts"] + e["dur"])
    lines.append(f"  compute stream idle: {late / 1e3:.1f} ms with its next launch late "
                 f"(CPU behind, {late_n} gaps), {waited / 1e3:.1f} ms launched but waiting "
                 f"({waited_n} gaps)")
    for gap, cpu_late, name, at in sorted(biggest, reverse=True)[:8]:
        lines.append(f"    {gap / 1e3:7.2f} ms idle at {at / 1e3:7.1f} ms "
                     f"({cpu_late / 1e3:.2f} of it the CPU's) before {name}")
    blocking = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["name"] in (
                "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaStreamSynchronize",
                "cudaMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaLaunchKernel"):
            n, ms = blocking.get(e["name"], (0, 0.0))
            blocking[e["name"]] = (n + 1, ms + e["dur"] / 1e3)
    for name, (n, ms) in sorted(blocking.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  CPU {name}: {n} calls, {ms:.1f} ms")
    # The runtime's waits on the thread that launches the compute (Note [Awaited
    # transfers] in src/runtime/copy_engine.h): time it stands still.
    waits = [e["dur"] / 1e3 for e in events
             if e.get("ph") == "X" and e.get("name") == "spillway::wait_tensor"]
    if waits:
        lines.append(f"  CPU spillway::wait_tensor: {len(waits)} calls, {sum(waits):.1f} ms, "
                     f"the longest {max(waits):.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for path in paths:
        print(summarize(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
