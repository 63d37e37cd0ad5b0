"""The measurements behind a device profile, each timed with CUDA events.

Note [Gated streams]: a small copy or kernel takes a few microseconds on the
GPU, less than Python takes to issue it. Timing work as Python issues it
would measure the host. Instead, every measured stream first waits on an
event behind a spin kernel (torch.cuda._sleep) on a gate stream; the host
queues all the work while the gate is shut, and the events then time the
GPU running it back to back. When the host needed longer than the gate
stayed shut, the gate doubles and the measurement is repeated.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import torch

KIB = 1 << 10
MIB = 1 << 20


class CalibrationError(RuntimeError):
    """A measurement could not be made; the message starts with [calibrate]."""


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class Gate:
    """Holds streams back behind a spin kernel (Note [Gated streams])."""

    def __init__(self, device: torch.device, cycles: int = 20_000_000) -> None:
        if not hasattr(torch.cuda, "_sleep"):
            raise CalibrationError("[calibrate] this torch has no torch.cuda._sleep")
        self._stream = torch.cuda.Stream(device)
        self.cycles = cycles

    def run(self, streams: Sequence[torch.cuda.Stream], enqueue: Callable[[], Callable[[], object]]):
        """Shut the gate on `streams`, call enqueue() (which queues work and timing events on
        them and returns a reader of its results), open the gate, synchronize, return the
        reader's result. Retries with a longer gate while the host was too slow."""
        for _ in range(6):
            shut, opened = _event(), _event()
            shut.record(self._stream)
            with torch.cuda.stream(self._stream):
                torch.cuda._sleep(self.cycles)
            opened.record(self._stream)
            for stream in streams:
                stream.wait_event(opened)
            start = time.perf_counter()
            read = enqueue()
            host_ms = (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize()
            if host_ms < 0.8 * shut.elapsed_time(opened):
                return read()
            self.cycles *= 2
        raise CalibrationError(
            f"[calibrate] the host needed {host_ms:.1f} ms to queue the work, longer than a "
            f"{shut.elapsed_time(opened):.1f} ms gate")


@dataclasses.dataclass
class LinkBuffers:
    """Pinned host and device buffers for both directions, `size` bytes each."""

    device_out: torch.Tensor   # D2H source
    host_in: torch.Tensor      # D2H destination (pinned)
    host_out: torch.Tensor     # H2D source (pinned)
    device_in: torch.Tensor    # H2D destination
    size: int

    @staticmethod
    def allocate(device: torch.device, size: int) -> "LinkBuffers":
        def pinned():
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)

        return LinkBuffers(
            device_out=torch.ones(size, dtype=torch.uint8, device=device), host_in=pinned(),
            host_out=pinned(), device_in=torch.empty(size, dtype=torch.uint8, device=device),
            size=size)

    def copy(self, direction: str, offset: int, nbytes: int) -> None:
        """Queue one copy of nbytes at offset on the current stream (non_blocking)."""
        if direction == "d2h":
            dst, src = self.host_in, self.device_out
        else:
            dst, src = self.device_in, self.host_out
        dst[offset:offset + nbytes].copy_(src[offset:offset + nbytes], non_blocking=True)


def _offsets(count: int, nbytes: int, size: int) -> list[int]:
    slots = max(1, size // nbytes)
    return [(i % slots) * nbytes for i in range(count)]


def copies_for(nbytes: int, target_bytes: int, max_copies: int = 256) -> int:
    """How many back-to-back copies of nbytes make one timed batch."""
    return max(1, min(max_copies, math.ceil(target_bytes / nbytes)))


def link_gbs(
    buffers: LinkBuffers, gate: Gate, streams: dict[str, torch.cuda.Stream], direction: str,
    nbytes: int, *, duplex: bool, target_bytes: int, repeats: int,
) -> float:
    """GB/s (1e9 B/s) of copies of nbytes in `direction` ("d2h" or "h2d"), the median over
    repeats of a batch of back-to-back copies on that direction's stream. duplex: while the
    other direction streams at least 4x the batch's bytes (in chunks of at most 64 MiB) on
    its own stream; the batch must end before that traffic does, or it is repeated with more."""
    other = "h2d" if direction == "d2h" else "d2h"
    count = copies_for(nbytes, target_bytes)
    offsets = _offsets(count, nbytes, buffers.size)
    chunk = min(64 * MIB, buffers.size)
    background_factor = 4
    samples = []
    while len(samples) < repeats:
        background = max(background_factor * count * nbytes, 2 * chunk) if duplex else 0
        used = [streams[direction]] + ([streams[other]] if duplex else [])

        def enqueue():
            start, end, other_end = _event(), _event(), _event()
            if duplex:
                with torch.cuda.stream(streams[other]):
                    for offset in _offsets(math.ceil(background / chunk), chunk, buffers.size):
                        buffers.copy(other, offset, chunk)
                    other_end.record()
            with torch.cuda.stream(streams[direction]):
                start.record()
                for offset in offsets:
                    buffers.copy(direction, offset, nbytes)
                end.record()
            return lambda: (start.elapsed_time(end), end.elapsed_time(other_end) if duplex else 1.0)

        ms, margin = gate.run(used, enqueue)
        if duplex and margin <= 0:  # the other direction finished first: not all duplex
            background_factor *= 2
            if background_factor > 64:
                raise CalibrationError(f"[calibrate] {other} traffic never outlasted a {direction} "
                                       f"batch of {count} x {nbytes} B")
            continue
        samples.append(count * nbytes / (ms * 1e-3) / 1e9)
    return statistics.median(samples)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, iterations: int,
                  repeats: int) -> float:
    """Dense n x n x n torch.mm TFLOPS (2 n^3 per mm), the median over repeats of
    `iterations` back-to-back mms after a warm-up. fp32 runs with TF32 off."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: the fp32 roofline
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        c = torch.empty(n, n, device=device, dtype=dtype)
        for _ in range(2):
            torch.mm(a, b, out=c)
        samples = []
        for _ in range(repeats):
            start, end = _event(), _event()
            start.record()
            for _ in range(iterations):
                torch.mm(a, b, out=c)
            end.record()
            torch.cuda.synchronize()
            samples.append(2 * n**3 * iterations / (start.elapsed_time(end) * 1e-3) / 1e12)
        del a, b, c
        return statistics.median(samples)
    finally:
        torch.set_float32_matmul_precision(previous)


def attention_tflops(device: torch.device, shape: tuple[int, int, int, int], iterations: int,
                     repeats: int) -> tuple[float, float]:
    """(forward, backward) TFLOPS of bf16 scaled_dot_product_attention as Hugging Face
    models call it: q, k, v of `shape` (batch, heads, seq, head_dim) transposed from
    (batch, seq, heads, head_dim), an additive bf16 causal mask of (batch, 1, seq, seq)
    and no is_causal, torch's default kernel. In the FLOPs the cost model counts for
    such a node (src/sim/cost_model.cc attention_work): 4 * batch * heads * seq^2 *
    head_dim forward, 2.5x that backward. The backward's time is a forward-and-
    backward's minus a forward's; medians over repeats of `iterations` back-to-back
    calls after a warm-up."""
    import torch.nn.functional as F

    batch, heads, seq, dim = shape
    generator = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(batch, seq, heads, dim, device=device, dtype=torch.bfloat16,
                          generator=generator).requires_grad_() for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    grad = torch.randn(batch, heads, seq, dim, device=device, dtype=torch.bfloat16,
                       generator=generator)
    future = torch.ones(seq, seq, device=device, dtype=torch.bool).triu(1)
    mask = torch.zeros(batch, 1, seq, seq, device=device, dtype=torch.bfloat16)
    mask.masked_fill_(future, torch.finfo(torch.bfloat16).min)

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward_backward():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.autograd.backward(out, grad, inputs=leaves)

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        samples = []
        for _ in range(repeats):
            start, end = _event(), _event()
            start.record()
            for _ in range(iterations):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iterations)
        return statistics.median(samples)

    forward_ms = timed(forward)
    backward_ms = timed(forward_backward) - forward_ms
    del q, k, v, leaves, grad, mask
    if backward_ms <= 0:
        raise CalibrationError(f"[calibrate] attention backward timed at {backward_ms:.3f} ms")
    flops = 4.0 * batch * heads * seq * seq * dim
    return flops / (forward_ms * 1e-3) / 1e12, 2.5 * flops / (backward_ms * 1e-3) / 1e12


def memory_gbs(device: torch.device, nbytes: int, iterations: int, repeats: int) -> float:
    """Device memory bandwidth in GB/s from a device-to-device copy of nbytes: bytes read
    plus bytes written per second (the roofline's convention: a node moves what it reads
    and what it writes)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        start, end = _event(), _event()
        start.record()
        for _ in range(iterations):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        samples.append(2 * src.numel() * 4 * iterations / (start.elapsed_time(end) * 1e-3) / 1e9)
    del src, dst
    return statistics.median(samples)


def launch_floor_us(device: torch.device, gate: Gate, kernels: int, repeats: int) -> tuple[float, float]:
    """(GPU microseconds per tiny kernel queued back to back, host microseconds to issue
    one from Python), medians over repeats. The first is the roofline's per-node floor."""
    x = torch.zeros(1, device=device)
    stream = torch.cuda.current_stream(device)
    x.add_(1)
    gpu, host = [], []
    for _ in range(repeats):
        def enqueue():
            start, end = _event(), _event()
            start.record(stream)
            for _ in range(kernels):
                x.add_(1)
            end.record(stream)
            return lambda: start.elapsed_time(end)

        gpu.append(gate.run([stream], enqueue) * 1e3 / kernels)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(kernels):
            x.add_(1)
        host.append((time.perf_counter() - begin) * 1e6 / kernels)
        torch.cuda.synchronize()
    return statistics.median(gpu), statistics.median(host)
