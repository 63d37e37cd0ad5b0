#!/usr/bin/env python3
"""Can a TorchDispatchMode's ops be handled in C++? (issue 12: the replay's dispatch
overhead; probe.cc says how.)

    python3 bench/torch/cpp_dispatch_probe/probe.py [--reps 60]

Builds probe.cc against the installed torch (torch.utils.cpp_extension, about 40 s;
written for torch 2.13's PyInterpreterVTable). Then it times a small Llama training
step four ways, median of --reps:
  - plain;
  - under a Python mode that only calls through;
  - under that mode with its ops handled in C++;
  - under the C++ handler, forwarding every op to the mode's __torch_dispatch__.
It checks first that three steps under the C++ handler leave the loss and every
parameter torch.equal to a twin run without any mode.
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2] / "python" / "tests")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--build", default="/tmp/spillway-cpp-dispatch-probe")
    args = parser.parse_args(argv)

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.cpp_extension import load

    from _models import tiny_llama

    pathlib.Path(args.build).mkdir(parents=True, exist_ok=True)
    probe = load(name="spillway_cpp_dispatch_probe", sources=[str(HERE / "probe.cc")],
                 build_directory=args.build, extra_cflags=["-O2"])
    torch.set_num_threads(1)

    class CallThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model, ids = tiny_llama(1, layers=2, hidden=64, vocab=128, seq=16)
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, twin))

    def step(m, o):
        loss = m(ids, labels=ids).loss
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    def in_cpp(forward_all=False):
        probe.set_forward_all(forward_all)
        with CallThrough():
            probe.handle_top_mode()
            return step(model, opt)

    for k in range(3):
        assert torch.equal(in_cpp(), step(twin, twin_opt)), k
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    before = probe.counts()[0]
    in_cpp()
    ops = probe.counts()[0] - before

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(args.reps):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2] * 1e3

    def through():
        with CallThrough():
            step(model, opt)

    plain = median_ms(lambda: step(model, opt))
    rows = [("python call-through mode", median_ms(through)),
            ("its ops handled in C++", median_ms(in_cpp)),
            ("C++ handler forwarding to Python", median_ms(lambda: in_cpp(True)))]
    probe.uninstall()
    print(f"torch {torch.__version__}, {ops} ops per step, median of {args.reps}; loss and "
          f"parameters torch.equal to the twin over 3 steps")
    print(f"{'plain step':34s} {plain:8.2f} ms")
    for name, ms in rows:
        print(f"{name:34s} {ms:8.2f} ms  (+{(ms - plain) / ops * 1e3:.2f} us/op)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
