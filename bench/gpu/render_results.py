#!/usr/bin/env python3
"""Render bench/gpu's JSON (spillway_bench_gpu --json) as the markdown page
recorded under bench/results/, with the issue's targets checked:
  * copy engine >= 95 % of raw cudaMemcpyAsync for transfers >= 4 MiB, in
    each direction;
  * both directions at once >= 1.6x the one-way throughput (engine, each size
    >= 4 MiB; the faster one-way direction is the reference);
  * pool: zero pinned allocations after the first step, pinned <= 1.1x peak live.
Rows the benchmark marked INVALID (failed verification, a figure above the
link's ceiling, events disagreeing with the wall clock) count as missed.

Usage: render_results.py bench_gpu.json [date] [command] > runtime_link_h200.md
"""
import json
import sys


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        data = json.load(f)
    date = sys.argv[2] if len(sys.argv) > 2 else "(date of the run)"
    command = sys.argv[3] if len(sys.argv) > 3 else "scripts/device-check"
    rows = data["link"]
    out = []
    out.append(f"# Copy engine vs raw cudaMemcpyAsync, {data['device']}\n")
    out.append(
        f"Measured {date} by `{command}` (bench/gpu/copy_bandwidth.cc, plain C++ "
        f"against the CUDA runtime; no PyTorch involved). Batches of max(2, "
        f"{data['batch_mib']} MiB / size) transfers per direction, pinned host memory, "
        f"one warm-up, median of {data['repeats']} repeats, raw and engine interleaved "
        f"in the same run. Timing: {data['timing']}. Every batch is verified (sampled "
        f"destination words poisoned before, compared with the source pattern after; "
        f"the engine's byte counters must grow by the batch). A figure above "
        f"{data['max_one_way_gbs']:.0f} GB/s one way or {data['max_both_gbs']:.0f} GB/s "
        f"both ways is physically impossible on this link and marks the row INVALID. "
        f"GB/s = 1e9 bytes/s; 'both' counts the bytes of both directions.\n")
    out.append("| size | direction | transfers | raw GB/s | raw (events) | engine GB/s | "
               "engine (events) | engine / raw | target |")
    out.append("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    ok_all = True
    for r in rows:
        ratio = r["engine_gbs"] / r["raw_gbs"] if r["raw_gbs"] else 0.0
        target = ""
        if r["mib"] >= 4 and r["direction"] != "both":
            met = ratio >= 0.95 and r["valid"]
            ok_all &= met
            target = ">= 95 %: " + ("met" if met else "**missed**")
        if not r["valid"]:
            ok_all = False
            problems = "; ".join(p for p in (r["raw_problems"], r["engine_problems"]) if p)
            target = (target + " " if target else "") + f"**INVALID** ({problems})"
        out.append(f"| {r['mib']} MiB | {r['direction']} | {r['count']} | {r['raw_gbs']:.1f} | "
                   f"{r['raw_event_gbs']:.1f} | {r['engine_gbs']:.1f} | "
                   f"{r['engine_event_gbs']:.1f} | {100 * ratio:.1f} % | {target} |")
    by = {(r["mib"], r["direction"]): r for r in rows}
    out.append("")
    out.append("Both directions at once over the faster one-way direction (target >= 1.6x "
               "for the engine at sizes >= 4 MiB):")
    out.append("")
    out.append("| size | engine both GB/s | engine one-way GB/s | engine ratio | raw ratio | target |")
    out.append("|---:|---:|---:|---:|---:|---|")
    for mib in sorted({r["mib"] for r in rows}):
        if not all((mib, d) in by for d in ("D2H", "H2D", "both")):
            continue
        one = max(by[(mib, "D2H")]["engine_gbs"], by[(mib, "H2D")]["engine_gbs"])
        both = by[(mib, "both")]["engine_gbs"]
        raw_one = max(by[(mib, "D2H")]["raw_gbs"], by[(mib, "H2D")]["raw_gbs"])
        raw_ratio = by[(mib, "both")]["raw_gbs"] / raw_one
        target = ""
        if mib >= 4:
            met = both >= 1.6 * one
            ok_all &= met
            target = "met" if met else "**missed**"
        out.append(f"| {mib} MiB | {both:.1f} | {one:.1f} | {both / one:.2f}x | "
                   f"{raw_ratio:.2f}x | {target} |")
    if data.get("sweep"):
        out.append("")
        out.append("## Engine options (diagnosis; defaults are 32 MiB chunks, 96 MiB in flight)")
        out.append("")
        out.append("| chunk MiB | in flight MiB | size | direction | engine GB/s | note |")
        out.append("|---:|---:|---:|---|---:|---|")
        for s in data["sweep"]:
            note = "" if s["valid"] else f"**INVALID** ({s['engine_problems']})"
            out.append(f"| {s['chunk_mib']} | {s['inflight_mib']} | {s['mib']} MiB | "
                       f"{s['direction']} | {s['engine_gbs']:.1f} | {note} |")
    out.append("")
    out.append("## Pinned pool")
    out.append("")
    out.append("| loop | steps | pinned allocations in step 1 | after step 1 | reuses | "
               "pinned GiB | peak live GiB | pinned / peak live | seconds |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, key in (("pool only (events on the copy streams)", "pool_loop"),
                      ("whole runtime, real copies", "runtime_loop")):
        p = data[key]
        ratio = p["pinned_gib"] / p["peak_live_gib"] if p["peak_live_gib"] else 0.0
        met = p["pinned_allocations_after_first_step"] == 0 and ratio <= 1.1
        ok_all &= met
        out.append(f"| {name} | {p['steps']} | {p['pinned_allocations_first_step']} | "
                   f"{p['pinned_allocations_after_first_step']} | {p['reuses']} | "
                   f"{p['pinned_gib']:.2f} | {p['peak_live_gib']:.2f} | {ratio:.3f} | "
                   f"{p['seconds']:.2f} |")
    out.append("")
    out.append("Workload: the attention-scope saved activations of BENCHMARKS.md T1 per "
               "layer (q, k, v, attention output: 64 MiB each in bf16; logsumexp: 1 MiB "
               "fp32), 16 layers, allocated in forward order and released in reverse.")
    out.append("")
    out.append(f"All targets met: {'yes' if ok_all else 'no'}.")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
