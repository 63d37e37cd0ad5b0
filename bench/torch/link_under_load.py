#!/usr/bin/env python3
"""The host link's rate while the GPU computes, and the compute's rate while the link copies.

    python3 bench/torch/link_under_load.py [--mib 64] [--ms 300] [--json OUT]

spillway.calibrate times the links with the compute stream idle (a spin
kernel holds the streams while the copies queue). An offload plan copies
while the step computes, so both share the GPU's memory system: this measures,
for D2H and H2D copies of --mib MiB between pinned host memory and the device
(back to back on their own stream, as the runtime issues them),

  * the copies' rate alone, beside T1-shaped bf16 matmuls (16384 x 2048 @
    2048 x 5632) and beside a memory-bound elementwise loop (SiLU times an
    input, 4 x 4096 x 5632 bf16, an MLP's activation), each kernel loop
    running on the default stream for about --ms milliseconds;
  * each kernel loop's time alone and beside the copies (its slowdown).

Times are CUDA events, median of 5. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def _timed(fn, stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--ms", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("[link_under_load] needs CUDA")
    dev = torch.device("cuda")
    n = args.mib << 20
    device_buf = torch.empty(n, dtype=torch.uint8, device=dev)
    host_buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(16384, 2048, dtype=torch.bfloat16, device=dev)
    b = torch.randn(2048, 5632, dtype=torch.bfloat16, device=dev)
    x = torch.randn(4, 4096, 5632, dtype=torch.bfloat16, device=dev)
    y = torch.randn_like(x)
    kernels = {"matmul": lambda: torch.mm(a, b),
               "elementwise": lambda: torch.nn.functional.silu(x) * y}
    copy_stream = torch.cuda.Stream()
    compute = torch.cuda.current_stream()

    def loop_of(fn, ms):
        for _ in range(3):
            fn()
        one = statistics.median(_timed(fn, compute) for _ in range(5))
        count = max(1, int(ms / max(one, 1e-3)))

        def run():
            for _ in range(count):
                fn()  # each result freed before the next: the loop holds one at a time
        return run

    def copies(direction, count):
        def run():
            with torch.cuda.stream(copy_stream):
                _copy(count)

        def _copy(count):
            for _ in range(count):
                if direction == "d2h":
                    host_buf.copy_(device_buf, non_blocking=True)
                else:
                    device_buf.copy_(host_buf, non_blocking=True)
        return run

    results = {"mib": args.mib, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    loops = {name: loop_of(fn, args.ms) for name, fn in kernels.items()}
    for name, loop in loops.items():
        results[f"{name}_alone_ms"] = statistics.median(_timed(loop, compute) for _ in range(5))
    for direction in ("d2h", "h2d"):
        copies(direction, 4)()
        torch.cuda.synchronize()
        one = statistics.median(_timed(copies(direction, 1), copy_stream) for _ in range(5))
        count = max(1, int(args.ms / one))
        alone = statistics.median(_timed(copies(direction, count), copy_stream)
                                  for _ in range(5))
        results[f"{direction}_alone_gbs"] = count * n / alone / 1e6
        for name, loop in loops.items():
            both_copy, both_kernel = [], []
            for _ in range(5):
                torch.cuda.synchronize()
                c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                k0, k1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                k0.record(compute)
                loop()
                k1.record(compute)
                c0.record(copy_stream)
                copies(direction, count)()
                c1.record(copy_stream)
                torch.cuda.synchronize()
                both_copy.append(c0.elapsed_time(c1))
                both_kernel.append(k0.elapsed_time(k1))
            copy_ms, kernel_ms = statistics.median(both_copy), statistics.median(both_kernel)
            results[f"{direction}_beside_{name}_gbs"] = count * n / copy_ms / 1e6
            results[f"{name}_beside_{direction}_ms"] = kernel_ms
            results[f"{name}_slowdown_beside_{direction}"] = kernel_ms / results[f"{name}_alone_ms"]
    width = max(len(k) for k in results)
    for key, value in results.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
