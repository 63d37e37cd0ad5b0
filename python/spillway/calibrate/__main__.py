"""python -m spillway.calibrate [--out FILE] [--device N] [--quick]

Measures the device profile the simulator reads (link curves, matmul TFLOPS,
memory bandwidth, launch floor, memory) and writes it as JSON; prints one
line per measurement and a summary. Exit status 2 without CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import CalibrationError, calibrate, dumps, save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spillway.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the profile here (default: print it)")
    parser.add_argument("--device", type=int, help="CUDA device index (default: the current one)")
    parser.add_argument("--quick", action="store_true",
                        help="three transfer sizes, a 4096^3 matmul, 3 repeats: seconds, not a minute")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        profile = calibrate(args.device, quick=args.quick, log=lambda line: print(line, flush=True))
    except CalibrationError as e:
        print(e, file=sys.stderr)
        return 2
    if args.out:
        save(profile, args.out)
    else:
        sys.stdout.write(dumps(profile))
    largest = {c: profile[c][-1] for c in ("d2h", "h2d", "d2h_duplex", "h2d_duplex")}
    print(f"{args.out or 'profile'}: {profile['name']} in {time.monotonic() - start:.1f} s; "
          f"link at {largest['d2h']['bytes'] >> 20} MiB d2h {largest['d2h']['gbs']:.1f} / "
          f"h2d {largest['h2d']['gbs']:.1f} GB/s, duplex {largest['d2h_duplex']['gbs']:.1f} + "
          f"{largest['h2d_duplex']['gbs']:.1f}; bf16 {profile['matmul_tflops_bf16']:.0f} TFLOPS, "
          f"fp32 {profile['matmul_tflops_fp32']:.1f}; memory {profile['memory_gbs']:.0f} GB/s; "
          f"launch {profile['launch_us']:.2f} us; {profile['memory_bytes'] / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
