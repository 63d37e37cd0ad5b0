"""Which host arithmetic reproduces a device's AdamW(fused=True), found by running both.

Note [Probing the device optimizer]
The host update (Note [Host AdamW], src/optim/adamw.cc) knows two forms of PyTorch's
fused AdamW kernel. Which one a given torch build runs, and whether its compiler
made the same contractions, is not something to assume: probe_adamw() runs
torch.optim.AdamW(fused=True) on the device on a tensor whose values span many
binades (zeros of both signs and subnormals among them), with the caller's
hyperparameters, at steps 1, 2, 3, 1000 and 2**20 + 5 (the step count is set
directly), and runs each host form beside it on the same values. A form is used
only if parameter and both moments are the same bits at every probed step. The
result is cached per (device, hyperparameters).

The powers beta**step in the bias corrections come from the device as well
(powers()): its pow is not correctly rounded, so the host's could differ.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import torch

ARITHMETICS = ("cuda-fused-double", "cuda-fused-float")

_PROBE_STEPS = (1, 2, 3, 1000, 2 ** 20 + 5)


def host_threads() -> int:
    """The host update's default thread count: the CPUs this process may use, less two
    when there are more than four. The update runs while the step goes on: the Python
    thread and autograd's device thread that launch its kernels keep a CPU each, or
    the GPU would wait for them. SPILLWAY_HOST_THREADS, a positive integer, sets it."""
    import os
    forced = os.environ.get("SPILLWAY_HOST_THREADS")
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"SPILLWAY_HOST_THREADS must be a positive integer, not {forced!r}")
        return int(forced)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    return cpus - 2 if cpus > 4 else cpus


def arithmetic_code(name: str) -> int:
    """The op's integer for a form's name."""
    return ARITHMETICS.index(name)


def powers(arithmetic: str, beta1: float, beta2: float, step: float,
           device: torch.device) -> tuple[float, float]:
    """beta1**step and beta2**step as the device kernel of `arithmetic` computes them:
    in double (cuda-fused-double) or in float (cuda-fused-float), with the step read as
    a float, by the device's own pow."""
    return _powers_of(arithmetic, beta1, beta2, [step], device)[0]


def _powers_of(arithmetic: str, beta1: float, beta2: float, steps: list[float],
               device) -> list[tuple[float, float]]:
    """powers() at each of `steps`, read back from the device at once. Each step's pow
    runs on the same two-element tensors as it always did (a longer tensor could take
    another code path, a vectorised one on a CPU), so the bits are those of one step."""
    step32 = torch.tensor(steps, dtype=torch.float32).tolist()
    dtype = torch.float64 if arithmetic == ARITHMETICS[0] else torch.float32
    base = torch.tensor([beta1, beta2], dtype=dtype, device=device)
    # A tensor exponent of the same shape: the elementwise pow kernel, not a
    # special case for scalar exponents such as 2.
    out = [torch.pow(base, torch.full((2,), s, dtype=dtype, device=device)) for s in step32]
    return [tuple(p) for p in torch.stack(out).tolist()]


# Steps' powers are made this many at a time: each making is a round trip to the
# device, and on a busy link its small copies wait behind gigabytes of offloads (the
# T3 profile: 200 ms for one).
_POWERS_BLOCK = 1024
_side_streams: dict = {}
_blocks: dict = {}
_blocks_lock = threading.Lock()


def device_powers(arithmetic: str, beta1: float, beta2: float, step: float,
                  device: torch.device) -> tuple[float, float]:
    """powers() from a cache that holds them for whole blocks of whole steps, made on a
    side stream of the device's own (torch's compute stream is the legacy default
    stream, which a small op issued there from a host-update worker would wait behind).
    A step that is not a whole number is computed alone."""
    step = float(step)
    if step != int(step) or step < 0:
        return _powers_on_side_stream(arithmetic, beta1, beta2, [step], str(device))[0]
    first = int(step) // _POWERS_BLOCK * _POWERS_BLOCK
    key = (arithmetic, float(beta1), float(beta2), str(device), first)
    with _blocks_lock:
        block = _blocks.get(key)
        if block is None:
            block = _blocks[key] = _powers_on_side_stream(
                arithmetic, float(beta1), float(beta2),
                [float(s) for s in range(first, first + _POWERS_BLOCK)], str(device))
            if len(_blocks) > 64:
                _blocks.pop(next(iter(_blocks)))
    return block[int(step) - first]


def _powers_on_side_stream(arithmetic: str, beta1: float, beta2: float, steps: list[float],
                           device: str) -> list[tuple[float, float]]:
    dev = torch.device(device)
    if dev.type != "cuda":
        return _powers_of(arithmetic, beta1, beta2, steps, dev)
    stream = _side_streams.setdefault(device, torch.cuda.Stream(dev))
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        return _powers_of(arithmetic, beta1, beta2, steps, dev)


def host_update(arithmetic: str, param: torch.Tensor, grad: torch.Tensor,
                exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                betas: tuple[float, float], eps: float, weight_decay: float,
                maximize: bool, step: float, device: torch.device, threads: int) -> None:
    """One host AdamW update in place (float32 CPU tensors), the bias corrections from
    `device`'s pow."""
    p1, p2 = powers(arithmetic, betas[0], betas[1], step, device)
    torch.ops.spillway.adamw_update_(param, grad, exp_avg, exp_avg_sq, float(lr),
                                     float(betas[0]), float(betas[1]), float(eps),
                                     float(weight_decay), bool(maximize), p1, p2,
                                     arithmetic_code(arithmetic), int(threads))


def _probe_values(n: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
    exponent = torch.randint(-30, 5, (n,), generator=g).to(torch.float64)
    out = (scale * mantissa * torch.pow(2.0, exponent)).to(torch.float32)
    kind = torch.randint(0, 16, (n,), generator=g)
    out[kind == 0] = 0.0
    out[kind == 1] = -0.0
    out[kind == 2] = (mantissa[kind == 2] * 2.0 ** -140).to(torch.float32)  # subnormal
    return out


@functools.lru_cache(maxsize=None)
def _probe_cached(device: str, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, maximize: bool) -> tuple:
    from spillway import ops  # loads spillway._C, which registers the op
    del ops
    dev = torch.device(device)
    n = (1 << 16) + 7
    p0 = _probe_values(n, 1, 1.0)
    ref = p0.clone().to(dev).requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=lr, betas=(beta1, beta2), eps=eps,
                            weight_decay=weight_decay, maximize=maximize, fused=True)
    hosts = {a: (p0.clone(), torch.zeros(n), torch.zeros(n)) for a in ARITHMETICS}
    mismatch = {}
    for i, step in enumerate(_PROBE_STEPS):
        grad = _probe_values(n, 100 + i, 1e4 if i == 2 else 1.0)
        if i > 0:
            opt.state[ref]["step"].fill_(step - 1)
        ref.grad = grad.to(dev)
        opt.step()
        got = (ref.detach().cpu(), opt.state[ref]["exp_avg"].cpu(),
               opt.state[ref]["exp_avg_sq"].cpu())
        for a, (p, m, v) in hosts.items():
            if a in mismatch:
                continue
            host_update(a, p, grad, m, v, lr=lr, betas=(beta1, beta2), eps=eps,
                        weight_decay=weight_decay, maximize=maximize, step=step,
                        device=dev, threads=1)
            for name, h, d in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), got):
                same = h.view(torch.int32) == d.view(torch.int32)
                if not bool(same.all()):
                    k = int((~same).nonzero()[0])
                    mismatch[a] = (f"{name}[{k}] at step {step}: device {d[k].item()!r}, "
                                   f"host {h[k].item()!r} (grad {grad[k].item()!r}, "
                                   f"{int((~same).sum())} of {n} differ)")
                    break
    matching = [a for a in ARITHMETICS if a not in mismatch]
    return (matching[0] if matching else None), tuple(sorted(mismatch.items()))


def probe_adamw(device, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 1e-2, maximize: bool = False) -> dict:
    """Runs torch.optim.AdamW(fused=True) on `device` beside each host form
    (Note [Probing the device optimizer]). Returns {"arithmetic": the first form that
    gave the same bits at every probed step, or None; "mismatch": {form: where it
    first differed}}."""
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"[optim] {name} must be a finite number >= 0, got {value!r}")
    arithmetic, mismatch = _probe_cached(str(torch.device(device)), float(lr),
                                         float(betas[0]), float(betas[1]), float(eps),
                                         float(weight_decay), bool(maximize))
    return {"arithmetic": arithmetic, "mismatch": dict(mismatch)}


def measure_host_adamw(arithmetic: str = ARITHMETICS[0], *, elements: int = 1 << 25,
                       threads: int | None = None, rounds: int = 3, repeat: int = 3,
                       while_copying: bool = False) -> dict:
    """The host update's bandwidth on this machine (28 bytes per element), sampled
    (Note [Sampling the host update's speed]). Returns {"gbs": the median sample,
    "best_gbs", "samples_gbs": every sample, round by round, "elements", "threads",
    "copied_gbs": what the GPU copied meanwhile, both ways, while_copying only}.

    while_copying: measured while the GPU copies pinned host memory both ways, as a
    replayed step's write-backs and copies back do while its updates run (they share
    the host's memory bandwidth: T3's updates ran at 78 GB/s in a step on the H200
    machine, against 122 alone). Needs CUDA."""
    import statistics
    import time

    from spillway import ops  # loads spillway._C, which registers the op
    del ops
    if elements < 1 or rounds < 1 or repeat < 1:
        raise ValueError(f"[optim] elements, rounds and repeat must be >= 1, got "
                         f"{elements}, {rounds}, {repeat}")
    if threads is None:
        threads = host_threads()
    code = arithmetic_code(arithmetic)
    samples: list[float] = []
    link = LinkTraffic() if while_copying else None
    with link if link is not None else contextlib.nullcontext():
        for _ in range(rounds):
            p, g = torch.randn(elements), torch.randn(elements)
            m, v = torch.zeros(elements), torch.zeros(elements)
            for k in range(repeat + 1):  # the first one warms: threads up, pages mapped
                began = time.perf_counter()
                torch.ops.spillway.adamw_update_(p, g, m, v, 1e-4, 0.9, 0.999, 1e-8, 1e-2,
                                                 False, 0.9, 0.999, code, threads)
                if k:
                    samples.append(28 * elements / (time.perf_counter() - began) / 1e9)
            del p, g, m, v
    out = {"gbs": statistics.median(samples), "best_gbs": max(samples),
           "samples_gbs": samples, "elements": elements, "threads": threads}
    if link is not None:
        out["copied_gbs"] = link.copied_gbs()
    return out


def measure_host_adamw_gbs(arithmetic: str = ARITHMETICS[0], **kwargs) -> float:
    """measure_host_adamw()'s median sample in GB/s: what
    spillway.trace.plan(host_adamw_gbs=...) needs. About two seconds for the default."""
    return measure_host_adamw(arithmetic, **kwargs)["gbs"]


# Note [Sampling the host update's speed]
# A plan that runs AdamW on the host is made for the speed measured here, so one bad
# reading changes the plan: on T3 (H100 machine, run 6) single readings of 16M
# elements, best of 3, gave 50 GB/s in two processes and 83-105 in two others, while
# in the two plans that ran updates on the host they went at 78-98 GB/s in the step. The
# measurement is therefore the median of several samples over fresh arrays (pages
# placed anew each round), 32M elements each (about 10 ms per update), rather than
# the best of a few: a slow round moves it by a sample, not by the whole reading.
# LinkTraffic gives its pinned buffers back on exit (they were 0.5 GiB of the
# process's RSS for the rest of its life).


class LinkTraffic:
    """While entered: pinned host memory copied to and from the GPU, 256 MiB each way on
    two streams, back to back, from a thread of its own: the link and the host's memory
    busy as a replayed step's write-backs and copies back keep them. copied_gbs(): what
    it moved per second, both ways together. Needs CUDA."""

    def __init__(self, size: int = 256 << 20):
        if not torch.cuda.is_available():
            raise RuntimeError("[optim] copies between host and GPU need CUDA")
        self.pairs = [(torch.empty(size, dtype=torch.uint8, pin_memory=True),
                       torch.empty(size, dtype=torch.uint8, device="cuda"), torch.cuda.Stream())
                      for _ in range(2)]
        self.size, self.copied, self.began, self.ended = size, 0, 0.0, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._copy, daemon=True)

    def _copy(self) -> None:
        (h1, d1, s1), (h2, d2, s2) = self.pairs
        while not self.stop.is_set():
            with torch.cuda.stream(s1):
                d1.copy_(h1, non_blocking=True)
            with torch.cuda.stream(s2):
                h2.copy_(d2, non_blocking=True)
            s1.synchronize()
            s2.synchronize()
            self.copied += 2 * self.size

    def __enter__(self):
        import time
        self.began = time.perf_counter()
        self.thread.start()
        time.sleep(0.2)  # under way before anything is timed
        return self

    def __exit__(self, *exc):
        import time
        self.ended = time.perf_counter()
        self.stop.set()
        self.thread.join()
        # Its buffers go back: the pinned ones would otherwise stay in torch's host
        # cache, in the process's RSS, for as long as it lives.
        self.pairs = None
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()
        torch.cuda.empty_cache()

    def copied_gbs(self) -> float:
        import time
        seconds = (self.ended or time.perf_counter()) - self.began
        return self.copied / seconds / 1e9
