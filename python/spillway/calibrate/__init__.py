"""Measure one GPU's device profile, the numbers the simulator's cost model reads.

    python -m spillway.calibrate --out device-profile.json [--device N] [--quick]

    from spillway.calibrate import calibrate
    profile = calibrate(0)              # a dict in the device-profile format

The profile (include/spillway/sim.h DeviceProfile; src/sim/profiles/ holds the
shipped one) is JSON: format "spillway.device_profile", version 1, name,
source, memory_bytes, matmul_tflops_bf16, matmul_tflops_fp32,
attention_tflops_bf16 and attention_backward_tflops_bf16 (bf16
scaled_dot_product_attention with an additive causal mask, as Hugging Face
models call it, in the cost model's FLOPs), memory_gbs
(read + write bytes per second of device memory), launch_us (per-kernel
floor), allocation_granularity (the caching allocator's 512 B rounding: not
measured), and four link curves d2h, h2d, d2h_duplex, h2d_duplex, each a list
of {"bytes": int, "gbs": float} points sorted by bytes (GB = 1e9 bytes; a
duplex curve is one direction's rate while the other direction runs).

On an H200 the whole calibration takes well under a minute; --quick (three
transfer sizes, a 4096^3 matmul, fewer repeats) a few seconds. Needs CUDA.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import time
from typing import Any, Callable

from ._measure import KIB, MIB, CalibrationError

__all__ = ["FORMAT", "VERSION", "LINK_SIZES", "QUICK_LINK_SIZES", "CalibrationError", "calibrate",
           "check_profile", "dumps", "save"]

FORMAT = "spillway.device_profile"
VERSION = 1
LINK_SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
QUICK_LINK_SIZES = (256 * KIB, 4 * MIB, 64 * MIB)
CURVES = ("d2h", "h2d", "d2h_duplex", "h2d_duplex")
ALLOCATION_GRANULARITY = 512  # PyTorch's caching allocator rounds every block to 512 B

# Field order of the C++ writer (write_device_profile).
_FIELDS = ("format", "version", "name", "source", "memory_bytes", "matmul_tflops_bf16",
           "matmul_tflops_fp32", "attention_tflops_bf16", "attention_backward_tflops_bf16",
           "memory_gbs", "launch_us", "allocation_granularity", *CURVES)


def calibrate(device: int | str | None = None, *, quick: bool = False,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the profile of one CUDA device (an index, "cuda:N", or None for the current
    one) and return it as a dict in the device-profile format (check_profile passes).

    Allocates 2 x 256 MiB of pinned host memory and about 1.5 GiB on the device (less
    with quick), all freed on return. log receives one line per measurement.
    Raises CalibrationError("[calibrate] ...") without CUDA or when a measurement fails.
    """
    import torch

    from . import _measure

    if not torch.cuda.is_available():
        raise CalibrationError(
            f"[calibrate] needs a CUDA device, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    say = log or (lambda _line: None)
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        index = torch.device(device).index or 0
    if not 0 <= index < torch.cuda.device_count():
        raise CalibrationError(f"[calibrate] no CUDA device {index} "
                               f"({torch.cuda.device_count()} visible)")
    dev = torch.device("cuda", index)
    started = time.monotonic()
    sizes = QUICK_LINK_SIZES if quick else LINK_SIZES
    repeats = 3 if quick else 7
    with torch.cuda.device(dev):
        torch.cuda.synchronize()
        gate = _measure.Gate(dev)
        streams = {"d2h": torch.cuda.Stream(dev), "h2d": torch.cuda.Stream(dev)}
        buffers = _measure.LinkBuffers.allocate(dev, max(sizes))
        curves: dict[str, list[dict[str, Any]]] = {name: [] for name in CURVES}
        try:
            for direction in ("d2h", "h2d"):  # a first batch of each: warm-up
                _measure.link_gbs(buffers, gate, streams, direction, MIB, duplex=False,
                                  target_bytes=16 * MIB, repeats=1)
            for nbytes in sizes:
                for curve in CURVES:
                    direction, duplex = curve.split("_")[0], curve.endswith("_duplex")
                    gbs = _measure.link_gbs(buffers, gate, streams, direction, nbytes,
                                            duplex=duplex, target_bytes=(16 if quick else 64) * MIB,
                                            repeats=repeats)
                    curves[curve].append({"bytes": nbytes, "gbs": round(gbs, 3)})
                say(f"link {_size(nbytes):>8}: " + ", ".join(
                    f"{c} {curves[c][-1]['gbs']:.1f}" for c in CURVES) + " GB/s")
        finally:
            del buffers
        n = 4096 if quick else 8192
        bf16 = _measure.matmul_tflops(dev, torch.bfloat16, n, 10 if quick else 20, repeats)
        fp32 = _measure.matmul_tflops(dev, torch.float32, n, 3 if quick else 5, min(repeats, 5))
        say(f"matmul {n}^3: bf16 {bf16:.1f} TFLOPS, fp32 (TF32 off) {fp32:.1f} TFLOPS")
        attention_shape = (2, 16, 2048, 128) if quick else (4, 16, 4096, 128)
        attention, attention_backward = _measure.attention_tflops(
            dev, attention_shape, 5 if quick else 10, repeats)
        say(f"attention {attention_shape}, bf16 with a causal mask: forward {attention:.1f} TFLOPS, "
            f"backward {attention_backward:.1f} TFLOPS")
        copy_bytes = (256 if quick else 1024) * MIB
        memory = _measure.memory_gbs(dev, copy_bytes, 10, repeats)
        say(f"device copy of {_size(copy_bytes)}: {memory:.0f} GB/s (read + write)")
        launch_us, dispatch_us = _measure.launch_floor_us(dev, gate, 500 if quick else 1000, repeats)
        say(f"tiny kernels: {launch_us:.2f} us each on the GPU, {dispatch_us:.2f} us each to issue "
            "from Python")
        torch.cuda.empty_cache()
    properties = torch.cuda.get_device_properties(dev)
    name = torch.cuda.get_device_name(dev)
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    source = (
        f"spillway.calibrate{' --quick' if quick else ''} on {today} ({socket.gethostname()}, "
        f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}), "
        f"{time.monotonic() - started:.0f} s. Links: pinned host tensors, non_blocking copies "
        "on dedicated streams, queued while a spin kernel holds the streams and timed with "
        f"CUDA events as a batch of back-to-back copies (>= {16 if quick else 64} MiB or 256 "
        f"copies), median of {repeats}; duplex: one direction's rate while the other streams "
        f"at least 4x its bytes. Matmul: {n}^3 torch.mm, fp32 with TF32 off. Attention: "
        f"bf16 scaled_dot_product_attention on q, k, v of shape {attention_shape} "
        "(transposed from batch, seq, heads, dim) with an additive causal mask of "
        "(batch, 1, seq, seq), torch's default kernel; backward = forward-and-backward minus "
        "forward. memory_gbs: "
        f"(read + write) bytes of a {_size(copy_bytes)} device-to-device copy. launch_us: GPU "
        f"time per tiny kernel queued back to back (issuing one from Python costs "
        f"{dispatch_us:.1f} us on this host, not included). allocation_granularity: the "
        "caching allocator's rounding, not measured.")
    profile = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "source": source,
        "memory_bytes": int(properties.total_memory),
        "matmul_tflops_bf16": round(bf16, 1),
        "matmul_tflops_fp32": round(fp32, 2),
        "attention_tflops_bf16": round(attention, 1),
        "attention_backward_tflops_bf16": round(attention_backward, 1),
        "memory_gbs": round(memory, 1),
        "launch_us": round(launch_us, 3),
        "allocation_granularity": ALLOCATION_GRANULARITY,
        **curves,
    }
    check_profile(profile)
    return profile


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def check_profile(profile: dict[str, Any]) -> None:
    """Raise ValueError naming the field when `profile` breaks the rules the C++ parser
    (parse_device_profile) enforces: format and version, every field present and none
    unknown, positive numbers (memory_bytes and launch_us may be 0), integer byte counts,
    non-empty curves of {bytes, gbs} points with strictly increasing bytes."""
    def fail(field: str, detail: str):
        raise ValueError(f"[calibrate] device profile: field '{field}'{detail}")

    if profile.get("format") != FORMAT:
        fail("format", f": expected '{FORMAT}', got {profile.get('format')!r}")
    if profile.get("version") != VERSION:
        fail("version", f": expected {VERSION}, got {profile.get('version')!r}")
    for key in profile:
        if key not in _FIELDS:
            fail(key, " is not a field of a device profile")
    optional = ("allocation_granularity", "attention_tflops_bf16", "attention_backward_tflops_bf16")
    for key in _FIELDS:
        if key not in profile and key not in optional:
            fail(key, " is missing")

    def number(value, field, allow_zero=False, integer=False):
        ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value < 0 or (
                value == 0 and not allow_zero):
            fail(field, f": expected a {'non-negative' if allow_zero else 'positive'} "
                        f"{'integer' if integer else 'number'}, got {value!r}")

    for key in ("name", "source"):
        if not isinstance(profile[key], str):
            fail(key, f": expected a string, got {profile[key]!r}")
    number(profile["memory_bytes"], "memory_bytes", allow_zero=True, integer=True)
    for key in ("matmul_tflops_bf16", "matmul_tflops_fp32", "memory_gbs"):
        number(profile[key], key)
    number(profile["launch_us"], "launch_us", allow_zero=True)
    for key in ("attention_tflops_bf16", "attention_backward_tflops_bf16"):
        if key in profile:
            number(profile[key], key)
    if "allocation_granularity" in profile:
        number(profile["allocation_granularity"], "allocation_granularity", integer=True)
    for curve in CURVES:
        points = profile[curve]
        if not isinstance(points, list) or not points:
            fail(curve, ": expected a non-empty array of {bytes, gbs}")
        for i, point in enumerate(points):
            where = f"{curve}[{i}]"
            if not isinstance(point, dict) or set(point) != {"bytes", "gbs"}:
                fail(where, f": expected an object {{bytes, gbs}}, got {point!r}")
            number(point["bytes"], f"{where}.bytes", integer=True)
            number(point["gbs"], f"{where}.gbs")
            if i and point["bytes"] <= points[i - 1]["bytes"]:
                fail(f"{where}.bytes", ": points must be sorted by strictly increasing bytes")


def dumps(profile: dict[str, Any]) -> str:
    """The profile as JSON text, fields in the C++ writer's order, one curve point a line
    (as src/sim/profiles/ writes them)."""
    lines = []
    for key in (k for k in _FIELDS if k in profile):
        value = profile[key]
        if key in CURVES:
            points = ",\n".join(f"    {json.dumps(p, allow_nan=False)}" for p in value)
            lines.append(f'  "{key}": [\n{points}\n  ]')
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, allow_nan=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def save(profile: dict[str, Any], path: str | os.PathLike) -> None:
    """Check the profile and write it to path (through a temporary file and a rename)."""
    check_profile(profile)
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps(profile))
    os.replace(tmp, path)
